"""The fused decode-path kernels against the torch versions the CPU path runs: the router
(`engine.ops.gpu.moe.route`: softmax, top-k, renormalisation in one launch), the gates
(engine/ops/gpu/gates.py) and q/k norm + RoPE (`engine.ops.gpu.norm.norm_rope`). Equal in fp32 to
rounding, in bf16 to a rounding step; routing picks the same experts."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from tests.engine.triton_interpreter import CUDA, RUNNABLE, in_this_process, run_interpreted

pytest.importorskip("triton")


@pytest.mark.slow  # minutes in the interpreter
@pytest.mark.skipif(RUNNABLE, reason="this process runs the kernels itself")
def test_fused_kernels_in_triton_interpreter_process():
    run_interpreted(__file__)


from engine.ops import gates as reference  # noqa: E402
from engine.ops.gpu import conv, gates, moe, norm, tickets  # noqa: E402
from engine.ops.moe import route  # noqa: E402
from engine.ops.rope import norm_rope, rope_cos_sin  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def _randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(DEVICE)


def _close_sums(got, want, torch_rounded=None):
    """`_close` for sums taken in another order than the reference's: fp32 to the rounding of the
    largest output (a small output may be a cancellation of large terms). bf16 with `torch_rounded`
    (the same computed by torch in bf16): no farther from the fp32 reference than torch's own bf16
    result, where intermediates rounded to bf16 (an expert's activation) put outputs past one step."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6 * want.abs().max().item())
    elif torch_rounded is None:
        _close(got, want.to(got.dtype))
    else:
        assert (got.float() - want).abs().max() <= max((torch_rounded.float() - want).abs().max(), 2**-7)


def _close(got, want):
    """fp32: to rounding; bf16: within one of its steps on a GPU (the fp32 sigmoid and exp may differ
    in their last bit from torch's, and so land on the other side of a bf16 rounding), three in the
    interpreter (its float -> bf16 conversion truncates where the GPU's rounds to nearest)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        steps = 1 if CUDA else 3  # atol too: a sum is within its terms' steps, not its own
        torch.testing.assert_close(got, want, rtol=steps * 2**-7, atol=steps * 2**-7)


@in_this_process
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 0])
def test_deltanet_gates(dtype, rows):
    """g in fp32 whatever the activations' dtype, beta in b's."""
    fused = _randn(rows, 2 * 32 + 5, dtype=dtype, seed=rows, scale=12.0)  # past softplus's threshold too
    b, a = fused[:, :32], fused[:, 32:64]  # splits of the fused projection
    neg_a = -torch.rand(32, generator=torch.Generator().manual_seed(1)).exp().to(DEVICE)
    dt_bias = _randn(32, dtype=dtype, seed=2)
    g, beta = gates.deltanet_gates.fast(a, b, neg_a, dt_bias)
    want_g, want_beta = reference.deltanet_gates(a, b, neg_a, dt_bias)
    _close(g, want_g)
    _close(beta, want_beta)


@in_this_process
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_on_split_views(dtype):
    fused = _randn(5, 3 * 48, dtype=dtype, seed=3)
    gate, up = fused[:, 48:96], fused[:, 96:]
    _close(gates.silu_mul.fast(gate, up), reference.silu_mul(gate, up))


@in_this_process
@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_mul_on_the_attention_gate_view(dtype):
    """x as attention leaves it ([1, Hq, T, D] transposed back: heads strided by T * D), the gate a view
    of the fused q projection: read in place, the output contiguous."""
    q_and_gate = _randn(3, 4, 2 * 16, dtype=dtype, seed=4)  # [T, Hq, 2D], as the fused q projection
    _, gate = q_and_gate.chunk(2, dim=-1)
    for x in (_randn(3, 4, 16, dtype=dtype, seed=5), _randn(4, 3, 16, dtype=dtype, seed=5).transpose(0, 1)):
        got = gates.sigmoid_mul.fast(x, gate)
        assert got.is_contiguous()
        _close(got, reference.sigmoid_mul(x, gate))


@in_this_process
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_reads_its_gate_off_the_fused_projection(dtype):
    """z as the DeltaNet's fused input projection leaves it: [T, Hv, Dv] rows strided by the projection's width."""
    from engine.ops.norm import gated_rms_norm  # noqa: PLC0415

    tokens, heads, dim = 5, 4, 32
    fused = _randn(tokens, 3 * heads * dim + 8, dtype=dtype, seed=12)
    z = fused[:, 2 * heads * dim : 3 * heads * dim].view(tokens, heads, dim)
    x, weight = _randn(tokens, heads, dim, dtype=dtype, seed=13), _randn(dim, dtype=dtype, seed=14, scale=0.1)
    _close(norm.gated_rms_norm.fast(x, z, weight, 1e-6), gated_rms_norm(x, z, weight, 1e-6))


@in_this_process
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("splits", "tokens", "capture_at"),
    [((32, 32, 64), 37, [1, 2, 36]), ((16, 16, 32), 2, [1]), ((24, 24, 48), 5, []), ((96,), 3, [3])],
)
def test_causal_conv_reads_projection_columns_and_writes_contiguous_parts(dtype, splits, tokens, capture_at):
    """The prefill conv on a column slice of the fused projection (rows strided by its width), its output
    as contiguous parts (q, k, v as fla's scan takes them), parts not multiples of 32 columns, fewer
    tokens than the conv's state; the states after the chunk and at each capture as the reference's."""
    from engine.ops import conv as reference_conv  # noqa: PLC0415

    channels = sum(splits)
    x = _randn(tokens, channels + 40, dtype=dtype, seed=tokens)[:, :channels]
    state, weight = _randn(channels, 3, dtype=dtype, seed=2), _randn(channels, 4, dtype=dtype, seed=3)
    parts, final, captured = conv._triton_conv(x, state, weight, capture_at, splits)
    want_parts, want_final, want_captured = reference_conv.causal_conv(x, state, weight, capture_at, splits)
    assert [p.shape for p in parts] == [(tokens, n) for n in splits] and all(p.is_contiguous() for p in parts)
    for got, want in zip([*parts, final, *captured], [*want_parts, want_final, *want_captured], strict=True):
        _close(got, want)


@in_this_process
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("lengths", "capture_ats"),
    [([5, 2, 9], [[2, 5], [], [1, 9]]), ([1, 1], [[1], []]), ([40, 3], [[], [3]])],
    ids=["three", "single-rows", "long-short"],
)
def test_causal_conv_over_spans_is_each_sequence_from_its_own_state(dtype, lengths, capture_ats):
    """Several sequences' rows in one launch: each row reads the rows before it only within its own
    sequence and its own state before that (sequences shorter than the state too); the parts, each
    sequence's final state and captures equal the conv run on each sequence alone."""
    from engine.ops import conv as reference_conv  # noqa: PLC0415

    splits = (32, 32, 64)
    bounds = [(sum(lengths[:i]), sum(lengths[: i + 1])) for i in range(len(lengths))]
    x = _randn(sum(lengths), 128 + 40, dtype=dtype, seed=sum(lengths))[:, :128]
    states = [_randn(128, 3, dtype=dtype, seed=10 + i) for i in range(len(lengths))]
    weight = _randn(128, 4, dtype=dtype, seed=3)
    got = conv._triton_conv_spans(x, states, weight, bounds, capture_ats, splits)
    want = reference_conv.causal_conv_spans(x, states, weight, bounds, capture_ats, splits)
    assert [len(c) for c in got[2]] == [len(c) for c in capture_ats]
    flat = [*got[0], *got[1], *(c for caps in got[2] for c in caps)]
    for g, w in zip(flat, [*want[0], *want[1], *(c for caps in want[2] for c in caps)], strict=True):
        _close(g, w)


@in_this_process
@pytest.mark.parametrize(
    ("tokens", "top_k", "experts"),
    [(400, 9, 257), (2000, 3, 11), (7, 3, 5), (1, 2, 8), (0, 8, 64)],
    ids=["35b-folded", "blocks", "one-chunk", "one-token", "empty"],
)
def test_counting_sort_by_expert_equals_a_stable_argsort(tokens, top_k, experts):
    """`group_by_expert`'s counting sort (per-block counts, one scan, each block's assignments placed by
    their rank among equal keys): the assignments in the order of a stable argsort of their experts, the
    absent ones (-1) after every expert's rows, each expert's row end and each assignment's row, over
    several blocks."""
    ids = torch.randint(-1, experts, (tokens, top_k), generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    order, offs, rows = moe._group_by_expert_triton(ids, experts)
    want_order, want_offs, want_rows = moe._group_by_expert_torch(ids, experts)
    assert torch.equal(order, want_order) and torch.equal(offs, want_offs) and torch.equal(rows, want_rows)
    assert torch.equal(order[rows], torch.arange(order.numel(), device=DEVICE))  # each assignment's row
    assert offs.dtype == torch.int32 and offs.shape == (experts,)
    assert (ids.flatten()[order[offs[-1] :]] < 0).all() if tokens else not order.numel()


@in_this_process
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [48, 1100])
def test_moe_activation_of_expert_ordered_rows_in_one_launch(dtype, inter):
    """silu(gate) * up * each row's routing weight (the weight of the assignment the row holds) of the up
    projections' rows in expert order: as the torch version, rounded once instead of after each op."""
    tokens, top_k, experts = 7, 3, 5
    ids = torch.randint(0, experts, (tokens, top_k), generator=torch.Generator().manual_seed(23)).to(DEVICE)
    order, _, _ = moe.group_by_expert(ids, experts)
    gate_up = _randn(tokens * top_k, 2 * inter, dtype=dtype, seed=24, scale=2.0)
    weights = _randn(tokens, top_k, dtype=dtype, seed=25).abs()
    gate, up = gate_up.float().chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up * weights.flatten()[order, None].float()
    _close(moe.glu(gate_up, weights, order), want.to(dtype))


@in_this_process
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("ordered", [False, True], ids=["in-place", "expert-order"])
def test_moe_sum_reads_each_assignments_row_where_it_lies(dtype, partial, ordered):
    """The experts' rows summed per token in one launch: rows in expert order read through where each
    assignment sits (no index_copy first), or in the assignments' order; absent assignments (-1) skipped
    whatever their rows hold. As the torch version (index_copy, masked fill, fp32 sum, cast)."""
    tokens, top_k, hidden, experts = 7, 3, 1100, 5  # two blocks of columns, the second partial
    gen = torch.Generator().manual_seed(21)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
    if partial:
        ids[::2, 1], ids[3] = -1, -1
    ids = ids.to(DEVICE)
    rows = moe.group_by_expert(ids, experts)[2] if ordered else None  # where each assignment's row sits
    ys = _randn(tokens * top_k, hidden, dtype=dtype, seed=22)
    absent = (ids.flatten() < 0).nonzero()[:, 0]
    ys[absent if rows is None else rows[absent]] = float("nan")  # rows no GEMM wrote
    got = moe._summed_triton(ys, rows, ids, partial, dtype)
    assert not got.isnan().any()
    _close(got, moe._summed_torch(ys, rows, ids, partial, dtype))


@in_this_process
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_sigmoid_mul_with_a_per_row_gate(dtype):
    fused = _randn(6, 40, dtype=dtype, seed=6)
    gate = fused[:, 39:]  # [T, 1]: the last column of the router's fused projection
    base, y = _randn(6, 24, dtype=dtype, seed=7), _randn(6, 24, dtype=dtype, seed=8)
    _close(gates.add_sigmoid_mul.fast(base, gate, y), reference.add_sigmoid_mul(base, gate, y))


@in_this_process
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "with-shared"])
@pytest.mark.parametrize(
    ("rows", "experts", "top_k", "renormalise", "dtype"),
    [
        (1, 256, 8, True, torch.bfloat16),  # the 35B-A3B shape, one decode row
        (5, 64, 8, True, torch.float32),
        (37, 8, 2, False, torch.float32),  # tiny's shape
        (3, 10, 3, True, torch.bfloat16),  # neither a power of two
        (0, 64, 8, True, torch.float32),  # an empty chunk
    ],
)
def test_fused_route_equals_the_torch_route(rows, experts, top_k, renormalise, dtype, shared):
    """With `shared`, the column after the router's is the shared expert's gate: it joins each row
    as expert `experts`, weighted by its sigmoid, after the top k."""
    gen = torch.Generator().manual_seed(rows * 1000 + experts)
    fused = torch.randn(rows, experts + 40, generator=gen).to(dtype).to(DEVICE)
    logits = fused[:, : experts + shared]  # a split of the fused projection: rows strided by its whole width
    weights, ids = moe.route.fast(logits, top_k, renormalise, dtype, shared)
    want_w, want_ids = route(logits, top_k, renormalise, dtype, shared)
    width = top_k + shared
    assert weights.dtype == dtype and ids.dtype == torch.long and weights.shape == ids.shape == (rows, width)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)
    if shared:
        assert (ids[:, -1] == experts).all() and not (ids[:, :-1] == experts).any()
        torch.testing.assert_close(weights[:, -1], torch.sigmoid(fused[:, experts].float()).to(dtype))
        assert moe.route._check((logits, top_k, renormalise, dtype, shared))  # the first-use check, as served


