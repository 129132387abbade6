"""Everything a running server holds: settings, engine, store, renderer, memo, scheduler,
metrics and recorder, and what each request is given from them: the `RestorePlanner` (its plan) and
the `Checkpoints` (its checkpoint steps on the worker). Built once by `build_service`; only the
app's wiring reads it (a request's work is given the parts it uses), nothing is global."""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from checkpoint_store import CheckpointStore, StoreConfig
from engine import Engine
from engine.engine_config import EngineConfig
from engine.warmup import warm_up
from gateway.anchors import root_anchor
from gateway.checkpoints import Checkpoints
from gateway.live import LiveSequences
from gateway.memo import MemoFile, TokenMemo
from gateway.metrics import Metrics, PinCounts
from gateway.pins import PinConfig, Pins
from gateway.plan import RestorePlanner
from gateway.recorder import Recorder
from gateway.render import Renderer, load_renderer
from gateway.replay_outputs import ReplayOutputs
from gateway.retention import Retention
from gateway.scheduler import Scheduler
from gateway.store_queue import StoreQueue
from gateway.tenants import TenantKey
from gateway.volatile import VolatileRules

log = logging.getLogger("gateway")
GiB = 1 << 30
DEVICE_PARTS = ("weights", "decode_slots", "expert_cache", "expert_staging", "expert_stream", "live_sequences")


@dataclass(frozen=True)
class ServeConfig:
    model_dir: Path | None = None
    preset: str = "tiny"
    engine: EngineConfig = EngineConfig()  # how the engine runs the model: device, max_running, budgets
    rank_engines: tuple[EngineConfig, ...] = ()  # expert parallel: ranks 1.. (`engine` is rank 0's), each its own plan's
    host: str = "127.0.0.1"
    port: int = 1919
    ram_cache_gib: float = 4.0
    disk_cache: Path | None = None
    disk_cache_gib: float = 64.0
    policy: str = "anchor"
    eviction: str = "anchor"  # the RAM tier's eviction order (checkpoint_store/eviction.py ORDERS)
    api_key: str | tuple[TenantKey, ...] | None = None  # one unnamed key, or tenants (gateway/tenants.py)
    record_dir: Path | None = None
    replay_outputs: Path | None = None
    keep_volatile: bool = False
    max_body_bytes: int = 32 << 20
    default_max_tokens: int = 2048
    max_tokens_cap: int | None = None
    forced_decode: str = "prefill"  # "prefill" | "steps" (see gateway/generation.py)
    live_sequences: int = 4  # sequences kept after their answer, continued in place (0: always restore)
    pins: PinConfig = PinConfig()  # a session's state kept while its tool runs (gateway/pins.py)
    max_queue: int = 64  # requests waiting beyond the engine's max_running; more are answered `overloaded`
    model_name: str | None = None


