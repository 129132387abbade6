"""Stateful property tests of put / match / evict / restart invariants."""

import shutil
import tempfile

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule

from checkpoint_store import CheckpointStore, StoreConfig
from checkpoint_store.snapshot import Snapshot

from .synth import assert_same, expected_chain, make_snapshot

KiB = 1 << 10


class StoreMachine(RuleBasedStateMachine):
    """A forest of records (sessions branching off shared prefixes) against the real store."""

    anchors = Bundle("anchors")

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="ckpt-props-")
        self.model: dict[bytes, tuple[bytes | None, Snapshot]] = {}
        self.store: CheckpointStore | None = None
        self.lossy = False  # sticky: counters restart with the store, losses do not

    @initialize(ram_kib=st.sampled_from([0, 16, 256, 2048, 65536]), disk_kib=st.sampled_from([0, 4096, 8192]))
    def open_store(self, ram_kib: int, disk_kib: int) -> None:
        disk = {"disk_dir": self.dir, "disk_bytes": disk_kib * KiB} if disk_kib else {}
        self.config = StoreConfig(
            ram_bytes=ram_kib * KiB, fingerprint="fp", max_batch_bytes=512 * KiB, **disk
        )
        self.store = CheckpointStore(self.config)

    def teardown(self) -> None:
        if self.store is not None:
            self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(
        target=anchors,
        parent=st.none() | anchors,
        tokens=st.integers(0, 6),
        state_numel=st.none() | st.sampled_from([16, 2048, 65536, 262144]),
        seed=st.integers(0, 2**16),
    )
    def put(self, parent: bytes | None, tokens: int, state_numel: int | None, seed: int) -> bytes:
        start = 0 if parent is None else self.model[parent][1].end
        anchor = b"r%d" % len(self.model)
        snap = make_snapshot(seed, start, start + tokens, state_numel is not None, state_numel or 0)
        self.store.put(anchor, parent, snap)
        self.model[anchor] = (parent, snap)
        return anchor

    @rule(
        target=anchors,
        parent=st.none() | anchors,
        states=st.lists(st.none() | st.sampled_from([2048, 65536, 262144]), min_size=1, max_size=6),
        seed=st.integers(0, 2**16),
    )
    def put_turns(self, parent: bytes | None, states: list[int | None], seed: int) -> bytes:
        """A session's next turns: a run of records, each with or without a state."""
        for i, state_numel in enumerate(states):
            parent = self.put(parent, 1 + i % 3, state_numel, seed + i)
        return parent

    @rule(anchor=anchors, with_state=st.booleans())
    def put_again(self, anchor: bytes, with_state: bool) -> None:
        """The same record again, or (if it had none) with a state added."""
        parent, snap = self.model[anchor]
        if with_state and not snap.has_state:
            state = make_snapshot(len(self.model), snap.start, snap.end, True).tensors
            snap = Snapshot(
                snap.start, snap.end, {**snap.tensors, "conv.1": state["conv.1"], "rec.1": state["rec.1"]}
            )
            self.model[anchor] = (parent, snap)
        self.store.put(anchor, parent, snap if with_state else snap.without_state())

    @rule(anchor=anchors)
    def restore(self, anchor: bytes) -> None:
        chain = self.path(anchor)
        before = self.disk_evictions()
        n = self.store.longest_restorable(chain)
        assert self.model[chain[n - 1]][1].has_state if n else True
        if not self.lossy and self.lossless():
            assert n == self.deepest_state(chain)
        if n:
            got = self.store.load_chain(chain[:n])
            if got is None:  # only the writer thread, evicting meanwhile to make room, may take it away
                assert self.disk_evictions() > before, "longest_restorable promised this chain"
            else:
                assert_same(got, expected_chain([self.model[a][1] for a in chain[:n]]))

    def disk_evictions(self) -> int:
        stats = self.store.stats()
        return stats.disk_evictions + stats.disk_states_dropped

    @precondition(lambda self: self.config.disk_dir is not None)
    @rule()
    def restart(self) -> None:
        self.store.flush()
        self.lossy |= not self.lossless()
        self.store.close()  # flushes: everything put so far is durable
        self.store = CheckpointStore(self.config)

    @precondition(lambda self: self.config.disk_dir is not None)
    @rule()
    def flush(self) -> None:
        self.store.flush()
        assert self.store.stats().write_queue_depth == 0

    @invariant()
    def within_budgets(self) -> None:
        if self.store is None:
            return
        stats = self.store.stats()
        assert stats.ram_bytes <= self.config.ram_bytes
        assert stats.disk_bytes <= (self.config.disk_bytes if self.config.disk_dir else 0)
        assert stats.corrupt_records == 0
        event(f"evicted: ram={stats.ram_evictions + stats.ram_states_dropped > 0}")
        event(f"evicted: disk={stats.disk_evictions + stats.disk_states_dropped > 0}")

    def path(self, anchor: bytes) -> list[bytes]:
        chain = [anchor]
        while (parent := self.model[chain[-1]][0]) is not None:
            chain.append(parent)
        return chain[::-1]

    def deepest_state(self, chain: list[bytes]) -> int:
        return max((i + 1 for i, a in enumerate(chain) if self.model[a][1].has_state), default=0)

    def lossless(self) -> bool:
        """Nothing was evicted or refused anywhere, so every record put must be restorable."""
        s = self.store.stats()
        if self.config.disk_dir is not None:
            return s.disk_evictions == s.disk_states_dropped == s.write_errors == 0
        return s.ram_evictions == s.ram_states_dropped == s.ram_rejected == 0


StoreMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestStoreMachine = StoreMachine.TestCase
