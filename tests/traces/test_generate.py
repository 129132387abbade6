"""The session generator: deterministic, realistic in shape, and read back exactly by the readers."""

from __future__ import annotations

import json

import pytest

from adapters.readers import read_claude, read_trace
from traces.formats import to_trace
from traces.generate import EXAMPLES, SESSIONS_DIR, main, write, write_examples
from traces.session import simulate


@pytest.fixture(scope="module")
def session():
    return simulate(11, num_requests=30, num_turns=3, scale=0.6)


def test_a_session_has_the_requested_calls_turns_and_tool_loops(session):
    steps = [s for t in session.turns for s in t.steps]
    assert len(session.turns) == 3 and len(steps) == 30
    assert all(
        not t.steps[-1].runs and t.steps[-1].content for t in session.turns
    )  # each turn ends in an answer
    outputs = [len(r.output) for s in steps for r in s.runs]
    assert min(outputs) < 200 and max(outputs) > 4000  # a few lines to many kilobytes
    names = {r.name for s in steps for r in s.runs}
    assert {"read_file", "edit_file", "run_tests"} <= names
    times = [x for s in steps for x in (s.start, s.end)]
    assert times == sorted(times)


def test_generation_is_deterministic(tmp_path, session):
    first = write(session, tmp_path / "a", "s", ("codex", "claude", "recording"))
    second = write(simulate(11, 30, 3, 0.6), tmp_path / "b", "s", ("codex", "claude", "recording"))
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]


@pytest.mark.parametrize(
    ("fmt", "protocol"), [("codex", "responses"), ("claude", "anthropic"), ("recording", "chat")]
)
def test_written_files_read_back_as_the_session(tmp_path, session, fmt, protocol):
    [path] = write(session, tmp_path, "s", (fmt,))
    problems: list = []
    [trace] = read_trace(path, problems=problems)
    expected = to_trace(session, protocol)
    assert problems == [] and trace.session_id == session.session_id
    assert len(trace.requests) == len(expected.requests)
    for got, want in zip(trace.requests, expected.requests, strict=True):
        assert got.protocol == protocol
        assert got.body == want.body
        assert got.output == want.output
        assert got.after_tool_result == want.after_tool_result
        assert got.ts == pytest.approx(want.ts, abs=0.1) and got.output_ts == pytest.approx(
            want.output_ts, abs=0.01
        )


def test_generated_claude_transcript_needs_blobs_only_for_merged_tool_results(tmp_path, session):
    [path] = write(session, tmp_path, "s", ("claude",))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    blobs = [line for line in lines if line["type"] == "api-request-blob"]
    parallel = [s for t in session.turns for s in t.steps if len(s.runs) > 1]
    assert len(blobs) == len(parallel) > 0
    # Without the api-request lines the chain alone gives the same conversation.
    stripped = tmp_path / "stripped.jsonl"
    stripped.write_text(
        "".join(json.dumps(x) + "\n" for x in lines if not x["type"].startswith("api-request"))
    )
    [exact], [chain] = read_claude(path), read_claude(stripped)
    assert [r.body["messages"] for r in chain.requests] == [r.body["messages"] for r in exact.requests]


def test_committed_examples_are_what_the_generator_writes(tmp_path):
    written = write_examples(tmp_path)
    assert {p.name for p in written} == {p.name for p in SESSIONS_DIR.glob("*.jsonl")}
    for path in written:
        assert path.read_bytes() == (SESSIONS_DIR / path.name).read_bytes(), (
            f"regenerate: python -m traces.generate --examples ({path.name})"
        )


def test_examples_cover_short_and_long_sessions():
    sizes = sorted(e.requests for e in EXAMPLES)
    assert 3 <= len(EXAMPLES) <= 5 and sizes[0] <= 30 and sizes[-1] >= 150
    assert sum(p.stat().st_size for p in SESSIONS_DIR.glob("*.jsonl")) < 4_000_000


def test_cli_writes_files_and_rejects_bad_arguments(tmp_path, capsys):
    assert (
        main(
            ["--seed", "3", "--requests", "20", "--turns", "2", "--formats", "codex", "--out", str(tmp_path)]
        )
        == 0
    )
    assert (tmp_path / "session-3.codex.jsonl").is_file()
    assert main(["--requests", "3", "--turns", "2", "--out", str(tmp_path)]) == 2
    assert "cannot hold" in capsys.readouterr().err
