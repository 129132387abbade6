"""The quantized-weight Triton kernels (engine/ops/gpu/quant.py's dispatch to gemv.py and gemm.py)
against plain torch: the packed weight's reference dequantization equals `gguf`'s / the FP8 reference
bit for bit, and the GEMV, GEMM and expert-grouped kernels equal `x @ dequantized.T`. Without a GPU they
run in Triton's interpreter (TRITON_INTERPRET=1, numpy; slow, so the shapes are small); on a GPU natively."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.triton_interpreter import CUDA, RUNNABLE, in_this_process, run_interpreted

pytest.importorskip("triton")
gguf = pytest.importorskip("gguf")


@pytest.mark.slow  # minutes in the interpreter
@pytest.mark.skipif(RUNNABLE, reason="this process runs the kernels itself")
def test_kernels_in_triton_interpreter_process():
    run_interpreted(__file__)


from engine.ops.gpu import fp8_prefill, gemv, quant, tickets  # noqa: E402
from engine.quant import fp8  # noqa: E402
from engine.quant.ggml import T  # noqa: E402
from tests.engine.test_quant_gguf import random_blocks  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
GGML = [T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]


def ggml_weight(qtype, shape, seed=0) -> tuple[quant.QuantWeight, torch.Tensor]:
    """Random blocks (every bit pattern, finite scales) packed, and `gguf`'s dequantization."""
    rows = int(np.prod(shape[:-1]))
    raw = random_blocks(qtype, rows, shape[-1], np.random.default_rng(seed))
    reference = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).reshape(shape)
    return quant.pack_ggml(torch.from_numpy(raw).reshape(*shape[:-1], -1), qtype, shape), reference


def fp8_weight(shape, seed=0) -> tuple[quant.QuantWeight, torch.Tensor]:
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    q, scale = fp8.quantize(w)
    return quant.pack_fp8(q, scale), fp8.dequantize(q, scale)


def weights(fmt, shape):
    return fp8_weight(shape) if fmt == "fp8" else ggml_weight(fmt, shape)


FMTS = [*GGML, "fp8"]
IDS = [getattr(f, "name", f) for f in FMTS]


@in_this_process
@pytest.mark.parametrize("fmt", FMTS, ids=IDS)
def test_packed_reference_equals_the_files_dequantization(fmt):
    w, reference = weights(fmt, (3, 40, 512))
    assert torch.equal(w.dequantize(), reference)
    if fmt != "fp8":  # the packed arrays hold the file's bytes (Q4_K: 6-bit scales as bytes)
        file_bytes = (
            3 * 40 * 512 // 256 * gguf.GGML_QUANT_SIZES[fmt][1] * (256 // gguf.GGML_QUANT_SIZES[fmt][0])
        )
        assert w.nbytes <= file_bytes * 1.03


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    scale = want.abs().max().item()
    assert (got.float() - want).abs().max().item() <= tol * scale, (
        got.float() - want
    ).abs().max().item() / scale


@in_this_process
@pytest.mark.parametrize("fmt", FMTS, ids=IDS)
@pytest.mark.parametrize("rows", [1, 3, 37])  # GEMV, GEMV, GEMM with a partial tile
def test_linear_equals_dequantized_matmul(fmt, rows):
    dtype = torch.bfloat16 if CUDA else torch.float32
    w, reference = weights(fmt, (72, 512))
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = quant.linear(x.to(DEVICE), w.to(DEVICE)).cpu()
    close(got, x.float() @ reference.T, dtype)


