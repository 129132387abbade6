"""A model whose weights stay quantized (`keep_quantized`: GGUF Q8_0 / Q4_K / Q5_K / Q6_K matrices,
FP8 e4m3 weights as `QuantWeight`s run by the Triton kernels) against the same file dequantized to
fp32 at load: the same logits (<= 1e-4) in prefill and decode, exact restores, the file's size in
memory, and the fusion of quantized projections. Without a GPU the kernels run in Triton's
interpreter, which Triton picks at import: these tests run in a fresh TRITON_INTERPRET=1 process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn

pytest.importorskip("triton")
pytest.importorskip("gguf")

CUDA = torch.cuda.is_available()
RUNNABLE = os.environ.get("TRITON_INTERPRET") == "1"
in_this_process = pytest.mark.skipif(not RUNNABLE, reason="run in a fresh TRITON_INTERPRET=1 process")


GROUPS = {  # each run in its own interpreter process (the K-quants' ~100 s, with the restore; the random Q4_K_M ~60 s)
    "kquants": "kmix or fusion or moved",
    "presets": "q8_0 or fp8",
    "random": "random",
}


@pytest.mark.skipif(RUNNABLE or CUDA, reason="this process runs the kernels itself")
@pytest.mark.parametrize("group", [pytest.param(g, marks=pytest.mark.slow) for g in [*GROUPS, "slow"]])  # minutes each
def test_quantized_model_in_triton_interpreter_process(group):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    select = ["-k", GROUPS[group], "-m", "not slow"] if group in GROUPS else ["-m", "slow"]
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--timeout",
        "900",
        *select,
        __file__,
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0 and " passed" in done.stdout and " failed" not in done.stdout, done.stdout[
        -4000:
    ]


from checkpoint_store.snapshot import concat_chain  # noqa: E402
from engine import Engine  # noqa: E402
from engine.gguf_file import read_gguf  # noqa: E402
from engine.model import Concat, fuse, matmul  # noqa: E402
from engine.ops.gpu import quant  # noqa: E402
from engine.presets import PRESETS, _config, materialise, write_preset  # noqa: E402
from engine.quant import fp8  # noqa: E402
from peer.gguf_export import export_gguf  # noqa: E402
from tests.engine.kquants import T, quantize, write_kquant_gguf  # noqa: E402

# The tiny preset's shape with rows of 256 (K-quant super-blocks) and a small vocabulary (no tokenizer)
KMIX = _config(
    "kmix",
    num_hidden_layers=4,
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=256,
    vocab_size=2048,
    max_position_embeddings=65536,
)
IDS = [1000 + 7 * i for i in range(20)]  # 40 expert rows: the grouped kernels (decode: the expert GEMV)


class Models(dict):
    """The test models, each written on first use: tiny's Q8_0 GGUF and FP8 folder (both
    architectures), and the K-quant mix of the `KMIX` shape."""

    def __init__(self, root: Path, preset_dirs: dict[str, str]):
        super().__init__()
        self.root, self.preset_dirs = root, preset_dirs

    def __missing__(self, name: str) -> Path:
        root, presets = self.root, self.preset_dirs
        preset = "tiny-next" if name.startswith("next") else "tiny"
        if name == "kmix":
            no_vocab = mock.patch("peer.gguf_export.add_vocab"), mock.patch("peer.gguf_export.qwen_vocab")
            with mock.patch.dict(PRESETS, {"kmix": KMIX}), no_vocab[0], no_vocab[1]:
                config, raw, state_dict = materialise("kmix")
                path = write_kquant_gguf(config, raw, state_dict, root / "kmix.gguf")
        elif name in ("fp8", "next-fp8"):
            path = write_preset(preset, root / f"{preset}-fp8", fmt="fp8")
        elif name == "random-q4_k_m":  # llama-quantize's types at the `small` shape (peer.gguf_random)
            from peer.gguf_random import write_random_gguf  # noqa: PLC0415

            path = write_random_gguf("small", root / "small-random-q4_k_m.gguf")
        elif name == "llama-q4_k_m":  # llama.cpp's: rows of 64 fall back to Q5_0 / Q5_1 / Q8_0
            from peer.gguf_export import preset_gguf  # noqa: PLC0415
            from peer.llama_server import PEER_HOME  # noqa: PLC0415

            path = preset_gguf("tiny", PEER_HOME / "models", "q4_k_m")
        else:
            path = export_gguf(presets[preset], root / f"{preset}-q8_0.gguf", "q8_0")
        self[name] = path
        return path


@pytest.fixture(scope="module")
def models(tmp_path_factory, preset_dirs) -> Models:
    if not RUNNABLE:
        pytest.skip("run in a fresh TRITON_INTERPRET=1 process")
    return Models(tmp_path_factory.mktemp("quantized"), preset_dirs)


def pair(path: Path) -> tuple[Engine, Engine]:
    return Engine.load(path, keep_quantized=True), Engine.load(
        path, dtype=torch.float32, keep_quantized=False
    )


def quantized_weights(engine: Engine) -> dict[int, int]:
    """Count of `QuantWeight`s per format among the model's HF-named weights (not the fused ones)."""
    counts: dict[int, int] = {}
    for name, module in engine.model.named_modules():
        if isinstance(module, quant.QuantWeight) and name.rsplit(".", 1)[-1] in (
            "weight",
            "gate_up_proj",
            "down_proj",
        ):
            counts[module.fmt] = counts.get(module.fmt, 0) + 1
    return counts


