"""Attention on the GPU: SDPA (flash) with grouped KV heads for prefill, and a split-K Triton
kernel for one query against a preallocated KV cache whose length lives on the device (decode
inside a CUDA graph: one graph serves every length up to the cache's capacity)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention.bias import causal_lower_right

DECODE_SPLITS = 64


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: [T, Hq, D] for the last T positions of k, v: [S, Hkv, D]. Returns [T, Hq, D]."""
    num_q, total = q.shape[0], k.shape[0]
    if num_q == 1 and total > 1:  # one decode token: the split-K kernel (SDPA's cuDNN path costs ~1 ms of host time a call)
        return decode_attention(q[0], k, v, torch.full((1,), total, device=q.device, dtype=torch.int32))[None]
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, T|S, D]
    if num_q == total:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    else:  # queries are the last rows: the causal mask is aligned to the bottom right
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(num_q, total), enable_gqa=True)
    return out[0].transpose(0, 1)


@triton.jit
def _decode_partial(
    Q, K, V, LENGTH, PO, PM, PL, scale,
    stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    GROUP: tl.constexpr, GPAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr, IEEE: tl.constexpr,
):
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    length = tl.load(LENGTH)
    per_split = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, length)
    rows = tl.arange(0, GPAD)
    dims = tl.arange(0, D)
    q = tl.load(Q + (kv_head * GROUP + rows)[:, None] * stride_qh + dims[None, :], mask=(rows < GROUP)[:, None], other=0.0)
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
    base = (kv_head * SPLITS + split) * GPAD
    tl.store(PO + (base + rows)[:, None] * D + dims[None, :], acc)
    tl.store(PM + base + rows, m)
    tl.store(PL + base + rows, denom)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """q: [Hq, D] one query; k_cache, v_cache: [capacity, Hkv, D], of which the first `length`
    (int32/int64 [1] on the device) rows are valid. Returns [Hq, D]."""
    num_heads, dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    gpad = max(16, triton.next_power_of_2(group))
    ieee = q.dtype == torch.float32
    block_n = 32 if ieee else 64
    po = torch.empty(num_kv_heads, DECODE_SPLITS, gpad, dim, device=q.device, dtype=torch.float32)
    pm = torch.empty(num_kv_heads, DECODE_SPLITS, gpad, device=q.device, dtype=torch.float32)
    pl = torch.empty_like(pm)
    q = q.contiguous()
    _decode_partial[(num_kv_heads, DECODE_SPLITS)](
        q, k_cache, v_cache, length, po, pm, pl, dim**-0.5,
        q.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        GROUP=group, GPAD=gpad, D=dim, BLOCK_N=block_n, SPLITS=DECODE_SPLITS, IEEE=ieee,
        num_warps=4, num_stages=2,
    )
    top = pm.max(dim=1, keepdim=True).values  # [Hkv, 1, GPAD]
    w = torch.exp(pm - top)  # empty splits: exp(-inf) = 0
    out = (po * w[..., None]).sum(1) / (pl * w).sum(1)[..., None]  # [Hkv, GPAD, D]
    return out[:, :group].reshape(num_heads, dim).to(q.dtype)
