"""Precompute yields to live requests between passes and resumes from what it stored (run as a
background task of the real scheduler)."""

from __future__ import annotations

import threading

import pytest

from engine import Feed
from gateway.anchors import anchor_chain, boundaries
from gateway.checkpoints import PRECOMPUTE_STEP
from gateway.protocols import chat
from gateway.service import ServeConfig, build_service


@pytest.fixture(scope="module")
def runtime():
    rt = build_service(ServeConfig(preset="tiny"))
    yield rt
    rt.close()


def long_history(rt, log: str = "log"):
    messages = [{"role": "user", "content": "Look at the logs."}]
    for i in range(3):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "cat", "arguments": '{"path": "log"}'}}
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"c{i}", "content": f"line {i} of the {log}\n" * 600}]
    messages.append({"role": "assistant", "content": "The logs show a timeout."})
    segments = rt.renderer.render(chat.parse_request({"model": "tiny", "messages": messages}), rt.memo)
    return [s for s in segments if s.kind != "generation_prompt"]


def run(rt, segments) -> int:
    return rt.checkpoints.schedule_precompute(segments).result(timeout=300)


def hold_first_segment_in_store(rt, segments, chain) -> threading.Event:
    """The first segment's checkpoint captured and put in the store queue, its store held until the
    returned event is set (as the previous answer's checkpoints on their way into a slow store)."""
    first = segments[0].token_ids
    captured = rt.scheduler.submit(lambda: rt.engine.prefill(rt.engine.new_state(), first, capture_at=[len(first)]))
    stored = threading.Event()
    rt.store_queue.put(chain[:1], None, [captured.result(timeout=60).snapshots[-1]], ready=stored.wait)
    return stored


def assert_admitted_within_one_step(rt) -> None:
    """A live request of three tokens, run to its logits, admitted at the engine step after its
    arrival (the scheduler's queue_steps histogram)."""

    def request():
        feed = Feed(rt.engine.new_state(), [1, 2, 3])
        yield feed
        return feed.result.logits.shape

    within = 'queue_steps_bucket{le="1"}'
    before = rt.scheduler.stats()[within]
    assert rt.scheduler.start(request()).result(timeout=60) is not None
    assert rt.scheduler.stats()[within] == before + 1


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


def test_precompute_waiting_for_its_prefix_to_be_stored_never_holds_up_a_request(runtime, monkeypatch):
    """The previous answer's checkpoints (the precompute's prefix) still on their way into the store, the
    store thread held until the end: a request that arrives meanwhile runs on the worker at once, and the
    precompute gives way to it (before: it waited on the worker for the store)."""
    rt = runtime
    segments = long_history(rt, "other log")
    chain = anchor_chain(segments, rt.checkpoints.root)
    stored = hold_first_segment_in_store(rt, segments, chain)
    try:
        asked, live_waiting = threading.Event(), rt.scheduler.live_waiting
        monkeypatch.setattr(rt.scheduler, "live_waiting", lambda: asked.set() or live_waiting())  # a spy
        precompute = rt.checkpoints.schedule_precompute(segments)
        assert asked.wait(60)  # the worker has taken it up and waits for its prefix
        assert_admitted_within_one_step(rt)  # while the store is held
        assert rt.store_queue.holds(chain[:1])
        assert precompute.result(timeout=60) == 0  # gave way before computing anything
    finally:
        stored.set()
    rt.store_queue.wait_for(chain[:1])
    assert rt.store.longest_restorable(chain) >= 1


def test_a_request_arriving_while_precompute_computes_starts_within_one_step(runtime, monkeypatch):
    """Precompute's engine steps under way (its first pass of several): a live request that arrives
    meanwhile is admitted at the next step (its steps run instead of the background's), and the
    precompute then goes on to the end of its history."""
    rt = runtime
    segments = long_history(rt, "third log")
    computing = threading.Event()
    run_step = rt.engine.run

    def spied(plan):  # runs the real step; says when the background pass is computing
        run_step(plan)
        computing.set()

    monkeypatch.setattr(rt.engine, "run", spied)
    precompute = rt.checkpoints.schedule_precompute(segments)
    assert computing.wait(60)
    assert_admitted_within_one_step(rt)
    assert not precompute.done()  # answered while the precompute was still under way
    assert precompute.result(timeout=300) > 2 * PRECOMPUTE_STEP  # several passes (earlier tests' prefix aside)
    assert run(rt, segments) == 0  # all of it checkpointed


def test_a_request_whose_prefix_is_being_stored_waits_in_the_queue_not_on_the_worker(runtime):
    """A request that restores a prefix still on its way into the store (the store thread held) is not
    admitted until it is stored (`Checkpoints.ready`): a request behind it runs to its end meanwhile
    (before: the first one's restore waited on the worker, and every other request with it); once the
    prefix is stored, the first one restores it."""
    rt = runtime
    segments = long_history(rt, "fourth log")
    chain, ends = anchor_chain(segments, rt.checkpoints.root), boundaries(segments)
    stored = hold_first_segment_in_store(rt, segments, chain)

    def restoring():
        state, cached = rt.checkpoints.restore(chain[:1], ends)
        feed = Feed(state, [1, 2, 3])
        yield feed
        return cached

    try:
        assert not rt.checkpoints.ready(chain[:1], ends)
        waiting = rt.scheduler.start(restoring(), ready=lambda: rt.checkpoints.ready(chain[:1], ends))
        assert_admitted_within_one_step(rt)  # the request behind it: runs to its end
        assert not waiting.done() and rt.scheduler.queue_depth == 1
    finally:
        stored.set()
    assert waiting.result(timeout=60) == ends[0]  # restored from the store once stored