@in_this_process
@pytest.mark.parametrize(
    "name",
    [
        "q8_0",
        "next-q8_0",
        "fp8",
        "next-fp8",
        "kmix",
        "random-q4_k_m",
        pytest.param(
            "llama-q4_k_m", marks=[pytest.mark.slow, pytest.mark.skipif("not llama_quantize_built()")]
        ),
    ],
)
def test_quantized_logits_equal_the_dequantized_models(models, name):
    """Prefill (GEMM, grouped experts) and decode (GEMV, the runner's slot path) on the kept weights
    give the logits of the fp32 model dequantized at load. llama.cpp's Q4_K_M of tiny keeps only its
    Q8_0 tensors packed (Q5_0 / Q5_1 are dequantized): fusions of packed and plain parts. The random
    Q4_K_M of `small` has a Q4_K_M file's layout: fused projections of two formats (one GEMV launch
    each in decode) and the DeltaNet out_proj's reordered value heads (read through its column map)."""
    q, d = pair(models[name])
    formats = quantized_weights(q)
    expected = (
        {quant.FP8}
        if name.endswith("fp8")
        else {
            "kmix": {quant.Q4_K, quant.Q5_K, quant.Q6_K, quant.Q8_0},
            "random-q4_k_m": {quant.Q4_K, quant.Q6_K},
        }.get(name, {quant.Q8_0})
    )
    assert set(formats) == expected, formats
    # the shared expert folded into the packed stacks (`SparseMoe.fold_shared`), but in tiny's FP8
    # (its 32-row gate and up are off a 128-row scale block: they cannot be one weight)
    assert all(layer.mlp.folded == (not name.endswith("fp8")) for layer in q.model.model.layers)
    if name == "random-q4_k_m":
        pairs = [
            m
            for m in q.model.modules()
            if isinstance(m, Concat)
            and m.count == 2
            and not any(isinstance(w, torch.Tensor) for w in m.weights())
        ]
        mapped = [m for m in q.model.modules() if isinstance(m, quant.QuantWeight) and m.chunked_columns]
        assert pairs and mapped
    ids = IDS[:3] if name == "random-q4_k_m" else IDS  # its GEMMs at `small`'s shape: minutes interpreted
    sq, sd = q.new_state(), d.new_state()
    lq, ld = q.prefill(sq, ids).logits, d.prefill(sd, ids).logits
    assert (lq - ld).abs().max().item() <= 1e-4
    for token in (11, 12):
        assert (q.decode(sq, token) - d.decode(sd, token)).abs().max().item() <= 1e-4


@in_this_process
@pytest.mark.parametrize("name", ["kmix", "next-q8_0", "next-fp8"])
def test_restore_is_exact_on_the_quantized_model(models, name):
    """A restore at a capture, the rest prefilled, then two decode steps (the GEMV path): the logits of
    the whole prefill and the same steps."""
    engine = Engine.load(models[name], keep_quantized=True)
    ids = [int(x) for x in torch.randint(0, 2048, (10,), generator=torch.Generator().manual_seed(5))]
    state = engine.new_state()
    full = [engine.prefill(state, ids).logits, *(engine.decode(state, t) for t in (11, 12))]
    at = int(torch.randint(1, len(ids) - 1, (1,), generator=torch.Generator().manual_seed(6)))
    snapshots = engine.prefill(engine.new_state(), ids, capture_at=[at]).snapshots
    state = engine.restore(concat_chain(snapshots))
    rest = [engine.prefill(state, ids[at:]).logits, *(engine.decode(state, t) for t in (11, 12))]
    assert max((r - f).abs().max().item() for r, f in zip(rest, full, strict=True)) <= 1e-4


