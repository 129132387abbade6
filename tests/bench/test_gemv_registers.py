"""bench/gemv_registers.py: the GEMV's registers read from its sm_90 cubin on this CPU machine, and the
warps an SM keeps resident at that count."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def test_resident_warps_from_registers():
    from bench.gemv_registers import resident_warps  # noqa: PLC0415

    assert resident_warps(255, 4) == 8  # 2 CTAs of 128 threads in 65,536 registers
    assert resident_warps(96, 4) == 20
    assert resident_warps(32, 8) == 64  # the SM's 64 warps bound it, not the registers


def test_the_table_for_the_launch_configuration():
    out = subprocess.run([sys.executable, "bench/gemv_registers.py", "--formats", "q8_0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    if out.returncode != 0 and ("ptxas" in out.stderr or "backend" in out.stderr):
        pytest.skip(f"triton cannot compile for sm_90 here: {out.stderr[-300:]}")
    assert out.returncode == 0, out.stderr
    row = out.stdout.splitlines()[-1].split()
    assert row[:2] == ["32", "4"] and len(row) == 2 + 2 * 5  # BN, warps, then registers and warps per mode
    for regs, warps in zip(row[2::2], row[3::2], strict=True):
        assert 0 < int(regs.rstrip("r")) <= 255 and 0 < int(warps.rstrip("w")) <= 64
