"""Two trees' figures side by side: the prefill and the decode per batch (`bench/gpu.py --only
prefill,decode,batched` JSON) and the K sessions at once (`bench/llamacpp.py --sessions` JSON), each as
this tree against a base tree.

    python bench/compare.py --decode BASE.json CURRENT.json --sessions BASE.json CURRENT.json [--json OUT]

Prints one table per figure (the base, the current tree, current / base) and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

SESSION_FIELDS = ("p50_ttft_ms", "p95_ttft_ms", "worst_ttft_after_tool_ms", "wall_s", "output_tokens_per_s")


def decode_rows(path: Path) -> dict[str, float]:
    """Milliseconds a prefill of a fresh sequence per context, keyed `prefill N`, and a decode step per
    batch size, keyed `batch N` (what the JSON holds of each)."""
    data = json.loads(path.read_text())
    prefill = {f"prefill {r['context']}": r["seconds"] * 1e3 for r in data.get("prefill", [])}
    return {**prefill, **{f"batch {r['batch']}": r["ms_per_step"] for r in data.get("batched_decode", [])}}


def session_rows(path: Path) -> dict[str, float]:
    """Each run's summary fields, keyed `K=k server field`."""
    data = json.loads(path.read_text())
    rows = {}
    for run in data["runs"]:
        for field in SESSION_FIELDS:
            rows[f"K={run['k']} {run['server']} {field}"] = run["summary"][field]
    return rows


def side_by_side(title: str, base: dict[str, float], current: dict[str, float]) -> list[dict]:
    """Rows present in either tree, with current / base where both have them; printed as a table."""
    table = Table(title=title)
    for column in ("figure", "base", "current", "current / base"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    rows = []
    for key in dict.fromkeys([*base, *current]):
        b, c = base.get(key), current.get(key)
        ratio = c / b if b and c is not None else None
        rows.append({"figure": key, "base": b, "current": c, "ratio": ratio})
        cells = [f"{v:,.2f}" if v is not None else "-" for v in (b, c)]
        table.add_row(key, *cells, f"{ratio:.3f}" if ratio is not None else "-")
    Console().print(table)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decode", nargs=2, type=Path, metavar=("BASE", "CURRENT"), help="bench/gpu.py JSON")
    p.add_argument(
        "--sessions", nargs=2, type=Path, metavar=("BASE", "CURRENT"), help="bench/llamacpp.py JSON"
    )
    p.add_argument("--json", type=Path, help="write the tables here")
    args = p.parse_args(argv)
    out = {}
    if args.decode:
        out["prefill_decode_ms"] = side_by_side("prefill and decode, ms", *map(decode_rows, args.decode))
    if args.sessions:
        out["sessions"] = side_by_side("K sessions at once", *map(session_rows, args.sessions))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