@in_this_process
@pytest.mark.parametrize(("rows", "experts", "top_k"), [(1, 256, 8), (3, 10, 3), (16, 64, 8), (17, 8, 2)])
def test_fused_router_equals_the_gemm_and_the_route(rows, experts, top_k):
    """The router's GEMM (router rows, then the shared expert's gate, then padding, as the folded
    layer's in_proj is) and the routing in one launch, for up to 16 rows (beyond: GEMM and route);
    its logits rounded as the GEMM's. The same experts and weights as `moe.router`."""
    from engine.ops.moe import router  # noqa: PLC0415

    gen = torch.Generator().manual_seed(rows * 100 + experts)
    x = torch.randn(rows, 512, generator=gen).to(DEVICE)
    w = (torch.randn(experts + 8, 512, generator=gen) / 8).to(DEVICE)
    w[experts + 1 :] = 0  # the padding rows
    weights, ids = (moe.router_fused.fast if rows <= moe.ROUTER_ROWS else moe.router)(x, w, experts, top_k, True)
    want_w, want_ids = router(x, w, experts, top_k, True)
    assert weights.shape == ids.shape == (rows, top_k + 1) and (ids[:, -1] == experts).all()
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
    assert not tickets.tickets(x.device).any()  # each row's ticket left at zero
    assert moe.router_fused._check((x, w, experts, top_k, True))
    if rows <= moe.ROUTER_ROWS:  # other launch settings: the same routing
        tiles = moe.RouterTiles(block_e=4, block_h=512, warps=1)
        other_w, other_ids = moe._router_triton(x, w, experts, top_k, True, tiles)
        assert torch.equal(other_ids, ids)
        torch.testing.assert_close(other_w, weights, rtol=1e-5, atol=1e-6)


