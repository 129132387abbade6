"""Expert parallel across processes: rank 0 serves and mirrors every engine call to the other
ranks, which run the same calls on their own engines, so every rank runs the same forwards (whose
all-reduces then meet, `engine.parallel`).

The calls mirrored are `MIRRORED`: those that make a sequence's state, change it, or run a
forward (`Engine.prefill`, `decode`, `feed`, `generate` and `step` all go through `run`).
Reads (`snapshot`, `kv_delta`, `memory`) run on rank 0 alone where the states are replicated
(rank 0's are every rank's); under head split (`engine.head_split`) `snapshot` and `kv_delta`
are mirrored too (every rank's heads are gathered into the whole snapshot). Rank 0 names each state and feed it sends by a number; a follower
keeps its own under the same number, and forgets it when rank 0's is collected (told with the
next call). A call crosses as one `broadcast_object_list` of (method, arguments, numbers
forgotten); a restore carries its snapshots, a step its plan by feed numbers and the feeds
first seen in it. Warm-up runs on every rank at once before mirroring starts.

`python -m engine.parallel_worker` is a rank > 0 (started by `start`): it reads its `RankSpec`
(pickled) from stdin, loads and warms up its engine, then follows until rank 0 says stop.
"""

from __future__ import annotations

import collections
import datetime
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from checkpoint_store.snapshot import Snapshot
from engine import split_choice
from engine.engine import Engine
from engine.engine_config import EngineConfig
from engine.feed import Feed
from engine.parallel import ExpertParallel
from engine.scheduler import StepPlan
from engine.state import SequenceState
from engine.warmup import warm_up

log = logging.getLogger(__name__)
MIRRORED = ("new_state", "restore", "rewind", "run", "grow_ahead", "snapshot", "kv_delta")
# the calls cross on a gloo group of their own, where a follower waits while the server is idle:
# no timeout a quiet night could reach (the forwards' all-reduces keep the default group's)
IDLE_TIMEOUT = datetime.timedelta(days=365)
STOP_TIMEOUT_S = 60  # for the followers to leave once told to stop


@dataclass(frozen=True)
class RankSpec:
    """What a rank loads and where it joins: the model (a folder, else a preset), how to run it
    (`config.expert_parallel` names the rank) and the group's rendezvous."""

    model_dir: Path | None
    preset: str
    config: EngineConfig
    init_method: str  # tcp://host:port of rank 0's store
    backend: str  # "gloo" (CPU) or "nccl" (GPUs)
    choose_split: bool = False  # time replicated and head split at warm-up, keep the faster (`engine.split_choice`)

    @property
    def parallel(self) -> ExpertParallel:
        assert self.config.expert_parallel is not None
        return self.config.expert_parallel


def join(spec: RankSpec) -> dist.ProcessGroup:
    """Join the group as `spec`'s rank (on the CPU the ranks share the cores); returns the group
    the calls cross on."""
    if spec.backend == "nccl":
        torch.cuda.set_device(torch.device(spec.config.device))
    elif spec.config.torch_device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.parallel.world))
    dist.init_process_group(spec.backend, init_method=spec.init_method, rank=spec.parallel.rank,
                            world_size=spec.parallel.world)
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def load(cls: type[Engine], spec: RankSpec) -> Engine:
    """This rank's engine, warmed up (every rank at once: warm-up's forwards meet in their
    all-reduces); with `spec.choose_split`, replicated or head split, whichever ran faster."""
    if spec.model_dir is not None:
        engine = cls.load(spec.model_dir, spec.config)
    else:
        engine = cls.from_preset(spec.preset, spec.config)
    warm_up(engine)
    if spec.choose_split and not spec.config.head_split:
        engine = split_choice.choose(engine)
    return engine


