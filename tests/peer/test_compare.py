"""The replay comparison's request bodies and summary arithmetic (no server)."""

from __future__ import annotations

from adapters.trace import AssistantOutput, TraceRequest
from peer.compare import Sample, probe_body, summarise


def test_probe_body_asks_for_one_greedy_token():
    request = TraceRequest(
        protocol="chat",
        body={
            "model": "gpt-x",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        output=AssistantOutput(content="hello"),
    )
    body = probe_body(request, "peer")
    assert body == {
        "model": "peer",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "temperature": 0,
        "stream": False,
    }
    assert request.body["stream"] is True  # the trace is not modified


def test_summary_counts_reprocessing_against_prompt_growth():
    samples = [
        Sample(0, False, 100.0, 90.0, prompt_tokens=1000, processed=1000, reused=0),
        Sample(
            1, True, 20.0, 15.0, prompt_tokens=1100, processed=100, reused=1000
        ),  # ideal: only the new 100
        Sample(2, True, 80.0, 70.0, prompt_tokens=1200, processed=600, reused=600),  # 500 seen before
        Sample(
            3, False, 50.0, 45.0, prompt_tokens=900, processed=300, reused=600
        ),  # prompt shrank: all re-done
    ]
    s = summarise(samples)
    assert s.requests == 4
    assert s.total_ttft_ms == 250.0
    assert s.worst_ttft_after_tool_ms == 80.0
    assert s.mean_ttft_after_tool_ms == 50.0
    assert (s.prompt_tokens, s.processed, s.reused) == (4200, 2000, 2200)
    assert s.new_tokens == 1000 + 100 + 100 + 0
    assert s.reprocessed == 0 + 0 + 500 + 300
