"""The Triton kernels whose offloaded-decode paths the CPU runs only in Triton's interpreter also
compile for the H200 (sm_90, PTX and cubin through the bundled ptxas), on this CPU machine: what the
interpreter lets through (a loop bound computed at run time, a pointer chosen per row) fails here
as it would on the GPU, before a lease is spent on it."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine.ops.gpu import fp8_prefill, gather, gemm, gemv, moe, quant  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)
GEMV = {
    "X": "*bf16",
    "PART": "*fp32",
    "OUT": "*bf16",
    "COUNT": "*i32",
    "EXPERT": "*i64",
    "SCALE": "*bf16",
    "XCOLS": "*i64",
    "N": "i32",
    "N2": "i32",
    "K": "i32",
    "K_SPLIT": "i32",
    "SPLIT": "i32",
    "XROW": "i32",
    "FMT": "constexpr",
    "BN": "constexpr",
    "CHUNK": "constexpr",
    "GROUPED": "constexpr",
    "X_PER": "constexpr",
    "TOPK": "constexpr",
    "GLU": "constexpr",
    "XMAP": "constexpr",
    "FMT2": "constexpr",
    "CHUNK2": "constexpr",
    "STAGES": "constexpr",
    "UNROLL": "constexpr",
}
PARTS = {  # the field arrays' types per format (quant.FIELDS)
    quant.Q8_0: ("*i8", "*fp16", "*i8", "*i8"),
    quant.Q4_K: ("*u8", "*u8", "*u8", "*fp16"),
    quant.Q5_K: ("*u8", "*u8", "*u8", "*fp16"),
    quant.Q6_K: ("*u8", "*u8", "*i8", "*fp16"),
    quant.FP8: ("*fp8e4nv", "*fp32", "*fp8e4nv", "*fp8e4nv"),
}


GEMV_DIVISIBLE = ("N", "N2", "K", "K_SPLIT", "XROW")  # at the decode shapes, as the launcher specialises them


def launch_attrs(fn, signature: dict, divisible: tuple[str, ...] = ()) -> dict:
    """What Triton's launcher specialises a launch on: every pointer 16-byte aligned (torch's
    allocations) and the `divisible` integers multiples of 16. A compile without them assumes
    neither: other loads (a byte at a time) and other registers than the launched kernel's."""
    return {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if signature.get(name, "").startswith("*") or name in divisible
    }


def compile_for_h200(fn, signature: dict, constexprs: dict, divisible: tuple[str, ...] = (), warps: int = 4) -> str:
    try:
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=launch_attrs(fn, signature, divisible))
        kernel = triton.compile(source, target=H200, options={"num_warps": warps})
    except (FileNotFoundError, RuntimeError) as exc:  # no CUDA backend or ptxas in this triton build
        if "ptxas" in str(exc) or "backend" in str(exc):
            pytest.skip(f"triton cannot compile for sm_90 here: {exc}")
        raise
    return kernel.asm["ptx"]


@pytest.mark.parametrize("fmt", sorted(PARTS), ids=lambda f: quant.NAMES[f])
@pytest.mark.parametrize(
    "mode", [(False, 1, 1, False, False), (False, 1, 1, False, True), (True, 9, 1, True, False), (True, 1, 9, False, False)],
    ids=["linear", "mapped", "glu", "topk"],
)
def test_gemv_compiles_with_its_split_sums(fmt, mode):
    """The plain GEMV, MoE decode's up (SiLU and routing weight inside) and down (a token's experts
    summed; 9 a token: 8 routed and the shared one), a plain one reading x through a column map:
    each split's sums taken by its last program behind an acquire-release ticket."""
    grouped, x_per, top_k, glu, xmap = mode
    signature = {**GEMV, **{f"P{i}": t for i, t in enumerate(PARTS[fmt])}, **{f"Q{i}": t for i, t in enumerate(PARTS[fmt])}}
    constexprs = gemv.gemv_constexprs(fmt, 32, grouped, x_per, top_k, glu, xmap)
    ptx = compile_for_h200(gemv._gemv_kernel, signature, constexprs, GEMV_DIVISIBLE)
    assert ".entry _gemv_kernel" in ptx
    assert "atom.global.gpu.acq_rel.add" in ptx or "atom.acq_rel.gpu.global.add" in ptx, [
        line for line in ptx.splitlines() if "atom" in line
    ]


