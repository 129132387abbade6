"""Expert offload on a CUDA device: the copy stream, events and pinned host experts for real.

    pytest -m gpu tests/engine/test_offload_gpu.py        (FT_MATERIALISE is set by the tests that need it)

Each test prints `METRIC name value`. Errors are relative Frobenius norms, as in test_gpu.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from engine import Engine
from engine.engine import chunk_tokens
from engine.loader import build_model, fingerprint, place
from engine.offload import GiB, Policy, budget_for, dense_bytes, plan
from engine.presets import materialise
from engine.runner import starting_capacity

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
FP32_TOL = 1e-4
CUDA = torch.device("cuda")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


def metric(name: str, value: float) -> None:
    print(f"METRIC {name} {value:.3e}")


def engines(preset: str, dtype: torch.dtype, slots: int, max_running: int = 1) -> tuple[Engine, Engine]:
    """The preset on the GPU, whole and with `slots` experts per layer resident (same weights)."""
    config, _, state_dict = materialise(preset, "cpu", dtype)
    fp = fingerprint(config, state_dict)
    plain = Engine(place(build_model(config, state_dict), CUDA), fp)
    plain.runner.warmup(max_running)  # its slot buffers now: what the process holds before the offloaded engine
    model = build_model(config, state_dict)
    p = plan(
        config, dense_bytes(model), 1 << 50, dtype, max_running, starting_capacity(CUDA), chunk_tokens(CUDA)
    )
    budget = (budget_for(config, p, slots) + p.expert_bytes // 2) / GiB  # the stream buffers `plan` adds below half
    offloaded = Engine.offloaded(model, fp, CUDA, budget, max_running)
    assert offloaded.offload is not None and offloaded.offload.plan.slots == slots
    return plain, offloaded


def run(engine: Engine, prompt: list[int], forced: list[int]) -> torch.Tensor:
    """Logits of a prefill (all positions) then of each forced decode step: [T + F, V], on the host
    (a reference kept on the device would count against the other engine's budget)."""
    state = engine.new_state()
    logits = engine.prefill(state, prompt, all_logits=True).logits.cpu()
    return torch.cat([logits, engine.feed(state, forced).cpu()])


def prompt(n: int) -> list[int]:
    return [1000 + (i * 7919) % 50_000 for i in range(n)]


@pytest.fixture(scope="module")
def small_fp32():
    return engines("small", torch.float32, slots=8)


def test_fp32_offload_matches_no_offload(small_fp32):
    """Long chunks (prefetch, double-buffered groups of 4 of 8 slots), short ones and decode."""
    plain, offloaded = small_fp32
    assert offloaded.offload.policy.stream_tokens <= 300
    want = run(plain, prompt(300), list(range(500, 516)))
    got = run(offloaded, prompt(300), list(range(500, 516)))
    metric("offload_fp32_rel", rel(got, want))
    assert rel(got, want) <= FP32_TOL
    short = run(offloaded, prompt(7), [3, 4, 5])  # below stream_tokens: routed experts only
    assert rel(short, run(plain, prompt(7), [3, 4, 5])) <= FP32_TOL
    # decode read the misses in place from pinned host memory, in CUDA graphs
    assert offloaded.offload.mapped and offloaded.runner.use_graph and offloaded.offload_stats()["mapped"] > 0


def test_fp32_misses_computed_on_the_host(small_fp32):
    plain, offloaded = small_fp32
    offload = offloaded.offload
    saved, offload.policy = offload.policy, Policy(offload.policy.stream_tokens, cpu_rows=2)
    try:
        before = offload.stats.on_host
        got = run(offloaded, prompt(9), list(range(600, 616)))
        assert offload.stats.on_host > before
    finally:
        offload.policy = saved
    metric("offload_host_rel", rel(got, run(plain, prompt(9), list(range(600, 616)))))
    assert rel(got, run(plain, prompt(9), list(range(600, 616)))) <= FP32_TOL


def test_bf16_offload_within_the_bf16_bound():
    """bf16 offload at most twice as far from fp32 as bf16 without offload is, plus 0.01 (the
    bound of test_gpu.py: random presets amplify rounding through routing flips)."""
    plain32, _ = engines("small", torch.float32, slots=8)
    plain16, off16 = engines("small", torch.bfloat16, slots=8)
    ids, forced = prompt(600), list(range(700, 716))
    ref = run(plain32, ids, forced)
    noise, err = rel(run(plain16, ids, forced), ref), rel(run(off16, ids, forced), ref)
    metric("bf16_plain_vs_fp32", noise)
    metric("bf16_offload_vs_fp32", err)
    assert err <= 2 * noise + 0.01


def test_every_expert_resident_decodes_in_graphs():
    """A budget with a slot for every expert: copied once, decode captured in CUDA graphs again."""
    plain, offloaded = engines("small", torch.float32, slots=32)
    assert offloaded.offload.holds_all and offloaded.runner.use_graph
    got, want = (
        run(offloaded, prompt(300), list(range(800, 816))),
        run(plain, prompt(300), list(range(800, 816))),
    )
    metric("offload_all_resident_rel", rel(got, want))
    assert rel(got, want) <= FP32_TOL and offloaded.runner.graphs


def test_fetching_experts_refuse_graph_capture(small_fp32):
    """A chunk beyond decode size fetches experts (host decisions): never under capture."""
    _, offloaded = small_fp32
    cache = next(iter(offloaded.offload.caches.values()))
    x = torch.randn(40, offloaded.config.hidden_size, device=CUDA)
    weights, ids = torch.ones(40, 2, device=CUDA) / 2, torch.arange(80, device=CUDA).view(40, 2) % 32
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CUDA graph"), torch.cuda.graph(graph):
        cache.run(x, weights, ids, offloaded.kernels.moe_experts)


def test_35b_shape_offload_within_the_bf16_bound():
    """qwen3.6-35b-a3b-e64, 16 of 64 experts per layer resident, in bf16 against the fp32 model
    (the same weights: the preset's bf16 values): at most twice as far as bf16 without offload,
    plus 0.01; the fp32 greedy token wherever its top-two margin exceeds twice the bf16 noise."""
    config, _, sd32 = materialise("qwen3.6-35b-a3b-e64", "cpu", torch.float32)
    fp = fingerprint(config, sd32)
    ids, forced = prompt(1024), list(range(900, 916))

    def last(engine: Engine) -> torch.Tensor:  # the last 48 prefill positions and the decode steps
        return run(engine, ids, forced)[-64:].cpu()

    ref = last(Engine(place(build_model(config, sd32), CUDA), fp))
    torch.cuda.empty_cache()
    sd16 = {name: t.to(torch.bfloat16) for name, t in sd32.items()}
    del sd32
    plain = last(Engine(place(build_model(config, sd16), CUDA), fp))
    torch.cuda.empty_cache()
    model = build_model(config, sd16)
    p = plan(
        config, dense_bytes(model), 1 << 50, torch.bfloat16, 1, starting_capacity(CUDA), chunk_tokens(CUDA)
    )
    offloaded = Engine.offloaded(model, fp, CUDA, (budget_for(config, p, 16) + p.expert_bytes // 2) / GiB, 1)
    got = last(offloaded)
    noise, err = rel(plain, ref), rel(got, ref)
    metric("e64_bf16_plain_vs_fp32", noise)
    metric("e64_bf16_offload_vs_fp32", err)
    metric(
        "e64_offload_hit_rate",
        offloaded.offload.stats.hits / max(1, offloaded.offload.stats.hits + offloaded.offload.stats.misses),
    )
    assert err <= 2 * noise + 0.01
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (plain - ref).abs().max()
    metric("e64_clear_positions", clear.float().mean().item())
    assert (got.argmax(-1) == ref.argmax(-1))[clear].all()


PEAK_SCRIPT = """
import json, sys, torch
from engine import Engine
budget = float(sys.argv[1])
torch.cuda.reset_peak_memory_stats()
engine = Engine.from_preset("qwen3.6-35b-a3b-e64", device="cuda", gpu_memory_gib=budget, max_running=1)
engine.warmup(max_batch=1)
slots = engine.offload.plan.slots
state = engine.new_state()
logits = engine.prefill(state, [1000 + i % 40000 for i in range(8192)]).logits  # 8K: a full chunk
state = engine.new_state()
engine.prefill(state, [2000 + i % 40000 for i in range(4090)])
engine.feed(state, list(range(10)))  # past 4096 tokens: the decode slots double their capacity
print(json.dumps({"peak": engine.offload.peak_reserved(), "slots": [slots, engine.offload.plan.slots],
                  "capacity": engine.runner.capacity}))
"""


@pytest.mark.parametrize("budget", [9.0, 10.0])
def test_peak_reserved_memory_within_the_budget_as_decode_slots_grow(budget):
    """A fresh process (peak reserved memory is per process): the e64 35B shape offloaded within
    `budget` GiB (bf16 experts: 9 GiB holds top_k of them per layer only with 4096-token chunks;
    8 GiB, with the decode graphs and staging rows, none: a `BudgetError`),
    an 8K prefill, then a sequence decoded past the slots' first capacity."""
    env = {**os.environ, "FT_MATERIALISE": "1", "FT_PREFILL_CHUNK": "4096" if budget < 10 else ""}
    proc = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(budget)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    metric("peak_reserved_gib", out["peak"] / GiB)
    print("METRIC slots_before_after", out["slots"], "capacity", out["capacity"])
    assert out["capacity"] == 8192 and out["slots"][1] <= out["slots"][0]  # shrunk where the growth needed it
    assert out["peak"] <= budget * GiB
