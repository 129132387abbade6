"""Expert offload on a CUDA device: the copy stream, events and pinned host experts for real.

    pytest -m gpu tests/engine/test_offload_gpu.py        (FT_MATERIALISE is set by the tests that need it)

Each test prints `METRIC name value`. Errors are relative Frobenius norms, as in test_gpu.py.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from engine import Engine
from engine.engine_config import EngineConfig
from engine.loader import build_model, fingerprint, place
from engine.offload import ExpertCachePolicy, GiB, budget_for, dense_bytes, hit_ratio, plan
from engine.presets import materialise
from engine.runner import starting_capacity
from tests.engine.test_gpu import _within_bf16_noise

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
FP32_TOL = 1e-4
T = TypeVar("T")
CUDA = torch.device("cuda")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


def metric(name: str, value: float) -> None:
    print(f"METRIC {name} {value:.3e}")


def held(engine: Engine, when: str) -> None:
    """What the offloaded engine holds and its plan keeps free, as METRIC lines (a failing budget
    test shows where the memory went)."""
    p = engine.offload.plan
    print(
        f"METRIC {when} held_gib {engine.offload.held() / GiB:.4f} budget_gib {p.budget / GiB:.4f} "
        f"slots {p.slots} workspace_mib {p.workspace / 2**20:.1f} small_mib {p.small / 2**20:.1f}"
    )


def release() -> None:
    """Engines gone (their offload's finalizer lifts the allocator cap, `ExpertOffload.cap`), their
    cached blocks back to the device, and the cap lifted here too: a failed test's traceback keeps its
    offloaded engine alive, and its cap would fail every later test's reference engine."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)


def on_plain(preset: str, dtype: torch.dtype, work: Callable[[Engine], T]) -> T:
    """`work` on the preset whole on the GPU, the engine freed after: built beside an offloaded engine, what
    it allocates later would count against the other's budget (the budget is what the process holds beyond
    what it held before)."""
    release()
    config, _, state_dict = materialise(preset, "cpu", dtype)
    out = work(Engine(place(build_model(config, state_dict), CUDA), fingerprint(config, state_dict)))
    release()
    return out


def plain_runs(preset: str, dtype: torch.dtype, runs) -> list[torch.Tensor]:
    """`run` of each (prompt, forced) in `runs` on the preset whole on the GPU."""
    return on_plain(preset, dtype, lambda engine: [run(engine, *r) for r in runs])


def one_pass(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Every position's logits of one prefill of `ids`, on the host: the bf16 bound's measure."""
    return engine.prefill(engine.new_state(), ids, all_logits=True).logits.cpu()


# Slots of room a test budget leaves beyond the plan's: the decode graphs' pools (captured at the first decode
# step, ~5 of the small preset's fp32 slots on the H200), which `plan` has no figure for
SPARE = 6


def offloaded(preset: str, dtype: torch.dtype, slots: int, spare: int = SPARE, running: int = 1) -> Engine:
    """The preset on the GPU with about `slots` experts per layer resident (a budget for `spare` more; what
    warm-up leaves is asserted by the caller), decode slots for `running` sequences."""
    config, _, state_dict = materialise(preset, "cpu", dtype)
    model = build_model(config, state_dict)
    p = plan(config, dense_bytes(model), 1 << 50, dtype, running, starting_capacity(CUDA), EngineConfig("cuda").chunk_tokens)
    # budget_for: with the stream buffers `plan` reserves below half the experts
    budget = (budget_for(config, p, slots) + spare * p.expert_bytes * p.layers + p.expert_bytes // 2) / GiB
    engine = Engine.offloaded(
        model, fingerprint(config, state_dict), EngineConfig("cuda", gpu_memory_gib=budget, max_running=running)
    )
    # of `ft serve`'s warm-up, what fits these small budgets (its full 8K-token chunk does not): what a short
    # chunk allocates (`OffloadPlan.small`, each forward's workspace from it); the policy stays the link's estimate,
    # so that each test's chunk lengths choose its path (measured, chunks of ~9 tokens streamed on the H200)
    policy = engine.offload.policy
    engine.offload.calibrate_stream(lambda n: engine.prefill(engine.new_state(), prompt(n)))
    engine.offload.policy = policy
    assert engine.offload is not None and config.num_experts_per_tok <= engine.offload.plan.slots
    return engine


def run(engine: Engine, prompt: list[int], forced: list[int]) -> torch.Tensor:
    """Logits of a prefill's last position then of each forced decode step (each reads every position's KV
    and state): [1 + F, V], on the host (a reference kept on the device would count against the other
    engine's budget; every position's logits, [T, V] in fp32, would take most of a small budget)."""
    state = engine.new_state()
    logits = engine.prefill(state, prompt).logits.view(1, -1).cpu()
    return torch.cat([logits, engine.feed(state, forced).cpu()])


def prompt(n: int) -> list[int]:
    return [1000 + (i * 7919) % 50_000 for i in range(n)]


SMALL_RUNS = {  # a long chunk (streamed), a short one (routed experts only), and the host's misses
    "long": (prompt(300), list(range(500, 516))),
    "short": (prompt(7), [3, 4, 5]),
    "host": (prompt(9), list(range(600, 616))),
}


@pytest.fixture(scope="class")
def small_fp32():
    """`small` in fp32 with about 8 of its 32 experts per layer resident, and the same weights' `run`s of
    SMALL_RUNS whole (computed first). The engine and its allocator cap go with the class that uses it."""
    want = dict(zip(SMALL_RUNS, plain_runs("small", torch.float32, SMALL_RUNS.values()), strict=True))
    engine = offloaded("small", torch.float32, slots=8)
    held(engine, "after_warmup")
    yield engine, want
    del engine
    release()
    torch.cuda.set_per_process_memory_fraction(1.0)  # whatever still holds the engine


class TestSmallFp32:
    """The tests of the `small_fp32` engine, one after another."""

    def test_fp32_offload_matches_no_offload(self, small_fp32):
        """Long chunks (streamed whole: fewer than half the experts have slots), short ones and decode."""
        engine, want = small_fp32
        assert engine.offload.plan.slots < engine.config.num_experts // 2
        assert engine.offload.stream is not None and engine.offload.policy.stream_tokens <= 300
        got = run(engine, *SMALL_RUNS["long"])
        metric("offload_fp32_rel", rel(got, want["long"]))
        assert rel(got, want["long"]) <= FP32_TOL
        # below stream_tokens: routed experts only
        assert rel(run(engine, *SMALL_RUNS["short"]), want["short"]) <= FP32_TOL
        # decode read the misses in place from pinned host memory, in CUDA graphs
        assert engine.offload.mapped and engine.runner.use_graph and engine.offload_stats()["mapped"] > 0

    def test_fp32_misses_computed_on_the_host(self, small_fp32):
        engine, want = small_fp32
        offload = engine.offload
        saved, offload.policy = offload.policy, ExpertCachePolicy(offload.policy.stream_tokens, cpu_rows=2)
        held(engine, "after_first_test")
        try:
            before = offload.stats.on_host
            got = run(engine, *SMALL_RUNS["host"])
            assert offload.stats.on_host > before
        finally:
            offload.policy = saved
        metric("offload_host_rel", rel(got, want["host"]))
        assert rel(got, want["host"]) <= FP32_TOL

    def test_fetching_experts_refuse_graph_capture(self, small_fp32):
        """A chunk beyond decode size fetches experts (host decisions): never under capture."""
        engine, _ = small_fp32
        cache = next(iter(engine.offload.caches.values()))
        x = torch.randn(40, engine.config.hidden_size, device=CUDA)
        weights, ids = torch.ones(40, 2, device=CUDA) / 2, torch.arange(80, device=CUDA).view(40, 2) % 32
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match="CUDA graph"), torch.cuda.graph(graph):
            cache.run(x, weights, ids, engine.kernels.moe_experts)


def test_bf16_offload_within_the_bf16_bound():
    """bf16 offload, its prefill's last position and 16 decode steps, each no further from fp32 than the
    worst position of one bf16 pass without offload over the same tokens, plus 0.01 (the bound of
    test_gpu.py: random presets amplify rounding through routing flips)."""
    ids, forced = prompt(600), list(range(700, 716))
    exact, plain = (on_plain("small", dtype, lambda e: one_pass(e, ids + forced)) for dtype in (torch.float32, torch.bfloat16))
    got = run(offloaded("small", torch.bfloat16, slots=8), ids, forced)
    _within_bf16_noise(got, exact[len(ids) - 1 :], plain, exact, "bf16_offload")


def test_every_expert_resident_decodes_in_graphs():
    """A budget with a slot for every expert: copied once, decode captured in CUDA graphs again."""
    runs = [(prompt(300), list(range(800, 816)))]
    (want,) = plain_runs("small", torch.float32, runs)
    engine = offloaded("small", torch.float32, slots=32, spare=2 * SPARE)  # room beyond all: none given up
    assert engine.offload.holds_all and engine.runner.use_graph
    got = run(engine, *runs[0])
    metric("offload_all_resident_rel", rel(got, want))
    assert rel(got, want) <= FP32_TOL and engine.runner.graphs


def test_decode_batches_wider_than_a_graph_holds_run_eagerly():
    """`--max-running 16` on the small preset (top-4 of 32 experts, 8 resident): the decode graphs hold
    up to 8 rows (32 assignments read in place), so warm-up captures those and a step of 12 sequences
    runs eagerly (its experts fetched), each sequence's logits its own as without offload (fp32)."""
    from engine import Feed

    prompts = [prompt(20 + 9 * i)[i:] for i in range(12)]
    forced = [[700 + 13 * i + j for j in range(3)] for i in range(12)]
    # first, as the other tests: an engine built beside the offloaded one would count against its budget
    want = plain_runs("small", torch.float32, list(zip(prompts, forced, strict=True)))
    # what a short chunk allocates measured first (`offloaded`), while the budget still has a full chunk's
    # room: uncalibrated, each prefill would keep that room free beside the graphs' pools (0.2 GiB over)
    engine = offloaded("small", torch.float32, slots=8, running=16)
    assert not engine.offload.holds_all and engine.runner.graph_rows == 8, engine.runner.graph_rows
    engine.runner.warmup(16, prefill=False)  # warm-up's graphs (its 8K-token chunk does not fit this budget)
    assert {rows for kind, rows in engine.runner.graphs if kind == "decode"} == {1, 2, 4, 8}, engine.runner.graphs
    states = [engine.new_state() for _ in prompts]
    for state, ids in zip(states, prompts, strict=True):
        engine.prefill(state, ids)
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in range(3):  # 12 rows (eager), then 3 of them (the 4-row graph), as the scheduler steps them
        feeds = {i: Feed(states[i], [forced[i][step]]) for i in (range(12) if step < 2 else range(3))}
        engine.step([(feed, 1) for feed in feeds.values()])
        for i, feed in feeds.items():
            got[i].append(feed.result.logits.view(-1).cpu())
    errors = [rel(torch.stack(g), w[1 : 1 + len(g)]) for g, w in zip(got, want, strict=True)]
    metric("offload_wide_batch_rel", max(errors))
    assert max(errors) <= FP32_TOL, errors


def test_35b_shape_offload_within_the_bf16_bound():
    """qwen3.6-35b-a3b-e64, 16 of 64 experts per layer resident, in bf16 against the fp32 model (the
    same weights: the preset's bf16 values): its prefill's last position and 16 decode steps each no
    further from fp32 than the worst position of one bf16 pass without offload, plus 0.01; the fp32
    greedy token wherever its top-two margin exceeds twice that pass's largest deviation."""
    config, _, sd32 = materialise("qwen3.6-35b-a3b-e64", "cpu", torch.float32)
    fp = fingerprint(config, sd32)
    ids, forced = prompt(1024), list(range(900, 916))
    release()  # an earlier test's offloaded engine, with its cap, may still await collection
    exact = one_pass(Engine(place(build_model(config, sd32), CUDA), fp), ids + forced)
    release()
    sd16 = {name: t.to(torch.bfloat16) for name, t in sd32.items()}
    del sd32
    plain = one_pass(Engine(place(build_model(config, sd16), CUDA), fp), ids + forced)
    release()
    model = build_model(config, sd16)
    p = plan(
        config, dense_bytes(model), 1 << 50, torch.bfloat16, 1, starting_capacity(CUDA), EngineConfig("cuda").chunk_tokens
    )
    budget = (budget_for(config, p, 16) + p.expert_bytes // 2) / GiB
    offloaded = Engine.offloaded(model, fp, EngineConfig("cuda", gpu_memory_gib=budget, max_running=1))
    got = run(offloaded, ids, forced)
    metric("e64_offload_hit_rate", hit_ratio(offloaded.offload_stats()) or 0.0)
    _within_bf16_noise(got, exact[len(ids) - 1 :], plain, exact, "e64_bf16_offload")


PEAK_SCRIPT = """
import json, sys, torch
from engine import Engine, Feed
from engine.warmup import warm_up
budget, running, chunk = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) or None
torch.cuda.reset_peak_memory_stats()
engine = Engine.from_preset(
    "qwen3.6-35b-a3b-e64", device="cuda", gpu_memory_gib=budget, max_running=running, prefill_chunk=chunk
)
warm_up(engine)  # `ft serve`'s: decode graphs up to what reads experts in place (4 rows)
slots = engine.offload.plan.slots
states = [engine.new_state() for _ in range(running)]
for i, s in enumerate(states):
    engine.prefill(s, [3000 + 17 * i + j for j in range(50 + i)])
for step in range(3):  # every sequence in one decode step (as the scheduler steps them): 8 rows run eagerly
    engine.step([(Feed(s, [5 + step]), 1) for s in states])
del states
state = engine.new_state()
logits = engine.prefill(state, [1000 + i % 40000 for i in range(8192)]).logits  # 8K: a full chunk
state = engine.new_state()
engine.prefill(state, [2000 + i % 40000 for i in range(4090)])
engine.feed(state, list(range(10)))  # past 4096 tokens: the decode slots double their capacity
print(json.dumps({"peak": engine.offload.peak_reserved(), "slots": [slots, engine.offload.plan.slots],
                  "capacity": engine.runner.capacity}))
"""


@pytest.mark.parametrize(("budget", "running"), [(9.0, 1), (10.0, 1), (12.0, 8)])
def test_peak_reserved_memory_within_the_budget_as_decode_slots_grow(budget, running):
    """A fresh process (peak reserved memory is per process): the e64 35B shape offloaded within
    `budget` GiB (bf16 experts: 9 GiB holds top_k of them per layer only with 4096-token chunks;
    8 GiB, with the decode graphs and staging rows, none: a `BudgetError`), warmed up and decoding
    `running` sequences in one step (8: wider than a graph holds), an 8K prefill, then a sequence
    decoded past the slots' first capacity."""
    env = {**os.environ, "FT_MATERIALISE": "1"}
    chunk = 4096 if budget < 10 else 0  # 0: the device's default
    proc = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(budget), str(running), str(chunk)],
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
