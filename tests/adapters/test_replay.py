"""`ft replay` end to end on the tiny preset: a generated short session (a tool loop, a final
answer, a second user turn) replayed under every policy, checked against the gateway's own
counters; the suffix floor route; malformed traces and bad arguments."""

from __future__ import annotations

import json

import pytest

from adapters import client
from adapters.trace import AssistantOutput, RecordLine, ToolCall, encode_jsonl
from ft.cli import main
from gateway.suffix_floor import SuffixFloor, code_corpus
from tests.conftest import start_server

SYSTEM = "You are a careful coding agent working in a Python repository. " * 12
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "shell",
            "description": "Run a shell command",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]
STEPS = [  # (user text or None after a tool result, answer)
    (
        "The test_refund suite fails, please fix it.",
        AssistantOutput(
            "I should look at the failing test first.", None, [ToolCall("shell", {"command": "pytest -x"})]
        ),
    ),
    (
        None,
        AssistantOutput(
            "The rounding happens too early.", None, [ToolCall("shell", {"command": "git diff"})]
        ),
    ),
    (
        None,
        AssistantOutput(
            "The diff is right; time to report.", "Fixed: rounding now happens after conversion."
        ),
    ),
    (
        "Thanks. Now explain why it failed.",
        AssistantOutput(
            "A short explanation is enough.", "Rounding before conversion lost a cent on each line."
        ),
    ),
]


def chat_session() -> list[RecordLine]:
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    lines = []
    for i, (user, output) in enumerate(STEPS):
        if user is not None:
            messages.append({"role": "user", "content": user})
        body = {"model": "tiny", "messages": list(messages), "tools": TOOLS}
        lines.append(RecordLine("chat", "/v1/chat/completions", body, output, ts=1000.0 + i))
        calls = [
            {
                "id": f"call_{i}_{j}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for j, c in enumerate(output.tool_calls)
        ]
        messages.append(
            {
                "role": "assistant",
                "content": output.content or "",
                "reasoning_content": output.reasoning,
                **({"tool_calls": calls} if calls else {}),
            }
        )
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "output line\n" * 30})
    return lines


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("replay") / "short.recording.jsonl"
    path.write_bytes(encode_jsonl(chat_session()))
    return path


@pytest.fixture(scope="module")
def report(trace_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("replay_out")
    argv = [
        "replay",
        str(trace_file),
        "--preset",
        "tiny",
        "--compare",
        "anchor,prefix,user,none",
        "--json",
        str(out / "r.json"),
        "--plot",
        str(out / "r.png"),
        "--quiet",
    ]
    assert main(argv) == 0
    return out


def test_replay_writes_json_and_png(report):
    data = json.loads((report / "r.json").read_text())
    assert list(data["policies"]) == ["anchor", "prefix", "user", "none"]
    assert (report / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = data["policies"]["anchor"]["rows"]
    assert len(rows) == len(STEPS)
    assert [r["after_tool_result"] for r in rows] == [False, True, True, False]
    assert all(r["client_ttft_ms"] > 0 and r["server_ttft_ms"] > 0 for r in rows)
    for r in rows:  # where the server's time to first token went
        assert list(r["server_timing"]) == ["plan", "queue", "restore", "prefill"]
        assert abs(sum(r["server_timing"].values()) - r["server_ttft_ms"]) <= 0.3
    assert all(r["floor_ms"] > 0 for r in rows if r["new_tokens"] > 0)
    assert rows[0]["new_tokens"] == rows[0]["prompt_tokens"] == rows[0]["prefilled_tokens"]


def test_prefilled_counts_equal_the_gateway_counters(report):
    data = json.loads((report / "r.json").read_text())
    for policy in data["policies"].values():
        rows = policy["rows"]
        assert sum(r["prefilled_tokens"] for r in rows) == policy["server_prefilled_tokens"]
        assert policy["summary"]["prefilled_tokens"] == policy["server_prefilled_tokens"]
        for prev, row in zip(rows, rows[1:], strict=False):
            assert row["context_tokens"] == prev["prompt_tokens"] + prev["output_tokens"]


def test_anchor_reprefills_less_than_prefix_less_than_none(report):
    data = json.loads((report / "r.json").read_text())
    total = {name: p["summary"]["prefilled_tokens"] for name, p in data["policies"].items()}
    assert total["anchor"] < total["prefix"] < total["none"]
    ratio = {name: p["summary"]["reprefill_ratio"] for name, p in data["policies"].items()}
    assert ratio["anchor"] < ratio["prefix"] < ratio["none"]
    anchor_rows = data["policies"]["anchor"]["rows"]
    assert all(r["prefilled_tokens"] == r["new_tokens"] for r in anchor_rows if r["after_tool_result"])


def test_rows_say_why_their_tokens_were_prefilled(report):
    data = json.loads((report / "r.json").read_text())
    for policy in data["policies"].values():
        rows = policy["rows"]
        assert all(sum(r["prefill_reasons"].values()) == r["prefilled_tokens"] for r in rows)
        assert sum(policy["summary"]["prefill_reasons"].values()) == policy["summary"]["prefilled_tokens"]
        assert rows[0]["prefill_reasons"] == {"new": rows[0]["prefilled_tokens"]}  # a fresh server each
    anchor, none = data["policies"]["anchor"]["rows"], data["policies"]["none"]["rows"]
    assert all(r["prefill_reasons"] == {"new": r["prefilled_tokens"]} for r in anchor if r["after_tool_result"])
    # no checkpoints: what the server computed before is prefilled again
    assert none[1]["prefill_reasons"]["no_anchor"] == none[0]["prompt_tokens"]
    assert all(r["prefill_reasons"]["no_anchor"] > 0 for r in none[1:])


@pytest.fixture(scope="module")
def server():
    s = start_server(preset="tiny", policy="anchor")
    yield s
    s.stop()


def test_suffix_floor_route_times_a_warm_prefill(server):
    with server.client() as client:
        r = client.post("/v1/ft/suffix_floor", json={"context": 1100, "new": 64})
        assert r.status_code == 200, r.text
        assert r.json()["ms"] > 0
        again = client.post("/v1/ft/suffix_floor", json={"context": 1200, "new": 8})  # from the cached state
        assert again.status_code == 200 and again.json()["ms"] > 0


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"context": 10},
        {"context": -1, "new": 5},
        {"context": 10, "new": 0},
        {"context": "10", "new": 5},
        {"context": 10, "new": True},
        {"context": 10**9, "new": 1},
        [1, 2],
    ],
)
def test_suffix_floor_rejects_bad_bodies(server, body):
    with server.client() as client:
        r = client.post("/v1/ft/suffix_floor", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]


