"""Replay a `bench/pressure.py --logs` access log through the store's RAM tier offline, and show where
an eviction order loses to the offline optimum.

The log's puts, promotions and restores are applied to a real `RamTier` (sizes only) in the given
order at a budget, with the run's pins; a replay approximates the run (the run's timing, live sequences and
prefetches stay as they were logged). Reported:
the RAM byte-hit ratio beside Belady's (`bench/belady.py`) and the order's regrets, each by part
class (part, segment kind):

- evicted then read: a part the tier gave up whose next access is a read, with how many restores
  later (the optimum gives up the part read last, never one read next);
- admitted and never read: bytes a put or a promotion took in whose next access is not a read
  (they displaced something for nothing).

    python bench/pressure_replay.py /tmp/logs/n16-anchor-0.5.jsonl --order anchor lru
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from belady import belady_hits, part_sizes

from checkpoint_store.ram import RamTier
from checkpoint_store.record import KV_PART, STATE_PART, RecordMeta
from checkpoint_store.store import Access

Key = tuple[bytes, str]
MARKS = ("pin", "unpin")  # accesses that move no bytes


@dataclass(frozen=True)
class Sized:
    """A part as the tier accounts it: its bytes."""

    nbytes: int


def read_log(path: Path) -> list[Access]:
    out = []
    for line in path.read_text().splitlines():
        f = json.loads(line)
        f["anchor"] = bytes.fromhex(f["anchor"])
        f["parent"] = bytes.fromhex(f["parent"]) if f.get("parent") else None
        out.append(Access(**f))
    return out


def replay(log: list[Access], budget: int, order: str) -> dict:
    """The RAM tier's hits over `log` at `budget` in `order`, and its regrets."""
    sizes, metas, kinds = part_sizes(log), {}, {}
    for a in log:
        if a.kind == "put":
            metas[a.anchor] = RecordMeta(a.anchor, a.parent, a.start, a.end)
            kinds[a.anchor] = a.segment
    ram = RamTier(budget, order)
    restore_no = _restore_numbers(log)
    next_read = _next_reads(log)
    evicted: list[tuple[int, Key]] = []
    original = ram._evict

    def evict(anchor: bytes, part: str) -> None:
        evicted.append((position, (anchor, part)))
        original(anchor, part)

    ram._evict = evict  # type: ignore[method-assign]
    hit = wanted = 0
    clock = 0
    regrets: dict[str, Counter] = {"evicted_read": Counter(), "admitted_unread": Counter()}
    soon: dict[str, list[int]] = defaultdict(list)
    i = 0
    while i < len(log):
        position, a = i, log[i]
        if a.kind not in ("put", "promote", "get"):
            if a.kind in MARKS:
                (ram.pinned.add if a.kind == "pin" else ram.pinned.discard)(a.anchor)
            i += 1
            continue
        if a.kind in ("put", "promote"):
            clock += 1
            j = i + 1
            state = None
            if j < len(log) and log[j].anchor == a.anchor and log[j].kind == a.kind and log[j].part == STATE_PART:
                state, j = Sized(sizes.get((a.anchor, STATE_PART), log[j].nbytes)), j + 1
            held = ram.get(a.anchor)
            kv = Sized(sizes.get((a.anchor, KV_PART), a.nbytes))
            if a.part == STATE_PART:  # a promotion of the state alone
                state, kv = Sized(sizes.get((a.anchor, STATE_PART), a.nbytes)), held.kv if held else kv
            before = {p for p in (KV_PART, STATE_PART) if _holds(ram, a.anchor, p)}
            ram.put(metas[a.anchor], kv, state, clock, break_pins=a.kind == "put")
            for p in (KV_PART, STATE_PART):
                if p not in before and _holds(ram, a.anchor, p) and next_read[(i, p)] is None:
                    regrets["admitted_unread"][_cls(p, kinds, a.anchor)] += sizes.get((a.anchor, p), 0)
            i = j
            continue
        clock += 1  # a restore: its gets, the last one a state
        j = i
        while j < len(log) and log[j].kind == "get":
            g = log[j]
            wanted += sizes.get((g.anchor, g.part), 0)
            hit += sizes.get((g.anchor, g.part), 0) if _holds(ram, g.anchor, g.part) else 0
            ram.touch(g.anchor, clock, with_state=g.part == STATE_PART)
            j += 1
            if g.part == STATE_PART:
                break
        i = j
    next_after = _next_after(log)
    for at, (anchor, part) in evicted:
        later = next_after(at, anchor, part)
        if later is not None and log[later].kind == "get":
            cls = _cls(part, kinds, anchor)
            regrets["evicted_read"][cls] += sizes.get((anchor, part), 0)
            soon[cls].append(restore_no[later] - restore_no[at])
    optimum, _ = belady_hits(log, budget)
    return {"order": order, "ram_hit": hit / wanted if wanted else 1.0, "belady": optimum / wanted if wanted else 1.0,
            "regrets": regrets, "restores_until_read": soon}


def _holds(ram: RamTier, anchor: bytes, part: str) -> bool:
    held = ram.get(anchor)
    return held is not None and (part == KV_PART or held.state is not None)


def _cls(part: str, kinds: dict[bytes, str], anchor: bytes) -> str:
    return f"{part}:{kinds.get(anchor) or '?'}"


def _restore_numbers(log: list[Access]) -> list[int]:
    out, n = [], 0
    for a in log:
        n += a.kind == "get" and a.part == STATE_PART
        out.append(n)
    return out


def _next_reads(log: list[Access]) -> dict[tuple[int, str], int | None]:
    """For each put or promotion at i and part p of its record: the index of that part's next access
    if it is a read, else None."""
    following: dict[Key, int] = {}
    out: dict[tuple[int, str], int | None] = {}
    for i in range(len(log) - 1, -1, -1):
        a = log[i]
        if a.kind in MARKS:
            continue
        for p in (KV_PART, STATE_PART):
            nxt = following.get((a.anchor, p))
            out[(i, p)] = nxt if nxt is not None and log[nxt].kind == "get" else None
        following[(a.anchor, a.part)] = i
    return out


def _next_after(log: list[Access]) -> Callable[[int, bytes, str], int | None]:
    """A lookup: the index of a part's first access after a position (marks aside), or None."""
    positions: dict[Key, list[int]] = defaultdict(list)
    for k, a in enumerate(log):
        if a.kind not in MARKS:
            positions[(a.anchor, a.part)].append(k)

    def after(at: int, anchor: bytes, part: str) -> int | None:
        found = positions.get((anchor, part), [])
        k = bisect.bisect_right(found, at)
        return found[k] if k < len(found) else None

    return after


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument("--order", nargs="+", default=["anchor", "lru"])
    p.add_argument("--share", type=float, help="budget as a share of the log's parts (default: from the name)")
    args = p.parse_args(argv)
    for path in args.logs:
        log = read_log(path)
        share = args.share or float(path.stem.rsplit("-", 1)[1])
        budget = int(share * sum(part_sizes(log).values()))
        for order in args.order:
            r = replay(log, budget, order)
            print(f"{path.name} {order}: RAM hit {r['ram_hit']:.3f}, Belady {r['belady']:.3f}")
            for name, counts in r["regrets"].items():
                top = ", ".join(f"{c} {n / 2**20:.1f} MiB" for c, n in counts.most_common(6))
                print(f"  {name}: {top}")
            waits = {c: sorted(v) for c, v in r["restores_until_read"].items()}
            print("  restores until read: " + "; ".join(
                f"{c} median {v[len(v) // 2]} (n {len(v)})" for c, v in waits.items() if v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