@in_this_process
def test_equal_probabilities_take_the_lowest_expert_first():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0, 2.0]], device=DEVICE)
    weights, ids = moe.route.fast(logits, 3, True, torch.float32)
    assert ids.tolist() == [[1, 2, 4]]
    torch.testing.assert_close(weights, torch.full((1, 3), 1 / 3, device=DEVICE))
    levels = torch.randint(0, 5, (4, 256), generator=torch.Generator().manual_seed(0)).float().to(DEVICE)
    _, ids = moe.route.fast(levels, 8, True, torch.float32)  # dozens tied at each level
    assert torch.equal(ids, torch.sort(-levels, dim=1, stable=True).indices[:, :8])


@in_this_process
def test_the_route_check_is_blind_to_the_order_of_ties():
    """Tied probabilities in another order (and the other of two tied at the k-th place) pass the
    first-use check; another expert does not."""
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0, 2.0]], device=DEVICE)
    weights = torch.full((1, 2), 0.5, device=DEVICE)
    tied = moe.Checked("tied", lambda *a: (weights, torch.tensor([[4, 1]], device=DEVICE)), route, canon=moe._route_canon)
    assert tied._check((logits, 2, True, torch.float32))
    wrong = moe.Checked("wrong", lambda *a: (weights, torch.tensor([[3, 1]], device=DEVICE)), route, canon=moe._route_canon)
    assert not wrong._check((logits, 2, True, torch.float32))


