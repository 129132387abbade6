"""Checkpoints.restore against the real store and its write queue (tiny preset, on the real
scheduler's worker): a restore waits for its own chain's queued checkpoints and then uses them;
with none queued it matches the chain once."""

from __future__ import annotations

import threading

import pytest

from gateway.protocols import chat
from gateway.service import ServeConfig, build_service


@pytest.fixture
def runtime():
    rt = build_service(ServeConfig(preset="tiny"))
    yield rt
    rt.close()


def test_restore_waits_for_its_queued_chain_and_matches_once_when_none_is_queued(runtime, monkeypatch):
    rt = runtime
    body = {"model": "tiny", "messages": [{"role": "system", "content": "You read logs."},
                                          {"role": "user", "content": "line of the log\n" * 40}]}
    plan = rt.planner.plan(chat.parse_request(body))
    # the store writer holds its first put until the restore has matched once (the real store,
    # paused): the prompt's checkpoints are then certainly queued when the restore starts
    gate, put = threading.Event(), rt.store.put

    def paused_put(*args):
        gate.wait()
        return put(*args)

    matches, longest_restorable = [], rt.store.longest_restorable

    def counted(chain):
        matches.append(len(chain))
        gate.set()
        return longest_restorable(chain)

    monkeypatch.setattr(rt.store, "put", paused_put)
    monkeypatch.setattr(rt.store, "longest_restorable", counted)

    def prefill():
        yield from rt.checkpoints.prefill(rt.engine.new_state(), plan.segments, plan.chain, plan.ends, 0)

    def restore() -> int:
        matches.clear()
        return rt.scheduler.submit(lambda: rt.checkpoints.restore(plan.chain, plan.ends)[1]).result(timeout=120)

    try:
        rt.scheduler.start(prefill()).result(timeout=120)
        assert rt.store_queue.holds(plan.chain)
        assert restore() == plan.ends[-1]  # matched again after waiting: the whole prompt
        assert len(matches) == 2
    finally:
        gate.set()
    assert restore() == plan.ends[-1]
    assert len(matches) == 1  # nothing of the chain queued: the first match is final