def start(spec: RankSpec, configs: Sequence[EngineConfig]) -> tuple[MirroredEngine, list[subprocess.Popen]]:
    """Rank 0 (`spec`) here, ranks 1.. as processes of this host, rank r as `configs[r - 1]` says
    (its device, its budget, `expert_parallel` naming it): rank 0's engine, loaded and warmed up
    with theirs, mirroring; and the followers' processes."""
    followers = []
    for config in configs:
        proc = subprocess.Popen([sys.executable, "-m", "engine.parallel_worker"], stdin=subprocess.PIPE)
        assert proc.stdin is not None
        proc.stdin.write(pickle.dumps(replace(spec, config=config)))
        proc.stdin.close()
        followers.append(proc)
    try:
        control = join(spec)
        engine = load(MirroredEngine, spec)
    except BaseException:
        for proc in followers:
            proc.kill()
            proc.wait()
        raise
    assert isinstance(engine, MirroredEngine)
    engine.start_mirroring(control)
    return engine, followers


def stop(engine: MirroredEngine, followers: Sequence[subprocess.Popen]) -> None:
    """The followers told to stop and waited for (killed if they do not leave), the group left."""
    try:
        engine.stop_mirroring()
    except RuntimeError as exc:  # a follower already gone (the group's transport says so)
        log.warning("expert parallel: the other ranks could not be told to stop: %s", exc)
    finally:
        for proc in followers:
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        dist.destroy_process_group()


