"""The load test (slow): 16 concurrent agent-like sessions for 10 minutes against a real `ft serve`
(bench/load.py), some abandoning their answers mid-stream: no errors, no memory growth past the
warm-up beyond a bound, a clean exit. The figures are printed and written as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_GROWTH_MIB = 256  # RSS growth from the end of the first minute to the end: a leak, not a cache filling


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_sixteen_sessions_for_ten_minutes(tmp_path):
    out = tmp_path / "load.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "load.py"),
            "--sessions",
            "16",
            "--minutes",
            "10",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=1400,
    )
    print(done.stdout)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["errors"] == 0, summary["error_kinds"]
    assert summary["exit_code"] == 0
    assert summary["requests"] > 16 and summary["ttft_ms"]["p50"] > 0
    assert summary["rss_mib"]["growth_after_warmup"] < MAX_GROWTH_MIB, summary["rss_mib"]
