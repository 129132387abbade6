"""Checkpoints.restore and its PrefixCache against the real store and its write queue (tiny preset,
on the real scheduler's worker): a restore waits for its own chain's queued checkpoints and then
uses them; with none queued it matches the chain once; the cache names each tier in turn."""

from __future__ import annotations

import threading

import pytest

from gateway.prefix_cache import Hit, Tier
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


def test_the_prefix_cache_answers_the_deepest_anchor_and_its_tier(runtime, monkeypatch):
    rt = runtime
    cache = rt.checkpoints.cache
    body = {"model": "tiny", "messages": [{"role": "user", "content": "a question\n" * 30}]}
    plan = rt.planner.plan(chat.parse_request(body))
    chain, ends = plan.chain, plan.ends
    gate, put = threading.Event(), rt.store.put
    monkeypatch.setattr(rt.store, "put", lambda *args: (gate.wait(), put(*args))[1])

    def on_worker(fn):
        return rt.scheduler.submit(fn).result(timeout=120)

    def prefill():
        yield from rt.checkpoints.prefill(rt.engine.new_state(), plan.segments, chain, ends, 0)

    try:
        assert on_worker(lambda: cache.find(chain, ends)) == Hit(0, None)
        rt.scheduler.start(prefill()).result(timeout=120)
        assert on_worker(lambda: cache.find(chain, ends)) == Hit(0, Tier.QUEUED)
        assert not on_worker(lambda: cache.ready(chain, ends))
    finally:
        gate.set()
    assert on_worker(lambda: cache.settle(chain)) == Hit(len(chain), Tier.RAM)
    assert on_worker(lambda: cache.ready(chain, ends))
    state, cached = on_worker(lambda: rt.checkpoints.restore(chain, ends))
    assert cached == ends[-1]
    on_worker(lambda: rt.live.keep(chain, ends, state))
    hit = on_worker(lambda: cache.find(chain, ends))
    assert hit == Hit(len(chain), Tier.LIVE)
    assert on_worker(lambda: cache.take_live(chain, hit)) is state
    assert on_worker(lambda: cache.find(chain, ends)) == Hit(len(chain), Tier.RAM)
    with pytest.raises(KeyError):
        on_worker(lambda: cache.take_live(chain, hit))  # already taken