def _broadcast(message: Any, group: dist.ProcessGroup) -> Any:
    box = [message]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class MirroredEngine(Engine):
    """Rank 0's engine: once `start_mirroring` is called, each call of `MIRRORED` is sent to the
    other ranks: a step before it runs here (its all-reduces meet theirs), the others (copies, no
    collective) after, with the number of the state they made. One call at a time (a lock): each
    is one message, in order."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.mirroring = False
        self._control: dist.ProcessGroup | None = None
        self._lock = threading.RLock()
        self._names: dict[int, int] = {}  # id() of a live state or feed -> its number
        self._next = 0
        self._forgotten: collections.deque[int] = collections.deque()  # numbers of those collected since

    def start_mirroring(self, control: dist.ProcessGroup) -> None:
        """From now on every call of `MIRRORED` is sent on `control` (`join`'s group)."""
        self._control, self.mirroring = control, True

    def stop_mirroring(self) -> None:
        """Tell the other ranks to stop (they leave their loop and the group)."""
        with self._lock:
            if self.mirroring:
                self._send("stop")
                self.mirroring = False

    def _send(self, method: str, *args: Any) -> None:
        forgotten = [self._forgotten.popleft() for _ in range(len(self._forgotten))]
        assert self._control is not None
        _broadcast((method, args, forgotten), self._control)

    def _name(self, obj: object) -> int:
        """A new number for a state or feed, forgotten when it is collected."""
        number, key = self._next, id(obj)
        self._next += 1
        self._names[key] = number
        weakref.finalize(obj, self._forget, key, number)
        return number

    def _forget(self, key: int, number: int) -> None:
        if self._names.get(key) == number:
            del self._names[key]
        self._forgotten.append(number)

    def _number(self, state: SequenceState) -> int:
        if (number := self._names.get(id(state))) is None:
            raise RuntimeError("a sequence state the other ranks do not hold (made before mirroring started)")
        return number

    def new_state(self) -> SequenceState:
        with self._lock:
            state = super().new_state()
            if self.mirroring:
                self._send("new_state", self._name(state))
            return state

    def restore(self, snapshot: Snapshot | Sequence[Snapshot]) -> SequenceState:
        with self._lock:
            state = super().restore(snapshot)
            if self.mirroring:
                self._send("restore", self._name(state), snapshot)
            return state

    def rewind(self, state: SequenceState, record: Snapshot) -> SequenceState:
        with self._lock:
            number = self._number(state) if self.mirroring else 0
            rewound = super().rewind(state, record)
            if self.mirroring:
                into = number if rewound is state else self._name(rewound)
                self._send("rewind", number, record.without_kv(), into)
            return rewound

    def snapshot(self, state: SequenceState, start: int) -> Snapshot:
        with self._lock:
            if self.mirroring and self.engine_config.head_split:
                self._send("snapshot", self._number(state), start)
            return super().snapshot(state, start)

    def kv_delta(self, state: SequenceState, start: int, end: int) -> Snapshot:
        with self._lock:
            if self.mirroring and self.engine_config.head_split:
                self._send("kv_delta", self._number(state), start, end)
            return super().kv_delta(state, start, end)

    def grow_ahead(self) -> bool:
        with self._lock:
            if self.mirroring:
                self._send("grow_ahead")
            return super().grow_ahead()

    def run(self, plan: StepPlan) -> None:
        with self._lock:
            if self.mirroring:
                self._send("run", *self._layout(plan))
            super().run(plan)

    def _layout(self, plan: StepPlan) -> tuple[list[tuple], tuple]:
        """The feeds first seen in `plan` ((number, its state's number, Feed's arguments, how far
        it is)) and the plan's parts by feed number."""
        new: list[tuple] = []

        def number(feed: Feed) -> int:
            if (known := self._names.get(id(feed))) is None:
                known = self._name(feed)
                made = (feed.token_ids, feed.capture_at, feed.state_at, feed.kv_start, feed.all_logits)
                new.append((known, self._number(feed.state), made, feed.start, feed.done))
            return known

        layout = ([number(f) for f in plan.decode], [(number(f), n) for f, n in plan.slotted],
                  [(number(f), n) for f, n in plan.forward], [number(f) for f in plan.riding])
        return new, layout


class Follower:
    """A rank > 0: runs each call rank 0 sends on its own engine, its states and feeds under rank 0's numbers."""

    def __init__(self, engine: Engine, control: dist.ProcessGroup):
        self.engine, self.control = engine, control
        self.held: dict[int, Any] = {}  # number -> SequenceState or Feed

    def follow(self) -> None:
        """Until rank 0 says stop."""
        while True:
            method, args, forgotten = _broadcast(None, self.control)
            for number in forgotten:
                self.held.pop(number, None)
            if method == "stop":
                return
            if method not in MIRRORED:
                raise RuntimeError(f"rank 0 sent {method!r}, not an engine call this rank mirrors")
            getattr(self, method)(*args)

    def new_state(self, number: int) -> None:
        self.held[number] = self.engine.new_state()

    def restore(self, number: int, snapshot: Snapshot | Sequence[Snapshot]) -> None:
        self.held[number] = self.engine.restore(snapshot)

    def rewind(self, number: int, record: Snapshot, into: int) -> None:
        self.held[into] = self.engine.rewind(self.held[number], record)

    def grow_ahead(self) -> None:
        self.engine.grow_ahead()

    def snapshot(self, number: int, start: int) -> None:
        self.engine.snapshot(self.held[number], start)  # its part of the gather; rank 0 keeps the snapshot

    def kv_delta(self, number: int, start: int, end: int) -> None:
        self.engine.kv_delta(self.held[number], start, end)

    def run(self, new: list[tuple], layout: tuple) -> None:
        for number, state, made, start, done in new:
            feed = Feed(self.held[state], *made)
            if feed.start != start:
                raise RuntimeError(f"feed {number}: starts at {feed.start} here, at {start} on rank 0")
            feed.done = done
            self.held[number] = feed
        decode, slotted, forward, riding = layout
        held = self.held
        plan = StepPlan(decode=[held[n] for n in decode], slotted=[(held[n], c) for n, c in slotted],
                        forward=[(held[n], c) for n, c in forward], riding=[held[n] for n in riding])
        self.engine.run(plan)
        for number in [*decode, *(n for n, _ in slotted), *(n for n, _ in forward), *riding]:
            if held[number].result is not None:  # finished here as on rank 0: nothing more runs it
                del held[number]


def main() -> int:
    # a signal to the whole process group (Ctrl-C in a terminal) is rank 0's to act on: it drains,
    # then tells the others to stop; a rank 0 gone for good ends their broadcast with an error
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    spec: RankSpec = pickle.loads(sys.stdin.buffer.read())
    control = join(spec)
    try:
        Follower(load(Engine, spec), control).follow()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