def test_gemv_of_two_formats_compiles():
    """Q4_K_M's DeltaNet input projection: the Q6_K qkv and the Q4_K gate, b and a in one launch."""
    signature = {
        **GEMV,
        **{f"P{i}": t for i, t in enumerate(PARTS[quant.Q6_K])},
        **{f"Q{i}": t for i, t in enumerate(PARTS[quant.Q4_K])},
    }
    constexprs = {**gemv.gemv_constexprs(quant.Q6_K, 32, fmt2=quant.Q4_K), "STAGES": 3, "UNROLL": 2}
    assert ".entry _gemv_kernel" in compile_for_h200(gemv._gemv_kernel, signature, constexprs, GEMV_DIVISIBLE)


def test_bf16_decode_kernels_compile():
    up = {
        "X": "*bf16",
        "W": "*bf16",
        "IDS": "*i64",
        "A": "*bf16",
        "H": "i32",
        "INTER": "i32",
        "TOPK": "constexpr",
        "BLOCK_I": "constexpr",
        "BLOCK_H": "constexpr",
    }
    down = {
        "A": "*bf16",
        "W": "*bf16",
        "IDS": "*i64",
        "RW": "*bf16",
        "PART": "*fp32",
        "OUT": "*bf16",
        "COUNT": "*i32",
        "H": "i32",
        "INTER": "i32",
        "TOPK": "constexpr",
        "BLOCK_N": "constexpr",
        "BLOCK_I": "constexpr",
    }
    assert ".entry _up_kernel" in compile_for_h200(
        moe._up_kernel, up, {"TOPK": 9, "BLOCK_I": 8, "BLOCK_H": 256}
    )
    assert ".entry _down_kernel" in compile_for_h200(
        moe._down_kernel, down, {"TOPK": 9, "BLOCK_N": 32, "BLOCK_I": 128}
    )


def test_router_with_the_shared_expert_compiles():
    """The router's kernel appending the shared expert (its gate's sigmoid, expert E) to the top 8."""
    signature = {
        "L": "*bf16",
        "W": "*bf16",
        "IDS": "*i64",
        "E": "i32",
        "stride": "i32",
        "TOPK": "constexpr",
        "RENORM": "constexpr",
        "SHARED": "constexpr",
        "BE": "constexpr",
        "BK": "constexpr",
    }
    constexprs = {"TOPK": 8, "RENORM": True, "SHARED": True, "BE": 256, "BK": 16}
    assert ".entry _route_kernel" in compile_for_h200(moe._route_kernel, signature, constexprs)


def test_staging_gather_compiles_to_wide_loads():
    """Parts 16-byte aligned with widths divisible by 16 words (as Triton specializes them at run
    time): the gather reads and writes whole 16-byte words, what reaches the link's rate."""
    signature = {
        "IDS": "*i32",
        **{f"{a}{i}": "*i32" for a in "SD" for i in range(4)},
        **{f"W{i}": "i32" for i in range(4)},
        "NPARTS": "constexpr",
        "BLOCK": "constexpr",
    }
    names = list(signature)
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n[0] in "SDW"}
    try:
        kernel = triton.compile(
            ASTSource(
                fn=gather._gather_kernel,
                signature=signature,
                constexprs={"NPARTS": 4, "BLOCK": gather.BLOCK},
                attrs=aligned,
            ),
            target=H200,
        )
    except (FileNotFoundError, RuntimeError) as exc:
        if "ptxas" in str(exc) or "backend" in str(exc):
            pytest.skip(f"triton cannot compile for sm_90 here: {exc}")
        raise
    ptx = kernel.asm["ptx"]
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx


def test_decode_combine_compiles():
    """The split-K decode attention's combination at the 35B shape (8 query heads per KV head, 256 dims)."""
    from engine.ops.gpu import attention  # noqa: PLC0415

    signature = {
        "PO": "*fp32",
        "PM": "*fp32",
        "PL": "*fp32",
        "OUT": "*bf16",
        "NUM_KV": "i32",
        "GROUP": "constexpr",
        "GPAD": "constexpr",
        "D": "constexpr",
        "SPLITS": "constexpr",
    }
    constexprs = {"GROUP": 8, "GPAD": 16, "D": 256, "SPLITS": attention.DECODE_SPLITS}
    assert ".entry _decode_combine" in compile_for_h200(attention._decode_combine, signature, constexprs)


