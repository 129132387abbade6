"""K sessions at once (peer/sessions.py) against the real tiny server: every session in flight
together, answers decoded at their recorded lengths, the tool gap, nonces for reused traces, and
the summary's arithmetic over the rows."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import pytest

from adapters.readers import read_trace
from adapters.replay_report import percentile
from engine.engine_config import EngineConfig
from gateway.render import load_renderer
from peer.sessions import ft_send, plan_sessions, run_sessions, summarise_run, with_nonce
from tests.conftest import start_server

TRACE = Path(__file__).resolve().parents[2] / "traces" / "sessions" / "small-bugfix.recording.jsonl"
BENCH = TRACE.parents[2] / "bench" / "llamacpp.py"
GAP = 0.2


@pytest.fixture(scope="module")
def trace():
    (t,) = read_trace(TRACE)
    return msgspec.structs.replace(t, requests=t.requests[:2])


@pytest.fixture(scope="module")
def server():
    server = start_server(preset="tiny", forced_decode="steps", engine=EngineConfig(max_running=2))
    yield server
    server.stop()


def test_with_nonce_prefixes_the_first_user_message_only():
    body = {
        "messages": [
            {"role": "system", "content": "sys"},
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {}}, {"type": "text", "text": "fix"}],
            },
            {"role": "user", "content": "more"},
        ]
    }
    out = with_nonce(body, "[s1] ")
    assert out["messages"][1]["content"][1]["text"] == "[s1] fix"
    assert out["messages"][0]["content"] == "sys" and out["messages"][2]["content"] == "more"
    assert body["messages"][1]["content"][1]["text"] == "fix"  # the trace is not modified


def test_two_sessions_at_once(server, trace):
    sessions = plan_sessions([trace], 2, load_renderer(None))
    assert [s.nonce for s in sessions] == [
        None,
        "[session 1] ",
    ]  # one trace for two sessions: the copy is marked
    assert sessions[1].answer_tokens == sessions[0].answer_tokens

    both_in_flight = threading.Barrier(2, timeout=120)

    def send(client, request, n):  # each request waits for the other session's: both run at once
        both_in_flight.wait()
        return ft_send(client, request, n)

    turns, wall = run_sessions(server.url, sessions, send, GAP)

    assert [(t.session, t.index) for t in turns] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [t.after_tool_result for t in turns] == [False, True, False, True]
    for t in turns:
        assert t.output_tokens == t.answer_tokens > 0  # the recorded answer, every token decoded
        assert t.processed + t.reused == t.prompt_tokens
        assert set(t.phases or {}) >= {"plan", "queue", "restore", "prefill"}
    first, second = turns[0], turns[1]
    assert second.start_ms >= first.start_ms + first.total_ms + 1000 * GAP  # the tool gap after the answer
    assert second.reused > 0  # the session's own history is cached
    assert turns[2].prompt_tokens > turns[0].prompt_tokens  # the nonce is in the copy's prompt
    assert wall >= max(t.start_ms + t.total_ms for t in turns) / 1000

    s = summarise_run(turns, wall)
    assert (s.sessions, s.requests) == (2, 4)
    assert s.worst_ttft_after_tool_ms == max(turns[1].ttft_ms, turns[3].ttft_ms)
    assert s.p50_ttft_ms == percentile([t.ttft_ms for t in turns], 50)
    assert s.output_tokens == sum(t.answer_tokens for t in turns)
    assert s.output_tokens_per_s == pytest.approx(s.output_tokens / wall)
    assert (s.processed, s.reused) == (sum(t.processed for t in turns), sum(t.reused for t in turns))


@pytest.mark.slow
def test_bench_sessions_cli_writes_a_run_per_k(tmp_path):
    """`bench/llamacpp.py --only ft --sessions 1,2`: a fresh `ft serve --forced-decode steps` per K."""
    out = tmp_path / "sessions.json"
    args = ["--preset", "tiny", "--only", "ft", "--sessions", "1,2", "--max-requests", "2", "--tool-gap", "0"]
    subprocess.run(
        [sys.executable, str(BENCH), *args, "--out", str(out), str(TRACE)], check=True, timeout=600
    )
    result = json.loads(out.read_text())
    assert [(r["k"], r["server"]) for r in result["runs"]] == [(1, "ft/anchor steps"), (2, "ft/anchor steps")]
    assert [s["nonce"] for s in result["runs"][1]["sessions"]] == [None, "[session 1] "]
    for run in result["runs"]:
        assert run["summary"]["requests"] == 2 * run["k"]
        assert all(t["output_tokens"] == t["answer_tokens"] for t in run["turns"])
    assert result["meta"]["parallel"] == 2 and result["meta"]["tool_gap_s"] == 0
