"""`ft replay` on real client sessions (tests/data/clients) on the tiny preset: a Claude Code
transcript replays (it exited 2 before the readers found every message), the prompts the server
sees are exactly as long as what the CLI sent, and a request that cannot be rebuilt exactly is
replayed with the rest and reported as approximate, with the reason, in the table and the JSON."""

from __future__ import annotations

import json
import lzma

from adapters.replay_report import summarize
from adapters.replay_rows import PolicyRun, Row
from ft.cli import main
from tests.adapters.clients import DATA, ids, sent, session_file, transcript_lines, write_lines

FOLDER = DATA / "claude-2.1.332" / "files"


def broken_copy(path):
    """The same session under another id, with the second request's last message hash found nowhere."""
    lines = transcript_lines(FOLDER)
    for line in lines:
        if "sessionId" in line:
            line["sessionId"] = "broken-copy"
    requests = [i for i, line in enumerate(lines) if line["type"] == "api-request"]
    lines[requests[1]]["tail"][-1] = "f" * 64
    return write_lines(path, lines), requests[1] + 1


def test_replay_of_claude_sessions_reports_fidelity(tmp_path, capsys):
    broken, line = broken_copy(tmp_path / "broken.jsonl")
    out = tmp_path / "r.json"
    argv = ["replay", str(session_file(FOLDER)), str(broken), "--preset", "tiny", "--compare", "anchor"]
    assert main([*argv, "--no-floor", "--threads", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "broken-copy: 2 of 6 requests rebuilt approximately" in printed and "≈" in printed
    data = json.loads(out.read_text())
    fidelity = data["fidelity"]
    assert (fidelity["identical"], fidelity["approximate"]) == (10, 2)
    assert [(r["session"], r["index"]) for r in fidelity["approximate_requests"]] == [
        ("broken-copy", 1),
        ("broken-copy", 2),
    ]
    assert f"(line {line})" in fidelity["approximate_requests"][0]["why"]
    assert "keeps messages" in fidelity["approximate_requests"][1]["why"]
    anchor = data["policies"]["anchor"]
    assert (anchor["summary"]["identical"], anchor["summary"]["approximate"]) == (10, 2)
    rows = anchor["rows"]
    assert [r["fidelity"] for r in rows[6:]] == ["identical", *["approximate"] * 2, *["identical"] * 3]
    # The server saw prompts exactly as long as the bodies the CLI sent (the same renderer).
    lengths = [len(ids("anthropic", body)) for body in sent(FOLDER)]
    assert [r["prompt_tokens"] for r in rows] == lengths * 2


def test_summary_counts_fidelity():
    common = dict(
        session="s", protocol="anthropic", after_tool_result=False, prompt_tokens=10, output_tokens=1
    )
    times = dict(context_tokens=0, new_tokens=10, prefilled_tokens=10, cached_tokens=0)
    rows = [
        Row(index=i, **common, **times, client_ttft_ms=1.0, server_ttft_ms=1.0, total_ms=2.0, fidelity=f)
        for i, f in enumerate(["identical", "approximate", "identical"])
    ]
    summary = summarize(PolicyRun("anchor", rows))
    assert (summary.identical, summary.approximate, summary.requests) == (2, 1, 3)


def test_captures_are_json_lists_without_credentials():
    for path in DATA.glob("*/*/requests.json.xz"):
        captured = json.loads(lzma.decompress(path.read_bytes()))
        assert isinstance(captured, list) and captured
        secrets = [
            v
            for c in captured
            for k, v in c["headers"].items()
            if k.lower() in ("authorization", "x-api-key")
        ]
        assert secrets and set(secrets) == {"<redacted>"}