@in_this_process
@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_decode_kernels_skip_absent_experts(dtype):
    """An expert id of -1 is no expert: its row adds nothing (offloaded decode runs the resident and
    the in-place experts as two calls, each with the other's ids at -1); the Triton pair twice
    (the down kernel sums a token's experts in the last of their programs, behind a counter), the
    per-assignment kernels and the grouped ones."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 256, generator=gen).to(dtype).to(DEVICE)
    gate_up = (torch.randn(5, 256, 256, generator=gen) / 16).to(dtype).to(DEVICE)
    down = (torch.randn(5, 256, 128, generator=gen) / 11).to(dtype).to(DEVICE)
    ids = torch.tensor([[0, -1, 3], [4, 2, 1], [-1, -1, -1]], device=DEVICE)  # an odd count a token, as 8 + 1
    weights = torch.rand(3, 3, generator=gen).to(dtype).to(DEVICE)
    present = ids >= 0
    want = moe.experts_loop(x.float(), (weights * present).float(), ids.clamp(min=0), gate_up.float(), down.float())
    per_assignment = functools.partial(moe._experts_triton, tiles=moe.DecodeTiles(grouped=0))
    triton_pair = (per_assignment, per_assignment)  # twice: the second launch finds the tickets the first left
    if dtype == torch.float32 or CUDA:  # the interpreter's bf16 dots are off (see the decode attention's test)
        triton_pair += (moe._experts_triton, moe._experts_triton)  # the grouped kernels, the default
    for fn in (*triton_pair, moe._experts_gathered, moe.experts_loop):
        got = fn(x, weights, ids, gate_up, down)
        _close(got, want.to(dtype))
        assert not got[2].any()  # no expert at all: zeros
    assert not tickets.tickets(x.device).any()  # the down kernel's sums left their counters at zero


@in_this_process
@pytest.mark.parametrize("dtype", DTYPES if CUDA else [torch.float32])  # the interpreter's bf16 dots are off
@pytest.mark.parametrize("tokens", [1, 6, 17])
def test_grouped_decode_experts_equal_the_loop(dtype, tokens):
    """The decode experts that read each chosen expert once for all its tokens (`DecodeTiles.grouped`):
    experts chosen by several tokens (the shared one, last, by every token), absent ones (-1) and a
    token with none; 17 tokens, past `GROUPED_TOKENS`, take the per-assignment kernels; the tickets
    left at zero."""
    gen = torch.Generator().manual_seed(tokens)
    hidden, inter, routed, top_k = 256, 128, 5, 2  # the per-assignment kernels: 256 and 128 a step
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    gate_up = (torch.randn(routed + 1, 2 * inter, hidden, generator=gen) / 11).to(dtype).to(DEVICE)
    down = (torch.randn(routed + 1, hidden, inter, generator=gen) / 8).to(dtype).to(DEVICE)
    chosen = torch.stack([torch.randperm(routed, generator=gen)[:top_k] for _ in range(tokens)])
    ids = torch.cat([chosen, torch.full((tokens, 1), routed)], dim=1)
    ids[0, 1] = -1
    if tokens > 1:
        ids[-1] = -1
    ids = ids.to(DEVICE)
    weights = torch.rand(tokens, top_k + 1, generator=gen).to(dtype).to(DEVICE)
    present = ids >= 0
    want = moe.experts_loop(x.float(), (weights * present).float(), ids.clamp(min=0), gate_up.float(), down.float())
    torch_rounded = moe.experts_loop(x, weights * present, ids.clamp(min=0), gate_up, down)
    tiles = moe.DecodeTiles(up_i=16, up_h=32, down_n=16, down_i=32)
    for _ in range(2):  # the second launch finds the tickets the first left
        got = moe._experts_triton(x, weights, ids, gate_up, down, tiles)
        _close_sums(got, want, torch_rounded)
    assert not tickets.tickets(x.device).any()


@in_this_process
@pytest.mark.parametrize("dtype", DTYPES if CUDA else [torch.float32])  # the interpreter's bf16 dots are off
@pytest.mark.parametrize(("rows", "n", "split"), [(2, 64, 1), (5, 40, 2), (16, 96, 4), (3, 2048, None)])
def test_small_gemm_equals_the_matmul(dtype, rows, n, split):
    """A few rows against a plain weight in one launch (`dense.small_linear`): columns past a block's
    end, K split and summed in order by the last program (tickets left at zero), the split it picks."""
    from engine.ops.gpu import dense  # noqa: PLC0415

    x = _randn(rows, 1024, dtype=dtype, seed=rows)
    w = _randn(n, 1024, dtype=dtype, seed=n, scale=0.05)
    assert dense.fits(x, w) and not dense.fits(x[:1], w)  # one row: cuBLAS's GEMV
    assert not dense.fits(x, w.new_empty(dense.MAX_N + 1, 1024))  # a lm_head's outputs: cuBLAS's
    got = dense.small_linear(x, w, split)
    want = (x.float() @ w.float().T).to(dtype)
    _close_sums(got, want)
    assert not tickets.tickets(x.device).any()


@in_this_process
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "dim", "rotary"), [(4, 16, 8), (2, 32, 32), (3, 24, 12)])
def test_norm_rope_on_the_fused_projections_views(dtype, heads, dim, rotary):
    """q as the fused projection leaves it ([T, H, 2D] halves), positions not from 0."""
    tokens = 5
    q_and_gate = _randn(tokens, heads, 2 * dim, dtype=dtype, seed=heads * dim, scale=3.0)
    q, _ = q_and_gate.chunk(2, dim=-1)
    weight = _randn(dim, dtype=dtype, seed=9, scale=0.1)
    cos, sin = rope_cos_sin(torch.arange(100, 100 + tokens, device=DEVICE), rotary, 10_000.0, dtype)
    _close(norm.norm_rope.fast(q, weight, 1e-6, cos, sin), norm_rope(q, weight, 1e-6, cos, sin))


@in_this_process
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_decode_attention_combined_in_one_kernel(dtype):
    """The split-K decode attention's partial results combined by one kernel equal the torch
    combination, empty splits (a short row: max -inf, nothing summed) included; and the whole
    decode attention equals the reference one over rows of different lengths (in the interpreter:
    fp32 only, its bf16 dots in the partial kernel are wrong with or without the combine)."""
    from engine.ops import attention as reference_attention  # noqa: PLC0415
    from engine.ops.gpu import attention  # noqa: PLC0415

    batch, kv_heads, group, dim = 2, 2, 3, 64
    splits, gpad = attention.DECODE_SPLITS, 16
    gen = torch.Generator().manual_seed(7)
    po = torch.randn(batch, kv_heads, splits, gpad, dim, generator=gen).to(DEVICE)
    pm = torch.randn(batch, kv_heads, splits, gpad, generator=gen).to(DEVICE)
    pl = torch.rand(batch, kv_heads, splits, gpad, generator=gen).to(DEVICE) + 0.5
    pm[1, :, 5:] = float("-inf")  # row 1 filled only its first five splits
    po[1, :, 5:], pl[1, :, 5:] = 0.0, 0.0
    got = attention._combine_triton(po, pm, pl, group, dtype)
    _close(got, attention._combine_torch(po, pm, pl, group, dtype))
    if dtype == torch.bfloat16 and not CUDA:  # the interpreter's bf16 dots in the partial kernel are off
        return
    capacity = 96
    q = _randn(batch, kv_heads * group, dim, dtype=dtype, seed=8)
    k, v = (_randn(3, capacity, kv_heads, dim, dtype=dtype, seed=s) for s in (9, 10))
    index, lengths = torch.tensor([2, 0], device=DEVICE), torch.tensor([90, 7], device=DEVICE)
    want = reference_attention.decode_attention(q.float(), k.float(), v.float(), index, lengths)
    got = attention.decode_attention(q, k, v, index, lengths)
    tol = {"rtol": 2e-2 if dtype == torch.bfloat16 else 1e-4, "atol": 2e-2}
    torch.testing.assert_close(got.float(), want, **tol)
    # the step's new key and value rows written by the kernel (each row's last position), then read:
    # a split's share holding it sees it; the positions before it are untouched
    fused = _randn(batch, kv_heads, 3 * dim, dtype=dtype, seed=11)  # strided views, as the model's qkv split
    k_new, v_new = fused[..., :dim], fused[..., 2 * dim :]
    k_ref, v_ref = k.float().clone(), v.float().clone()
    want = reference_attention.decode_attention(q.float(), k_ref, v_ref, index, lengths, k_new.float(), v_new.float())
    before = k.clone()
    got = attention.decode_attention(q, k, v, index, lengths, k_new, v_new)
    torch.testing.assert_close(got.float(), want, **tol)
    last = lengths - 1
    assert torch.equal(k[index, last], k_new) and torch.equal(v[index, last], v_new)
    k[index, last] = before[index, last]
    assert torch.equal(k, before)  # nothing else written


@in_this_process
@pytest.mark.skipif(
    CUDA, reason="on a GPU, tests/engine/test_gpu.py runs the model with them against the CPU's"
)
@pytest.mark.parametrize("preset", ["tiny", "tiny-next"])
def test_the_model_with_the_fused_kernels_gives_the_reference_logits(preset_dirs, preset):
    """The fused kernels where the model calls them (its own strides: splits of fused projections,
    the chunked q and gate), both architectures: prefill and decode logits equal the torch path's."""
    import dataclasses  # noqa: PLC0415

    from engine import Engine  # noqa: PLC0415
    from engine.ops import REFERENCE  # noqa: PLC0415
    from engine.ops.gpu import recurrent  # noqa: PLC0415

    fast = {  # the GPU bundle's fast versions, unchecked (a `Checked` would fall back on a mismatch)
        "route": moe.route.fast,
        "router": moe.router,  # its fused kernel taken unchecked below
        "norm_rope": norm.norm_rope.fast,
        "gated_rms_norm": norm.gated_rms_norm.fast,
        "causal_conv": conv.causal_conv.fast,
        "causal_conv_spans": conv._triton_conv_spans,
        **{
            name: getattr(gates, name).fast
            for name in ("deltanet_gates", "silu_mul", "sigmoid_mul", "add_sigmoid_mul")
        },
        "deltanet_decode": functools.partial(recurrent._triton_decode_step, unfused=None),
    }
    fused = dataclasses.replace(REFERENCE, name="fused", **fast)
    plain, engine = Engine.load(preset_dirs[preset]), Engine.load(preset_dirs[preset])
    engine.kernels = engine.runner.kernels = fused
    ids = [1000 + 37 * i % 4000 for i in range(40)]
    out = {}
    verdict, moe.router_fused.verdict = moe.router_fused.verdict, True  # decode's fused router, unchecked
    try:
        for name, eng in (("plain", plain), ("fused", engine)):
            state = eng.new_state()
            out[name] = torch.stack([eng.prefill(state, ids).logits, *eng.feed(state, [11, 12])])
    finally:
        moe.router_fused.verdict = verdict
    torch.testing.assert_close(out["fused"], out["plain"], rtol=1e-4, atol=1e-4)


