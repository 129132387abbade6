"""Routed experts without a Python loop over experts and without a host sync (so the same code
runs inside a CUDA graph): grouped GEMMs over expert-sorted rows for prefill, and for a few tokens
(decode) two Triton kernels that read only the chosen experts' weights, each chosen expert once for all
the tokens that chose it (`DecodeTiles`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.ops.gpu import fp8_prefill, quant, tickets
from engine.ops.gpu.checked import Checked
from engine.ops.moe import DECODE_ROWS, experts_loop, router_logits
from engine.ops.moe import route as reference_route
from engine.ops.moe import router as reference_router

GRAPH_TOKENS = 512  # fp32: up to a captured prefill's tokens (engine.runner.PREFILL_BUCKETS) the Triton kernels too


# assignments a program of the counting sort places (512: 144 programs at the 35B shape's 8K tokens), and
# compared with each other at a time (64: 47 registers a thread at 8 warps for sm_90, where 128 took 181)
SORT_BLOCK, SORT_CHUNK = 512, 64


@triton.jit
def _sort_keys(IDS, i, N, E):
    """Assignments i's keys: their expert, E where none (-1: after every expert's rows), -1 past N."""
    ids = tl.load(IDS + i, mask=i < N, other=0)
    return tl.where(i < N, tl.where(ids < 0, E, ids), -1).to(tl.int32)


@triton.jit
def _count_keys_kernel(IDS, COUNTS, N, E, EP: tl.constexpr, BLOCK: tl.constexpr):
    """Block b's assignments counted per key into COUNTS[b, :] (zeroed)."""
    b = tl.program_id(0)
    i = b * BLOCK + tl.arange(0, BLOCK)
    tl.atomic_add(COUNTS + b * EP + _sort_keys(IDS, i, N, E), 1, mask=i < N)


@triton.jit
def _key_starts_kernel(COUNTS, BASE, OFFS, B, E, EP: tl.constexpr, STEP: tl.constexpr):
    """One program: BASE[b, e], the row of block b's first assignment of key e (the rows of every smaller key,
    then key e's rows in the blocks before b); OFFS[e] the end of expert e's rows."""
    keys = tl.arange(0, EP)
    totals = tl.zeros([EP], tl.int32)
    for r0 in range(0, B, STEP):
        r = r0 + tl.arange(0, STEP)
        totals += tl.sum(tl.load(COUNTS + r[:, None] * EP + keys[None, :], mask=(r < B)[:, None], other=0), 0)
    ends = tl.cumsum(totals, 0)
    tl.store(OFFS + keys, ends, mask=keys < E)
    running = ends - totals  # [EP]: where each key's rows start
    for r0 in range(0, B, STEP):
        r = r0 + tl.arange(0, STEP)
        tile = tl.load(COUNTS + r[:, None] * EP + keys[None, :], mask=(r < B)[:, None], other=0)
        tl.store(BASE + r[:, None] * EP + keys[None, :], running[None, :] + tl.cumsum(tile, 0) - tile,
                 mask=(r < B)[:, None])
        running += tl.sum(tile, 0)


