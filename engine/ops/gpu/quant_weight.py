"""Weights kept quantized in memory: GGML Q8_0, Q4_K, Q5_K, Q6_K and Qwen's block FP8, as a `QuantWeight`.

A `QuantWeight` holds one linear weight [N, K] (or a stack of experts [E, N, K]) repacked from the
file's blocks into separate arrays per field (quants, sub-block scales, super-block scales), the
same bytes as the file (Q4_K's 6-bit scales unpacked to bytes: 0.58 instead of 0.5625 bytes a
weight); engine/ops/gpu/quant.py multiplies with it.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.quant.ggml import T, k_scale_min

Q8_0, Q4_K, Q6_K, FP8, Q5_K = 0, 1, 2, 3, 4
FORMATS = {T.Q8_0: Q8_0, T.Q4_K: Q4_K, T.Q5_K: Q5_K, T.Q6_K: Q6_K}
NAMES = {Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K", FP8: "FP8"}
# The packed arrays of each format, rows first as in the weight: Q8_0 int8 [.., N, K] and fp16
# [.., N, K/32]; Q4_K nibbles [.., N, K/2], 6-bit scales and mins as bytes [.., N, K/32] each, fp16
# (d, dmin) [.., N, K/256, 2]; Q5_K the same nibbles, fifth bits [.., N, K/8], (scale, min)
# [.., N, K/32, 2], (d, dmin); Q6_K nibbles [.., N, K/2], 2-bit highs [.., N, K/4], int8 scales
# [.., N, K/16], fp16 [.., N, K/256]; FP8 e4m3 [.., N, K], fp32 [.., ceil(N/128), ceil(K/128)].
FIELDS = {
    Q8_0: ("qs", "d"),
    Q4_K: ("qs", "sc", "mn", "dd"),
    Q5_K: ("qs", "qh", "scmn", "dd"),
    Q6_K: ("ql", "qh", "sc", "d"),
    FP8: ("w", "scale"),
}
BLOCK_K = {Q8_0: 32, Q4_K: 256, Q5_K: 256, Q6_K: 256, FP8: 128}  # K must be a multiple of the format's block
GEMV_CHUNK = {Q8_0: 32, Q4_K: 64, Q5_K: 64, Q6_K: 128, FP8: 128}  # columns per GEMV step: one group of scales
FP8_ROWS = 128  # rows per FP8 scale block


class QuantWeight(nn.Module):
    """A packed weight [.., N, K] standing for a dense one of `dtype` (what the model computes in:
    `linear` returns x's dtype, `rows` this one). Its field arrays (`FIELDS[fmt]`) are buffers, so
    it moves with its model (`.to(device)`: never `.to(dtype)`, which would cast its fp16 scales)
    and counts in `parameters()` / `buffers()` walks (resident bytes: `nbytes`)."""

    columns: torch.Tensor | None

    def __init__(self, fmt: int, shape: tuple[int, ...], parts: tuple[torch.Tensor, ...],
                 dtype: torch.dtype = torch.float32, columns: torch.Tensor | None = None):
        """`columns` [K]: where the file's columns (the packed order) sit in the model's, when they
        differ (Qwen3.5's DeltaNet out_proj in GGUF): x's columns are gathered into the file's order."""
        super().__init__()
        self.fmt, self.shape, self.dtype = fmt, tuple(shape), dtype
        for name, part in zip(FIELDS[fmt], parts, strict=True):
            self.register_buffer(name, part, persistent=False)
        self.register_buffer("columns", columns, persistent=False)
        # the GEMV reads x through `columns` a chunk at a time where they move in runs of whole
        # chunks (the DeltaNet's out_proj: value heads of 128 columns), else x is gathered first
        self.chunked_columns = columns is not None and _in_runs(columns, GEMV_CHUNK[fmt])

    @property
    def parts(self) -> tuple[torch.Tensor, ...]:
        return tuple(self._buffers[name] for name in FIELDS[self.fmt])  # type: ignore[misc]

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts)

    def extra_repr(self) -> str:
        return f"{NAMES[self.fmt]}, shape={list(self.shape)}, dtype={self.dtype}"

    def dequantize(self) -> torch.Tensor:
        """fp32 [.., N, K] in the model's column order."""
        w = self._dequantize()
        if self.columns is None:
            return w
        out = torch.empty_like(w)
        out[..., self.columns] = w
        return out

    def _dequantize(self) -> torch.Tensor:
        """fp32 [.., N, K] in the packed order: the reference the kernels are tested against (plain torch)."""
        n, k = self.shape[-2:]
        if self.fmt == Q8_0:
            qs, d = self.parts
            return (qs.float().unflatten(-1, (-1, 32)) * d.float()[..., None]).flatten(-2)
        if self.fmt in (Q4_K, Q5_K):
            if self.fmt == Q4_K:
                qs, sc, mn, dd = self.parts
            else:
                qs, qh, scmn, dd = self.parts
                sc, mn = scmn.unbind(-1)
            q = qs.unflatten(-1, (-1, 32)).unsqueeze(-2)
            q = torch.cat([q & 0x0F, q >> 4], dim=-2).flatten(-3, -2)  # [.., N, K/32, 32]
            if self.fmt == Q5_K:  # sub-block j of a super-block takes bit j of its 32 qh bytes
                high = qh.unflatten(-1, (-1, 32)).unsqueeze(-2)  # [.., N, K/256, 1, 32]
                q = q | (torch.cat([(high >> j) & 1 for j in range(8)], dim=-2).flatten(-3, -2) << 4)
            d, dmin = dd.float().repeat_interleave(8, dim=-2).unbind(-1)  # [.., N, K/32]
            return ((d * sc.float())[..., None] * q.float() - (dmin * mn.float())[..., None]).flatten(-2)
        if self.fmt == Q6_K:
            ql, qh, sc, d = self.parts
            low = ql.unflatten(-1, (-1, 64)).unsqueeze(-2)
            low = torch.cat([low & 0x0F, low >> 4], dim=-2).flatten(-2)  # [.., N, K/128, 128]
            high = qh.unflatten(-1, (-1, 32)).unsqueeze(-2)
            high = torch.cat([(high >> s) & 3 for s in (0, 2, 4, 6)], dim=-2).flatten(
                -2
            )  # [.., N, K/128, 128]
            q = ((low | (high << 4)).view(torch.int8) - 32).flatten(-2).unflatten(-1, (-1, 16)).float()
            scale = d.float().repeat_interleave(16, dim=-1) * sc.float()  # [.., N, K/16]
            return (scale[..., None] * q).flatten(-2)
        w, scale = self.parts
        s = scale.float().repeat_interleave(128, dim=-2).repeat_interleave(128, dim=-1)
        return w.float() * s[..., :n, :k]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of a 2-D weight, dequantized to `dtype` [T, K]: an embedding lookup
        (the rows' blocks gathered, then the reference dequantization; no host sync)."""
        if self.fmt == FP8:
            w, scale = self.parts
            s = scale[ids // FP8_ROWS].repeat_interleave(128, dim=-1)[:, : self.shape[-1]]
            return (w[ids].float() * s).to(self.dtype)
        picked = QuantWeight(self.fmt, (ids.numel(), self.shape[-1]), tuple(p[ids] for p in self.parts))
        return picked.dequantize().to(self.dtype)

    def narrow_rows(self, start: int, length: int) -> QuantWeight:
        """Rows [start, start + length) as views of this weight's arrays (FP8: `start` on a block)."""
        if self.fmt == FP8:
            w, scale = self.parts
            if start % FP8_ROWS:
                raise ValueError(f"FP8 rows from {start}: not on a {FP8_ROWS}-row scale block")
            blocks = (start + length + FP8_ROWS - 1) // FP8_ROWS - start // FP8_ROWS
            parts = (w.narrow(-2, start, length), scale.narrow(-2, start // FP8_ROWS, blocks))
        else:
            dim = len(self.shape) - 2  # every GGML field has the weight's rows at this dim
            parts = tuple(p.narrow(dim, start, length) for p in self.parts)
        return QuantWeight(
            self.fmt, (*self.shape[:-2], length, self.shape[-1]), parts, self.dtype, self.columns
        )

    def experts(self, start: int, length: int) -> QuantWeight:
        """Experts [start, start + length) of a stack [E, N, K], as views of its arrays."""
        parts = tuple(p.narrow(0, start, length) for p in self.parts)
        return QuantWeight(self.fmt, (length, *self.shape[1:]), parts, self.dtype, self.columns)

    def expert(self, e: int) -> QuantWeight:
        """Expert `e` of a stack [E, N, K]: one weight [N, K], views of the stack's arrays."""
        return QuantWeight(self.fmt, self.shape[1:], tuple(p[e] for p in self.parts), self.dtype, self.columns)

    def take_rows(self, index: torch.Tensor) -> QuantWeight:
        """Rows `index` (a permutation or selection, GGML formats: rows are independent), copied."""
        if self.fmt == FP8:
            raise ValueError("FP8 rows share 128-row scale blocks: they cannot be reordered")
        dim = len(self.shape) - 2
        parts = tuple(p.index_select(dim, index.to(p.device)) for p in self.parts)
        return QuantWeight(
            self.fmt, (*self.shape[:-2], index.numel(), self.shape[-1]), parts, self.dtype, self.columns
        )


def _in_runs(columns: torch.Tensor, run: int) -> bool:
    """Whether each `run` entries of `columns` from a multiple of `run` are consecutive columns."""
    if columns.numel() % run:
        return False
    runs = columns.view(-1, run)
    return bool((runs - runs[:, :1] == torch.arange(run, device=columns.device)).all())


def can_concat(weights: list[QuantWeight]) -> bool:
    """Whether the weights' rows can be stacked into one weight of their format: the same format and
    leading dims, and (FP8) every part but the last a whole number of scale blocks of rows."""
    first = weights[0]
    if any(w.fmt != first.fmt or w.shape[:-2] != first.shape[:-2] or w.shape[-1] != first.shape[-1]
           or w.columns is not None for w in weights):
        return False
    return first.fmt != FP8 or all(w.shape[-2] % FP8_ROWS == 0 for w in weights[:-1])


def concat_rows(weights: list[QuantWeight]) -> QuantWeight:
    """One weight [.., sum N, K] of `weights` (`can_concat`), in a fresh copy."""
    if not can_concat(weights):
        raise ValueError(f"cannot concatenate {[(NAMES[w.fmt], w.shape) for w in weights]}")
    first = weights[0]
    dim = len(first.shape) - 2
    parts = tuple(torch.cat(fields, dim=dim) for fields in zip(*(w.parts for w in weights), strict=True))
    rows = sum(w.shape[-2] for w in weights)
    return QuantWeight(first.fmt, (*first.shape[:-2], rows, first.shape[-1]), parts, first.dtype)


def stack(weights: list[QuantWeight]) -> QuantWeight:
    """Weights [N, K] of one format → one [E, N, K] (experts)."""
    first = weights[0]
    if any(w.fmt != first.fmt or w.shape != first.shape for w in weights):
        raise ValueError("stacked weights differ in format or shape")
    parts = tuple(torch.stack(fields) for fields in zip(*(w.parts for w in weights), strict=True))
    return QuantWeight(first.fmt, (len(weights), *first.shape), parts, first.dtype)


def append_expert(experts: QuantWeight, w: QuantWeight) -> QuantWeight | None:
    """A stack [E, N, K] and one more expert's weight [N, K] → a fresh stack [E + 1, N, K]; None
    where `w` is of another format or shape."""
    if w.fmt != experts.fmt or w.shape != experts.shape[1:] or w.columns is not None or experts.columns is not None:
        return None
    parts = tuple(torch.cat([p, q[None]]) for p, q in zip(experts.parts, w.parts, strict=True))
    return QuantWeight(experts.fmt, (experts.shape[0] + 1, *w.shape), parts, experts.dtype)


def pack_ggml(
    raw: torch.Tensor, qtype, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> QuantWeight:
    """GGML rows (uint8 [.., N, row bytes], as in the file) → a `QuantWeight` standing for `dtype`."""
    fmt = FORMATS[qtype]
    n, k = shape[-2:]
    if k % BLOCK_K[fmt]:
        raise ValueError(f"{qtype.name}: rows of {k} are not whole {BLOCK_K[fmt]}-weight blocks")
    lead = tuple(shape[:-1])
    if fmt == Q8_0:
        b = raw.reshape(*lead, k // 32, 34)
        return QuantWeight(fmt, shape, (b[..., 2:].contiguous().view(torch.int8).reshape(*lead, k),
                                        b[..., :2].contiguous().view(torch.float16).reshape(*lead, k // 32)), dtype)
    if fmt in (Q4_K, Q5_K):
        b = raw.reshape(-1, 144 if fmt == Q4_K else 176)
        sc, mn = k_scale_min(b[:, 4:16])
        dd = b[:, :4].contiguous().view(torch.float16).reshape(*lead, k // 256, 2)  # d, dmin
        if fmt == Q4_K:
            return QuantWeight(fmt, shape, (b[:, 16:].reshape(*lead, k // 2).contiguous(), sc.reshape(*lead, k // 32),
                                            mn.reshape(*lead, k // 32), dd), dtype)
        return QuantWeight(fmt, shape, (b[:, 48:].reshape(*lead, k // 2).contiguous(),
                                        b[:, 16:48].reshape(*lead, k // 8).contiguous(),
                                        torch.stack([sc, mn], dim=-1).reshape(*lead, k // 32, 2), dd), dtype)
    b = raw.reshape(-1, 210)
    return QuantWeight(fmt, shape, (b[:, :128].reshape(*lead, k // 2).contiguous(),
                                    b[:, 128:192].reshape(*lead, k // 4).contiguous(),
                                    b[:, 192:208].contiguous().view(torch.int8).reshape(*lead, k // 16),
                                    b[:, 208:].contiguous().view(torch.float16).reshape(*lead, k // 256)), dtype)


def pack_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32
) -> QuantWeight:
    """Qwen FP8: e4m3 [.., N, K] with [128, 128]-block scales (kept as fp32)."""
    return QuantWeight(FP8, tuple(weight.shape), (weight.contiguous(), scale_inv.float().contiguous()), dtype)
