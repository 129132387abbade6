"""engine/ops/gates.py fused: one Triton launch each, one program per row, every intermediate
rounded to the activations' dtype where the torch version rounds it (bf16 results equal torch's
but where an fp32 sigmoid or exp differs in its last bit and lands across a rounding)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import engine.ops.gates as reference
from engine.ops.gpu.checked import Checked


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[.., N] as [rows, N] with unit column stride (a view where the strides allow)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def as_heads(t: torch.Tensor) -> torch.Tensor:
    """[.., H, N] (or [.., N]: H = 1) as [rows, H, N] with unit column stride, a view where the strides
    allow: a kernel reads row r at (r // H) * stride(0) + (r % H) * stride(1), so a per-head view of a
    wider projection ([T, H, D] split off [T, H, 2D], or off a fused output's columns) is not copied."""
    t = t.reshape(-1, 1, t.shape[-1]) if t.dim() < 3 else t.reshape(-1, *t.shape[-2:])
    return t if t.stride(-1) == 1 else t.contiguous()


@triton.jit
def _deltanet_gates(A, B, NEG_A, DT, G, BETA, N, sa, sb, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(A + row * sa + cols, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(DT + cols, mask=mask, other=0.0).to(tl.float32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's threshold
    tl.store(G + row * N + cols, tl.load(NEG_A + cols, mask=mask, other=0.0) * softplus, mask=mask)
    b = tl.load(B + row * sb + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(BETA + row * N + cols, tl.sigmoid(b).to(BETA.dtype.element_ty), mask=mask)


def _deltanet_gates_triton(a, b, neg_a, dt_bias):
    a2, b2 = _rows(a), _rows(b)
    rows, n = a2.shape
    g = torch.empty(rows, n, dtype=torch.float32, device=a.device)
    beta = torch.empty(rows, n, dtype=b.dtype, device=b.device)
    if rows:
        _deltanet_gates[(rows,)](
            a2, b2, neg_a, dt_bias, g, beta, n, a2.stride(0), b2.stride(0), BLOCK=triton.next_power_of_2(n)
        )
    return g.view(a.shape), beta.view(b.shape)


SILU_MUL, SIGMOID_MUL, ADD_SIGMOID_MUL = 0, 1, 2  # the kinds of `_gate_kernel`


@triton.jit
def _gate_kernel(X, GATE, Y, OUT, H, N, sx, sxh, sg, sgh, sy, syh, KIND: tl.constexpr, BLOCK: tl.constexpr):
    """KIND SILU_MUL: silu(GATE) * X; SIGMOID_MUL: X * sigmoid(GATE); ADD_SIGMOID_MUL: X + sigmoid(GATE[row, 0]) * Y.
    Row r of each operand at (r // H) * its row stride + (r % H) * its head stride (`as_heads`)."""
    row = tl.program_id(0)
    t, h = row // H, row % H
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dtype = OUT.dtype.element_ty
    x = tl.load(X + t * sx + h * sxh + cols, mask=mask, other=0.0).to(tl.float32)
    if KIND == 2:  # ADD_SIGMOID_MUL (a jit function reads no plain globals)
        s = tl.sigmoid(tl.load(GATE + t * sg + h * sgh).to(tl.float32)).to(dtype).to(tl.float32)
        y = tl.load(Y + t * sy + h * syh + cols, mask=mask, other=0.0).to(tl.float32)
        out = x + (s * y).to(dtype).to(tl.float32)
    else:
        g = tl.load(GATE + t * sg + h * sgh + cols, mask=mask, other=0.0).to(tl.float32)
        if KIND == 0:  # SILU_MUL
            out = (g * tl.sigmoid(g)).to(dtype).to(tl.float32) * x
        else:
            out = x * tl.sigmoid(g).to(dtype).to(tl.float32)
    tl.store(OUT + row * N + cols, out.to(dtype), mask=mask)


def _gate(kind: int, x, gate, y=None):
    x3, g3 = as_heads(x), as_heads(gate)
    y3 = as_heads(y) if y is not None else x3
    rows, heads, n = x3.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows * heads:
        _gate_kernel[(rows * heads,)](
            x3, g3, y3, out, heads, n, *x3.stride()[:2], *g3.stride()[:2], *y3.stride()[:2], KIND=kind,
            BLOCK=triton.next_power_of_2(n),
        )
    return out


deltanet_gates = Checked("deltanet_gates", _deltanet_gates_triton, reference.deltanet_gates)
silu_mul = Checked("silu_mul", lambda gate, up: _gate(SILU_MUL, up, gate), reference.silu_mul)
sigmoid_mul = Checked("sigmoid_mul", lambda x, gate: _gate(SIGMOID_MUL, x, gate), reference.sigmoid_mul)
add_sigmoid_mul = Checked(
    "add_sigmoid_mul", lambda base, gate, y: _gate(ADD_SIGMOID_MUL, base, gate, y), reference.add_sigmoid_mul
)