@triton.jit
def _place_keys_kernel(IDS, BASE, ORDER, ROWS, N, E, EP: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Block b's assignments at their rows, a chunk at a time: the next free row of their key (BASE[b, key],
    then advanced by each chunk's count of it) + their rank among the chunk's earlier assignments of the same
    key (a stable sort); ORDER[row] = the assignment, ROWS[assignment] = its row."""
    b = tl.program_id(0)
    lane = tl.arange(0, CHUNK)
    free = tl.load(BASE + b * EP + tl.arange(0, EP))  # [EP]: each key's next row
    for c in range(BLOCK // CHUNK):
        i = b * BLOCK + c * CHUNK + lane
        key = _sort_keys(IDS, i, N, E)
        rank = tl.sum(((key[:, None] == key[None, :]) & (lane[None, :] < lane[:, None])).to(tl.int32), 1)
        slot = tl.maximum(key, 0)  # past N (key -1, after every real assignment): any bin
        row = tl.gather(free, slot, 0) + rank
        tl.store(ORDER + row, i.to(tl.int64), mask=i < N)
        tl.store(ROWS + i, row.to(tl.int64), mask=i < N)
        free += tl.histogram(slot, EP)


def _group_by_expert_triton(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    flat = ids.flatten()
    n, ep = flat.numel(), triton.next_power_of_2(num_experts + 1)
    blocks = max(triton.cdiv(n, SORT_BLOCK), 1)
    counts = torch.zeros(blocks, ep, dtype=torch.int32, device=ids.device)
    base = torch.empty_like(counts)
    order, rows = torch.empty(2, n, dtype=torch.int64, device=ids.device)
    offs = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    _count_keys_kernel[(blocks,)](flat, counts, n, num_experts, EP=ep, BLOCK=SORT_BLOCK)
    _key_starts_kernel[(1,)](counts, base, offs, blocks, num_experts, EP=ep, STEP=16)
    _place_keys_kernel[(blocks,)](flat, base, order, rows, n, num_experts, EP=ep, BLOCK=SORT_BLOCK,
                                  CHUNK=SORT_CHUNK, num_warps=8)
    return order, offs, rows


def _group_by_expert_torch(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    flat = ids.flatten()
    key = torch.where(flat < 0, num_experts, flat)
    order = torch.argsort(key, stable=True)
    experts = torch.arange(num_experts, device=ids.device, dtype=flat.dtype)
    offs = torch.searchsorted(key[order], experts, right=True).to(torch.int32)
    return order, offs, torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=ids.device))


# ids [T, k] -> order [T*k] (assignments sorted by expert, stably; the absent ones, -1, last: in no expert's
# rows), offs [E] int32 (end of each expert's rows) and rows [T*k] (the row each assignment sits at: order's
# inverse, where `_summed` reads it back), on the device without a host sync. A counting sort in
# three launches (the torch version: an argsort, eight radix passes over 64-bit keys, and ~6 small ops)
group_by_expert = Checked("group_by_expert", _group_by_expert_triton, _group_by_expert_torch)


@triton.jit
def _sum_rows_kernel(YS, ROWS, IDS, OUT, H, TOPK: tl.constexpr, GATHER: tl.constexpr, PARTIAL: tl.constexpr,
                     BLOCK: tl.constexpr):
    """Token t, a block of columns: the sum in fp32, j = 0 .. TOPK - 1, of its assignments' rows of YS,
    assignment a = t * TOPK + j at row ROWS[a] (GATHER: YS in expert order) or a; with PARTIAL, those
    whose IDS[a] < 0 (no expert: rows no GEMM wrote) skipped."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOPK):
        a = t * TOPK + j
        row = tl.load(ROWS + a).to(tl.int64) if GATHER else a
        keep = mask & (tl.load(IDS + a + 0 * cols) >= 0) if PARTIAL else mask  # the id broadcast over the block
        acc += tl.load(YS + row * H + cols, mask=keep, other=0.0).to(tl.float32)
    tl.store(OUT + t * H + cols, acc.to(OUT.dtype.element_ty), mask=mask)


def _summed_triton(ys: torch.Tensor, rows: torch.Tensor | None, ids: torch.Tensor, partial: bool, dtype: torch.dtype):
    (tokens, top_k), hidden = ids.shape, ys.shape[1]
    out = torch.empty(tokens, hidden, dtype=dtype, device=ys.device)
    block = min(1024, triton.next_power_of_2(hidden))
    if tokens:
        _sum_rows_kernel[(tokens, triton.cdiv(hidden, block))](
            ys, ids if rows is None else rows, ids, out, hidden, TOPK=top_k, GATHER=rows is not None,
            PARTIAL=partial, BLOCK=block,
        )
    return out


def _summed_torch(ys: torch.Tensor, rows: torch.Tensor | None, ids: torch.Tensor, partial: bool, dtype: torch.dtype):
    out = ys if rows is None else ys[rows]  # row copies
    if partial:
        out = out.masked_fill((ids.flatten() < 0)[:, None], 0)
    return out.view(*ids.shape, -1).sum(1, dtype=torch.float32).to(dtype)


# Rows in expert order (assignment a's at `rows[a]`, from `group_by_expert`; None: already in the assignments'
# order) back to their assignments, summed per
# token in fp32 → [T, H] in `dtype`. With `partial` (ids may hold -1 in a prefill), the absent
# assignments' rows, which no GEMM wrote, count as zeros. One launch reading each row where it lies (not an
# index_copy of every row into assignment order, then the sum and the cast)
_summed = Checked("moe_sum", _summed_triton, _summed_torch)


@triton.jit
def _glu_kernel(GU, RW, ORDER, A, INTER, BLOCK: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = k < INTER
    tl.store(A + j * INTER + k, quant.glu_row(GU, RW, ORDER, j, k, keep, INTER).to(A.dtype.element_ty), mask=keep)


def glu(gate_up: torch.Tensor, weights: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The experts' up projections' rows in expert order [T*k, 2I] (gate | up) → silu(gate) * up * each row's
    routing weight (of assignment order[j]) [T*k, I], in one launch (the torch version: the gather of the
    weights, the SiLU and two products, each a pass over the rows)."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    act = gate_up.new_empty(rows, inter)
    block = min(1024, triton.next_power_of_2(inter))
    if rows:
        _glu_kernel[(rows, triton.cdiv(inter, block))](gate_up, weights.flatten(), order, act, inter, BLOCK=block)
    return act


def experts_grouped(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    partial: bool = False,
) -> torch.Tensor:
    """x: [T, H]; weights, ids: [T, k]; gate_up: [E, 2I, H]; down: [E, H, I]. Returns [T, H].
    `partial`: ids may hold -1 (no expert) beyond decode sizes too (a streamed piece's experts)."""
    if ids.numel() <= DECODE_ROWS:
        return experts_decode(x, weights, ids, gate_up, down)
    if x.dtype != torch.bfloat16:  # fp32, the exactness mode: the loop syncs with the host, no graph holds it
        return (experts_decode if x.shape[0] <= GRAPH_TOKENS else experts_loop)(x, weights, ids, gate_up, down)
    num_tokens, top_k = ids.shape
    order, offs, rows = group_by_expert(ids, gate_up.shape[0])
    xs = x.index_select(0, order // top_k)  # [T*k, H], rows grouped by expert
    gate_up_rows = quant.grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)  # [T*k, 2I]
    act = glu(gate_up_rows, weights, order)  # routing weight folded in before the down GEMM
    ys = quant.grouped_mm(act, down.transpose(1, 2), offs=offs)  # [T*k, H] bf16
    return _summed(ys, rows, ids, partial, x.dtype)


@triton.jit
def _up_kernel(X, W, IDS, A, H, INTER, TOPK: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr):
    slot = tl.program_id(0)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    expert = tl.load(IDS + slot).to(tl.int64)
    x = X + (slot // TOPK) * H
    w = W + tl.maximum(expert, 0) * (2 * INTER * H)
    gate = tl.zeros([BLOCK_I], tl.float32)
    up = tl.zeros([BLOCK_I], tl.float32)
    for h0 in range(0, tl.where(expert >= 0, H, 0), BLOCK_H):  # no expert (-1): nothing read, zeros
        h = h0 + tl.arange(0, BLOCK_H)
        xv = tl.load(x + h).to(tl.float32)[None, :]
        gate += tl.sum(tl.load(w + i[:, None] * H + h[None, :]).to(tl.float32) * xv, 1)
        up += tl.sum(tl.load(w + (INTER + i)[:, None] * H + h[None, :]).to(tl.float32) * xv, 1)
    act = gate * tl.sigmoid(gate) * up
    tl.store(A + slot * INTER + i, act.to(A.dtype.element_ty))


@triton.jit
def _down_kernel(A, W, IDS, RW, PART, OUT, COUNT, H, INTER, TOPK: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_I: tl.constexpr):
    """Program (assignment a = token * TOPK + j, n-block): the token's j-th expert's down projection,
    weighted; the last of the token's TOPK programs to finish sums them into OUT (a ticket per
    (token, n-block) in COUNT, reset by that program: `tickets.tickets`). The assignments vary
    fastest, so an expert two tokens chose is read for both in the same wave of programs (once
    from memory, then from L2), wherever it sits in each token's list."""
    slot, block = tl.program_id(0), tl.program_id(1)
    token = slot // TOPK
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    expert = tl.load(IDS + slot).to(tl.int64)
    w = W + tl.maximum(expert, 0) * (H * INTER)  # the expert's base: offsets within it fit 32 bits
    acc = tl.zeros([BLOCK_N], tl.float32)
    for i0 in range(0, tl.where(expert >= 0, INTER, 0), BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)
        av = tl.load(A + slot * INTER + i).to(tl.float32)
        acc += tl.sum(tl.load(w + (n[:, None] * INTER + i[None, :])).to(tl.float32) * av[None, :], 1)
    tl.store(PART + slot * H + n, acc * tl.load(RW + slot).to(tl.float32))
    ticket = COUNT + token * tl.num_programs(1) + block
    if tickets.last_to_finish(ticket, TOPK):
        total = tl.zeros([BLOCK_N], tl.float32)
        for j in range(TOPK):
            total += tl.load(PART + (token * TOPK + j) * H + n, cache_modifier=".cg")
        tl.atomic_xchg(ticket, 0)  # for the next launch
        tl.store(OUT + token * H + n, total.to(OUT.dtype.element_ty))


@triton.jit
def _routed_to(IDS, slot, TOKENS, TOPK: tl.constexpr, MT: tl.constexpr, KP: tl.constexpr):
    """The expert of assignment `slot`, whether `slot` is its first assignment (its leader), and per
    token t < MT the assignment that chose it (a token's experts are distinct) and whether one did."""
    expert = tl.load(IDS + slot)
    t, j = tl.arange(0, MT), tl.arange(0, KP)
    flat = t[:, None] * TOPK + j[None, :]
    valid = (t[:, None] < TOKENS) & (j[None, :] < TOPK)
    match = (tl.load(IDS + flat, mask=valid, other=-1) == expert) & valid
    leader = tl.min(tl.min(tl.where(match, flat, MT * KP), 1), 0) == slot
    return expert, leader, tl.sum(tl.where(match, flat, 0), 1), tl.sum(match.to(tl.int32), 1) > 0


@triton.jit
def _up_grouped_kernel(X, W, IDS, A, H, INTER, TOKENS, TOPK: tl.constexpr, MT: tl.constexpr, KP: tl.constexpr,
                       BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (assignment slot, i-block): where the slot is its expert's first assignment, that
    expert's gate and up rows of the block against every token that chose it, as one small matmul
    ([MT tokens, BLOCK_H] x [BLOCK_H, BLOCK_I], the absent tokens' rows zero): each expert read once
    whatever the number of tokens choosing it; SiLU(gate) * up into each of those assignments' rows
    of A. The other programs (and those of absent experts, -1) do nothing."""
    slot = tl.program_id(0)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    expert, leader, rows, has = _routed_to(IDS, slot, TOKENS, TOPK, MT, KP)
    if leader & (expert >= 0):
        t = tl.arange(0, MT)
        w = W + expert.to(tl.int64) * (2 * INTER * H)
        gate = tl.zeros([MT, BLOCK_I], tl.float32)
        up = tl.zeros([MT, BLOCK_I], tl.float32)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            xv = tl.load(X + t[:, None] * H + h[None, :], mask=has[:, None], other=0.0)
            gate = tl.dot(xv, tl.trans(tl.load(w + i[:, None] * H + h[None, :])), gate, input_precision="ieee")
            up = tl.dot(xv, tl.trans(tl.load(w + (INTER + i)[:, None] * H + h[None, :])), up, input_precision="ieee")
        act = gate * tl.sigmoid(gate) * up
        tl.store(A + rows[:, None] * INTER + i[None, :], act.to(A.dtype.element_ty), mask=has[:, None])


@triton.jit
def _down_grouped_kernel(A, W, IDS, RW, PART, OUT, COUNT, H, INTER, TOKENS, TOPK: tl.constexpr, MT: tl.constexpr,
                         KP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr):
    """Program (assignment slot, n-block): where the slot is its expert's first assignment, that
    expert's down projection of every assignment that chose it (one small matmul, as in
    `_up_grouped_kernel`), weighted, into PART; an absent expert's slot (-1) a zero row of its own.
    Each token's TOPK rows are summed in order by the program that stores the last of them (a
    ticket per (token, n-block) in COUNT, reset by it), as `_down_kernel` does."""
    slot, block = tl.program_id(0), tl.program_id(1)
    blocks = H // BLOCK_N
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, MT)
    expert, leader, rows, has = _routed_to(IDS, slot, TOKENS, TOPK, MT, KP)
    if expert < 0:  # its own row, zeros, and its own ticket
        has = t == slot // TOPK
        rows = tl.where(has, slot, 0)
    if leader | (expert < 0):
        acc = tl.zeros([MT, BLOCK_N], tl.float32)
        w = W + tl.maximum(expert, 0).to(tl.int64) * (H * INTER)
        for i0 in range(0, tl.where(expert >= 0, INTER, 0), BLOCK_I):
            i = i0 + tl.arange(0, BLOCK_I)
            av = tl.load(A + rows[:, None] * INTER + i[None, :], mask=has[:, None], other=0.0)
            acc = tl.dot(av, tl.trans(tl.load(w + n[:, None] * INTER + i[None, :])), acc, input_precision="ieee")
        weight = tl.load(RW + rows, mask=has, other=0.0).to(tl.float32)
        tl.store(PART + rows[:, None] * H + n[None, :], acc * weight[:, None], mask=has[:, None])
        tickets = COUNT + t * blocks + block
        tl.debug_barrier()  # every thread's PART rows stored before any ticket is taken
        last = has & (tl.atomic_add(tickets, 1, mask=has, sem="acq_rel", scope="gpu") == TOPK - 1)
        tl.debug_barrier()
        if tl.sum(last.to(tl.int32), 0) > 0:
            total = tl.zeros([MT, BLOCK_N], tl.float32)
            for j in range(TOPK):
                total += tl.load(PART + (t * TOPK + j)[:, None] * H + n[None, :], mask=last[:, None], other=0.0,
                                 cache_modifier=".cg")
            tl.atomic_xchg(tickets, 0, mask=last)  # for the next launch
            tl.store(OUT + t[:, None] * H + n[None, :], total.to(OUT.dtype.element_ty), mask=last[:, None])


@dataclass(frozen=True)
class DecodeTiles:
    """Launch settings of the grouped decode experts (`_up_grouped_kernel`, `_down_grouped_kernel`):
    the up kernel's rows (of the gate's and of the up's) and columns a step, the down kernel's
    outputs and inner columns a step (tensor-core tiles: 16 a side at least), their warps and the
    loads' pipeline depth. `grouped=0`: the per-assignment kernels (`_up_kernel`, `_down_kernel`,
    their own tiles), which `fitted` falls back to where the tiles do not divide a model's sizes."""

    grouped: int = 1
    up_i: int = 32
    up_h: int = 256
    up_warps: int = 4
    down_n: int = 64
    down_i: int = 128
    down_warps: int = 4
    stages: int = 3

    @functools.cache  # noqa: B019 (a few settings a process, each frozen)
    def fitted(self, hidden: int, inter: int) -> DecodeTiles:
        """The tiles cut to a model's sizes (the tiny presets'); not grouped where they do not divide them."""
        t = replace(self, up_i=min(self.up_i, inter), up_h=min(self.up_h, hidden), down_n=min(self.down_n, hidden),
                    down_i=min(self.down_i, inter))
        fits = min(t.up_i, t.up_h, t.down_n, t.down_i) >= 16 and not (
            inter % t.up_i or hidden % t.up_h or hidden % t.down_n or inter % t.down_i)
        return t if fits else replace(t, grouped=0)


# tokens up to which the grouped kernels run: one tensor-core tile's rows (an fp32 prefill of up to
# GRAPH_TOKENS takes the per-assignment kernels: a tile of 512 tokens' rows is far past the registers)
GROUPED_TOKENS = 16
DECODE_TILES = DecodeTiles()


def _experts_triton(x, weights, ids, gate_up, down, tiles: DecodeTiles | None = None):
    t = (tiles or DECODE_TILES).fitted(x.shape[1], down.shape[2])
    if t.grouped and ids.shape[0] <= GROUPED_TOKENS:
        return _experts_grouped_decode(x, weights, ids, gate_up, down, t)
    num_tokens, top_k = ids.shape
    hidden, inter = x.shape[1], down.shape[2]
    block_i, block_h, block_n = 8, 256, 32
    assert inter % block_i == 0 and hidden % block_h == 0 and hidden % block_n == 0 and inter % 128 == 0
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    _up_kernel[(num_tokens * top_k, inter // block_i)](x, gate_up, ids, act, hidden, inter, TOPK=top_k, BLOCK_I=block_i, BLOCK_H=block_h)
    part = torch.empty(num_tokens, top_k, hidden, dtype=torch.float32, device=x.device)  # one row per chosen expert
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(num_tokens * top_k, hidden // block_n)](act, down, ids, weights, part, out, tickets.tickets(x.device),
                                                         hidden, inter, TOPK=top_k, BLOCK_N=block_n, BLOCK_I=128)
    return out


def _experts_grouped_decode(x, weights, ids, gate_up, down, t: DecodeTiles):
    num_tokens, top_k = ids.shape
    hidden, inter = x.shape[1], down.shape[2]
    slots = num_tokens * top_k
    x, ids, weights = x.contiguous(), ids.contiguous(), weights.contiguous()
    shape = {"TOPK": top_k, "MT": GROUPED_TOKENS, "KP": triton.next_power_of_2(top_k)}
    act = torch.empty(slots, inter, dtype=x.dtype, device=x.device)
    _up_grouped_kernel[(slots, inter // t.up_i)](x, gate_up, ids, act, hidden, inter, num_tokens, **shape,
                                                 BLOCK_I=t.up_i, BLOCK_H=t.up_h, num_warps=t.up_warps, num_stages=t.stages)
    part = torch.empty(num_tokens, top_k, hidden, dtype=torch.float32, device=x.device)
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    _down_grouped_kernel[(slots, hidden // t.down_n)](
        act, down, ids, weights, part, out, tickets.tickets(x.device), hidden, inter, num_tokens, **shape,
        BLOCK_N=t.down_n, BLOCK_I=t.down_i, num_warps=t.down_warps, num_stages=t.stages,
    )
    return out


def _experts_gathered(x, weights, ids, gate_up, down):
    """Plain torch for a few tokens: gather the hit experts' weights and batch-matmul them (an
    absent expert, -1, gathers expert 0 and is weighted 0)."""
    num_tokens, top_k = ids.shape
    flat = ids.flatten()
    present = flat.clamp(min=0)
    xs = x.repeat_interleave(top_k, dim=0)[:, None, :]  # [T*k, 1, H]
    gate, up = torch.bmm(xs, gate_up[present].transpose(1, 2)).chunk(2, dim=-1)  # [T*k, 1, I]
    ys = torch.bmm(F.silu(gate) * up, down[present].transpose(1, 2))[:, 0]  # [T*k, H]
    ys = ys.float() * (weights.flatten().float() * (flat >= 0))[:, None]
    return ys.view(num_tokens, top_k, -1).sum(1).to(x.dtype)


def experts_quantized(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up, down, partial: bool = False
) -> torch.Tensor:
    """Experts over `QuantWeight` stacks (gate_up [E, 2I, H], down [E, H, I]): the assignments in
    expert order through `quant.grouped` twice, the routing weight folded in before the down
    projection, summed per token in fp32. No host sync: decode runs inside the CUDA graph.
    `partial`: as `experts_grouped`."""
    num_tokens, top_k = ids.shape
    if ids.numel() <= DECODE_ROWS and quant.gemv_fits(gate_up) and quant.gemv_fits(down):
        return _experts_quantized_decode(x, weights, ids, gate_up, down)
    order, offs, rows = group_by_expert(ids, gate_up.shape[0])
    if (ys := fp8_prefill.experts(x, weights, gate_up, down, order, offs, top_k)) is not None:
        return _summed(ys, None, ids, partial, x.dtype)  # FP8 tensor cores, rows back in place
    act = glu(quant.grouped(x, gate_up, order, offs, top_k), weights, order)  # [T*k, I], expert order
    in_order = torch.arange(order.numel(), device=x.device)  # act's rows are already in expert order
    ys = quant.grouped(act, down, in_order, offs)  # [T*k, H]
    return _summed(ys, rows, ids, partial, x.dtype)


def _experts_quantized_decode(x, weights, ids, gate_up, down) -> torch.Tensor:
    """A few tokens: two launches that read only the chosen experts (`quant.experts_glu`, then
    `quant.experts_sum` over each token's experts)."""
    act = quant.experts_glu(x, gate_up, ids, weights)  # [T*k, I]
    return quant.experts_sum(act, down, ids)


experts_decode = Checked("moe_decode", _experts_triton, _experts_gathered)


@triton.jit
def _top_k(logits, cols, E, TOPK: tl.constexpr, RENORM: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr):
    """Logits [BE] fp32 (the first E valid, the others -inf as the callers load them): softmax, top-k
    by k rounds of arg-max (the lowest index among equals), renormalised → (values [BK], experts
    [BK], their slots)."""
    mask = cols < E
    p = tl.exp(logits - tl.max(logits, 0))
    p = p / tl.sum(p, 0)
    p = tl.where(mask, p, -1.0)  # below any probability: never picked
    slots = tl.arange(0, BK)
    values = tl.zeros([BK], dtype=tl.float32)
    chosen = tl.zeros([BK], dtype=tl.int64)
    for j in tl.static_range(TOPK):
        best = tl.max(p, 0)
        pick = tl.min(tl.where(p == best, cols, BE), 0)
        values = tl.where(slots == j, best, values)
        chosen = tl.where(slots == j, pick, chosen)
        p = tl.where(cols == pick, -1.0, p)
    if RENORM:
        values = values / tl.sum(values, 0)
    return values, chosen, slots


@triton.jit
def _route_out(W, IDS, row, values, chosen, slots, gate, E, TOPK: tl.constexpr, SHARED: tl.constexpr):
    """A row's routing stored; with SHARED the shared expert (E) after the top k, weighted sigmoid(gate)."""
    if SHARED:
        values = tl.where(slots == TOPK, tl.sigmoid(gate), values)
        chosen = tl.where(slots == TOPK, E, chosen)
    width = TOPK + SHARED
    keep = slots < width
    tl.store(W + row * width + slots, values.to(W.dtype.element_ty), mask=keep)
    tl.store(IDS + row * width + slots, chosen, mask=keep)


@triton.jit
def _route_kernel(L, W, IDS, E, stride, TOPK: tl.constexpr, RENORM: tl.constexpr, SHARED: tl.constexpr,
                  BE: tl.constexpr, BK: tl.constexpr):
    """One token row: softmax over the experts, top-k by k rounds of arg-max, renormalised; with
    SHARED, column E (the shared expert's gate) joins as expert E, weighted by its sigmoid."""
    row = tl.program_id(0)
    cols = tl.arange(0, BE)
    logits = tl.load(L + row * stride + cols, mask=cols < E, other=-float("inf")).to(tl.float32)
    values, chosen, slots = _top_k(logits, cols, E, TOPK, RENORM, BE, BK)
    gate = tl.load(L + row * stride + E).to(tl.float32) if SHARED else 0.0
    _route_out(W, IDS, row, values, chosen, slots, gate, E, TOPK, SHARED)


@triton.jit
def _router_kernel(X, R, LOGITS, W, IDS, COUNT, H, E, stride_r, TOPK: tl.constexpr, RENORM: tl.constexpr,
                   BE: tl.constexpr, BK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (block of router rows, token row): BLOCK_E of the row's E + 1 logits (the router's, then
    the shared expert's gate: rows of R), rounded to x's dtype as a GEMM's output is, into LOGITS
    [T, BE]; the last of the row's programs to finish (a ticket in COUNT, reset by it) routes them
    as `_route_kernel` does with SHARED: the router's GEMM and the routing in one launch."""
    block, row = tl.program_id(0), tl.program_id(1)
    e = block * BLOCK_E + tl.arange(0, BLOCK_E)
    valid = e <= E
    acc = tl.zeros([BLOCK_E], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(X + row * H + h).to(tl.float32)
        r = tl.load(R + e[:, None] * stride_r + h[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        acc += tl.sum(r * x[None, :], 1)
    tl.store(LOGITS + row * BE + e, acc.to(X.dtype.element_ty).to(tl.float32), mask=valid)
    ticket = COUNT + row
    if tickets.last_to_finish(ticket, tl.num_programs(0)):
        cols = tl.arange(0, BE)
        logits = tl.load(LOGITS + row * BE + cols, mask=cols < E, other=-float("inf"), cache_modifier=".cg")
        values, chosen, slots = _top_k(logits, cols, E, TOPK, RENORM, BE, BK)
        gate = tl.load(LOGITS + row * BE + E, cache_modifier=".cg")
        tl.atomic_xchg(ticket, 0)  # for the next launch
        _route_out(W, IDS, row, values, chosen, slots, gate, E, TOPK, True)


ROUTER_ROWS = 16  # tokens up to which `router` runs as one launch (decode); beyond, a GEMM and `route`


@dataclass(frozen=True)
class RouterTiles:
    """Launch settings of `_router_kernel`: router rows a program (two, so that the 257 rows of a
    256-expert router, 1 MB in bf16 and 2 MB in a GGUF's f32, are read by ~130 programs, about one
    per SM of an H200: 16 rows a program leave 17 programs reading it at a small fraction of the
    bandwidth), hidden columns a step (at most: a power of two dividing H) and warps (the last
    program's softmax and top-k reduce across them)."""

    block_e: int = 2
    block_h: int = 2048
    warps: int = 1


ROUTER_TILES = RouterTiles()


def router(x: torch.Tensor, w: torch.Tensor, experts: int, top_k: int, renormalise: bool):
    """`engine.ops.moe.router`: for a few rows (decode) one launch (`_router_kernel`, checked
    against the GEMM and torch's routing on its first use: `router_fused`), where it was a GEMM
    and the routing kernel; more rows, the GEMM, then `route`."""
    if x.shape[0] > ROUTER_ROWS or w.stride(1) != 1:
        return route(router_logits(x, w, experts), top_k, renormalise, x.dtype, True)
    return router_fused(x, w, experts, top_k, renormalise)


def _router_triton(x: torch.Tensor, w: torch.Tensor, experts: int, top_k: int, renormalise: bool,
                   tiles: RouterTiles | None = None):
    t = tiles or ROUTER_TILES
    rows, hidden = x.shape
    x = x.contiguous()
    width, be, block_e = top_k + 1, triton.next_power_of_2(experts + 1), t.block_e
    logits = torch.empty(rows, be, dtype=torch.float32, device=x.device)
    weights = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    ids = torch.empty(rows, width, dtype=torch.long, device=x.device)
    if rows:
        _router_kernel[(triton.cdiv(experts + 1, block_e), rows)](
            x, w, logits, weights, ids, tickets.tickets(x.device), hidden, experts, w.stride(0), TOPK=top_k,
            RENORM=renormalise, BE=be, BK=triton.next_power_of_2(width), BLOCK_E=block_e,
            BLOCK_H=min(t.block_h, hidden & -hidden), num_warps=t.warps,
        )
    return weights, ids


def _router_canon(out, args) -> tuple[torch.Tensor, torch.Tensor]:
    """`_routing_canon` of the logits the router computes (with the shared expert)."""
    x, w, experts = args[:3]
    return _routing_canon(*out, router_logits(x, w, experts), shared=True)


def _route_triton(logits: torch.Tensor, top_k: int, renormalise: bool, dtype: torch.dtype, shared: bool = False):
    """`engine.ops.moe.route` in one launch (the torch version: softmax, top-k's sort and
    reductions, the renormalisation and the cast, ~6 kernels per layer; with the shared expert,
    its sigmoid and two concatenations more)."""
    rows, columns = logits.shape
    experts, width = columns - shared, top_k + shared
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(rows, width, dtype=dtype, device=logits.device)
    ids = torch.empty(rows, width, dtype=torch.long, device=logits.device)
    if rows:
        _route_kernel[(rows,)](
            logits, weights, ids, experts, logits.stride(0), TOPK=top_k, RENORM=renormalise, SHARED=shared,
            BE=triton.next_power_of_2(experts), BK=triton.next_power_of_2(width),
        )
    return weights, ids


def _route_canon(out, args) -> tuple[torch.Tensor, torch.Tensor]:
    """`_routing_canon` of `route`'s arguments (logits, top_k, renormalise, dtype[, shared])."""
    return _routing_canon(*out, args[0], shared=len(args) > 4 and args[4])


def _routing_canon(weights: torch.Tensor, ids: torch.Tensor, logits: torch.Tensor, shared: bool):
    """What a routing decides, blind to ties (equal probabilities may be taken in any order, and
    either of two tied at the k-th place): per row the weights, and the probabilities of the
    chosen routed experts, each sorted."""
    probs = torch.softmax((logits[:, :-1] if shared else logits).float(), dim=-1)
    chosen = probs.gather(1, ids[:, : ids.shape[1] - shared])
    return weights.float().sort(dim=-1).values, chosen.sort(dim=-1).values


route = Checked("route", _route_triton, reference_route, canon=_route_canon)
router_fused = Checked("router", _router_triton, reference_router, canon=_router_canon)
