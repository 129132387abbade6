"""Where a decode token's wall time goes, without the profiler (CUPTI's per-node tracing of a
~2,000-node graph inflates the launch it measures): the host's time in each graph launch, in the
offload's between-steps work (`ExpertOffload.settle`), waiting for the token (the sampler's read
of the logits) and everything else, beside the device's time per graph (CUDA events around each
replay). `wall - graph device` is the time the device idles between graphs.

    with DecodeTimeline() as t:
        list(engine.generate(state, logits, params))
    print(t.summary(steps))
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch


class DecodeTimeline:
    """Patches `CUDAGraph.replay`, `ExpertOffload.settle` and `Sampler.__call__` while entered and
    sums their host seconds; CUDA events bracket every replay (their elapsed times are read at
    exit, after a synchronize)."""

    def __init__(self):
        self.host: dict[str, float] = defaultdict(float)
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.wall = 0.0

    def _wrap(self, owner, name: str, key: str, bracket: bool = False) -> None:
        original = getattr(owner, name)
        self._undo.append((owner, name, original))
        host, events = self.host, self.events

        def timed(*args, **kwargs):
            if bracket:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            began = time.perf_counter()
            out = original(*args, **kwargs)
            host[key] += time.perf_counter() - began
            if bracket:
                end.record()
                events.append((start, end))
            return out

        setattr(owner, name, timed)

    def __enter__(self) -> DecodeTimeline:
        from engine.offload import ExpertOffload  # noqa: PLC0415
        from engine.sampling import Sampler  # noqa: PLC0415

        self._undo = []
        self._wrap(torch.cuda.CUDAGraph, "replay", "graph launch", bracket=True)
        self._wrap(ExpertOffload, "settle", "offload settle")
        self._wrap(Sampler, "__call__", "sample (waits for the token)")
        torch.cuda.synchronize()
        self._began = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize()
        self.wall = time.perf_counter() - self._began
        for owner, name, original in self._undo:
            setattr(owner, name, original)

    def summary(self, tokens: int) -> dict:
        """Per token, in ms: wall, the graphs' device time, the device's idle time between them,
        and the host's time in each wrapped call and outside them."""
        device = sum(start.elapsed_time(end) for start, end in self.events)
        out = {
            "wall_ms": self.wall * 1e3 / tokens,
            "graphs_per_token": len(self.events) / tokens,
            "graph_device_ms": device / tokens,
        }
        out["device_idle_ms"] = out["wall_ms"] - out["graph_device_ms"]
        for key, seconds in self.host.items():
            out[f"host {key} ms"] = seconds * 1e3 / tokens
        out["host other ms"] = out["wall_ms"] - sum(s * 1e3 / tokens for s in self.host.values())
        return out


def show(name: str, summary: dict) -> None:
    print(f"{name}, per token: " + ", ".join(f"{k} {v:.2f}" for k, v in summary.items()), flush=True)


def decoding(engine, prompt: list[int]):
    """A state after a prefill of `prompt` and one greedy decode step (the graph captured, the
    caches warm), and that step's logits."""
    state = engine.new_state()
    return state, engine.decode(state, int(engine.prefill(state, prompt).logits.argmax()))


def decode_timeline(engine, prompt: list[int], steps: int = 16) -> dict:
    """`steps` greedy decode steps after `decoding(prompt)`, under `DecodeTimeline`; its summary
    per token."""
    from engine import SamplingParams  # noqa: PLC0415

    state, logits = decoding(engine, prompt)
    with DecodeTimeline() as timeline:
        list(engine.generate(state, logits, SamplingParams(temperature=0.0, max_tokens=steps + 1)))
    return timeline.summary(steps)