@in_this_process
@pytest.mark.parametrize("dtype", DTYPES)
def test_slotted_decode_steps_update_their_rows_slots_in_place(dtype):
    """The DeltaNet decode step on slotted states (the conv, then the gated delta rule): each row's
    slot stepped in place as the reference steps a gathered copy and writes it back, the other
    slots untouched; q, k, v as views of the conv's output, as the model passes them."""
    from engine.ops import conv as reference_conv
    from engine.ops import deltanet as reference_deltanet
    from engine.ops.gpu import conv, recurrent

    rows, slots, channels, width = 3, 5, 96, 3
    index = torch.tensor([3, 0, 4], device=DEVICE)
    x = _randn(rows, channels + 8, dtype=dtype, seed=1)[:, :channels]  # a view, as the projection's split
    weight = _randn(channels, 1, width + 1, dtype=dtype, seed=2)[:, 0]
    conv_slots = _randn(slots, channels, width, dtype=dtype, seed=3)
    want_slots = conv_slots.clone()
    want = reference_conv.decode_conv_slots(x, want_slots, index, weight)
    got = conv._triton_conv_slots(x, conv_slots, index, weight)
    _close(got, want)
    _close(conv_slots, want_slots)

    hk, hv, dk, dv = 2, 4, 16, 32
    mixed = _randn(rows, 2 * hk * dk + hv * dv, dtype=dtype, seed=4)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.reshape(rows, hk, dk), k.reshape(rows, hk, dk), v.reshape(rows, hv, dv)
    g = -_randn(rows, hv, dtype=torch.float32, seed=5).abs()
    beta = torch.rand(rows, hv, generator=torch.Generator().manual_seed(6)).to(dtype).to(DEVICE)
    rec_slots = _randn(slots, hv, dk, dv, dtype=torch.float32, seed=7)
    want_rec = rec_slots.clone()
    want = reference_deltanet.decode_gated_delta_rule_slots(q, k, v, g, beta, want_rec, index)
    got = recurrent._triton_recurrent_slots(q, k, v, g, beta, rec_slots, index)
    _close(got, want)
    torch.testing.assert_close(rec_slots, want_rec, rtol=1e-5, atol=1e-5)
    assert torch.equal(rec_slots[[1, 2]], want_rec[[1, 2]])  # slots no row reads: untouched

    # first use through `Checked`: both trials on copies, then the real slots stepped once
    checked = recurrent.checked(reference_deltanet.decode_gated_delta_rule)
    once = rec_slots.clone()
    reference_deltanet.decode_gated_delta_rule_slots(q, k, v, g, beta, once, index)
    checked(q, k, v, g, beta, rec_slots, index)
    assert checked.verdict is True
    torch.testing.assert_close(rec_slots, once, rtol=1e-5, atol=1e-5)