@dataclass
class Service:
    config: ServeConfig
    engine: Engine
    store: CheckpointStore
    renderer: Renderer
    root: bytes
    model_id: str
    memo: TokenMemo = field(default_factory=TokenMemo)
    scheduler: Scheduler = field(init=False)
    store_queue: StoreQueue = field(init=False)
    metrics: Metrics = field(default_factory=Metrics)
    recorder: Recorder | None = None
    replay: ReplayOutputs | None = None
    started_at: float = field(default_factory=time.time)
    planner: RestorePlanner = field(init=False)  # a request's plan, off the event loop
    checkpoints: Checkpoints = field(init=False)  # every request's checkpoint steps (worker only)
    live: LiveSequences = field(init=False)  # sequences kept on the device between requests (worker only)
    pins: Pins = field(init=False)  # answers that ended in a tool call, kept while the tool runs
    retention: Retention = field(init=False)  # what the pins keep, prefetched and expired off the worker

    def __post_init__(self) -> None:
        self.scheduler = Scheduler(self.engine, self.config.max_queue)
        self.store_queue = StoreQueue(self.store)
        self.planner = RestorePlanner(self.renderer, self.memo, self.root, self.volatile_rules, self.replay,
                               self.engine.max_context, self.config.default_max_tokens, self.config.max_tokens_cap)
        self.pins = Pins(self.config.pins)
        self.live = LiveSequences(self.config.live_sequences, self.pins)  # sequences left at a state checkpoint
        self.retention = Retention(self.pins, self.store, self.store_queue, self.live, self.scheduler)
        self.checkpoints = Checkpoints(self.engine, self.store, self.store_queue, self.live, self.metrics,
                                       self.config.policy, self.root, self.scheduler, self.retention)
        self.live.spill = self.checkpoints.spill  # a dropped sequence's state goes down to the store
        self.engine.relieve = self.live.yield_memory  # under a budget, kept sequences yield to a forward

    @property
    def idle(self) -> bool:
        """No request, background work or checkpoint write queued or running."""
        return self.scheduler.idle and self.store_queue.idle

    def memory(self) -> dict[str, int]:
        """Resident bytes by part: the engine's (weights, decode slots on its device), the live
        sequences' beyond the slots (on the device, kept between requests) and the checkpoint RAM
        cache's budget (host memory; what it holds is `ft_store_ram_bytes`). On a GPU also all that
        torch's allocator holds there (`device_reserved`) and the rest of it beyond those parts
        (`workspace`: forwards' activations, CUDA graphs' pools, captures in flight, free blocks)."""
        memory = {**self.engine.memory(), "live_sequences": self.engine.held_bytes(self.live.states()),
                  "ram_cache_budget": int(self.config.ram_cache_gib * GiB)}
        if (reserved := memory.get("device_reserved")) is not None:
            on_device = sum(memory.get(part, 0) for part in DEVICE_PARTS)
            memory["workspace"] = max(0, reserved - on_device)
        return memory

    def pin_counts(self) -> PinCounts:
        """Pins held now and pins broken so far, by tier (the live tier on the device; the store's RAM)."""
        return PinCounts(self.pins.active, {"device": self.pins.broken_live, "ram": self.store.pins_broken})

    @property
    def volatile_rules(self) -> VolatileRules:
        return VolatileRules(billing_header="keep" if self.config.keep_volatile else "drop")

    def close(self) -> None:
        self.retention.close()
        self.scheduler.close()
        self.store_queue.close()
        self.store.flush()
        self.store.close()
        self.memo.close()
        if self.recorder is not None:
            self.recorder.close()


def load_engine(config: ServeConfig) -> Engine:
    """The model, run as `config.engine` says, warmed up (the first request must not pay for
    kernel compilation)."""
    if config.model_dir is not None:
        engine = Engine.load(config.model_dir, config.engine)
    else:
        engine = Engine.from_preset(config.preset, config.engine)
    warm_up(engine)
    return engine


def ignore_file_size_signal() -> None:
    """A write past the file-size limit (RLIMIT_FSIZE) then fails with EFBIG, a counted cache
    write error, instead of killing the server with SIGXFSZ. CPython already ignores it at
    start-up; an embedding program may not (only the main thread can change it)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def build_service(config: ServeConfig, engine: Engine | None = None) -> Service:
    """A service with a fresh store; `engine` reuses an already loaded model (replays that
    compare policies on one set of weights), which brings its own `EngineConfig` (`config.engine`
    is then not used)."""
    engine = engine or load_engine(config)
    model_id = config.model_name or (config.model_dir.name if config.model_dir else config.preset)
    renderer = load_renderer(engine.model_dir)
    if config.disk_cache is not None:
        ignore_file_size_signal()
    store = CheckpointStore(StoreConfig(
        ram_bytes=int(config.ram_cache_gib * GiB),
        disk_dir=config.disk_cache,
        disk_bytes=int(config.disk_cache_gib * GiB),
        fingerprint=engine.fingerprint,
        eviction=config.eviction,
    ))
    root = root_anchor(engine.fingerprint, renderer.template_id)
    # the memo's ids belong to this model and template, as the checkpoints do
    # failed memo writes count and log with the store's (one disk, one line in the log); a cache
    # folder the store could not use (already logged) keeps the memo in memory, as the checkpoints
    memo_file = (MemoFile(config.disk_cache / f"memo-{root.hex()[:16]}", errors=store.write_errors)
                 if config.disk_cache and store.has_disk else None)
    return Service(
        config=config,
        engine=engine,
        store=store,
        renderer=renderer,
        root=root,
        model_id=model_id,
        memo=TokenMemo(file=memo_file),
        recorder=Recorder(config.record_dir) if config.record_dir else None,
        replay=ReplayOutputs.load(config.replay_outputs) if config.replay_outputs else None,
    )
