"""Readers against ground truth: real Claude Code and Codex sessions (tests/data/clients, written
by `python -m traces.capture_clients`), each request rebuilt from the transcript or rollout the
CLI wrote must be what the CLI sent: the same token ids through the gateway's renderer, and the
same body except for fields no model sees."""

from __future__ import annotations

import copy
import json
import logging

import pytest

from adapters.launch import find_cli
from adapters.readers import detect_format, read_claude, read_codex, read_trace
from adapters.readers.claude import known_messages, message_hash
from adapters.readers.claude_transcript import Transcript
from adapters.readers.codex_profiles import drop_sections, nearest_profile
from adapters.trace import is_tool_result_last
from tests.adapters.clients import (
    CLAUDE,
    CODEX,
    DATA,
    SESSIONS,
    ids,
    sent,
    session_file,
    transcript_lines,
    write_lines,
)
from traces.capture_clients import dropped_headings, run_session


def test_ground_truth_covers_both_clients_in_multi_turn_sessions():
    assert len(CLAUDE) >= 2 and len(CODEX) >= 2
    for folder in SESSIONS:
        bodies = sent(folder)
        users = [
            b for b in bodies if not is_tool_result_last("responses" if "input" in b else "anthropic", b)
        ]
        assert len(users) >= 3, f"{folder}: fewer than 3 user turns"
        assert len(bodies) > len(users), f"{folder}: no tool calls"


