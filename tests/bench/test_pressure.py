"""bench/pressure.py on the CPU with the tiny preset at small N, through the real server: a test of
its bookkeeping. Ratios lie in [0, 1], the offline optimum bounds each eviction order at each RAM
budget, at the whole working set every order reaches the optimum, and each request's restored
tokens plus its prefill reasons add up to its prompt."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint_store.store import Access

ROOT = Path(__file__).resolve().parents[2]
TRACES = ["small-bugfix.codex.jsonl", "small-bugfix.claude.jsonl", "many-turns.codex.jsonl",
          "feature-medium.codex.jsonl"]
EPS = 1e-9
# RAM tier shares of the working set: at a tenth, restores must read from disk whatever the interleaving
# (at a quarter, four sessions at times found everything they restored still in RAM)
SHARES = (0.1, 0.5, 1.0)


def belady_hits(log: list[Access], budget: int) -> tuple[float, int]:
    """bench/belady.py's (bench scripts import each other as top-level modules, not as a package)."""
    spec = importlib.util.spec_from_file_location("belady", ROOT / "bench" / "belady.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.belady_hits(log, budget)


def put(name: bytes, nbytes: int) -> Access:
    return Access("put", name, "kv", nbytes)


def get(name: bytes) -> Access:
    return Access("get", name, "kv", 0, "disk")


def test_belady_keeps_what_is_used_soonest():
    # two parts fit; the third put is used last, so it is the one not kept (LRU would drop A and miss it)
    log = [put(b"A", 10), put(b"B", 10), put(b"C", 10), get(b"A"), get(b"B"), get(b"A"), get(b"C")]
    assert belady_hits(log, 20) == (30.0, 40)
    assert belady_hits(log, 30) == (40.0, 40)
    assert belady_hits(log, 0) == (0.0, 40)


def test_belady_drops_what_comes_in_again_before_it_is_read():
    # B is promoted again before any read of it: holding it meanwhile is worth nothing, A is read
    log = [put(b"A", 10), put(b"B", 10), Access("promote", b"B", "kv", 10, "disk"), get(b"A")]
    assert belady_hits(log, 10) == (10.0, 10)


def test_belady_keeps_part_of_a_part_at_the_boundary():
    log = [put(b"A", 10), put(b"B", 10), get(b"A"), get(b"B")]
    assert belady_hits(log, 15) == (15.0, 20)  # all of A, half of B: the fractional bound


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("pressure") / "pressure.json"
    run = subprocess.run(
        [sys.executable, "bench/pressure.py", *(f"traces/sessions/{t}" for t in TRACES), "--sessions", "4",
         "--turns", "4", "--time-scale", "0.01", "--threads", "1", "--ram", *map(str, SHARES), "--json", str(out)],
        cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Sessions under memory pressure" in run.stdout
    [one] = json.loads(out.read_text())["results"]
    return one


def test_sessions_with_a_subagent_and_fewer_live_sequences(result):
    assert result["sessions"] == 4 and result["subagents"] == 1 and result["live"] == 1
    first = result["first_pass"]
    assert first["errors"] == [] and first["requests"] == 16 and result["working_set_bytes"] > 0
    subagent = [r for r in first["rows"] if "." in r["session"] and r["index"] == 0]
    assert subagent and subagent[0]["restored"] > 0  # its parent's system prompt and tools
    assert first["pins_broken"] > 0  # one live sequence for four sessions: each answer's takes another's pin


def test_ratios_are_ratios_and_the_optimum_bounds_each_order(result):
    runs = result["runs"]
    assert sorted((r["ram_share"], r["policy"]) for r in runs) == [
        (share, policy) for share in SHARES for policy in ("anchor", "lru")
    ]
    for run in [result["first_pass"], *runs]:
        assert run["errors"] == []
        for name in ("hit_ratio", "ram_hit_ratio", "optimum_ram_hit_ratio"):
            assert 0.0 <= run[name] <= 1.0, (name, run[name])
        assert run["optimum_ram_hit_ratio"] >= run["ram_hit_ratio"] - EPS


def test_the_smallest_budget_is_under_pressure(result):
    for run in result["runs"]:
        if run["ram_share"] == SHARES[0]:
            evicted = run["store_metrics"]["ram_evictions"] + run["store_metrics"]["ram_states_dropped"]
            assert evicted > 0 and run["read_bytes"]["disk"] > 0
            assert run["ram_hit_ratio"] < 1.0
            if run["policy"] == "lru":
                assert run["store_metrics"]["ram_states_dropped"] == 0  # records go whole


def test_at_the_whole_working_set_every_order_is_optimal(result):
    for run in result["runs"]:
        if run["ram_share"] == 1.0:
            assert run["working_set_bytes"] <= run["ram_bytes"]  # the same checkpoints as the first pass
            assert run["ram_hit_ratio"] == pytest.approx(run["optimum_ram_hit_ratio"], abs=EPS)
            assert run["ram_hit_ratio"] == 1.0 and run["read_bytes"]["disk"] == 0


def test_restored_and_reasons_add_up_to_the_prompt(result):
    for run in [result["first_pass"], *result["runs"]]:
        assert run["unaccounted_requests"] == 0
        for row in run["rows"]:
            assert row["restored"] + sum(row["reasons"].values()) == row["prompt"] > 0
        assert run["restored_tokens"] + sum(run["prefilled_by_reason"].values()) == run["prompt_tokens"]
        restorable = run["restored_tokens"] + run["prefilled_by_reason"]["evicted"]
        assert run["hit_ratio"] == pytest.approx(run["restored_tokens"] / restorable)
