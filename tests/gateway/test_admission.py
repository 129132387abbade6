"""Which waiting request the engine worker admits while a running one is finishing (its answer sent,
its end being checkpointed): only a request that continues that answer waits for it (run on the real
scheduler of a tiny-preset service)."""

from __future__ import annotations

import threading

import pytest

from engine import Feed
from gateway.service import ServeConfig, build_service


@pytest.fixture(scope="module")
def runtime():
    rt = build_service(ServeConfig(preset="tiny"))
    yield rt
    rt.close()


def prefill(rt, tokens: list[int]):
    feed = Feed(rt.engine.new_state(), tokens)
    yield feed
    return "done"


def test_only_a_request_that_continues_a_finishing_answer_waits_for_it(runtime):
    rt = runtime
    answered, release = threading.Event(), threading.Event()

    def answer():
        state = rt.engine.new_state()
        yield Feed(state, [1, 2, 3])
        answered.set()  # sent: what follows checkpoints its end, one step after another until released
        while not release.is_set():
            yield Feed(state, [4])
        return "answered"

    first = rt.scheduler.start(answer(), finishing=answered.is_set, prompt=[b"system", b"user", b"prompt"])
    try:
        assert answered.wait(60)
        continuing = rt.scheduler.start(prefill(rt, [5, 6]), prompt=[b"system", b"user", b"answer", b"tool"])
        other = rt.scheduler.start(prefill(rt, [7, 8]), prompt=[b"system", b"other user", b"prompt"])
        assert other.result(timeout=60) == "done"  # another session's request runs meanwhile
        assert not continuing.done() and rt.scheduler.queue_depth == 1
    finally:
        release.set()
    assert first.result(timeout=60) == "answered"
    assert continuing.result(timeout=60) == "done"  # admitted once the answer's end is checkpointed


def test_a_prompt_continues_another_when_it_holds_every_anchor_of_it_but_the_last():
    from gateway.scheduler import Task

    def task(*prompt: bytes) -> Task:
        return Task(iter(()), prompt=prompt)

    answer = task(b"s", b"u", b"g")
    assert task(b"s", b"u", b"a", b"t").extends(answer)
    assert task(b"s", b"u").extends(answer)
    assert not task(b"s", b"v", b"g").extends(answer)
    assert not task(b"s").extends(answer)
    assert not task(b"s", b"u").extends(task(b"s"))  # nothing before its last anchor: nothing to wait for
