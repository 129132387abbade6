"""bench/quant.py, through `bench/llamacpp_h200.sh quant`, on the CPU with the tiny preset: each part runs by the engine's normal loading
path, the JSON holds its figures and merges parts run in separate processes, the table shows the
targets beside them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peer.llama_server import server_binary

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "--preset",
    "tiny",
    "--device",
    "cpu",
    "--prefill",
    "64",
    "--context",
    "16",
    "--steps",
    "2",
    "--batches",
    "1,4",
]


def bench(tmp_path: Path, parts: str, *args: str, peer_home: Path | None = None) -> str:
    """`bench/llamacpp_h200.sh quant` (the H200 command) with the tiny preset on the CPU: the script's
    own arguments come first, so these override them."""
    env = dict(os.environ)  # the session's FT_HOME (tests/conftest.py): the tiny preset is written once
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # the script runs python3
    if peer_home is not None:
        env["FT_PEER_HOME"] = str(peer_home)
    run = subprocess.run(
        ["bash", "bench/llamacpp_h200.sh", "quant", str(tmp_path / "quant.json"), parts, *SMALL, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "quant.md").read_text() in run.stdout  # the table, also beside the JSON
    return run.stdout


def test_bf16_and_fp8_parts(tmp_path):
    out = bench(tmp_path, "bf16,fp8", peer_home=tmp_path / "peer")
    result = json.loads((tmp_path / "quant.json").read_text())
    assert set(result["formats"]) == {"bf16", "fp8"}
    for row in result["formats"].values():
        assert row["weights_bytes"] > 0 and row["file_bytes"] > 0 and row["prefill"]["tok_s"] > 0
        assert [d["batch"] for d in row["decode"]] == [1, 4] and all(d["tok_s"] > 0 for d in row["decode"])
        for d in row["decode"]:  # the best of every timed run, each kept
            assert len(d["runs_tok_s"]) == 3 and d["tok_s"] == max(d["runs_tok_s"])
    assert not list((tmp_path / "peer").glob("**/*fp8*")), "FP8 is quantized in memory: no folder"
    fp8, bf16 = result["formats"]["fp8"], result["formats"]["bf16"]
    assert fp8["file_bytes"] < bf16["file_bytes"]  # e4m3 and scales (tiny's fp32 embeddings and lm_head stay)
    by_target = {t["target"]: t for t in result["targets"]}
    assert by_target["FP8 prefill vs bf16 (tok/s)"]["ratio"] > 0
    assert by_target["Q4_K_M decode B=1 vs llama.cpp (tok/s)"]["ratio"] is None  # not run
    assert "| fp8 (ours) |" in out and "| FP8 decode B=1 vs bf16 (tok/s) |" in out


@pytest.mark.slow  # `bash .ci/run --slow` builds llama.cpp first
@pytest.mark.skipif(not server_binary().is_file(), reason="llama-server not built (.peer/build)")
def test_q4_k_m_llama_and_replays_merge_into_the_same_json(tmp_path):
    bench(tmp_path, "bf16")
    out = bench(tmp_path, "q4_k_m,replay-ft,llama,replay-llama", "--threads", "2", "--max-requests", "3")
    result = json.loads((tmp_path / "quant.json").read_text())
    assert set(result["formats"]) == {"bf16", "q4_k_m"} and len(result["commands"]) == 2
    q4 = result["formats"]["q4_k_m"]
    assert q4["file_bytes"] == result["llama"]["file_bytes"]  # the same file on both sides
    assert result["llama"]["prefill"]["tok_s"] > 0 and result["llama"]["decode"]["tok_s"] > 0
    assert result["llama"]["decode"]["tok_s"] == max(result["llama"]["decode"]["runs_tok_s"])
    for side in ("replay-ft", "replay-llama"):
        (session,) = result[side]["sessions"].values()
        assert session["summary"]["requests"] == 3 and session["summary"]["worst_ttft_after_tool_ms"] > 0
    by_target = {t["target"]: t for t in result["targets"]}
    assert by_target["Q4_K_M decode B=1 vs llama.cpp (tok/s)"]["ratio"] > 0
    assert by_target["replay worst TTFT after a tool, ours vs llama.cpp (ms)"]["ratio"] > 0
    assert "| q4_k_m (llama.cpp) |" in out