@pytest.mark.parametrize("folder", CLAUDE + CODEX, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_request_is_rebuilt_token_for_token(folder):
    [trace] = read_trace(session_file(folder), strict=True)
    bodies = sent(folder)
    assert len(trace.requests) == len(bodies)
    for index, (request, body) in enumerate(zip(trace.requests, bodies, strict=True)):
        assert request.fidelity == "identical" and request.why is None, (index, request.why)
        assert ids(request.protocol, request.body) == ids(request.protocol, body), f"request {index}"


@pytest.mark.parametrize("folder", CLAUDE, ids=lambda p: p.name)
def test_claude_bodies_equal_what_was_sent_but_the_device_metadata(folder):
    [trace] = read_claude(session_file(folder))
    for request, body in zip(trace.requests, sent(folder), strict=True):
        body = {k: v for k, v in body.items() if k != "metadata"}  # per-device ids, not in the transcript
        assert request.body == body


@pytest.mark.parametrize("folder", CODEX, ids=lambda p: p.name)
def test_codex_bodies_equal_what_was_sent_but_ids_the_rollout_lacks(folder):
    [trace] = read_codex(session_file(folder))
    for request, body in zip(trace.requests, sent(folder), strict=True):
        got, want = copy.deepcopy(request.body), copy.deepcopy(body)
        del want["input"][0]["id"]  # the base-instructions item id: derived from nothing in the rollout
        metadata = want.pop("client_metadata")
        assert got.pop("client_metadata").items() <= metadata.items()
        assert got == want


def test_claude_prompt_hashed_as_one_block_and_sent_as_a_string_is_found():
    """Old failure: the prompt of a later user turn is a string on the chain, but the request that
    puts a cache mark on it names it by the hash of its one-text-block form."""
    folder = DATA / "claude-2.1.332" / "files"
    transcript = Transcript()
    for number, line in enumerate(transcript_lines(folder), 1):
        transcript.add(number, line)
    prompt = "How many lines does notes.txt have?"
    as_block = {"role": "user", "content": [{"type": "text", "text": prompt}]}
    assert known_messages(transcript)[message_hash(as_block)] == {"role": "user", "content": prompt}
    [trace] = read_claude(session_file(folder))
    first, second = [r.body["messages"] for r in trace.requests if prompt in json.dumps(r.body)][:2]
    assert first[-1]["content"] == [{"type": "text", "text": prompt, "cache_control": {"type": "ephemeral"}}]
    assert second[-3]["content"] == prompt


def test_claude_results_of_parallel_tool_calls_are_found_merged():
    folder = DATA / "claude-2.1.332" / "echoes"
    [trace] = read_claude(session_file(folder))
    after_parallel = trace.requests[1].body["messages"][-1]["content"]
    assert sorted(b["content"] for b in after_parallel) == ["alpha", "beta"]
    # One message, in the order the tools finished (the order the transcript lines were written).
    assert after_parallel == sent(folder)[1]["messages"][-1]["content"]
    assert trace.requests[1].fidelity == "identical"


@pytest.mark.parametrize("folder", CLAUDE, ids=lambda p: p.name)
def test_claude_chain_rebuild_keeps_reminders_and_system_messages(folder, tmp_path):
    """Old failure: without api-request lines the chain rebuild dropped the <system-reminder>
    blocks before the first prompt and the mid-conversation system message. With the logged
    shape (system prompt, tools) it gives the same tokens as what was sent."""
    lines = [line for line in transcript_lines(folder) if line["type"] != "api-request"]
    [trace] = read_claude(write_lines(tmp_path / "t.jsonl", lines))
    assert trace.meta["rebuilt_from"] == "chain"
    bodies = sent(folder)
    assert len(trace.requests) == len(bodies)
    first = trace.requests[0].body["messages"]
    assert first[0]["content"][0]["text"].startswith("<system-reminder>") and first[1]["role"] == "system"
    for request, body in zip(trace.requests, bodies, strict=True):
        assert request.fidelity == "approximate" and "parentUuid chain" in request.why
        assert ids("anthropic", request.body) == ids("anthropic", body)


def test_claude_request_that_cannot_be_rebuilt_is_named_and_the_rest_stay_exact(tmp_path, caplog):
    folder = DATA / "claude-2.1.332" / "files"
    lines = transcript_lines(folder)
    requests_at = [i for i, line in enumerate(lines) if line["type"] == "api-request"]
    last = lines[requests_at[-1]]
    last["tail"] = [*last["tail"][:-1], "f" * 64]  # a message hash found nowhere
    with caplog.at_level(logging.WARNING, logger="ft.adapters.readers"):
        [trace] = read_trace(write_lines(tmp_path / "t.jsonl", lines), strict=True)
    bodies = sent(folder)
    assert [r.fidelity for r in trace.requests] == ["identical"] * (len(bodies) - 1) + ["approximate"]
    assert f"api-request {len(requests_at) - 1} (line {requests_at[-1] + 1})" in trace.requests[-1].why
    assert "1 of 6 requests rebuilt approximately" in caplog.text
    # Rebuilt from the chain it still carries every message (only cache marks may differ).
    assert ids("anthropic", trace.requests[-1].body) == ids("anthropic", bodies[-1])


def test_codex_version_without_a_profile_warns_and_is_approximate(tmp_path, caplog):
    folder = CODEX[0]
    lines = transcript_lines(folder)
    lines[0]["payload"]["cli_version"] = "0.172.0"
    with caplog.at_level(logging.WARNING, logger="ft.adapters.readers"):
        [trace] = read_codex(write_lines(tmp_path / "r.jsonl", lines))
    assert "Codex 0.172.0 has no profile (known: 0.171.0)" in caplog.text
    assert len([r for r in caplog.records if "no profile" in r.getMessage()]) == 1
    assert {r.fidelity for r in trace.requests} == {"approximate"}
    assert "of 0.171.0 used" in trace.requests[0].why
    assert trace.requests[0].body["tools"] == nearest_profile("0.172.0").tools


def test_codex_trims_whole_sections_of_its_base_instructions():
    folder = DATA / "codex-0.171.0" / "files"
    base = transcript_lines(folder)[0]["payload"]["base_instructions"]["text"]
    wire = sent(folder)[0]["input"][0]["content"][0]["text"]
    assert dropped_headings(base, wire) == list(nearest_profile("0.171.0").drop_sections)
    text = "# A\none\n## B\n```\n# not a heading\n```\ntwo\n## C\nthree\n"
    assert drop_sections(text, ("## B",)) == "# A\none\n## C\nthree\n"
    assert drop_sections(text, ("# A",)) == ""


def test_compressed_session_files_are_detected_and_folders_skip_the_captures():
    assert detect_format(session_file(CLAUDE[0])) == "claude"
    assert detect_format(session_file(CODEX[0])) == "codex"
    traces = read_trace(DATA, strict=True)
    assert sorted(t.source for t in traces) == ["claude"] * len(CLAUDE) + ["codex"] * len(CODEX)


@pytest.mark.slow
@pytest.mark.agents
@pytest.mark.parametrize("kind", ["claude", "codex"])
def test_readers_match_the_installed_cli_now(kind, tmp_path):
    """Re-drive the installed CLI through a session with parallel tool calls; the readers must
    still rebuild what it sends (a new CLI version: expect a Codex profile warning here)."""
    cli = find_cli(kind)
    if cli is None:
        pytest.skip(f"{kind} CLI not installed (npm install --prefix .agents ...)")
    folder = run_session(kind, cli, "echoes", tmp_path / "work", tmp_path / "out")
    [trace] = read_trace(session_file(folder), strict=True)
    bodies = sent(folder)
    assert len(trace.requests) == len(bodies) >= 7
    for request, body in zip(trace.requests, bodies, strict=True):
        assert request.fidelity == "identical", request.why
        assert ids(request.protocol, request.body) == ids(request.protocol, body)
