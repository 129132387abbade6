"""One decode step of the gated delta rule on slotted states, in place: each row's state is read
from its slot, stepped and written back by one Triton kernel (fla's recurrent kernel takes a
gathered copy of the states, which two more kernels gather and scatter, per DeltaNet layer and
decode step). The same operations as `engine.ops.deltanet.decode_gated_delta_rule`: q and k
L2-normalised (q scaled by Dk^-1/2), the state decayed by exp(g), the delta rule's update with
beta, the output read with q."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from engine.ops import deltanet as reference
from engine.ops.gpu.checked import Checked

BLOCK_V = 32  # value columns per program: a [Dk, 32] fp32 block of the state in registers


@triton.jit
def _recurrent_slots_kernel(
    Q, K, V, G, BETA, S, IDX, OUT, stride_q, stride_k, stride_v, stride_g, stride_beta, HV, GROUP, scale,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Program (row b, value head h, value block): the block of slot IDX[b]'s state [Dk, BV] of head
    h, stepped with row b's token and stored back; its output columns into OUT [B, Hv, Dv]."""
    b, h, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = h // GROUP
    dk = tl.arange(0, DK)
    dv = block * BV + tl.arange(0, BV)
    q = tl.load(Q + b * stride_q + hk * DK + dk).to(tl.float32)
    k = tl.load(K + b * stride_k + hk * DK + dk).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    v = tl.load(V + b * stride_v + h * DV + dv).to(tl.float32)
    decay = tl.exp(tl.load(G + b * stride_g + h).to(tl.float32))
    beta = tl.load(BETA + b * stride_beta + h).to(tl.float32)
    state = S + ((tl.load(IDX + b).to(tl.int64) * HV + h) * DK + dk[:, None]) * DV + dv[None, :]
    s = tl.load(state) * decay  # [DK, BV]
    delta = (v - tl.sum(s * k[:, None], 0)) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(state, s)
    tl.store(OUT + (b * HV + h) * DV + dv, tl.sum(s * q[:, None], 0).to(OUT.dtype.element_ty))


def _triton_recurrent_slots(q, k, v, g, beta, slots, index):
    batch, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if (
        slots.dtype != torch.float32 or not slots.is_contiguous() or dv % BLOCK_V or dk & (dk - 1)
        or any(t.stride(-1) != 1 for t in (q, k, v, g, beta)) or q.stride(1) != dk or k.stride(1) != dk
        or v.stride(1) != dv
    ):  # fmt: skip
        return reference.decode_gated_delta_rule_slots(q, k, v, g, beta, slots, index)
    out = torch.empty(batch, hv, dv, dtype=v.dtype, device=v.device)
    _recurrent_slots_kernel[(batch, hv, dv // BLOCK_V)](
        q, k, v, g, beta, slots, index, out, q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0),
        hv, hv // hk, dk**-0.5, DK=dk, DV=dv, BV=BLOCK_V,
    )  # fmt: skip
    return out


def _slots_after(out, args):
    """The step's output and the states of its rows' slots after it."""
    return out, args[5][args[6]]


def checked(decode: Callable) -> Checked:
    """The slotted step, checked on first use against `decode` (fla's recurrent kernel) on the
    gathered states and a scatter back; each trial on its own copy of the slots."""
    return Checked(
        "decode_gated_delta_rule_slots", _triton_recurrent_slots,
        functools.partial(reference.decode_gated_delta_rule_slots, decode=decode), canon=_slots_after,
        fresh=lambda args: (*args[:5], args[5].clone(), args[6]),
    )  # fmt: skip
