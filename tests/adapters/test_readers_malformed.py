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
    # A request left without its messages is no malformed input: it is rebuilt approximately.
    assert len(problems) == 1
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


def test_claude_line_without_message_is_reported(files, tmp_path):
    lines = files["claude"].read_text().splitlines()
    user_at = next(i for i, line in enumerate(lines, 1) if json.loads(line)["type"] == "user")
    user = json.loads(lines[user_at - 1])
    del user["message"]
    path = corrupt(files["claude"], tmp_path / "bad.jsonl", user_at, json.dumps(user))
    problems: list[TraceError] = []
    read_trace(path, problems=problems)
    assert [p.line for p in problems] == [user_at]


def test_claude_request_whose_message_is_nowhere_is_named_and_rebuilt_approximately(files, tmp_path):
    lines = files["claude"].read_text().splitlines()
    request_at = next(i for i, line in enumerate(lines, 1) if json.loads(line)["type"] == "api-request")
    broken = json.loads(lines[request_at - 1])
    broken["tail"] = ["0" * 64]
    path = corrupt(files["claude"], tmp_path / "bad.jsonl", request_at, json.dumps(broken))
    problems: list[TraceError] = []
    [trace] = read_trace(path, problems=problems)
    [exact] = read_trace(files["claude"])
    assert problems == []  # not malformed input: a fidelity note
    first = trace.requests[0]
    assert first.fidelity == "approximate" and f"(line {request_at})" in first.why
    assert "parentUuid chain" in first.why
    assert first.body["messages"] == exact.requests[0].body["messages"]
    # The rest replay; the next ones keep its messages, so they are approximate too, and say so.
    assert len(trace.requests) == len(exact.requests)
    assert all(
        "keeps messages of api-request" in r.why for r in trace.requests[1:] if r.fidelity != "identical"
    )


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
