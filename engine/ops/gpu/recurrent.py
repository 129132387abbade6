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

import engine.ops.deltanet as reference
from engine.ops.gpu import conv, tickets
from engine.ops.gpu.checked import Checked

BLOCK_V = 32  # value columns per program: a [Dk, 32] fp32 block of the state in registers


@triton.jit
def _recurrent_slots_kernel(
    Q, K, V, G, BETA, S, IDX, OUT, stride_q, stride_k, stride_v, stride_g, stride_beta, HV, GROUP, scale,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
):
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
    ):
        return reference.decode_gated_delta_rule_slots(q, k, v, g, beta, slots, index)
    out = torch.empty(batch, hv, dv, dtype=v.dtype, device=v.device)
    _recurrent_slots_kernel[(batch, hv, dv // BLOCK_V)](
        q, k, v, g, beta, slots, index, out, q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0),
        hv, hv // hk, dk**-0.5, DK=dk, DV=dv, BV=BLOCK_V,
    )
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
    )


@triton.jit
def _decode_step_kernel(
    MIXED, Z, A, B, NEG_A, DT, CW, CS, RS, IDX, NW, OUT, COUNT, stride_m, stride_z, stride_a, stride_b,
    C, KEY, HK, HV, GROUP, scale, eps, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, K: tl.constexpr,
    KP: tl.constexpr,
):
    """Program (row b, value head h, value block): `reference.decode_step` for the block, each value
    rounded where the four kernels it replaces round it: the conv of the head's q and k channels (each
    of the key head's programs computes them; the last to finish stores their conv state) and of its
    value columns (their conv state stored here), the gates, the recurrent step of slot IDX[b]'s
    state block, its output columns into OUT; the last of the head's programs to finish reads the
    head's output back and stores it RMS-normed and gated by SiLU(z)."""
    b, h, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows, blocks = tl.num_programs(0), tl.num_programs(2)
    hk = h // GROUP
    slot = tl.load(IDX + b).to(tl.int64)
    x, state_c = MIXED + b * stride_m, CS + slot * C * (K - 1)
    dk = tl.arange(0, DK)
    dv = block * BV + tl.arange(0, BV)
    cq, ck, cv = hk * DK + dk, KEY + hk * DK + dk, 2 * KEY + h * DV + dv
    every_k, every_v = dk < DK, dv < DV  # all true: a key head's channels, the block's value columns
    q, q_state = conv.conv_step(x, state_c, CW, cq, every_k, K, KP)
    k, k_state = conv.conv_step(x, state_c, CW, ck, every_k, K, KP)
    v, v_state = conv.conv_step(x, state_c, CW, cv, every_v, K, KP)
    a = tl.load(A + b * stride_a + h).to(tl.float32) + tl.load(DT + h).to(tl.float32)
    g = tl.load(NEG_A + h) * tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))  # softplus at torch's threshold
    beta = tl.sigmoid(tl.load(B + b * stride_b + h).to(tl.float32)).to(B.dtype.element_ty).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    state = RS + ((slot * HV + h) * DK + dk[:, None]) * DV + dv[None, :]
    s = tl.load(state) * tl.exp(g)  # [DK, BV]
    delta = (v - tl.sum(s * k[:, None], 0)) * beta
    s = s + k[:, None] * delta[None, :]
    tl.store(state, s)
    conv.store_state(state_c, cv, every_v, v_state, K, KP)
    out = OUT + (b * HV + h) * DV
    tl.store(out + dv, tl.sum(s * q[:, None], 0).to(OUT.dtype.element_ty))
    key_ticket = COUNT + b * HK + hk  # every program of the key head has read its q and k states
    if tickets.last_to_finish(key_ticket, GROUP * blocks):
        conv.store_state(state_c, cq, every_k, q_state, K, KP)
        conv.store_state(state_c, ck, every_k, k_state, K, KP)
        tl.atomic_xchg(key_ticket, 0)
    head_ticket = COUNT + rows * HK + b * HV + h  # every block of the head's output is stored
    if tickets.last_to_finish(head_ticket, blocks):
        cols = tl.arange(0, DV)
        o = tl.load(out + cols, cache_modifier=".cg").to(tl.float32)
        rstd = tl.rsqrt(tl.sum(o * o, 0) / DV + eps)
        dtype = OUT.dtype.element_ty  # `norm._gated_rms_norm`'s roundings
        normed = (tl.load(NW + cols).to(tl.float32) * (o * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        z = tl.load(Z + b * stride_z + h * DV + cols).to(tl.float32)
        tl.store(out + cols, (normed * z * tl.sigmoid(z)).to(dtype))
        tl.atomic_xchg(head_ticket, 0)


def _triton_decode_step(mixed, z, a, b, neg_a, dt_bias, conv_weight, norm_weight, eps, conv_slots, rec_slots, index,
                        unfused):
    rows, channels = mixed.shape
    hv, dk, dv = rec_slots.shape[1:]
    key = (channels - hv * dv) // 2
    width = conv_slots.shape[2]
    if (
        rec_slots.dtype != torch.float32 or not rec_slots.is_contiguous() or not conv_slots.is_contiguous()
        or dk & (dk - 1) or dv & (dv - 1) or key < dk or key % dk or hv % (key // dk)
        or any(t.stride(-1) != 1 for t in (mixed, z, a, b)) or conv_weight.stride() != (width + 1, 1)
        or rows * (key // dk + hv) > tickets.TICKETS
    ):
        return unfused(mixed, z, a, b, neg_a, dt_bias, conv_weight, norm_weight, eps, conv_slots, rec_slots, index)
    out = torch.empty(rows, hv, dv, dtype=mixed.dtype, device=mixed.device)
    block = min(BLOCK_V, dv)  # a head of the tiny presets' 16 columns: one block
    if rows:
        _decode_step_kernel[(rows, hv, dv // block)](
            mixed, z, a, b, neg_a, dt_bias, conv_weight, conv_slots, rec_slots, index, norm_weight, out,
            tickets.tickets(mixed.device), mixed.stride(0), z.stride(0), a.stride(0), b.stride(0), channels, key,
            key // dk, hv, hv // (key // dk), dk**-0.5, eps, DK=dk, DV=dv, BV=block, K=width + 1,
            KP=triton.next_power_of_2(width + 1),
        )
    return out


def _step_after(out, args):
    """The step's output and the conv and recurrent states of its rows' slots after it."""
    index = args[11]
    return out, args[9][index], args[10][index]


# rows up to which the fused step runs: it saves three launches a step, but every program of a key head
# computes that head's q and k conv again, work that grows with the rows where the launches saved do not
FUSED_ROWS = 4


def decode_step(unfused: Callable) -> Callable:
    """`Kernels.deltanet_decode` on the GPU: for steps of up to `FUSED_ROWS` rows one launch
    (`_decode_step_kernel`) checked on first use against `unfused` (`reference.decode_step` over the
    GPU's four kernels, which runs larger steps), each trial on its own copies of the slots."""
    return Checked(
        "deltanet_decode", functools.partial(_triton_decode_step, unfused=unfused), unfused, canon=_step_after,
        fresh=lambda args: (*args[:9], args[9].clone(), args[10].clone(), args[11]),
        applies=lambda args: args[0].shape[0] <= FUSED_ROWS,
    )
