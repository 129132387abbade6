"""The engine's one worker thread: a step loop over up to `max_running` live tasks at once.

A task is a generator that yields each `Feed` it needs run (a prompt's prefill, one decode token)
and is resumed once that feed holds its result. Every step runs one batched forward: the decode
token of every running task, then prefill chunks of the others, as the engine's scheduler plans
them (`engine.scheduler`: the token budget, the oldest prefill's share, then the fewest remaining
tokens first), so a new request's prefill starts at the next step instead of after the other
sessions' answers. Requests beyond `max_running` wait in a queue (`Overloaded` past `max_queue`);
one whose client left before it started is dropped; one that is not `ready` (what it restores is still
on its way into the store), or whose prompt extends an answer whose end is still being checkpointed, lets
those behind it go first, so no wait of its blocks the worker or another session.
Background tasks (precompute) run only in steps with no live work. Plain jobs (`submit`) run alone
between steps. With no live work, the worker first grows the engine's buffers ahead of need
(`Engine.grow_ahead`, one bounded piece at a time, before background steps), so that a request
grows none in its own steps.

Only this thread touches the engine; the event loop never blocks on model work.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future
from typing import Any

from engine import Engine, Feed
from engine.scheduler import StepPlan
from gateway.errors import ClientGone, Overloaded, is_typed
from gateway.metrics import Histogram

log = logging.getLogger("gateway.scheduler")
QUEUE_STEP_BUCKETS = (0, 1, 2, 4, 8, 16, 64)  # engine steps a live request waited before it started (a histogram)
READY_POLL = 0.002  # seconds between asks of a waiting task's `ready` while the worker has nothing else

Steps = Generator[Feed, None, Any]


class Task:
    def __init__(self, steps: Steps, cancel: threading.Event | None = None,
                 finishing: Callable[[], bool] = lambda: False, queued_at: int = 0,
                 ready: Callable[[], bool] = lambda: True, prompt: Sequence[bytes] = ()):
        self.steps, self.cancel, self.finishing, self.ready = steps, cancel, finishing, ready
        self.prompt = tuple(prompt)  # its prompt's anchors, chained: one names the prefix up to it
        self.future: Future = Future()
        self.feed: Feed | None = None
        self.queued_at = queued_at  # the scheduler's step count when it was queued

    @property
    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def advance(self) -> bool:
        """Run the task to its next feed; False once it has finished (its future resolved)."""
        try:
            self.feed = next(self.steps)
            return True
        except StopIteration as done:
            self.future.set_result(done.value)
        except BaseException as exc:  # noqa: BLE001 (delivered to whoever awaits the task)
            if not is_typed(exc):  # a bug: its client sees only a 500
                log.exception("task failed")
            self.future.set_exception(exc)
        self.feed = None
        return False

    def extends(self, other: Task) -> bool:
        """Whether this task's prompt continues `other`'s: it holds every anchor of `other`'s prompt
        but the last (the newest segment, which the next turn may render anew)."""
        done = other.prompt[:-1]
        return bool(done) and self.prompt[len(done) - 1:len(done)] == done[-1:]

    def drop(self) -> None:
        self.steps.close()
        if not self.future.done():
            self.future.set_exception(ClientGone())


class Scheduler:
    def __init__(self, engine: Engine, max_queue: int = 64):
        """Runs up to the engine's `max_running` tasks at once; `max_queue` more may wait. Steps
        slower than the engine's `step_log_ms` are logged."""
        self.engine, self.max_queue = engine, max_queue
        self.max_running = engine.engine_config.max_running
        self.step_log_ms = engine.engine_config.step_log_ms
        self._waiting: deque[Task] = deque()
        self._running: list[Task] = []
        self._background: list[Task] = []
        self._jobs: deque[tuple[Callable[[], Any], Future]] = deque()
        self._wake = threading.Condition()
        self._busy = False  # a step or job is running
        self._ahead = False  # work ran since the engine last had nothing to grow ahead
        self._grows_ahead = True  # off after a failure: requests grow what they need themselves
        self.steps_total = self.step_sequences_total = self.step_tokens_total = 0
        self.queue_steps = Histogram(QUEUE_STEP_BUCKETS)  # engine steps each live request waited (the worker's)
        self._step_end = time.perf_counter()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="engine-worker", daemon=True)
        self._thread.start()

    # -- what the gateway asks of it (any thread)

    def start(self, steps: Steps, cancel: threading.Event | None = None,
              finishing: Callable[[], bool] = lambda: False, ready: Callable[[], bool] = lambda: True,
              prompt: Sequence[bytes] = ()) -> Future:
        """Queue a live task; its future resolves with the generator's return value. `prompt`: the
        anchors of its prompt, chained. While a running task is `finishing` (its answer sent, its
        end being checkpointed: a step or a few), a task whose prompt extends that one's waits, so
        that it finds the answer's end checkpointed; the others go on. A task is admitted only once
        `ready` (asked on the worker thread) says its first step will not wait."""
        with self._wake:
            if len(self._waiting) >= self.max_queue:
                raise Overloaded(f"{len(self._waiting)} requests already wait; retry shortly")
            task = Task(steps, cancel, finishing, queued_at=self.steps_total, ready=ready, prompt=prompt)
            self._waiting.append(task)
            self._wake.notify()
        return task.future

    def background(self, steps: Steps) -> Future:
        """Queue a background task: run only in steps with no live work."""
        with self._wake:
            task = Task(steps)
            self._background.append(task)
            self._wake.notify()
        return task.future

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` alone on the worker, between two steps."""
        future: Future = Future()
        with self._wake:
            self._jobs.append((fn, future))
            self._wake.notify()
        return future

    async def run(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.submit(fn))

    def live_waiting(self) -> bool:
        """True when live work is queued or running (or the server is closing): background work
        should stop at its next boundary."""
        return bool(self._waiting or self._running or self._jobs) or self._closing

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def stats(self) -> dict[str, int]:
        """For /metrics: requests waiting and running, what the steps ran (mean batch size =
        step_sequences_total / steps_total), and how many steps live requests waited before they started
        (a cumulative histogram: `queue_steps_bucket{le="N"}`), and the engine's growth events by
        kind (`growth_events{kind="slot_growth"}`: `Engine.growth_events`)."""
        stats = {"queue_depth": len(self._waiting), "running": len(self._running), "steps_total": self.steps_total,
                 "step_sequences_total": self.step_sequences_total, "step_tokens_total": self.step_tokens_total}
        stats.update({f'queue_steps_bucket{{le="{le}"}}': n for le, n in self.queue_steps.cumulative()})
        stats.update({f'growth_events{{kind="{kind}"}}': n for kind, n in self.engine.growth_events.items()})
        return stats

    @property
    def idle(self) -> bool:
        """No task or job queued or running, nothing left to grow ahead."""
        return not (self._busy or self._ahead or self._waiting or self._running or self._background or self._jobs)

    def close(self, timeout: float = 30.0) -> None:
        """Finish queued and running live work, cut background work short, stop the thread."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(timeout)

    # -- the worker

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._jobs or self._waiting or self._running or self._background or self._closing
                           or self._ahead):
                    self._wake.wait()
                if self._closing and not (self._jobs or self._waiting or self._running):
                    for task in self._background:
                        task.drop()
                    self._background.clear()
                    return
                # growth ahead goes before background work (a precompute may take many steps)
                grow = self._ahead and not (self._jobs or self._waiting or self._running)
                self._busy = True
                self._ahead = True  # what the work about to run holds may need room next
            try:
                if grow:
                    self._grow_ahead()
                else:
                    self._run_jobs()
                    self._admit()
                    self._step()
            finally:
                self._busy = False
            if self._waiting and not (self._running or self._background or self._jobs or self._closing):
                with self._wake:  # none of the waiting tasks is ready: ask again shortly, not in a spin
                    self._wake.wait(READY_POLL)

    def _grow_ahead(self) -> None:
        """One piece of the engine's growth ahead of need. A failure (e.g. a memory budget that
        cannot hold the headroom) is logged once and turns it off: a request grows what it needs."""
        try:
            self._ahead = self._grows_ahead and self.engine.grow_ahead()
        except Exception:  # noqa: BLE001 (the worker goes on)
            log.exception("growth ahead of need failed: off from now on")
            self._ahead = self._grows_ahead = False

    def _run_jobs(self) -> None:
        while self._jobs:
            fn, future = self._jobs.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 (delivered to the awaiting request)
                    future.set_exception(exc)

    def _admit(self) -> None:
        finishing = [t for t in self._running if t.finishing()]
        with self._wake:
            waiting = list(self._waiting)
        for task in waiting:
            if len(self._running) >= self.max_running:
                break
            if not task.cancelled and (any(task.extends(t) for t in finishing) or not task.ready()):
                continue  # the end of the answer it continues, or what it restores, is still being stored: those behind it go first
            with self._wake:
                self._waiting.remove(task)
            self.queue_steps.observe(self.steps_total - task.queued_at)
            if task.cancelled:
                task.drop()  # its client left while it waited
            elif task.advance():  # restores its prefix and asks for its prefill
                self._running.append(task)

    def _step(self) -> None:
        """One forward over what the tasks ask for, then resume every task whose feed is done."""
        for task in [t for t in self._running if t.cancelled and t.feed is not None and t.feed.is_prefill]:
            task.drop()  # a decoding task notices its cancel itself and finishes its answer
            self._running.remove(task)
        tasks = list(self._running or self._background[:1])
        for task in tasks:
            if task.feed is None and not task.advance():  # a background task not started yet
                self._background.remove(task)
        feeds = [t.feed for t in tasks if t.feed is not None]
        plan = self.engine.scheduler.schedule(feeds, background=not self._running)
        if plan.empty:
            return
        grown = self.engine.growth_events if self.step_log_ms is not None else None
        start = time.perf_counter()
        try:
            self.engine.run(plan)
        except Exception as exc:  # noqa: BLE001 (the step's requests fail; the worker goes on)
            log.exception("engine step failed")
            for task in tasks:
                self._discard(task)
                task.steps.close()
                task.future.set_exception(exc)
            return
        self.steps_total += 1
        self.step_sequences_total += len(plan.parts)
        self.step_tokens_total += plan.tokens
        stepped = time.perf_counter()
        for task in tasks:
            if task.feed is not None and task.feed.result is not None and not task.advance():
                self._discard(task)
        self._log_step(plan, start, stepped, grown)

    def _log_step(self, plan: StepPlan, start: float, stepped: float, grown: dict[str, int] | None) -> None:
        """`step_log_ms`: a step slower than that, split into the engine's step, resuming its tasks
        (sampling, checkpoint hand-offs, the next feed) and the worker's time before it since the
        last step (jobs, admissions: restores), with the engine's growth events inside it (`grown`:
        `Engine.growth_events` before it)."""
        end, before = time.perf_counter(), start - self._step_end
        self._step_end = end
        if self.step_log_ms is None or (end - start) * 1e3 < self.step_log_ms:
            return
        prefills = [count for feed, count in plan.parts if feed.is_prefill]
        events = self.engine.growth_events
        growth = ", ".join(f"{kind} {n - grown[kind]}" for kind, n in events.items() if grown and n != grown[kind])
        log.info("step %d: %d prefill tokens in %d parts, %d decode rows: engine %.1f ms, tasks %.1f ms; "
                 "%.1f ms since the last step%s", self.steps_total, sum(prefills), len(prefills),
                 len(plan.parts) - len(prefills), (stepped - start) * 1e3, (end - stepped) * 1e3, before * 1e3,
                 f"; grew: {growth}" if growth else "")

    def _discard(self, task: Task) -> None:
        (self._running if task in self._running else self._background).remove(task)
