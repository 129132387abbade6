"""Gather experts read in place from pinned host memory into a device staging buffer.

An offloaded decode step reads the experts it lacks where they lie in host memory. Read by the
experts' own kernels, those reads are what those kernels load: 32 bytes of one weight row here,
two bytes of scales there, each a separate small request over the link (well below its bandwidth). This kernel reads each expert once, as whole 16-byte words in long
contiguous runs (full-size requests, many in flight), into a few device rows that the experts'
kernels then read from device memory. The ids come from the device (the routing), so nothing
waits on the host and a CUDA graph may hold it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # words (int32) of each part a program copies
PARTS = 4  # parts per launch (a quantized stack has at most 4)


@triton.jit
def _copy_part(src, dst, width, expert, r, offs):
    mask = offs < width
    tl.store(dst + r * width + offs, tl.load(src + expert * width + offs, mask=mask), mask=mask)


@triton.jit
def _gather_kernel(
    IDS, S0, S1, S2, S3, D0, D1, D2, D3, W0, W1, W2, W3, NPARTS: tl.constexpr, BLOCK: tl.constexpr
):
    """Program (block b, row r): words [b * BLOCK, (b + 1) * BLOCK) of each part of expert IDS[r]
    (source [E, W] in host memory) into row r of the staging parts ([R, W]); nothing for id -1."""
    r = tl.program_id(1)
    expert = tl.load(IDS + r).to(tl.int64)
    if expert >= 0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        _copy_part(S0, D0, W0, expert, r, offs)
        if NPARTS > 1:
            _copy_part(S1, D1, W1, expert, r, offs)
        if NPARTS > 2:
            _copy_part(S2, D2, W2, expert, r, offs)
        if NPARTS > 3:
            _copy_part(S3, D3, W3, expert, r, offs)


def _words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous [rows, ...] tensor as [rows, W] int32 words (its bytes per row divisible by 4)."""
    return t.view(torch.uint8).reshape(t.shape[0], -1).view(torch.int32)


def gather_fits(parts: tuple[torch.Tensor, ...]) -> bool:
    """Whether every part is contiguous with whole words per expert (the kernel's int32 view)."""
    return all(p.is_contiguous() and (p[0].nbytes % 4 == 0) and p.data_ptr() % 16 == 0 for p in parts)


def gather_experts(
    staging: tuple[torch.Tensor, ...], source: tuple[torch.Tensor, ...], ids: torch.Tensor
) -> None:
    """staging[p][r] = source[p][ids[r]] for every part p and row r with ids[r] >= 0 (rows of
    id -1 keep whatever they held). `source` parts [E, ...] (host memory the device reads in
    place, or device memory), `staging` [R, ...] of the same trailing shapes, R >= len(ids)."""
    ids = ids.flatten().to(torch.int32)
    for lo in range(0, len(source), PARTS):
        src = [_words(p) for p in source[lo : lo + PARTS]]
        dst = [_words(p) for p in staging[lo : lo + PARTS]]
        widest = max(s.shape[1] for s in src)
        pad = PARTS - len(src)
        widths = [s.shape[1] for s in src] + [0] * pad
        _gather_kernel[(triton.cdiv(widest, BLOCK), ids.numel())](
            ids, *src, *[src[0]] * pad, *dst, *[dst[0]] * pad, *widths, NPARTS=len(src), BLOCK=BLOCK
        )