@in_this_process
def test_a_quantized_model_moved_storage_by_storage_keeps_its_logits_and_size(models):
    """`place`'s move (engine.loader.copy_storages, here CPU to CPU) on packed weights: the fused
    quantized projections' parts stay views of one copy (the same resident bytes) and the logits
    are the same."""
    from engine.loader import copy_storages  # noqa: PLC0415

    engine = Engine.load(models["kmix"], keep_quantized=True)
    ids = list(range(100, 112))
    before, weights = engine.prefill(engine.new_state(), ids).logits, engine.memory()["weights"]
    copy_storages(engine.model, torch.device("cpu"))
    assert engine.memory()["weights"] == weights
    assert torch.equal(engine.prefill(engine.new_state(), ids).logits, before)


def tensor_bytes(path: Path) -> int:
    return sum(t.n_bytes for t in read_gguf(path).tensors.values())


@in_this_process
@pytest.mark.parametrize("name", ["q8_0", "kmix"])
def test_resident_weights_are_the_files_size(models, name):
    """The weights' resident bytes (fp32 norms and routers as in the file) are within 5% of the
    file's tensor data (Q4_K/Q5_K keep their 6-bit scales as bytes: +3% for those), a third or
    less of the dequantized model's."""
    q, d = pair(models[name])
    weights, file = q.memory()["weights"], tensor_bytes(models[name])
    assert abs(weights - file) <= 0.05 * file, (weights, file)
    assert weights < d.memory()["weights"] / 3


# --- fusion -------------------------------------------------------------------------------------


def holder(w) -> nn.Module:
    m = nn.Module()
    if isinstance(w, torch.Tensor):
        m.weight = nn.Parameter(w, requires_grad=False)
    else:
        m.weight = w
    return m


def ggml(qtype, rows: int, seed: int) -> quant.QuantWeight:
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(seed)).numpy()
    if qtype == T.Q8_0:
        from gguf import quants  # noqa: PLC0415

        return quant.pack_ggml(torch.from_numpy(quants.quantize(x, qtype)), qtype, (rows, 256))
    return quant.pack_ggml(torch.from_numpy(quantize(x, qtype)), qtype, (rows, 256))


def fp8_weight(rows: int, seed: int) -> quant.QuantWeight:
    return quant.pack_fp8(
        *fp8.quantize(torch.randn(rows, 256, generator=torch.Generator().manual_seed(seed)))
    )


def dense(w) -> torch.Tensor:
    return w if isinstance(w, torch.Tensor) else w.dequantize()


def fused_kinds(fused) -> list:
    ws = fused.weights() if isinstance(fused, Concat) else [fused]
    return [
        ("dense", w.shape[0]) if isinstance(w, torch.Tensor) else (quant.NAMES[w.fmt], w.shape[0]) for w in ws
    ]


CASES = {
    "one format": ([lambda: ggml(T.Q4_K, 64, 0), lambda: ggml(T.Q4_K, 32, 1)], [("Q4_K", 96)]),
    "mixed formats stay apart": (
        [lambda: ggml(T.Q4_K, 64, 0), lambda: ggml(T.Q6_K, 32, 1), lambda: ggml(T.Q6_K, 16, 2)],
        [("Q4_K", 64), ("Q6_K", 48)],
    ),
    "fp8 rows off a scale block": (
        [lambda: fp8_weight(64, 0), lambda: fp8_weight(128, 1)],
        [("FP8", 64), ("FP8", 128)],
    ),
    "fp8 on scale blocks": ([lambda: fp8_weight(128, 0), lambda: fp8_weight(64, 1)], [("FP8", 192)]),
    "plain beside quantized": (
        [
            lambda: torch.randn(8, 256),
            lambda: ggml(T.Q8_0, 32, 1),
            lambda: ggml(T.Q8_0, 32, 2),
            lambda: torch.randn(1, 256),
        ],
        [("dense", 8), ("Q8_0", 64), ("dense", 1)],
    ),
}


