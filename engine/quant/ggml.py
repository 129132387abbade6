"""GGML tensor types: block sizes and torch dequantization, equal bit for bit to `gguf.quants`.

A quantized GGML row is a run of blocks; each block holds `block_size` weights in `type_size`
bytes (fp16 scales, packed integers). The functions below take blocks as uint8 [N, type_size]
and return fp32 [N, block_size], with the same fp32 operations in the same order as the
`gguf` package's numpy reference (which follows ggml's own `dequantize_row_*`), so the values
are identical, not merely close. K-quants are 256-weight super-blocks of 8 or 16 sub-blocks.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
QK_K = 256


class UnsupportedType(ValueError):
    """A tensor of a GGML type this engine does not dequantize."""


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of every block, as fp32 [N, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, groups: int) -> torch.Tensor:
    """Bytes [N, groups * L] → 4-bit values [N, groups, 2, L]: per group the low nibbles of its
    L bytes, then their high nibbles (ggml's layout for 4-bit quants)."""
    qs = qs.reshape(qs.shape[0], groups, 1, -1)
    return torch.cat([qs & 0x0F, qs >> 4], dim=2)


def _bits(qh: torch.Tensor, n: int, shift: int, width: int) -> torch.Tensor:
    """`qh` [N, L] → [N, n, L]: field j is (qh >> (j * shift)) & (2**width - 1)."""
    shifts = torch.arange(0, n * shift, shift, dtype=torch.uint8).view(1, n, 1)
    return (qh.unsqueeze(1) >> shifts) & ((1 << width) - 1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:], 1).reshape(b.shape[0], -1).view(torch.int8) - 8
    return _f16(b, 0) * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 4:], 1).reshape(b.shape[0], -1).float()
    return _f16(b, 0) * q + _f16(b, 2)


def _low_high_5(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1: 16 bytes of low nibbles and a 32-bit mask of fifth bits → [N, 32] in 0..31."""
    high = _bits(qh, 8, 1, 1).transpose(1, 2).reshape(qh.shape[0], 32)  # bit i of the little-endian u32
    return _nibbles(qs, 1).reshape(qs.shape[0], 32) | (high << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _low_high_5(b[:, 2:6], b[:, 6:]).view(torch.int8) - 16
    return _f16(b, 0) * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _low_high_5(b[:, 4:8], b[:, 8:]).float()
    return _f16(b, 0) * q + _f16(b, 2)


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of packed 6-bit scales and mins → two uint8 [N, 8]."""
    d, m, md = scales.reshape(-1, 3, 4).unbind(1)
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: q [N, 8, 32] in sub-blocks → d * scale * q - dmin * min."""
    sc, mn = k_scale_min(b[:, 4:16])
    d = (_f16(b, 0) * sc.float()).unsqueeze(-1)
    dm = (_f16(b, 2) * mn.float()).unsqueeze(-1)
    return (d * q.float() - dm).reshape(b.shape[0], QK_K)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_affine(b, _nibbles(b[:, 16:], 4).reshape(-1, 8, 32))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    low = _nibbles(b[:, 48:], 4).reshape(-1, 8, 32)
    high = _bits(b[:, 16:48], 8, 1, 1)  # sub-block j takes bit j of each of the 32 bytes
    return _k_affine(b, low | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    low = _nibbles(b[:, :128], 2).reshape(n, 8, 32)
    high = torch.cat([_bits(half, 4, 2, 2) for half in b[:, 128:192].reshape(n, 2, 32).unbind(1)], dim=1)
    q = ((low | (high << 4)).view(torch.int8) - 32).reshape(n, 16, 16).float()
    d = _f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()
    return (d.unsqueeze(-1) * q).reshape(n, QK_K)


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).float()


def _f16_all(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


BLOCK_DEQUANT: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    T.F32: _f32,
    T.F16: _f16_all,
    T.BF16: _bf16,
    T.Q8_0: _q8_0,
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
}
SUPPORTED = frozenset(BLOCK_DEQUANT)
CHUNK_BLOCKS = 1 << 15  # bounds the fp32 temporaries of one step (a 2 GB embedding is done in pieces)


def block_shape(qtype: GGMLQuantizationType) -> tuple[int, int]:
    """(weights per block, bytes per block); plain floats count as blocks of one weight."""
    return GGML_QUANT_SIZES[qtype]


def as_bytes(data: np.ndarray) -> torch.Tensor:
    """A (read-only, memory-mapped) numpy array's bytes as a flat uint8 tensor, without a copy."""
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # not writable: it is only read
        return torch.from_numpy(flat)


def dequantize(
    data: np.ndarray | torch.Tensor,
    qtype: GGMLQuantizationType,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    name: str = "tensor",
) -> torch.Tensor:
    """A GGML tensor's data (any view of its bytes) → `dtype` [*shape] (PyTorch order: the GGML
    row, `ne[0]`, is the last dim), converted in chunks of blocks."""
    if qtype not in BLOCK_DEQUANT:
        raise UnsupportedType(
            f"{name}: GGML type {qtype.name} is not supported ({', '.join(t.name for t in SUPPORTED)})"
        )
    raw = data.reshape(-1).view(torch.uint8) if isinstance(data, torch.Tensor) else as_bytes(data)
    block_size, type_size = block_shape(qtype)
    numel = int(np.prod(shape))
    if shape[-1] % block_size or raw.numel() != numel // block_size * type_size:
        raise ValueError(f"{name}: {raw.numel()} bytes do not hold {qtype.name} {list(shape)}")
    blocks = raw.view(-1, type_size)
    out = torch.empty(numel, dtype=dtype)
    fn, step = BLOCK_DEQUANT[qtype], CHUNK_BLOCKS * max(1, 256 // block_size)
    for start in range(0, blocks.shape[0], step):
        part = blocks[start : start + step]
        out[start * block_size : (start + part.shape[0]) * block_size] = fn(part).reshape(-1)
    return out.view(shape)
