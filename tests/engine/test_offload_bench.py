"""`bench/offload.py --preset tiny` on the CPU: one budget in its child process, the table and the
JSON with speed, link bytes and a short replay per policy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.test_offload import budget_gib

BENCH = Path(__file__).resolve().parents[2] / "bench" / "offload.py"


@pytest.mark.slow  # about 50 s on 2 cores: a child process, a load, a warm-up and two replays
def test_bench_smoke_run_on_the_cpu(tiny, tmp_path, ft_home):
    budget = budget_gib(tiny, 3, max_running=1)  # 3 of 8 experts per layer: long chunks stream
    out = tmp_path / "offload.json"
    argv = [
        sys.executable,
        str(BENCH),
        "--preset",
        "tiny",
        "--device",
        "cpu",
        "--budgets",
        f"{budget:.6f}",
        "--context",
        "64",
        "--decode-steps",
        "4",
        "--limit",
        "3",
        "--policies",
        "anchor,none",
        "--step-log",
        "0",
        "--json",
        str(out),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "expert offload" in proc.stdout and "worst after a tool" in proc.stdout
    assert "prefill forward of" in proc.stderr and "prefill tokens in" in proc.stderr  # the replay's step log
    result = json.loads(out.read_text())
    (run,) = result["budgets"]
    assert run["plan"]["slots"] == 3 and run["experts"] == 8
    assert run["prefill_tokens"] == 64 and run["prefill_bytes"] > 0 and run["decode_steps"] == 4
    assert 0 <= run["decode_hit_rate"] <= 1 and run["decode_in_place_tok_s"] > 0  # staged, and the baseline
    anchor, none = run["replay"]["anchor"], run["replay"]["none"]
    assert anchor["prefilled_tokens"] < none["prefilled_tokens"]  # request 3 restores request 2's anchors
    assert anchor["worst_after_tool_ms"] > 0