@pytest.mark.parametrize("write", [False, True], ids=["read", "write-new-row"])
def test_decode_partial_compiles(write):
    """The split-K decode attention at the 35B shape, with the step's new key and value rows written
    by the program whose share holds them (a store, then a barrier before the reads)."""
    from engine.ops.gpu import attention  # noqa: PLC0415

    pointers = {
        "Q": "*bf16",
        "K": "*bf16",
        "V": "*bf16",
        "INDEX": "*i64",
        "LENGTH": "*i64",
        "PO": "*fp32",
        "PM": "*fp32",
        "PL": "*fp32",
        "K_NEW": "*bf16",
        "V_NEW": "*bf16",
        "scale": "fp32",
    }
    strides = (
        "stride_qb",
        "stride_qh",
        "stride_ks",
        "stride_kn",
        "stride_kh",
        "stride_vs",
        "stride_vn",
        "stride_vh",
        "stride_knb",
        "stride_knh",
        "stride_vnb",
        "stride_vnh",
        "NUM_KV",
    )
    constexprs = {
        "GROUP": 8,
        "GPAD": 16,
        "D": 256,
        "BLOCK_N": 64,
        "SPLITS": attention.DECODE_SPLITS,
        "IEEE": False,
        "WRITE": write,
    }
    signature = {**pointers, **dict.fromkeys(strides, "i32"), **dict.fromkeys(constexprs, "constexpr")}
    ptx = compile_for_h200(attention._decode_partial, signature, constexprs)
    assert ".entry _decode_partial" in ptx


def test_fused_router_compiles():
    """The router's GEMM and the routing in one launch at the 35B shape (256 experts and the shared
    expert's gate, top 8, hidden 2048)."""
    signature = {
        "X": "*bf16",
        "R": "*bf16",
        "LOGITS": "*fp32",
        "W": "*bf16",
        "IDS": "*i64",
        "COUNT": "*i32",
        "H": "i32",
        "E": "i32",
        "stride_r": "i32",
        "TOPK": "constexpr",
        "RENORM": "constexpr",
        "BE": "constexpr",
        "BK": "constexpr",
        "BLOCK_E": "constexpr",
        "BLOCK_H": "constexpr",
    }
    constexprs = {"TOPK": 8, "RENORM": True, "BE": 512, "BK": 16, "BLOCK_E": 16, "BLOCK_H": 256}
    ptx = compile_for_h200(moe._router_kernel, signature, constexprs)
    assert ".entry _router_kernel" in ptx and ("atom.global.gpu.acq_rel.add" in ptx or "atom.acq_rel.gpu.global.add" in ptx)


def test_slotted_decode_kernels_compile():
    """The DeltaNet decode step on slotted states (engine/ops/gpu/conv.py, recurrent.py) at the
    35B shape's sizes."""
    from engine.ops.gpu import conv, recurrent

    conv_sig = {
        "X": "*bf16",
        "S": "*bf16",
        "IDX": "*i64",
        "W": "*bf16",
        "Y": "*bf16",
        "C": "i32",
        "stride_x": "i32",
        "K": "constexpr",
        "KP": "constexpr",
        "BLOCK_C": "constexpr",
    }
    assert ".entry _conv_slots_kernel" in compile_for_h200(
        conv._conv_slots_kernel, conv_sig, {"K": 4, "KP": 4, "BLOCK_C": 256}
    )
    rec_sig = {
        "Q": "*bf16",
        "K": "*bf16",
        "V": "*bf16",
        "G": "*fp32",
        "BETA": "*bf16",
        "S": "*fp32",
        "IDX": "*i64",
        "OUT": "*bf16",
        "stride_q": "i32",
        "stride_k": "i32",
        "stride_v": "i32",
        "stride_g": "i32",
        "stride_beta": "i32",
        "HV": "i32",
        "GROUP": "i32",
        "scale": "fp32",
        "DK": "constexpr",
        "DV": "constexpr",
        "BV": "constexpr",
    }
    assert ".entry _recurrent_slots_kernel" in compile_for_h200(
        recurrent._recurrent_slots_kernel, rec_sig, {"DK": 128, "DV": 128, "BV": recurrent.BLOCK_V}
    )
    step_sig = {
        "MIXED": "*bf16",
        "Z": "*bf16",
        "A": "*bf16",
        "B": "*bf16",
        "NEG_A": "*fp32",
        "DT": "*bf16",
        "CW": "*bf16",
        "CS": "*bf16",
        "RS": "*fp32",
        "IDX": "*i64",
        "NW": "*bf16",
        "OUT": "*bf16",
        "COUNT": "*i32",
        "stride_m": "i32",
        "stride_z": "i32",
        "stride_a": "i32",
        "stride_b": "i32",
        "C": "i32",
        "KEY": "i32",
        "HK": "i32",
        "HV": "i32",
        "GROUP": "i32",
        "scale": "fp32",
        "eps": "fp32",
        "DK": "constexpr",
        "DV": "constexpr",
        "BV": "constexpr",
        "K": "constexpr",
        "KP": "constexpr",
    }
    ptx = compile_for_h200(
        recurrent._decode_step_kernel, step_sig, {"DK": 128, "DV": 128, "BV": recurrent.BLOCK_V, "K": 4, "KP": 4}
    )  # the fused step: its two tickets acquire-release
    assert ".entry _decode_step_kernel" in ptx
    assert ptx.count("atom.global.gpu.acq_rel.add") + ptx.count("atom.acq_rel.gpu.global.add") == 2


