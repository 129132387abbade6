"""Precompute yields to live requests between passes and resumes from what it stored (run as a
background task of the real scheduler)."""

from __future__ import annotations

import pytest

from gateway.checkpoints import PRECOMPUTE_STEP
from gateway.protocols import chat
from gateway.runtime import ServeConfig, build_runtime


@pytest.fixture(scope="module")
def runtime():
    rt = build_runtime(ServeConfig(preset="tiny"))
    yield rt
    rt.close()


def long_history(rt):
    messages = [{"role": "user", "content": "Look at the logs."}]
    for i in range(3):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "cat", "arguments": '{"path": "log"}'}}
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"c{i}", "content": f"line {i} of the log\n" * 600}]
    messages.append({"role": "assistant", "content": "The logs show a timeout."})
    segments = rt.renderer.render(chat.parse_request({"model": "tiny", "messages": messages}), rt.memo)
    return [s for s in segments if s.kind != "generation_prompt"]


def run(rt, segments) -> int:
    return rt.checkpoints.schedule_precompute(segments).result(timeout=300)


def test_precompute_stops_for_a_live_request_and_resumes_from_its_checkpoints(runtime, monkeypatch):
    segments = long_history(runtime)
    total = sum(len(s.token_ids) for s in segments)
    assert total > 3 * PRECOMPUTE_STEP
    calls = iter([False, True])  # a live request arrives after the first pass
    monkeypatch.setattr(runtime.scheduler, "live_waiting", lambda: next(calls, True))
    first = run(runtime, segments)
    assert 0 < first < total
    monkeypatch.setattr(runtime.scheduler, "live_waiting", lambda: False)
    second = run(runtime, segments)
    assert first + second == total  # resumed where it stopped: nothing computed twice
    assert run(runtime, segments) == 0  # all of it is checkpointed now
