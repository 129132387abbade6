"""Attention on the GPU: SDPA with grouped KV heads for prefill (flash, or cuDNN on bucketed rows
from PREFILL_CUDNN_ROWS on), and a split-K Triton kernel for one query per sequence against slotted
KV caches whose lengths live on the device (batched decode inside a CUDA graph: one graph serves
every length up to the slots' capacity)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from engine.ops.gpu.checked import Checked

DECODE_SPLITS = 64
# A prefill's causal attention where queries and keys are the same rows (a fresh sequence's first
# chunk). Left to itself torch runs cuDNN's on the H200, which builds an execution graph for every new
# shape (a setup far longer than the attention it runs), and a server meets a new length at nearly every
# such prefill. Below PREFILL_CUDNN_ROWS rows it runs flash (no per-shape setup). From there on cuDNN's
# is the faster, so those rows run on it padded to a multiple of PREFILL_BUCKET in one contiguous
# layout (its graph cache keys on shape and strides): zero rows after the last are never seen by a
# real query (causal), so the padding changes no value, and `prepare_prefill` builds every bucket's
# graph at warm-up. Where cuDNN does not take a shape SDPA falls back to flash.
PREFILL_CUDNN_ROWS = 4096
PREFILL_BUCKET = 512
_FLASH = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_CUDNN = [SDPBackend.CUDNN_ATTENTION, *_FLASH]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: [T, Hq, D] for the last T positions of k, v: [S, Hkv, D]. Returns [T, Hq, D]."""
    num_q, total = q.shape[0], k.shape[0]
    if num_q == 1 and total > 1:  # one query: the split-K kernel (SDPA's cuDNN path costs ~1 ms of host time a call)
        zero, length = torch.zeros(1, device=q.device, dtype=torch.long), torch.full((1,), total, device=q.device, dtype=torch.long)
        return decode_attention(q, k[None], v[None], zero, length)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, T|S, D]
    if num_q == total and num_q < PREFILL_CUDNN_ROWS:
        with sdpa_kernel(_FLASH):
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    elif num_q == total:
        pad = (0, 0, 0, -num_q % PREFILL_BUCKET)
        rows = [F.pad(x, pad).contiguous() for x in (qh, kh, vh)]  # one layout whatever the caller's
        with sdpa_kernel(_CUDNN):
            out = F.scaled_dot_product_attention(*rows, is_causal=True, enable_gqa=True)[:, :, :num_q]
    else:  # queries are the last rows: the causal mask is aligned to the bottom right
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(num_q, total), enable_gqa=True)
    return out[0].transpose(0, 1)


def prepare_prefill(heads: int, kv_heads: int, dim: int, max_tokens: int, device: torch.device, dtype: torch.dtype):
    """Build cuDNN's graph of every padded bucket up to `max_tokens` rows (warm-up)."""
    for rows in range(PREFILL_CUDNN_ROWS, max_tokens + PREFILL_BUCKET, PREFILL_BUCKET):
        kv = torch.zeros(rows, kv_heads, dim, device=device, dtype=dtype)
        causal_attention(torch.zeros(rows, heads, dim, device=device, dtype=dtype), kv, kv)


