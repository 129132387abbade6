"""Test data: simple round-to-nearest encoders for the K-quant formats (Q4_K, Q5_K, Q6_K), so that the
CPU tests can write K-quant GGUF files without llama.cpp's `llama-quantize` (the presets' real
Q4_K_M files need it). Any valid blocks do: the tests compare our kernels with our (gguf-exact)
dequantization of the same bytes; these only keep the weights near the originals, not llama.cpp's
error-minimising search. `write_kquant_gguf` writes a model with a Q4_K_M-like mix of types."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

F16 = np.float16


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(F16).reshape(-1, 1).view(np.uint8)


def _scale(v: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row 6-bit codes of non-negative `v` [nb, 8] and their fp16 super-scale."""
    d = (v.max(-1) / levels).astype(F16)
    safe = np.where(d == 0, 1, d.astype(np.float32))
    return np.clip(np.rint(v / safe[:, None]), 0, levels).astype(np.uint8), d


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins → ggml's 12 bytes (the inverse of `ggml.k_scale_min`)."""
    low = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    mid = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    high = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return np.concatenate([low, mid, high], axis=1).astype(np.uint8)


def _affine(x: np.ndarray, levels: int):
    """Q4_K/Q5_K: sub-blocks [nb, 8, 32] → codes q in 0..levels and the block header bytes."""
    xs = x.reshape(-1, 8, 32)
    lo = np.minimum(xs.min(-1), 0)
    sc, d = _scale((xs.max(-1) - lo) / levels, 63)
    mn, dmin = _scale(-lo, 63)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    q = np.rint((xs + offset[..., None]) / np.where(step == 0, 1, step)[..., None])
    q = np.clip(np.where(step[..., None] == 0, 0, q), 0, levels).astype(np.uint8)
    return q, np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_scales(sc, mn)], axis=1)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """Codes [nb, 8, 32] (low 4 bits) → 128 bytes: group g holds sub-blocks 2g (low) and 2g + 1 (high)."""
    q = q & 15
    return (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)


def q4_k(x: np.ndarray) -> np.ndarray:
    q, head = _affine(x, 15)
    return np.concatenate([head, _nibbles(q)], axis=1)


def q5_k(x: np.ndarray) -> np.ndarray:
    q, head = _affine(x, 31)
    qh = sum(((q[:, j] >> 4) & 1) << j for j in range(8)).astype(np.uint8)  # [nb, 32]: bit j from sub-block j
    return np.concatenate([head, qh, _nibbles(q)], axis=1)


def q6_k(x: np.ndarray) -> np.ndarray:
    xs = x.reshape(-1, 16, 16)
    amax = np.abs(xs).max(-1)  # [nb, 16]
    d = (amax.max(-1) / 31 / 127).astype(F16)
    safe = np.where(d == 0, 1, d.astype(np.float32))
    sc = np.clip(np.rint(amax / 31 / safe[:, None]), 0, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc
    q = np.rint(xs / np.where(step == 0, 1, step)[..., None])
    q = (np.clip(np.where(step[..., None] == 0, 0, q), -32, 31) + 32).astype(np.uint8).reshape(-1, 8, 32)
    ql = np.zeros((q.shape[0], 128), np.uint8)
    qh = np.zeros((q.shape[0], 64), np.uint8)
    for c in range(8):  # chunk c of 32: half h = c // 4, j = c % 4
        h, j = divmod(c, 4)
        at = h * 64 + (j % 2) * 32
        ql[:, at : at + 32] |= (q[:, c] & 15) << (4 * (j // 2))
        qh[:, h * 32 : h * 32 + 32] |= (q[:, c] >> 4) << (2 * j)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=1)


ENCODERS = {T.Q4_K: q4_k, T.Q5_K: q5_k, T.Q6_K: q6_k}


def quantize(x: np.ndarray, qtype) -> np.ndarray:
    """fp32 [.., K] (K a multiple of 256) → GGML rows uint8 [.., K / 256 * type size]."""
    blocks = ENCODERS[qtype](np.ascontiguousarray(x, np.float32).reshape(-1, 256))
    return blocks.reshape(*x.shape[:-1], -1)


def mix_type(name: str, t: torch.Tensor) -> T:
    """A Q4_K_M-like choice: Q6_K for the output and the down / fused-qkv projections, Q5_K for the
    attention output and DeltaNet gate, Q8_0 for the DeltaNet's small b and a projections (and where
    rows are not whole 256-blocks), Q4_K elsewhere: one DeltaNet input projection in three formats."""
    if t.shape[-1] % 256 or "ssm_alpha" in name or "ssm_beta" in name:
        return T.Q8_0
    if name == "output.weight" or "ffn_down" in name or "attn_qkv" in name:
        return T.Q6_K
    if "attn_output" in name or "attn_gate" in name:
        return T.Q5_K
    return T.Q4_K


def write_kquant_gguf(
    config, raw: dict, state_dict: dict[str, torch.Tensor], out: Path, choose=mix_type
) -> Path:
    """`peer.gguf_export.write_gguf` with every matrix llama.cpp would quantize in `choose(name, t)`."""
    import peer.gguf_export as export  # noqa: PLC0415

    plain = export.to_numpy

    def to_numpy(name: str, t: torch.Tensor, dtype: str):
        if export.keeps_f32(name, t):
            return plain(name, t, "f32")
        qtype = choose(name, t)
        x = t.float().contiguous().cpu().numpy()
        return (quants.quantize(x, qtype) if qtype == T.Q8_0 else quantize(x, qtype)), qtype

    with mock.patch.object(export, "to_numpy", to_numpy):
        return export.write_gguf(config, raw, state_dict, out, "f32")