@in_this_process
@pytest.mark.parametrize("fmt", FMTS, ids=IDS)
@pytest.mark.parametrize("rows", [1, 37])  # GEMV, GEMM
@pytest.mark.parametrize("runs", [128, 1], ids=["heads", "scattered"])
def test_a_weight_whose_columns_moved_reads_x_through_its_map(fmt, rows, runs):
    """`columns` (the file's column j is the model's columns[j]: Qwen3.5's DeltaNet out_proj in GGUF,
    value heads of 128 columns reordered). In runs of whole chunks the GEMV reads x through the map
    (no gather launch); any other map, and the GEMM, gather x's columns first. Both: x @ w.T in the
    model's order."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    w, reference = weights(fmt, (72, 512))
    gen = torch.Generator().manual_seed(runs)
    columns = (torch.randperm(512 // runs, generator=gen)[:, None] * runs + torch.arange(runs)).flatten()
    moved = quant.QuantWeight(w.fmt, w.shape, w.parts, w.dtype, columns)
    assert moved.chunked_columns == (runs == 128)
    model_order = torch.empty_like(reference)
    model_order[:, columns] = reference
    torch.testing.assert_close(moved.dequantize(), model_order, rtol=0, atol=0)
    x = torch.randn(rows, 512, generator=gen).to(dtype)
    got = quant.linear(x.to(DEVICE), moved.to(DEVICE)).cpu()
    close(got, x.float() @ model_order.T, dtype)


@in_this_process
def test_gemm_with_identity_returns_the_weights_exactly():
    """fp32 in the interpreter: the kernel's in-register dequantization is the reference's, bit for bit."""
    if CUDA:
        pytest.skip("fp32 dot products on a GPU may use TF32")
    for fmt in FMTS:
        w, reference = weights(fmt, (64, 256))
        got = quant.linear(torch.eye(256), w)  # [K, N] = w.T
        assert torch.equal(got.T, reference), fmt
        assert torch.equal(quant.dequantize_to(w, torch.float32), reference), fmt  # prefill's transient copy


@in_this_process
@pytest.mark.parametrize("fmt", [T.Q4_K, T.Q5_K, "fp8"], ids=["Q4_K", "Q5_K", "fp8"])
@pytest.mark.parametrize("tokens", [23, 1])  # prefill; decode (fewer assignments than experts)
def test_grouped_experts_equal_per_expert_matmuls(fmt, tokens):
    from engine.ops.gpu.moe import group_by_expert

    dtype = torch.bfloat16 if CUDA else torch.float32
    num_experts, top_k = 6, 2
    w, reference = weights(fmt, (num_experts, 64, 256))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, 256, generator=gen).to(dtype)
    ids = torch.stack(
        [torch.randperm(num_experts - 1, generator=gen)[:top_k] for _ in range(tokens)]
    )  # expert 5 unused
    order, offs, _ = group_by_expert(ids.to(DEVICE), num_experts)
    got = quant.grouped(x.to(DEVICE), w.to(DEVICE), order, offs, top_k).cpu()
    order = order.cpu()
    flat = ids.flatten()[order]
    want = torch.stack(
        [x[j // top_k].float() @ reference[e].T for j, e in zip(order.tolist(), flat.tolist(), strict=True)]
    )
    close(got, want, dtype)


def x_in_fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the FP8 prefill multiplies it: its e4m3 rows times their 1x128 scales, in fp32."""
    return fp8.dequantize(*fp8_rows_reference(x), fp8_prefill.X_BLOCK)


