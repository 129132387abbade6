"""Malformed input: reported with file and line, skipped by default, fatal with strict; never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from adapters.readers import TraceError, read_trace
from traces.generate import write
from traces.session import simulate


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("generated")
    paths = write(simulate(5, 20, 2, 0.3), folder, "s", ("codex", "claude", "recording"))
    return {p.name.split(".")[1]: p for p in paths}


def corrupt(source: Path, target: Path, line_number: int, replacement: str) -> Path:
    lines = source.read_text().splitlines()
    lines[line_number - 1] = replacement
    target.write_text("\n".join(lines) + "\n")
    return target


@pytest.mark.parametrize("fmt", ["codex", "claude", "recording"])
def test_a_line_that_is_not_json_is_reported_and_skipped(files, tmp_path, fmt):
    path = corrupt(files[fmt], tmp_path / f"bad.{fmt}.jsonl", 3, '{"type": "response_item", "payload": {')
    problems: list[TraceError] = []
    [trace] = read_trace(path, problems=problems)
    assert (problems[0].path, problems[0].line) == (str(path), 3)
    assert str(problems[0]).startswith(f"{path}:3: ")
    # Claude: the lost api-request breaks the exact rebuild, which falls back to the chain (said once).
    assert all("parentUuid chain" in p.reason for p in problems[1:]) and len(problems) <= 2
    assert len(trace.requests) >= 19
    with pytest.raises(TraceError) as info:
        read_trace(path, strict=True)
    assert info.value.line == 3


def test_codex_item_without_type_is_reported(files, tmp_path):
    path = corrupt(
        files["codex"],
        tmp_path / "bad.jsonl",
        4,
        json.dumps({"type": "response_item", "payload": {"role": "user"}}),
    )
    problems: list[TraceError] = []
    read_trace(path, problems=problems)
    assert [p.line for p in problems] == [4] and "malformed response_item" in problems[0].reason


def test_claude_line_without_message_and_unresolvable_request_are_reported(files, tmp_path):
    lines = files["claude"].read_text().splitlines()
    user_at = next(i for i, line in enumerate(lines, 1) if json.loads(line)["type"] == "user")
    request_at = next(i for i, line in enumerate(lines, 1) if json.loads(line)["type"] == "api-request")
    broken = json.loads(lines[request_at - 1])
    broken["tail"] = ["0" * 64]
    lines[request_at - 1] = json.dumps(broken)
    user = json.loads(lines[user_at - 1])
    del user["message"]
    lines[user_at - 1] = json.dumps(user)
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    problems: list[TraceError] = []
    read_trace(path, problems=problems)
    assert sorted(p.line for p in problems)[:2] == sorted([user_at, request_at])


def test_recording_line_with_an_unknown_protocol_is_reported(files, tmp_path):
    line = json.loads(files["recording"].read_text().splitlines()[1])
    line["protocol"] = "carrier-pigeon"
    path = corrupt(files["recording"], tmp_path / "bad.jsonl", 2, json.dumps(line))
    problems: list[TraceError] = []
    [trace] = read_trace(path, problems=problems)
    assert [p.line for p in problems] == [2] and "protocol" in problems[0].reason
    assert len(trace.requests) == 19


def test_unreadable_files_are_trace_errors(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        read_trace(tmp_path / "missing.jsonl")
    (tmp_path / "x.jsonl").write_text('{"hello": 1}\n')
    with pytest.raises(TraceError, match="unrecognised trace format"):
        read_trace(tmp_path / "x.jsonl")
    (tmp_path / "y.traj").write_text("{not json")
    with pytest.raises(TraceError, match=r"y\.traj"):
        read_trace(tmp_path / "y.traj", strict=True)
    problems: list[TraceError] = []
    assert read_trace(tmp_path, problems=problems) == []  # a folder: each bad file reported, none fatal
    assert {Path(p.path).name for p in problems} == {"x.jsonl", "y.traj"}


def test_summary_cli_reports_problems_without_a_traceback(files, tmp_path):
    path = corrupt(files["codex"], tmp_path / "bad.jsonl", 5, "garbage")
    run = [sys.executable, "-m", "adapters.readers"]
    lenient = subprocess.run([*run, str(path)], capture_output=True, text=True)
    assert lenient.returncode == 0 and f"{path}:5" in lenient.stderr and "Traceback" not in lenient.stderr
    strict = subprocess.run([*run, "--strict", str(path)], capture_output=True, text=True)
    assert strict.returncode == 1 and f"{path}:5" in strict.stderr and "Traceback" not in strict.stderr