@in_this_process
@pytest.mark.parametrize("case", list(CASES))
def test_fusion_joins_what_lines_up_and_keeps_the_rest_apart(case):
    makers, kinds = CASES[case]
    parts = [holder(make()) for make in makers]
    want = torch.cat([dense(p.weight) for p in parts])
    owner = nn.Module()
    fuse(owner, "in_proj", parts)
    assert fused_kinds(owner.in_proj) == kinds
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(9))
    assert torch.allclose(matmul(x, owner.in_proj), x @ want.T, atol=1e-4, rtol=1e-5)
    assert torch.equal(
        torch.cat([dense(p.weight) for p in parts]), want
    )  # each part: a view of the fused rows
    storages = {t.untyped_storage().data_ptr() for t in owner.buffers()}
    assert all(t.untyped_storage().data_ptr() in storages for p in parts for t in p.buffers())


@in_this_process
def test_plain_parts_after_quantized_ones_fuse_into_one_padded_gemm():
    """A quantized MoE projection: the shared expert's gate and up quantized, then the router and
    the output gate plain (as a quantized file keeps them): one quantized GEMV and one plain GEMM
    padded to aligned rows (zeros, dropped by the caller), not three matmuls."""
    parts = [
        holder(ggml(T.Q8_0, 32, 1)),
        holder(ggml(T.Q8_0, 32, 2)),
        holder(torch.randn(8, 256)),
        holder(torch.randn(1, 256)),
    ]
    want = torch.cat([dense(p.weight) for p in parts])
    owner = nn.Module()
    fuse(owner, "in_proj", parts, align=8)
    assert fused_kinds(owner.in_proj) == [("Q8_0", 64), ("dense", 16)]
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(9))
    out = matmul(x, owner.in_proj)
    assert out.shape == (3, 80) and not out[:, 73:].any()
    assert torch.allclose(out[:, :73], x @ want.T, atol=1e-4, rtol=1e-5)


def llama_quantize_built() -> bool:
    from peer.llama_server import quantize_binary  # noqa: PLC0415

    return quantize_binary().is_file()


@pytest.mark.skipif(not llama_quantize_built(), reason="llama-quantize not built (.peer/)")
def test_llama_cpp_q4_k_m_preset_stays_at_the_files_size():
    """llama.cpp's own Q4_K_M of the `small` preset (`ft model init --format gguf-q4_k_m`): every
    tensor is a K-quant or f32, so the kept weights are the file's tensor bytes within 5% (measured:
    1.014x on the CPU, 0.338x of the model dequantized to bf16). Loading only: no kernel runs."""
    from peer.gguf_export import preset_gguf  # noqa: PLC0415
    from peer.llama_server import PEER_HOME  # noqa: PLC0415

    path = preset_gguf("small", PEER_HOME / "models", "q4_k_m")
    weights, file = Engine.load(path, keep_quantized=True).memory()["weights"], tensor_bytes(path)
    assert abs(weights - file) <= 0.05 * file, (weights, file)


@in_this_process
def test_offloaded_q8_0_experts_stay_quantized_and_give_the_same_logits(models):
    """`--gpu-memory` on a quantized model: the routed experts live on the host and in the expert
    slots in their packed form (3 slots of tiny's 8 per layer: misses fetched every layer), and
    prefill and decode give the logits of the same model without offload."""
    from engine import offload  # noqa: PLC0415
    from engine.runner import starting_capacity  # noqa: PLC0415

    whole = Engine.load(models["q8_0"], keep_quantized=True)
    size = offload.expert_bytes(whole.model)
    p = offload.plan(
        whole.config,
        offload.dense_bytes(whole.model),
        1 << 50,
        whole.dtype,
        4,
        starting_capacity(whole.device),
        4096,
        size,
    )
    budget = offload.budget_for(whole.config, p, 3) + size // 2
    offloaded = Engine.load(models["q8_0"], keep_quantized=True, gpu_memory_gib=budget / offload.GiB)
    assert offloaded.offload is not None and offloaded.offload.plan.slots == 3
    cache = next(iter(offloaded.offload.caches.values()))
    assert all(p.dtype in (torch.int8, torch.float16) for p in cache.parts)  # Q8_0's quants and scales
    assert size < offload.expert_bytes(Engine.load(models["q8_0"], dtype=torch.float32).model) / 3
    sa, sb = whole.new_state(), offloaded.new_state()
    assert (whole.prefill(sa, IDS).logits - offloaded.prefill(sb, IDS).logits).abs().max().item() <= 1e-5
    for token in (11, 12):
        assert (whole.decode(sa, token) - offloaded.decode(sb, token)).abs().max().item() <= 1e-5
    assert offloaded.offload.stats.misses > 3 * len(offloaded.offload.caches)
    # the link timed on a packed expert (on CUDA at load): its host path dequantizes
    assert offloaded.offload.calibrate().costs is not None
