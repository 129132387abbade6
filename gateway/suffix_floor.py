"""The suffix floor: the measured time to prefill only a request's new tokens from a warm state.

`POST /v1/ft/suffix_floor` with `{"context": C, "new": N}` answers `{"ms": ...}`: on the engine
worker, a state holding C filler tokens is restored from a cached snapshot (never consumed) and
the prefill of N more filler tokens is timed. Filler is real code (this project's gateway
sources, tokenized once and cycled), so the MoE routes it as it routes an agent's tool output;
the filler token at position p is a fixed function of p, so a cached state at length L is a prefix of every longer one: a query extends the nearest
cached state below C (untimed) and caches the result, one state per 1024-token bucket, the few
most recently used kept. A replay that asks with growing C therefore calibrates each token once.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from checkpoint_store.snapshot import Snapshot
from engine import Engine
from gateway.endpoint import read_json
from gateway.errors import BadRequest
from gateway.service import Service

BUCKET_TOKENS = 1024
MAX_CACHED = 4
FILLER_LOW = 1000  # stay clear of the low (byte-level, special-adjacent) ids
MAX_BODY_BYTES = 4096


class SuffixFloor:
    """Calibration states of one engine, and the timed suffix prefill. Use on the engine worker."""

    def __init__(self, engine: Engine, corpus: list[int] | None = None, max_cached: int = MAX_CACHED) -> None:
        self.engine = engine
        self.max_cached = max_cached
        self._states: OrderedDict[int, Snapshot] = OrderedDict()  # bucket -> snapshot from position 0
        span = max(1, min(engine.config.vocab_size, 200_000) - FILLER_LOW)
        self.corpus = corpus or [FILLER_LOW + (p * 7919) % span for p in range(8192)]

    def filler(self, start: int, end: int) -> list[int]:
        """Deterministic token ids for positions [start, end)."""
        n = len(self.corpus)
        return [self.corpus[p % n] for p in range(start, end)]

    def measure(self, context: int, new: int) -> float:
        """Milliseconds to prefill `new` tokens after `context` tokens of warm state."""
        state = self._warm_state(context)
        ids = self.filler(context, context + new)
        started = time.perf_counter()
        self.engine.prefill(state, ids)
        return 1000 * (time.perf_counter() - started)

    def _warm_state(self, context: int):
        base = max((s for s in self._states.values() if s.end <= context), key=lambda s: s.end, default=None)
        state = self.engine.new_state() if base is None else self.engine.restore(base)
        if state.length < context:
            self.engine.prefill(state, self.filler(state.length, context))
        if context > 0:
            self._keep(context // BUCKET_TOKENS, self.engine.snapshot(state, 0))
        return state

    def _keep(self, bucket: int, snapshot: Snapshot) -> None:
        self._states[bucket] = snapshot
        self._states.move_to_end(bucket)
        while len(self._states) > self.max_cached:
            self._states.popitem(last=False)


def code_corpus(tokenizer) -> list[int]:
    """Token ids of the gateway package's Python sources (a fixed, realistic filler)."""
    root = Path(__file__).resolve().parent.parent / "gateway"
    return list(tokenizer.encode("".join(p.read_text(encoding="utf-8") for p in sorted(root.rglob("*.py")))))


def parse_floor_body(body: dict, max_context: int) -> tuple[int, int]:
    """(context, new) from a request body, or BadRequest."""
    values = []
    for name, low in (("context", 0), ("new", 1)):
        value = body.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise BadRequest(name, f"expected an integer >= {low}")
        values.append(value)
    context, new = values
    if context + new > max_context:
        raise BadRequest("new", f"context + new = {context + new} exceeds the model's {max_context} tokens")
    return context, new


async def suffix_floor(request: Request) -> Response:
    """`POST /v1/ft/suffix_floor`: {"context": C, "new": N} -> {"ms": float, "context": C, "new": N}."""
    rt: Service = request.app.state.runtime
    context, new = parse_floor_body(await read_json(request, MAX_BODY_BYTES), rt.engine.max_context)
    floor = getattr(request.app.state, "suffix_floor", None)
    if floor is None:
        corpus = await rt.scheduler.run(lambda: code_corpus(rt.renderer.tokenizer))
        floor = request.app.state.suffix_floor = SuffixFloor(rt.engine, corpus)
    ms = await rt.scheduler.run(lambda: floor.measure(context, new))
    return JSONResponse({"ms": round(ms, 3), "context": context, "new": new})
