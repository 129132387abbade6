"""Many agents in bounded memory: N sessions at once through the real server, the device keeping
live sequences for fewer of them, the RAM tier at a share of the run's working set, the disk tier on.

Sessions come from committed traces (`bench/pressure_workload.py`: told apart, a share spawning
subagents on their parent's system prompt and tools, each waiting its recorded or drawn tool time).
A first pass with an unbounded RAM tier measures the working set: the bytes of every checkpoint part
the run stores. Then, at each `--ram` share of it, one run per eviction order of the RAM tier
(`anchor`: the store's own, `lru`: plain least recently used), each on a fresh store, and the
offline optimum over each run's own access log (`bench/belady.py`). Per run:

- hit ratio: tokens restored / tokens restorable, where restorable = restored + `evicted` (tokens
  under a state checkpoint some earlier request took, no longer restorable), from `x-cached-tokens`
  and `x-prefill-reasons`; restored + every reason's tokens = the prompt's tokens (its usage);
- RAM hit ratio: bytes of record parts restores read from the RAM tier / bytes they read (the RAM
  tier's share; the disk tier serves the rest), beside Belady's on the same log: its upper bound;
- re-prefill ratio: tokens prefilled / tokens new since the session's previous request;
- client TTFT p50/p99 of requests after a tool result and at user turns;
- bytes moved per tier: parts read from RAM, the disk writer's queue and disk (the access log),
  `ft_store_bytes_restored` and evictions from /metrics;
- pins broken: pins of a session's state while its tool runs that a live request's memory broke, in
  the live tier and the RAM tier together (`ft_pins_broken_total`).

    python bench/pressure.py traces/sessions --sessions 8 16 32 --device cuda --json out.json
    python bench/pressure.py traces/sessions --sessions 4 --turns 4 --time-scale 0.01 --threads 1
    python bench/pressure.py traces/sessions --sessions 16 --logs /tmp/logs   # then bench/pressure_replay.py
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from belady import belady_hits, part_sizes
from pressure_workload import SPAWN_AFTER, Session, build_sessions

from adapters.client import (
    ReplayError,
    output_tokens_of,
    parse_prefill_reasons,
    parse_server_timing,
    stream,
    stream_body,
)
from adapters.replay import load_traces
from adapters.replay_report import percentile
from adapters.trace import TraceRequest
from checkpoint_store.store import Access
from ft.ps import scrape

GiB, MiB = 1 << 30, 1 << 20
ORDERS = ("anchor", "lru")
UNBOUNDED_GIB = 64.0  # the first pass's RAM tier: holds every checkpoint of a bench run


@dataclass
class Row:
    session: str
    index: int
    after_tool: bool
    prompt: int  # the answer's usage
    restored: int  # x-cached-tokens
    reasons: dict[str, int]  # x-prefill-reasons
    new: int  # prompt tokens beyond the session's previous prompt and answer
    output: int
    ttft_ms: float  # client side, to the first output event
    phases: dict[str, float] = field(default_factory=dict)  # the server's, ms (`server-timing`: queue, prefill, ...)

    @property
    def prefilled(self) -> int:
        return self.prompt - self.restored


@dataclass
class Run:
    policy: str
    ram_bytes: int
    rows: list[Row] = field(default_factory=list)
    log: list[Access] = field(default_factory=list)
    store: dict[str, float] = field(default_factory=dict)  # ft_store_* of /metrics at the end
    pins_broken: dict[str, float] = field(default_factory=dict)  # ft_pins_broken_total by tier at the end
    errors: list[str] = field(default_factory=list)


# -- one run -------------------------------------------------------------------------------------


def engine_config(args: argparse.Namespace) -> Any:
    from engine.engine_config import EngineConfig  # noqa: PLC0415

    return EngineConfig(device=args.device, max_running=args.max_running)


def run_once(engine: Any, args: argparse.Namespace, sessions: list[Session], policy: str, ram_bytes: int) -> Run:
    """Every session at once against a fresh server (`policy` evicting its RAM tier of `ram_bytes`)."""
    from gateway.embedded import serve_in_thread  # noqa: PLC0415
    from gateway.service import ServeConfig  # noqa: PLC0415

    run = Run(policy, ram_bytes)
    with tempfile.TemporaryDirectory(prefix="ft-pressure-") as disk:
        config = ServeConfig(model_dir=args.model, preset=args.preset, engine=engine_config(args),
                             eviction=policy, ram_cache_gib=(ram_bytes + 1) / GiB, disk_cache=Path(disk),
                             disk_cache_gib=args.disk_gib, live_sequences=args.live)
        with serve_in_thread(config, engine) as server:
            server.runtime.store.on_access = run.log.append
            spawned = {s.name: threading.Event() for s in sessions}
            threads = [threading.Thread(target=_drive, args=(server.url, s, spawned, run)) for s in sessions]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            server.wait_idle()
            run.store = _store_metrics(server.url)
            run.pins_broken = scrape(server.url, timeout=30).by("ft_pins_broken_total", "tier")
            server.runtime.store.on_access = None
    return run


def _drive(url: str, session: Session, spawned: dict[str, threading.Event], run: Run) -> None:
    """One session's requests in order, each after its wait; a subagent once its parent's answer is in."""
    if session.parent is not None:
        spawned[session.parent].wait()
    context = 0
    try:
        with httpx.Client(base_url=url, timeout=httpx.Timeout(3600, connect=30)) as client:
            for index, (req, wait) in enumerate(zip(session.requests, session.waits_s, strict=True)):
                time.sleep(wait)
                row = _send(client, session.name, index, req, context)
                run.rows.append(row)
                context = row.prompt + row.output
                if index + 1 >= SPAWN_AFTER:
                    spawned[session.name].set()
    except (httpx.HTTPError, ReplayError, KeyError, ValueError) as exc:
        run.errors.append(f"{session.name}: {type(exc).__name__}: {exc}")
    finally:
        spawned[session.name].set()  # a subagent never waits on a session that failed


def _send(client: httpx.Client, session: str, index: int, req: TraceRequest, context: int) -> Row:
    s = stream(client, req.path, stream_body(req), req.protocol)
    prompt = prompt_tokens_of(req.protocol, s.events)
    outputs = [n for event in s.events if (n := output_tokens_of(req.protocol, event))]
    return Row(session=session, index=index, after_tool=req.after_tool_result, prompt=prompt,
               restored=int(s.headers["x-cached-tokens"]),
               reasons=parse_prefill_reasons(s.headers.get("x-prefill-reasons", "")),
               new=prompt - context, output=outputs[-1] if outputs else 0, ttft_ms=s.ttft_ms,
               phases=parse_server_timing(s.headers.get("server-timing", "")))


def prompt_tokens_of(protocol: str, events: list[dict[str, Any]]) -> int:
    """The prompt's tokens as the answer's usage counts them (Anthropic's: uncached + read from cache)."""
    for event in reversed(events):
        holder = event.get("response") or event.get("message") or event
        usage = holder.get("usage") if isinstance(holder, dict) else None
        if not usage:
            continue
        if protocol == "chat":
            return int(usage["prompt_tokens"])
        if protocol == "anthropic" and "cache_read_input_tokens" in usage:
            return int(usage["input_tokens"]) + int(usage["cache_read_input_tokens"])
        if protocol == "responses" and "input_tokens" in usage:
            return int(usage["input_tokens"])
    raise ValueError(f"no prompt usage in the {protocol} answer")


def _store_metrics(url: str) -> dict[str, float]:
    """The server's `ft_store_*` samples without labels (read as `ft ps` reads them)."""
    samples = scrape(url, timeout=30)
    return {name.removeprefix("ft_store_"): value for (name, labels), value in samples.values.items()
            if name.startswith("ft_store_") and not labels}


def write_log(path: Path, log: list[Access]) -> None:
    """One access a line: its fields, anchors in hex."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for a in log:
            fields = vars(a) | {"anchor": a.anchor.hex(), "parent": a.parent.hex() if a.parent else None}
            f.write(json.dumps(fields) + "\n")


# -- figures -------------------------------------------------------------------------------------


def ratio(part: float, whole: float) -> float:
    return part / whole if whole else 1.0


def summarize(run: Run) -> dict[str, Any]:
    rows, sizes = run.rows, part_sizes(run.log)
    restored = sum(r.restored for r in rows)
    reasons = {k: sum(r.reasons.get(k, 0) for r in rows) for k in ("new", "edited", "evicted", "no_anchor")}
    fresh = [r for r in rows if r.new > 0]  # a prompt that rewrote history has no count of new tokens
    gets = [a for a in run.log if a.kind == "get"]
    read = {tier: sum(sizes.get((a.anchor, a.part), 0) for a in gets if a.source == tier)
            for tier in ("ram", "queue", "disk")}
    optimum, wanted = belady_hits(run.log, run.ram_bytes)
    tool = [r.ttft_ms for r in rows if r.after_tool]
    user = [r.ttft_ms for r in rows if not r.after_tool]
    return {
        "policy": run.policy,
        "ram_bytes": run.ram_bytes,
        "requests": len(rows),
        "errors": run.errors,
        "prompt_tokens": sum(r.prompt for r in rows),
        "restored_tokens": restored,
        "prefilled_by_reason": reasons,
        "unaccounted_requests": sum(r.restored + sum(r.reasons.values()) != r.prompt for r in rows),
        "hit_ratio": ratio(restored, restored + reasons["evicted"]),
        "ram_hit_ratio": ratio(read["ram"], sum(read.values())),
        "optimum_ram_hit_ratio": ratio(optimum, wanted),
        "reprefill_ratio": ratio(sum(r.prefilled for r in fresh), sum(r.new for r in fresh)),
        "ttft_ms": {
            "after_tool": {"n": len(tool), "p50": percentile(tool, 50), "p99": percentile(tool, 99)},
            "user_turn": {"n": len(user), "p50": percentile(user, 50), "p99": percentile(user, 99)},
        },
        "working_set_bytes": sum(sizes.values()),
        "put_bytes": sum(a.nbytes for a in run.log if a.kind == "put"),
        "read_bytes": read,
        "store_metrics": run.store,
        "pins_broken": int(sum(run.pins_broken.values())),
        "rows": [vars(r) for r in rows],
    }


# -- command line --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", type=Path, help="trace files or folders (as `ft replay` reads them)")
    p.add_argument("--sessions", type=int, nargs="+", default=[4], metavar="N", help="sessions at once (default 4)")
    p.add_argument("--subagents", type=float, default=0.25, metavar="SHARE",
                   help="share of the sessions that are subagents on a parent's prefix (default 0.25)")
    p.add_argument("--turns", type=int, default=8, help="requests of each session at most (default 8)")
    p.add_argument("--time-scale", type=float, default=1.0, help="factor on every tool time (default 1)")
    p.add_argument("--draw-tool-time", action="store_true", help="draw every tool time (lognormal), recorded or not")
    p.add_argument("--ram", type=float, nargs="+", default=[0.25, 0.5, 1.0], metavar="SHARE",
                   help="RAM tier budgets as shares of the working set (default 0.25 0.5 1)")
    p.add_argument("--live", type=int, metavar="N", help="live sequences kept on the device (default N/4, at least 1)")
    p.add_argument("--preset", default="tiny", help="model preset served in this process (default tiny)")
    p.add_argument("--model", type=Path, metavar="DIR", help="a model folder to serve instead of the preset")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--max-running", type=int, default=4, metavar="N", help="sequences decoded together (default 4)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--disk-gib", type=float, default=4.0, help="disk tier's cap (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the drawn tool times (default 0)")
    p.add_argument("--json", type=Path, metavar="OUT", help="write every figure and request as JSON")
    p.add_argument("--logs", type=Path, metavar="DIR",
                   help="write each run's access log as JSON lines (bench/pressure_replay.py replays them)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console  # noqa: PLC0415

    from gateway.service import ServeConfig, load_engine  # noqa: PLC0415

    args = parse_args(argv)
    if args.threads:
        import torch  # noqa: PLC0415

        torch.set_num_threads(args.threads)
    traces = load_traces(args.traces)
    engine = load_engine(ServeConfig(model_dir=args.model, preset=args.preset, engine=engine_config(args)))
    console = Console(width=200)
    results = []
    for n in args.sessions:
        live = args.live if args.live is not None else max(1, n // 4)
        sized = argparse.Namespace(**{**vars(args), "live": live})
        sessions = build_sessions(traces, n, args.subagents, args.turns, args.time_scale, args.seed,
                                  args.draw_tool_time)
        first = summarize(run_once(engine, sized, sessions, "anchor", int(UNBOUNDED_GIB * GiB)))
        working_set = first["working_set_bytes"]
        runs = []
        for share in args.ram:
            for policy in ORDERS:
                run = run_once(engine, sized, sessions, policy, int(share * working_set))
                if args.logs:
                    write_log(args.logs / f"n{n}-{policy}-{share:g}.jsonl", run.log)
                runs.append(summarize(run) | {"ram_share": share})
        results.append({"sessions": n, "subagents": sum(s.parent is not None for s in sessions), "live": live,
                        "working_set_bytes": working_set, "first_pass": first, "runs": runs})
    console.print(table(results))
    for result in results:
        for run in result["runs"]:
            tool = [row for row in run["rows"] if row["after_tool"]]
            if (r := max(tool, key=lambda row: row["ttft_ms"], default=None)) is not None:
                phases = ", ".join(f"{k} {v:,.0f}" for k, v in r["phases"].items())
                console.print(f"N={result['sessions']} RAM {run['ram_share']:.0%} {run['policy']}: slowest after a tool "
                              f"{r['session']}#{r['index']}, {r['new']:,} new tokens, TTFT {r['ttft_ms']:,.0f} ms "
                              f"(server ms: {phases or 'no server-timing'})")
    if args.json:
        meta = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
                "model": str(args.model) if args.model else args.preset,
                "device": args.device, "threads": args.threads, "traces": [str(p) for p in args.traces]}
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        console.print(f"wrote {args.json}")
    failed = [e for r in results for run in [r["first_pass"], *r["runs"]] for e in run["errors"]]
    for error in failed:
        console.print(f"[red]{error}")
    return 1 if failed else 0


def table(results: list[dict[str, Any]]) -> Any:
    from rich.table import Table  # noqa: PLC0415

    t = Table(title="Sessions under memory pressure (hit: tokens restored / restorable; RAM hit: bytes restores "
                    "read from RAM; Belady: the offline optimum's on the same run's accesses)")
    for name in ("N", "RAM", "policy", "hit", "RAM hit", "Belady", "re-prefill", "TTFT tool p50/p99 ms",
                 "TTFT user p50/p99 ms", "read MiB ram/queue/disk", "evicted records+states", "pins broken"):
        t.add_column(name, justify="left" if name == "policy" else "right")
    for result in results:
        for run in result["runs"]:
            m, tt, read = run["store_metrics"], run["ttft_ms"], run["read_bytes"]
            t.add_row(
                f"{result['sessions']} ({result['subagents']} sub, {result['live']} live)",
                f"{run['ram_share']:.0%} {run['ram_bytes'] / MiB:,.1f} MiB", run["policy"],
                f"{run['hit_ratio']:.3f}", f"{run['ram_hit_ratio']:.3f}", f"{run['optimum_ram_hit_ratio']:.3f}",
                f"{run['reprefill_ratio']:.2f}",
                f"{tt['after_tool']['p50']:.0f} / {tt['after_tool']['p99']:.0f}",
                f"{tt['user_turn']['p50']:.0f} / {tt['user_turn']['p99']:.0f}",
                " / ".join(f"{read[k] / MiB:,.1f}" for k in ("ram", "queue", "disk")),
                f"{m.get('ram_evictions', 0):.0f}+{m.get('ram_states_dropped', 0):.0f}",
                str(run["pins_broken"]),
            )
    return t


if __name__ == "__main__":
    sys.exit(main())