@triton.jit
def _decode_partial(
    Q, K, V, INDEX, LENGTH, PO, PM, PL, K_NEW, V_NEW, scale,
    stride_qb, stride_qh, stride_ks, stride_kn, stride_kh, stride_vs, stride_vn, stride_vh,
    stride_knb, stride_knh, stride_vnb, stride_vnh, NUM_KV,
    GROUP: tl.constexpr, GPAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr, IEEE: tl.constexpr, WRITE: tl.constexpr,
):
    """Program (kv head, split, row): its share of the row's keys against the head's queries. WRITE:
    the row's new key and value (K_NEW, V_NEW [B, Hkv, D]) are first stored at position length - 1
    of its slot by the program whose share holds it (the barrier makes them visible to its reads)."""
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.program_id(2)
    slot = tl.load(INDEX + row).to(tl.int64)
    length = tl.load(LENGTH + row)
    K += slot * stride_ks
    V += slot * stride_vs
    per_split = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, length)
    rows = tl.arange(0, GPAD)
    dims = tl.arange(0, D)
    if WRITE:
        last = length - 1
        if (last >= lo) & (last < hi):
            kn = tl.load(K_NEW + row * stride_knb + kv_head * stride_knh + dims)
            vn = tl.load(V_NEW + row * stride_vnb + kv_head * stride_vnh + dims)
            tl.store(K + last * stride_kn + kv_head * stride_kh + dims, kn)
            tl.store(V + last * stride_vn + kv_head * stride_vh + dims, vn)
        tl.debug_barrier()
    q_ptr = Q + row * stride_qb + (kv_head * GROUP + rows)[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr, mask=(rows < GROUP)[:, None], other=0.0)
    m = tl.full([GPAD], float("-inf"), tl.float32)
    denom = tl.zeros([GPAD], tl.float32)
    acc = tl.zeros([GPAD, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        valid = cols < hi
        k = tl.load(K + cols[:, None] * stride_kn + kv_head * stride_kh + dims[None, :], mask=valid[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        v = tl.load(V + cols[:, None] * stride_vn + kv_head * stride_vh + dims[None, :], mask=valid[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    base = ((row * NUM_KV + kv_head) * SPLITS + split) * GPAD
    tl.store(PO + (base + rows)[:, None] * D + dims[None, :], acc)
    tl.store(PM + base + rows, m)
    tl.store(PL + base + rows, denom)


def decode_attention(
    q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, index: torch.Tensor, lengths: torch.Tensor,
    k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per row against slotted caches: q [B, Hq, D]; k_slots, v_slots [S, capacity, Hkv, D];
    row b reads slot index[b], of which the first lengths[b] positions (on the device) are valid.
    Returns [B, Hq, D]. Each row's keys are split in DECODE_SPLITS parts, combined afterwards. With
    k_new, v_new [B, Hkv, D] (rows of unit stride), the kernel first writes them at position
    lengths[b] - 1 (`engine.ops.attention.decode_attention`): no index-put launches in front of it."""
    batch, num_heads, dim = q.shape
    num_kv_heads = k_slots.shape[2]
    group = num_heads // num_kv_heads
    gpad = max(16, triton.next_power_of_2(group))
    ieee = q.dtype == torch.float32
    block_n = 32 if ieee else 64
    po = torch.empty(batch, num_kv_heads, DECODE_SPLITS, gpad, dim, device=q.device, dtype=torch.float32)
    pm = torch.empty(batch, num_kv_heads, DECODE_SPLITS, gpad, device=q.device, dtype=torch.float32)
    pl = torch.empty_like(pm)
    q = q.contiguous()
    write = k_new is not None and v_new is not None
    if write:
        k_new, v_new = (t if t.stride(-1) == 1 else t.contiguous() for t in (k_new, v_new))
    kn, vn = (k_new, v_new) if write else (q, q)  # (unread without WRITE)
    _decode_partial[(num_kv_heads, DECODE_SPLITS, batch)](
        q, k_slots, v_slots, index, lengths, po, pm, pl, kn, vn, dim**-0.5,
        q.stride(0), q.stride(1), k_slots.stride(0), k_slots.stride(1), k_slots.stride(2),
        v_slots.stride(0), v_slots.stride(1), v_slots.stride(2), kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1),
        num_kv_heads, GROUP=group, GPAD=gpad, D=dim, BLOCK_N=block_n, SPLITS=DECODE_SPLITS, IEEE=ieee, WRITE=write,
        num_warps=4, num_stages=2,
    )
    return _combine(po, pm, pl, group, q.dtype)


def _combine_torch(po, pm, pl, group: int, dtype: torch.dtype) -> torch.Tensor:
    """The splits' partial results ([B, Hkv, SPLITS, GPAD, D], and their running max and
    denominator) as one: rescaled to the largest max, summed, divided. Returns [B, Hq, D]."""
    top = pm.max(dim=2, keepdim=True).values  # [B, Hkv, 1, GPAD]
    w = torch.exp(pm - top)  # empty splits: exp(-inf) = 0
    out = (po * w[..., None]).sum(2) / (pl * w).sum(2)[..., None]  # [B, Hkv, GPAD, D]
    batch, num_kv_heads, dim = po.shape[0], po.shape[1], po.shape[-1]
    return out[:, :, :group].reshape(batch, num_kv_heads * group, dim).to(dtype)


@triton.jit
def _decode_combine(PO, PM, PL, OUT, NUM_KV, GROUP: tl.constexpr, GPAD: tl.constexpr, D: tl.constexpr,
                    SPLITS: tl.constexpr):
    """Program (query head, row): `_combine_torch` for one head, in one launch instead of ~9."""
    head, row = tl.program_id(0), tl.program_id(1)
    kv_head, g = head // GROUP, head % GROUP
    at = ((row * NUM_KV + kv_head) * SPLITS + tl.arange(0, SPLITS)) * GPAD + g  # [SPLITS]
    m = tl.load(PM + at)
    w = tl.exp(m - tl.max(m, 0))  # empty splits (m = -inf, their partials 0): 0
    dims = tl.arange(0, D)
    po = tl.load(PO + at[:, None] * D + dims[None, :])  # [SPLITS, D]
    out = tl.sum(po * w[:, None], 0) / tl.sum(tl.load(PL + at) * w, 0)
    tl.store(OUT + (row * NUM_KV * GROUP + head) * D + dims, out.to(OUT.dtype.element_ty))


def _combine_triton(po, pm, pl, group: int, dtype: torch.dtype) -> torch.Tensor:
    batch, num_kv_heads, splits, gpad, dim = po.shape
    out = torch.empty(batch, num_kv_heads * group, dim, dtype=dtype, device=po.device)
    _decode_combine[(num_kv_heads * group, batch)](po, pm, pl, out, num_kv_heads, GROUP=group, GPAD=gpad, D=dim,
                                                   SPLITS=splits)
    return out


_combine = Checked("decode_combine", _combine_triton, _combine_torch)


def _slot_prefill_rows(q, k_slots, v_slots, slot, start):
    """Every query as a decode row of the split-K kernel on the same slot, query i over the first
    start + i + 1 positions: exact, but each query reads the keys again (fine for a few tokens)."""
    num_q = q.shape[0]
    lengths = start + torch.arange(1, num_q + 1, device=q.device)
    return decode_attention(q, k_slots, v_slots, slot.repeat(num_q), lengths)  # the kernel reads a dense index


def _slot_prefill_flash(q, k_slots, v_slots, slot, start):
    """Flash attention's variable-length path over the slots as one flat run of keys: the key
    offsets (on the device) pick the slot's first start + T rows, and the causal mask is aligned to
    the last of them, so query i sees positions [0, start + i]; the capacity bounds the length."""
    num_q, capacity = q.shape[0], k_slots.shape[1]
    first = slot * capacity
    cu_k = torch.cat([first, first + start + num_q]).to(torch.int32)
    cu_q = torch.arange(0, 2 * num_q, num_q, device=q.device, dtype=torch.int32)
    out = torch.ops.aten._flash_attention_forward(
        q.contiguous(), k_slots.flatten(0, 1), v_slots.flatten(0, 1), cu_q, cu_k, num_q, capacity, 0.0, True, False,
        scale=q.shape[-1] ** -0.5,
    )
    return out[0]


def slot_prefill_attention(q, k_slots, v_slots, slot, start):
    """`engine.ops.attention.slot_prefill_attention` on the GPU, inside a CUDA graph."""
    if q.dtype == torch.float32:  # flash has no fp32: the exactness mode reads rows with IEEE dots
        return _slot_prefill_rows(q, k_slots, v_slots, slot, start)
    return _checked_flash(q, k_slots, v_slots, slot, start)


_checked_flash = Checked("slot_prefill_attention", _slot_prefill_flash, _slot_prefill_rows)
