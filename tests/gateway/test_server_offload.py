"""`ft serve --gpu-memory` on the tiny preset: the routed experts offloaded to an expert cache of 3
of 8 experts per layer give the same greedy answers as without, and /metrics counts the cache."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.engine_config import EngineConfig
from gateway.serve import config_from_args
from tests.conftest import serve_args, start_server
from tests.engine.test_offload import budget_gib

TURNS = ["List the files under src/ and say which one parses flags.", "Now explain what the parser does " * 3]


@pytest.fixture(scope="module")
def offloaded(live_server):
    server = start_server(
        preset="tiny",
        policy="anchor",
        default_max_tokens=16,
        engine=EngineConfig(gpu_memory_gib=budget_gib(live_server.runtime.engine, 3)),
    )
    yield server
    server.stop()


def _conversation(server) -> list[str]:
    """Two turns of one session (the second restores or continues the first's state), greedy."""
    messages, answers = [], []
    with server.client() as c:
        for turn in TURNS:
            messages.append({"role": "user", "content": turn})
            r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "temperature": 0})
            assert r.status_code == 200, r.text
            message = r.json()["choices"][0]["message"]
            answer = (message.get("reasoning_content") or "") + "|" + (message.get("content") or "")
            assert len(answer) > 1
            messages.append({"role": "assistant", "content": message.get("content") or answer})
            answers.append(answer)
    return answers


def _metric(server, name: str) -> float:
    with server.client() as c:
        lines = c.get("/metrics").text.splitlines()
    return float(next(line.split()[-1] for line in lines if line.startswith(name + " ")))


def test_offloaded_server_answers_as_without(live_server, offloaded):
    engine = offloaded.runtime.engine
    assert engine.offload is not None and engine.offload.plan.slots == 3
    assert _conversation(offloaded) == _conversation(live_server)
    offloaded.wait_idle()
    hits, fetched, misses, mapped = (
        _metric(offloaded, f"ft_expert_cache_{name}_total") for name in ("hits", "fetched", "misses", "mapped")
    )
    assert misses > 0 and hits > 0 and mapped > 0  # prefill copies, decode reads in place
    assert 0 < fetched <= misses  # what the forwards fetched; the refreshes' swaps are copies too
    assert _metric(offloaded, "ft_expert_cache_on_host_total") == 0  # the CPU simulation copies every miss
    assert _metric(offloaded, "ft_expert_cache_hit_ratio") == pytest.approx(hits / (hits + fetched + mapped), abs=1e-6)
    stats = engine.offload_stats()  # per phase: decode read its misses in place, prefill copied them
    for phase in ("prefill", "decode"):
        ratio = stats[f"phase_hits_{phase}"] / stats[f"phase_needed_{phase}"]
        assert _metric(offloaded, f'ft_expert_cache_phase_hit_ratio{{phase="{phase}"}}') == pytest.approx(ratio, abs=1e-6)
    assert stats["phase_needed_prefill"] + stats["phase_needed_decode"] == hits + fetched + mapped
    expert = engine.offload.plan.expert_bytes
    assert _moved(offloaded) == (misses + mapped) * expert
    assert _metric(offloaded, 'ft_memory_bytes{part="expert_cache"}') == engine.offload.nbytes
    with live_server.client() as c:
        assert "ft_expert_cache" not in c.get("/metrics").text


def test_each_response_names_the_bytes_it_moved_over_the_link(live_server, offloaded):
    """`x-link-bytes`: what moved host -> device until the first token. With one output token
    nothing runs after it (no decode, no answer end to capture), so it is the request's whole
    traffic as /metrics counts it; a server without offload on a CPU moves nothing and says nothing."""
    expert = offloaded.runtime.engine.offload.plan.expert_bytes
    body = {"model": "tiny", "max_tokens": 1, "temperature": 0}
    for content in ("Which file parses the flags?", "Which file parses the flags? And which one tests it? " * 4):
        offloaded.wait_idle()
        before = _moved(offloaded)
        with offloaded.client() as c:
            r = c.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": content}]})
        assert r.status_code == 200, r.text
        offloaded.wait_idle()
        moved = int(r.headers["x-link-bytes"])
        assert moved > 0 and moved % expert == 0
        assert moved == _moved(offloaded) - before
    with live_server.client() as c:
        r = c.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and "x-link-bytes" not in r.headers


def _moved(server) -> float:
    return sum(_metric(server, f'ft_expert_cache_bytes_in_total{{phase="{p}"}}') for p in ("prefill", "decode"))


def test_gpu_memory_flag_reaches_the_config():
    assert config_from_args(serve_args("--gpu-memory", "6.5")).engine.gpu_memory_gib == 6.5
    assert config_from_args(serve_args()).engine.gpu_memory_gib is None
    with pytest.raises(SystemExit):
        serve_args("--gpu-memory", "0")


def test_budget_below_the_dense_weights_stops_ft_serve(ft_home):
    proc = subprocess.run(
        [sys.executable, "-m", "ft", "serve", "--preset", "tiny", "--port", "0", "--gpu-memory", "0.01"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert "--gpu-memory 0.010 GiB" in proc.stderr and "below the dense weights" in proc.stderr


def test_a_context_limit_refuses_longer_prompts_and_bounds_the_slots():
    """`EngineConfig.max_context` (what a memory plan leaves room for, or --max-context): /v1/models
    reports it (`ft launch` hands it to the agent, which compacts before it), a prompt past it is
    answered with the protocol's context-length error, not a failed step, and no decode slot grows
    past it."""
    server = start_server(preset="tiny", policy="anchor", default_max_tokens=8, engine=EngineConfig(max_context=600))
    try:
        engine = server.runtime.engine
        assert engine.max_context == 600
        with server.client() as c:
            assert c.get("/v1/models").json()["data"][0]["context_length"] == 600
            short = [{"role": "user", "content": "Say which file parses flags. " * 20}]
            r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": short, "temperature": 0})
            assert r.status_code == 200, r.text
            long = [{"role": "user", "content": "Say which file parses flags. " * 200}]
            r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": long, "temperature": 0})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "context_length_exceeded"
            assert "maximum context length is 600 tokens" in r.json()["error"]["message"]
        assert 0 < engine.runner.capacity <= 600
    finally:
        server.stop()