@pytest.mark.parametrize(("gather", "partial"), [(True, False), (False, True)])
def test_prefill_layout_kernels_compile(gather, partial):
    """The prefill kernels that read strided views and write in the next kernel's layout, at the 35B
    shape: the conv into q, k, v parts, the gated norm and the gates per head, the experts' activation
    and sum."""
    from engine.ops.gpu import conv, gates, norm

    conv_sig = {
        "X": "*bf16",
        "S": "*bf16",
        "SPAN": "*i32",
        "START": "*i32",
        "W": "*bf16",
        "Y": "*bf16",
        "T": "i32",
        "C": "i32",
        "stride_x": "i32",
        "END0": "i32",
        "END1": "i32",
        "K": "constexpr",
        "SPANS": "constexpr",
        "BLOCK_T": "constexpr",
        "BLOCK_C": "constexpr",
    }
    for spans in (False, True):  # one sequence; several sequences' rows, each from its own state
        consts = {"K": 4, "SPANS": spans, "BLOCK_T": 32, "BLOCK_C": 128}
        assert ".entry _causal_conv" in compile_for_h200(conv._causal_conv, conv_sig, consts)
    strides = {name: "i32" for name in ("H", "N", "sx", "sxh", "sz", "szh")}
    norm_sig = {"X": "*bf16", "Z": "*bf16", "W": "*bf16", "Y": "*bf16", **strides, "eps": "fp32", "BLOCK": "constexpr"}
    assert ".entry _gated_rms_norm" in compile_for_h200(norm._gated_rms_norm, norm_sig, {"BLOCK": 128})
    gate_sig = {
        "X": "*bf16",
        "GATE": "*bf16",
        "Y": "*bf16",
        "OUT": "*bf16",
        **{name: "i32" for name in ("H", "N", "sx", "sxh", "sg", "sgh", "sy", "syh")},
        "KIND": "constexpr",
        "BLOCK": "constexpr",
    }
    assert ".entry _gate_kernel" in compile_for_h200(gates._gate_kernel, gate_sig, {"KIND": gates.SIGMOID_MUL, "BLOCK": 256})
    sum_sig = {
        "YS": "*bf16",
        "ROWS": "*i64",
        "IDS": "*i64",
        "OUT": "*bf16",
        "H": "i32",
        "TOPK": "constexpr",
        "GATHER": "constexpr",
        "PARTIAL": "constexpr",
        "BLOCK": "constexpr",
    }
    constexprs = {"TOPK": 9, "GATHER": gather, "PARTIAL": partial, "BLOCK": 1024}
    assert ".entry _sum_rows_kernel" in compile_for_h200(moe._sum_rows_kernel, sum_sig, constexprs)
    glu_sig = {"GU": "*bf16", "RW": "*bf16", "ORDER": "*i64", "A": "*bf16", "INTER": "i32", "BLOCK": "constexpr"}
    assert ".entry _glu_kernel" in compile_for_h200(moe._glu_kernel, glu_sig, {"BLOCK": 512})


def test_counting_sort_by_expert_compiles():
    """`moe.group_by_expert`'s three kernels at the 35B shape's 257 keys (the shared expert folded in), at
    their launch settings (the placing kernel at 8 warps)."""
    keys = {"EP": 512}
    ids_sig = {"IDS": "*i64", "N": "i32", "E": "i32", "EP": "constexpr", "BLOCK": "constexpr"}
    count = compile_for_h200(moe._count_keys_kernel, {**ids_sig, "COUNTS": "*i32"}, {**keys, "BLOCK": moe.SORT_BLOCK})
    assert ".entry _count_keys_kernel" in count
    starts_sig = {
        "COUNTS": "*i32",
        "BASE": "*i32",
        "OFFS": "*i32",
        "B": "i32",
        "E": "i32",
        "EP": "constexpr",
        "STEP": "constexpr",
    }
    assert ".entry _key_starts_kernel" in compile_for_h200(moe._key_starts_kernel, starts_sig, {**keys, "STEP": 16})
    place_sig = {**ids_sig, "BASE": "*i32", "ORDER": "*i64", "ROWS": "*i64", "CHUNK": "constexpr"}
    place = compile_for_h200(
        moe._place_keys_kernel, place_sig, {**keys, "BLOCK": moe.SORT_BLOCK, "CHUNK": moe.SORT_CHUNK}, warps=8
    )
    assert ".entry _place_keys_kernel" in place