def fp8_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8_prefill.fp8_rows` in plain torch: the FP8 weights' own block quantization, in 1 x 128 blocks."""
    return fp8.quantize(x, fp8_prefill.X_BLOCK, torch.float32)


@in_this_process
def test_fp8_rows_are_the_torch_reference():
    """x per row and 128 columns over its largest |x| / 448, rounded to e4m3 (ties to even): the
    kernel's against plain torch's (the interpreter: bit for bit; a GPU divides in its own way:
    within one e4m3 step, the scales within 1e-6), across magnitudes, a zero group, a subnormal one,
    and 384 columns (groups not a power of two)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(70, 384, generator=gen) * torch.logspace(-6, 4, 70)[:, None]
    x[3, 128:256] = 0
    x[4, :128] = 1e-30
    x[5, 7] = 448 * 3  # a group's largest is exactly its scale times 448
    x = x.to(torch.bfloat16)
    q, s = fp8_prefill.fp8_rows(x.to(DEVICE))
    want_q, want_s = fp8_rows_reference(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (70, 3)
    if not CUDA:
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
        return
    torch.testing.assert_close(s.cpu(), want_s, rtol=1e-6, atol=0)
    step = want_q.float().abs().clamp(min=2**-9) / 8  # one e4m3 step at the value
    assert ((q.cpu().float() - want_q.float()).abs() <= step).all()


@in_this_process
@pytest.mark.parametrize("rows", [65, 200])  # past DEQUANT_ROWS: one partial tile, several
@pytest.mark.parametrize("tile", ["64:4:3:t", "32:4:3:n"])  # a tile's programs over N apart or together
def test_fp8_prefill_multiplies_x_in_fp8_rows_on_the_tensor_cores(rows, tile):
    """Prefill's FP8 (`fp8_prefill`: bf16 activations past DEQUANT_ROWS rows): x quantized per row and 128
    columns times the e4m3 weight, each 128-column step's sums scaled by both blocks' scales. A plain
    linear and MoE experts (rows gathered through `order`; an expert with none): equal to x's FP8 rows
    times the dequantized weight (fp32 out: 1e-5; bf16 out: its rounding); within FP8's error of the
    unquantized x."""
    from engine.ops.gpu.moe import group_by_expert

    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 384, generator=gen).to(torch.bfloat16)
    w, reference = fp8_weight((200, 384))  # 200 rows: a partial 128-row block
    want = x_in_fp8_rows(x) @ reference.T
    out = torch.empty(rows, 200, device=DEVICE)
    out = fp8_prefill.gemm(*fp8_prefill.fp8_rows(x.to(DEVICE)), w.to(DEVICE), out, tile=fp8_prefill.Tile.parse(tile))
    # fp32 sums in the interpreter; Hopper's FP8 MMA keeps ~14 bits of products aligned to the largest
    # (as cuBLAS's block-scaled GEMM does): bf16's tolerance
    close(out.cpu(), want, torch.bfloat16 if CUDA else torch.float32)
    got = quant.linear(x.to(DEVICE), w.to(DEVICE)).cpu()
    assert got.dtype == torch.bfloat16
    close(got, want, torch.bfloat16)
    unquantized = x.float() @ reference.T
    assert (got.float() - unquantized).abs().max() <= 0.05 * unquantized.abs().max()
    num_experts, top_k = 5, 2  # in the kernel's lookup, 8 lanes
    experts, experts_ref = fp8_weight((num_experts, 256, 384), seed=1)
    ids = torch.stack([torch.randperm(num_experts - 1, generator=gen)[:top_k] for _ in range(rows)])
    order, offs, _ = group_by_expert(ids.to(DEVICE), num_experts)  # expert 4 unused
    got = quant.grouped(x.to(DEVICE), experts.to(DEVICE), order, offs, top_k).cpu()
    order = order.cpu()
    xq = x_in_fp8_rows(x)
    flat = ids.flatten()[order]
    pairs = zip(order.tolist(), flat.tolist(), strict=True)
    close(got, torch.stack([xq[j // top_k] @ experts_ref[e].T for j, e in pairs]), torch.bfloat16)


def stored_bf16(v: torch.Tensor) -> torch.Tensor:
    """fp32 `v` as a kernel's bf16 store leaves it: to nearest on a GPU, toward zero in the interpreter."""
    return v.bfloat16().float() if CUDA else (v.view(torch.int32) & -65536).view(torch.float32)


@in_this_process
@pytest.mark.parametrize("partial", [False, True], ids=["routed", "streamed-piece"])
def test_fp8_experts_prefill_quantizes_x_and_the_activation_and_puts_rows_back(partial):
    """FP8 MoE prefill (`fp8_prefill.experts` through `experts_quantized`): x's FP8 rows through gate_up
    in expert order, silu(gate) * up * routing weight quantized straight into FP8 rows, down written at
    each assignment's row, summed per token; absent assignments (-1, `partial`) add nothing. Against
    the same steps in torch (gate_up's output rounded to bf16 as the kernel stores it: Triton's
    interpreter rounds toward zero, a GPU to nearest)."""
    from engine.ops.gpu.moe import experts_quantized
    from engine.ops.moe import DECODE_ROWS

    gen = torch.Generator().manual_seed(7)
    tokens, top_k, num_experts = 50, 3, 5
    assert tokens * top_k > DECODE_ROWS  # the prefill path
    x = torch.randn(tokens, 256, generator=gen).to(torch.bfloat16)
    gate_up, gate_up_ref = fp8_weight((num_experts, 256, 256), seed=2)  # [E, 2I, H], I = 128
    down, down_ref = fp8_weight((num_experts, 256, 128), seed=3)  # [E, H, I]
    ids = torch.stack([torch.randperm(num_experts - 1, generator=gen)[:top_k] for _ in range(tokens)])
    if partial:
        ids[::4, 1] = -1
    routing = torch.rand(tokens, top_k, generator=gen).to(torch.bfloat16)
    dev = [t.to(DEVICE) for t in (x, routing, ids, gate_up, down)]
    got = experts_quantized(*dev, partial=partial).cpu()
    xq = x_in_fp8_rows(x)
    want = torch.zeros(tokens, 256)
    for t in range(tokens):
        for j, e in enumerate(ids[t].tolist()):
            if e >= 0:
                gate, up = stored_bf16(xq[t] @ gate_up_ref[e].T).chunk(2)
                act = torch.nn.functional.silu(gate) * up * routing[t, j].float()
                want[t] += x_in_fp8_rows(act[None])[0] @ down_ref[e].T
    close(got, want, torch.bfloat16)


@in_this_process
def test_quantized_experts_of_a_streamed_piece_skip_the_absent_assignments():
    """A prefill's assignments with -1 (routed to experts outside the streamed piece): their rows
    add nothing, whatever the GEMMs left in them (`partial`)."""
    from engine.ops.gpu.moe import _summed, experts_quantized, group_by_expert
    from engine.ops.moe import DECODE_ROWS, experts_loop

    dtype = torch.bfloat16 if CUDA else torch.float32
    gate_up, gate_up_ref = ggml_weight(T.Q4_K, (4, 512, 256))  # [E, 2I, H]
    down, down_ref = ggml_weight(T.Q6_K, (4, 256, 256), seed=1)  # [E, H, I]
    gen = torch.Generator().manual_seed(3)
    tokens = 80
    x = torch.randn(tokens, 256, generator=gen).to(dtype)
    ids = torch.randint(-1, 4, (tokens, 2), generator=gen)
    assert ids.numel() > DECODE_ROWS  # the prefill path
    weights = torch.rand(tokens, 2, generator=gen).to(dtype)
    args = (t.to(DEVICE) for t in (x, weights, ids, gate_up, down))
    got = experts_quantized(*args, partial=True).cpu()
    want = experts_loop(x.float(), weights.float(), ids, gate_up_ref, down_ref)
    close(got, want, dtype)
    # what no GEMM wrote may hold anything: NaN there, and nothing of it in the sums
    ids = ids.to(DEVICE)
    order, _, rows = group_by_expert(ids, 4)
    ys = torch.where((ids.flatten()[order] < 0)[:, None], float("nan"), torch.ones(2 * tokens, 3, device=DEVICE))
    summed = _summed(ys, rows, ids, True, torch.float32)
    assert torch.equal(summed, (ids >= 0).sum(1, keepdim=True).float().expand(tokens, 3))


@in_this_process
@pytest.mark.parametrize("fmt", FMTS, ids=IDS)
def test_expert_decode_kernels_equal_per_assignment_matmuls(fmt):
    """MoE decode in two launches: each (token, chosen expert) through gate, up, SiLU and its
    routing weight, then each token's experts through down, summed; only those experts read
    (-1: none), the split-K sums taken inside the kernel (its counters left at zero). Three
    experts a token: an odd count, as the eight routed and the shared one folded in are."""
    from engine.ops.gpu.moe import experts_quantized
    from engine.ops.moe import experts_loop

    dtype = torch.bfloat16 if CUDA else torch.float32
    gate_up, gate_up_ref = weights(fmt, (5, 512, 256))  # [E, 2I, H]
    down, down_ref = weights(fmt, (5, 256, 256)) if fmt == "fp8" else ggml_weight(fmt, (5, 256, 256), seed=1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 256, generator=gen).to(dtype)
    ids = torch.tensor([[4, -1, 2], [0, 4, 1], [3, 1, 4]])
    routing = torch.rand(3, 3, generator=gen).to(dtype)
    dev = [t.to(DEVICE) for t in (x, gate_up, ids, routing, down)]
    act = quant.experts_glu(dev[0], dev[1], dev[2], dev[3])
    want_act = []
    for a, e in enumerate(ids.flatten().tolist()):
        gate, up = (x[a // 3].float() @ gate_up_ref[e].T).chunk(2) if e >= 0 else (torch.zeros(256),) * 2
        want_act.append(torch.nn.functional.silu(gate) * up * routing.flatten()[a].float())
    close(act.cpu(), torch.stack(want_act), dtype)
    got = quant.experts_sum(act, dev[4], dev[2]).cpu()
    want = torch.stack(
        [
            sum(act[t * 3 + j].cpu().float() @ down_ref[e].T for j, e in enumerate(ids[t].tolist()) if e >= 0)
            for t in range(3)
        ]
    )
    close(got, want, dtype)
    assert not tickets.tickets(torch.device(DEVICE)).any()
    # the model's decode path, against the per-expert loop on the dequantized weights
    got = experts_quantized(dev[0], dev[3], dev[2], dev[1], dev[4]).cpu()
    close(got, experts_loop(x.float(), routing.float(), ids, gate_up_ref, down_ref), dtype)


@in_this_process
@pytest.mark.parametrize("mode", ["linear", "glu", "topk"])
def test_every_split_a_gemv_may_run_with_gives_its_sums(mode):
    """Every split a GEMV shape may run with (`gemv._splits`) gives the same sums, taken by the
    last program of each split (its counter left at zero), launch after launch."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    dev = torch.device(DEVICE)
    gen = torch.Generator().manual_seed(5)
    if mode == "linear":
        w, ref = weights(T.Q4_K, (72, 1024))
        x = torch.randn(2, 1024, generator=gen).to(dtype)
        xr = x.float()
        args, want = (x.to(dev), w.to(dev), 2, 72), xr @ ref.T
        kw, top_k, sums = {}, 1, 2
    else:
        w, ref = weights(T.Q4_K, (3, 128, 1024) if mode == "glu" else (3, 64, 1024))
        ids = torch.tensor([[2, -1, 0, 1]])  # one token, four experts (-1: none)
        if mode == "glu":
            x = torch.randn(1, 1024, generator=gen).to(dtype)
            xr = x.float()
            routing = torch.rand(4, generator=gen).to(dtype)
            args = (x.to(dev), w.to(dev), 4, 64, ids.flatten().to(dev), 4)
            kw, top_k, sums = {"scale": routing.to(dev)}, 1, 4
            gate_up = [xr[0] @ ref[e].T if e >= 0 else torch.zeros(128) for e in ids[0].tolist()]
            want = torch.stack(
                [
                    torch.nn.functional.silu(g[:64]) * g[64:] * r.float()
                    for g, r in zip(gate_up, routing, strict=True)
                ]
            )
        else:
            x = torch.randn(4, 1024, generator=gen).to(dtype)
            xr = x.float()
            args = (x.to(dev), w.to(dev), 1, 64, ids.flatten().to(dev))
            kw, top_k, sums = {"top_k": 4}, 4, 1
            want = sum(xr[j] @ ref[e].T for j, e in enumerate(ids[0].tolist()) if e >= 0)[None]
    blocks = -(-args[3] // gemv.gemv_block_n(args[3], grouped=mode != "linear"))
    splits = gemv._splits(1024, quant.GEMV_CHUNK[quant.Q4_K], top_k, blocks * sums)
    assert splits[0] == top_k and len(splits) == 5  # 1024 columns: 1 .. 16 programs of 64 per assignment
    for split in splits:
        for _ in range(2):
            got = gemv._gemv(*args, **kw, split=split)
            close(got.cpu(), want, dtype)
            assert not tickets.tickets(dev).any()
    with pytest.raises(ValueError, match="not one of"):
        gemv._gemv(*args, **kw, split=3 * top_k)


def test_the_split_fills_the_gpu_with_1024_programs():
    """A GEMV runs with the smallest split of at least 1,024 programs, else the largest; the
    candidates stop at MAX_PROGRAMS programs."""
    assert gemv._splits(2048, 64, 1, 386) == [1, 2, 4, 8, 16, 32]
    assert gemv._heuristic_split([1, 2, 4, 8, 16, 32], 386) == 4  # the DeltaNet input projection
    assert gemv._heuristic_split(gemv._splits(512, 64, 8, 64), 64) == 16  # a token's experts, down
    assert gemv._splits(2048, 64, 1, 7760) == [1, 2, 4]  # the lm_head at 32 rows a program: 7,760 sums
    assert gemv._heuristic_split([1, 2, 4], 7760) == 1
    # rows a program: 64 for a plain GEMV of GEMV_WIDE_N outputs or more (the lm_head), not for experts
    assert gemv.gemv_block_n(248320) == max(gemv.GEMV_BLOCK_N, 64)
    assert gemv.gemv_block_n(248320, grouped=True) == gemv.GEMV_BLOCK_N
    assert gemv.gemv_block_n(2048) == min(gemv.GEMV_BLOCK_N, 2048)


@in_this_process
def test_gather_copies_each_staged_row_from_its_expert_and_skips_absent_ones():
    """The staging gather (engine/ops/gpu/gather.py) equals `gather_rows`: the parts of a Q4_K
    stack (four dtypes, widths not multiples of the block) and a second launch's parts beyond
    four; rows of id -1 keep what they held."""
    from engine.offload.cache import gather_rows  # noqa: PLC0415
    from engine.ops.gpu.gather import gather_experts, gather_fits  # noqa: PLC0415

    w, _ = ggml_weight(T.Q4_K, (6, 24, 512))
    extra = torch.arange(6 * 3 * 4, dtype=torch.float32).reshape(6, 3, 4)
    source = tuple(p.to(DEVICE) for p in (*w.parts, extra))
    assert gather_fits(source)
    ids = torch.tensor([[4, -1], [0, 5]], device=DEVICE)
    got = tuple(torch.zeros((5, *p.shape[1:]), dtype=p.dtype, device=DEVICE) for p in source)
    want = tuple(t.clone() for t in got)
    gather_experts(got, source, ids)
    gather_rows(want, source, ids)
    for g, r in zip(got, want, strict=True):
        assert torch.equal(g, r)
    assert torch.equal(got[0][2], source[0][0]) and not got[0][1].any()


@in_this_process
@pytest.mark.parametrize(
    ("first", "second"),
    [(T.Q6_K, T.Q4_K), (T.Q4_K, T.Q8_0), ("fp8", T.Q6_K), (T.Q8_0, T.Q5_K)],
    ids=["Q6_K+Q4_K", "Q4_K+Q8_0", "fp8+Q6_K", "Q8_0+Q5_K"],
)
def test_two_formats_in_one_gemv_launch(first, second):
    """A fused projection whose parts are in two formats (Q4_K_M's Q6_K qkv beside its Q4_K gate
    and b, a: `engine.model.Concat`): one GEMV launch writes both parts' outputs side by side, at
    every split of K both formats' chunks divide, each sum taken by its last program."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    dev = torch.device(DEVICE)
    a, ref_a = weights(first, (72, 1024))  # rows off a block of outputs: masked, in both parts
    b, ref_b = weights(second, (40, 1024))
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(8)).to(dtype)
    want = x.float() @ torch.cat([ref_a, ref_b]).T
    a, b, xd = a.to(dev), b.to(dev), x.to(dev)
    bn = gemv.gemv_block_n(112)
    blocks = -(-72 // bn) + -(-40 // bn)
    chunk = max(quant.GEMV_CHUNK[a.fmt], quant.GEMV_CHUNK[b.fmt])
    splits = gemv._splits(1024, chunk, 1, blocks * 3)
    assert len(splits) >= 3
    for split in splits:
        got = gemv._gemv(xd, a, 3, 72, second=b, split=split)
        assert got.shape == (3, 112)
        close(got.cpu(), want, dtype)
        assert not tickets.tickets(dev).any()
    close(quant.linear_pair(xd, a, b).cpu(), want, dtype)
    assert quant.linear_pair(torch.randn(5, 1024).to(dtype).to(dev), a, b) is None  # past decode rows: apart
