"""Causal attention with grouped KV heads over a cache (reference path: SDPA in query blocks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

QUERY_BLOCK = 1024


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: [T, Hq, D] for the last T positions of k, v: [S, Hkv, D] (S >= T). Returns [T, Hq, D]."""
    num_q, num_heads, _ = q.shape
    total, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    # [1, H, len, D], contiguous: the layout torch's fused CPU attention takes (a transposed 3-D view
    # falls back to the unfused path, about 3x slower at 600 queries over 5.6K keys)
    kh = k.transpose(0, 1).repeat_interleave(group, dim=0)[None]
    vh = v.transpose(0, 1).repeat_interleave(group, dim=0)[None]
    qh = q.transpose(0, 1).contiguous()[None]
    offset = total - num_q
    out = torch.empty_like(qh)
    for lo in range(0, num_q, QUERY_BLOCK):
        hi = min(lo + QUERY_BLOCK, num_q)
        visible = offset + hi  # keys [0, offset + hi) can be seen by this block
        q_pos = torch.arange(offset + lo, offset + hi, device=q.device)[:, None]
        k_pos = torch.arange(visible, device=q.device)[None, :]
        mask = k_pos <= q_pos  # [hi - lo, visible]
        out[:, :, lo:hi] = F.scaled_dot_product_attention(
            qh[:, :, lo:hi], kh[:, :, :visible], vh[:, :, :visible], attn_mask=mask
        )
    return out[0].transpose(0, 1)


def decode_attention(
    q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, index: torch.Tensor, lengths: torch.Tensor,
    k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per row against slotted caches: q [B, Hq, D]; k_slots, v_slots [S, capacity, Hkv, D];
    row b reads slot index[b], of which the first lengths[b] positions are valid. Returns [B, Hq, D].
    With k_new, v_new [B, Hkv, D] (the step's token), they are first written at position
    lengths[b] - 1 of each row's slot. Shapes never depend on the lengths (a masked read of the whole
    capacity), so it runs in a graph."""
    if k_new is not None and v_new is not None:
        last = lengths - 1
        k_slots[index, last], v_slots[index, last] = k_new, v_new
    num_heads = q.shape[1]
    keys, values = k_slots[index], v_slots[index]  # [B, capacity, Hkv, D]
    group = num_heads // keys.shape[2]
    kh = keys.transpose(1, 2).repeat_interleave(group, dim=1)  # [B, Hq, capacity, D]
    vh = values.transpose(1, 2).repeat_interleave(group, dim=1)
    visible = torch.arange(keys.shape[1], device=q.device)[None, :] < lengths[:, None]  # [B, capacity]
    out = F.scaled_dot_product_attention(q[:, :, None], kh, vh, attn_mask=visible[:, None, None, :])  # [B, Hq, 1, D]
    return out[:, :, 0]


def slot_prefill_attention(
    q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor, slot: torch.Tensor, start: torch.Tensor
) -> torch.Tensor:
    """Queries of a few new tokens of the sequence in slot `slot` ([1], on the device), at positions
    start, start+1, ... ([1] on the device), whose keys and values are already in the slot:
    q [T, Hq, D]; k_slots, v_slots [S, capacity, Hkv, D]. Query i sees positions [0, start + i].
    Returns [T, Hq, D]. Shapes never depend on start (a masked read of the whole capacity)."""
    num_q, num_heads, _ = q.shape
    keys, values = k_slots[slot][0], v_slots[slot][0]  # [capacity, Hkv, D]
    group = num_heads // keys.shape[1]
    kh = keys.transpose(0, 1).repeat_interleave(group, dim=0)[None]  # [1, Hq, capacity, D]
    vh = values.transpose(0, 1).repeat_interleave(group, dim=0)[None]
    q_pos = start + torch.arange(num_q, device=q.device)
    visible = torch.arange(keys.shape[0], device=q.device)[None, :] <= q_pos[:, None]  # [T, capacity]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kh, vh, attn_mask=visible)
    return out[0].transpose(0, 1)