FP8_GEMM = {
    "XQ": "*fp8e4nv",
    "XS": "*fp32",
    "W": "*fp8e4nv",
    "WS": "*fp32",
    "Y": "*bf16",
    "ORDER": "*i64",
    "OFFS": "*i32",
    "M": "i32",
    "N": "i32",
    "K": "i32",
    "E": "i32",
    "TILES": "i32",
    "TOP_K": "i32",
    "BM": "constexpr",
    "EXPERTS": "constexpr",
    "GATHER": "constexpr",
    "SCATTER": "constexpr",
    "N_FIRST": "constexpr",
}


@pytest.mark.parametrize("mode", ["linear", "gate_up", "down"])
def test_fp8_prefill_kernels_compile_to_fp8_tensor_core_mma(mode):
    """FP8 prefill (`fp8_prefill.experts`, `fp8_prefill.linear`): the GEMM, a plain linear or experts reading x
    through the order or writing back through it, in Hopper's FP8 warpgroup MMA (wgmma ... e4m3); and
    the kernels writing x's FP8 rows, plain and from the experts' gate and up."""
    tile = fp8_prefill.TILE
    constexprs = {
        "BM": tile.bm,
        "EXPERTS": 0 if mode == "linear" else 256,
        "GATHER": mode == "gate_up",
        "SCATTER": mode == "down",
        "N_FIRST": tile.n_first,
    }
    ptx = compile_for_h200(fp8_prefill._fp8_gemm_kernel, FP8_GEMM, constexprs, ("N", "K"))
    assert "wgmma" in ptx and "e4m3" in ptx, [line for line in ptx.splitlines() if "mma" in line][:5]
    rows = {
        "X": "*bf16",
        "Q": "*fp8e4nv",
        "S": "*fp32",
        "K": "i32",
        "S_ROW": "i32",
        "S_GROUP": "i32",
        "GROUPS": "constexpr",
    }
    assert "cvt" in compile_for_h200(fp8_prefill._fp8_rows_kernel, rows, {"GROUPS": 16}, ("K",))
    glu = {
        "GU": "*bf16",
        "RW": "*bf16",
        "ORDER": "*i64",
        "Q": "*fp8e4nv",
        "S": "*fp32",
        "INTER": "i32",
        "GROUPS": "constexpr",
    }
    assert ".entry _glu_fp8_rows_kernel" in compile_for_h200(fp8_prefill._glu_fp8_rows_kernel, glu, {"GROUPS": 4}, ("INTER",))


@pytest.mark.parametrize("fmt", sorted(PARTS), ids=lambda f: quant.NAMES[f])
@pytest.mark.parametrize("experts", [0, 256], ids=["linear", "grouped"])
def test_tiled_gemm_finds_its_tiles_and_compiles(fmt, experts):
    """The dequantizing GEMM of 5-64 rows (`quant.linear`, `quant.grouped`): a plain linear's row tiles,
    or each program's expert and rows found from the experts' row ends (`quant.tile_rows`)."""
    signature = {
        "X": "*bf16",
        **{f"P{i}": t for i, t in enumerate(PARTS[fmt])},
        "Y": "*bf16",
        "ORDER": "*i64",
        "OFFS": "*i32",
        "M": "i32",
        "N": "i32",
        "K": "i32",
        "E": "i32",
        "TOP_K": "i32",
        "FMT": "constexpr",
        "BM": "constexpr",
        "BN": "constexpr",
        "BK": "constexpr",
        "IEEE": "constexpr",
        "EXPERTS": "constexpr",
    }
    constexprs = {"FMT": fmt, "BM": 32, "BN": 64, "BK": 64, "IEEE": False, "EXPERTS": experts}
    assert ".entry _gemm_kernel" in compile_for_h200(gemm._gemm_kernel, signature, constexprs, ("N", "K"))