def test_suffix_floor_rejects_invalid_json(server):
    with server.client() as client:
        r = client.post("/v1/ft/suffix_floor", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400


def test_floor_states_are_not_consumed_and_stay_few(server):
    floor = SuffixFloor(server.runtime.engine, max_cached=2)
    assert len(code_corpus(server.runtime.renderer.tokenizer)) > 10_000
    for context in (100, 1500, 2600, 3100, 150):
        assert floor.measure(context, 4) > 0
    assert len(floor._states) <= 2
    assert floor.filler(0, 5) == floor.filler(0, 5)


def test_replay_against_a_running_server(server, trace_file, tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["replay", str(trace_file), "--server", server.url, "--limit", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["policies"]["server"]["rows"]
    assert len(rows) == 2 and rows[1]["after_tool_result"]
    assert rows[1]["prefill_reasons"] == {"new": rows[1]["prefilled_tokens"]}
    printed = capsys.readouterr().out
    assert "Summary per policy" in printed and "server why" in printed
    assert f"new {rows[1]['prefilled_tokens']:,}" in printed


def test_malformed_trace_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"protocol": "chat", "body": {"messages": []}, "path": "/v1/chat/completions"}\nnot json\n'
    )
    assert main(["replay", str(bad), "--preset", "tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ft replay: ") and "\n" not in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--server", "http://127.0.0.1:9", "--compare", "anchor"], "--compare needs --preset"),
        (["--compare", "anchor,radix"], "unknown policy radix"),
        (["--limit", "0"], "--limit"),
    ],
)
def test_bad_arguments_are_one_line(trace_file, capsys, argv, message):
    assert main(["replay", str(trace_file), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_unreachable_server_is_one_line(trace_file, capsys):
    assert main(["replay", str(trace_file), "--server", "http://127.0.0.1:9"]) == 1
    assert capsys.readouterr().err.startswith("ft replay: server: ")


def test_output_delta_detection_per_protocol():
    assert client.is_output_delta(
        "anthropic", {"type": "content_block_delta", "delta": {"type": "thinking_delta"}}
    )
    assert not client.is_output_delta("anthropic", {"type": "content_block_start"})
    assert client.is_output_delta("responses", {"type": "response.reasoning_text.delta"})
    assert not client.is_output_delta("responses", {"type": "response.output_item.added"})
    assert client.is_output_delta("chat", {"choices": [{"delta": {"reasoning_content": "x"}}]})
    assert not client.is_output_delta("chat", {"choices": [{"delta": {"role": "assistant", "content": ""}}]})


def test_server_timing_header_parses():
    from adapters.client import parse_server_timing

    assert parse_server_timing("plan;dur=1.2, queue;dur=0.0,restore;dur=30.5, prefill;dur=120") == {
        "plan": 1.2,
        "queue": 0.0,
        "restore": 30.5,
        "prefill": 120.0,
    }
    assert parse_server_timing("") == {} and parse_server_timing("cache;desc=hit") == {}


def test_prefill_reasons_header_parses():
    from adapters.client import parse_prefill_reasons

    assert parse_prefill_reasons("new=120, edited=4096,no_anchor=3") == {"new": 120, "edited": 4096, "no_anchor": 3}
    assert parse_prefill_reasons("") == {} and parse_prefill_reasons("new") == {}