@in_this_process
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_deltanet_decode_step_equals_its_four_kernels(dtype):
    """A decode step from the projection to the gated norm in one launch (`recurrent.decode_step`,
    the GPU's choice up to FUSED_ROWS rows) against `deltanet.decode_step` over the four Triton kernels it replaces
    (bf16: the same roundings; fp32: the torch references too): the output, every row's conv and
    recurrent slots after it (the key heads' q and k conv states stored once, by the last of their
    programs), the other slots untouched, the tickets left at zero; twice in a row, and through
    `Checked` (its trials on copies of the slots)."""
    from engine.ops import REFERENCE
    from engine.ops import deltanet as reference_deltanet
    from engine.ops.gpu import recurrent

    four = dataclasses.replace(
        REFERENCE,
        decode_conv_slots=conv._triton_conv_slots,
        decode_gated_delta_rule_slots=recurrent._triton_recurrent_slots,
        deltanet_gates=gates._deltanet_gates_triton,
        gated_rms_norm=norm._gated_triton,
    )
    unfused = functools.partial(reference_deltanet.decode_step, ops=four)

    rows, slots, width, hk, hv, dk, dv = 3, 5, 3, 2, 4, 32, 64  # 2 value heads a key head, 2 blocks a head
    index = torch.tensor([3, 0, 4], device=DEVICE)
    channels = 2 * hk * dk + hv * dv
    projection = _randn(rows, channels + hv * dv + 2 * hv + 8, dtype=dtype, seed=11)  # mixed ‖ z ‖ b ‖ a, padded
    mixed, z, b, a = projection[:, : channels + hv * dv + 2 * hv].split([channels, hv * dv, hv, hv], dim=-1)
    neg_a = -_randn(hv, dtype=torch.float32, seed=12).exp()
    dt_bias = _randn(hv, dtype=dtype, seed=13)
    conv_weight = _randn(channels, 1, width + 1, dtype=dtype, seed=14)[:, 0]
    norm_weight = _randn(dv, dtype=dtype, seed=15, scale=0.1) + 1
    conv_slots = _randn(slots, channels, width, dtype=dtype, seed=16)
    rec_slots = _randn(slots, hv, dk, dv, dtype=torch.float32, seed=17)
    args = (mixed, z, a, b, neg_a, dt_bias, conv_weight, norm_weight, 1e-6)
    want_conv, want_rec = conv_slots.clone(), rec_slots.clone()
    if dtype == torch.float32:
        torch_conv, torch_rec = conv_slots.clone(), rec_slots.clone()
    for _ in range(2):
        want = unfused(*args, want_conv, want_rec, index)
        got = recurrent._triton_decode_step(*args, conv_slots, rec_slots, index, unfused=None)
        _close(got, want)
        _close(conv_slots, want_conv)
        torch.testing.assert_close(rec_slots, want_rec, rtol=1e-5, atol=1e-5)
        assert not tickets.tickets(mixed.device).any()
        if dtype == torch.float32:
            _close_sums(got, reference_deltanet.decode_step(*args, torch_conv, torch_rec, index))
            torch.testing.assert_close(rec_slots, torch_rec, rtol=1e-5, atol=1e-5)
    assert torch.equal(rec_slots[[1, 2]], want_rec[[1, 2]]) and torch.equal(conv_slots[[1, 2]], want_conv[[1, 2]])
    fused = recurrent.decode_step(unfused)
    want = unfused(*args, want_conv, want_rec, index)
    _close(fused(*args, conv_slots, rec_slots, index), want)
    assert fused.verdict is True
    _close(conv_slots, want_conv)
    torch.testing.assert_close(rec_slots, want_rec, rtol=1e-5, atol=1e-5)
    assert not fused.applies((mixed.repeat(recurrent.FUSED_ROWS, 1),))  # wider steps: the four kernels
