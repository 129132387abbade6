"""`/metrics` read back with prometheus-client's own parser from the real server: its counts equal
the requests sent, its token counters the usage the answers reported; `/v1/ft/recent` lists them."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import start_server

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture(scope="module")
def server():
    with start_server(preset="tiny", default_max_tokens=4) as s:
        yield s


def test_exposition_parses_and_counts_every_request(server):
    system = "You are terse. " * 20
    sent, prompt = {CHAT: 0, MESSAGES: 0}, {"prefilled": 0, "reused": 0}
    with server.client() as c:
        for turn in range(3):  # one session: later turns restore what earlier ones checkpointed
            for path in (CHAT, MESSAGES):
                history = [{"role": "user", "content": f"question {i}"} for i in range(turn + 1)]
                if path == CHAT:
                    r = c.post(path, json={"messages": [{"role": "system", "content": system}, *history],
                                           "max_tokens": 4, "temperature": 0})
                    usage = r.json()["usage"]
                    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
                    total = usage["prompt_tokens"]
                else:
                    r = c.post(path, json={"model": "tiny", "system": system, "messages": history, "max_tokens": 4})
                    usage = r.json()["usage"]
                    cached = usage["cache_read_input_tokens"]
                    total = usage["input_tokens"] + cached
                assert r.status_code == 200, r.text
                sent[path] += 1
                prompt["reused"] += cached
                prompt["prefilled"] += total - cached
        server.wait_idle()
        text = c.get("/metrics").text
        recent = c.get("/v1/ft/recent").json()["requests"]
    values = samples(text)
    n = sum(sent.values())
    assert values[("ft_requests_total", (("endpoint", "chat"), ("status", "200")))] == sent[CHAT]
    assert values[("ft_requests_total", (("endpoint", "anthropic"), ("status", "200")))] == sent[MESSAGES]
    for histogram in ("ft_ttft_seconds", "ft_queue_seconds", "ft_restore_seconds", "ft_prefill_seconds"):
        assert values[(f"{histogram}_count", ())] == n
        assert values[(f"{histogram}_bucket", (("le", "+Inf"),))] == n
    assert values[("ft_ttft_seconds_sum", ())] >= values[("ft_prefill_seconds_sum", ())] > 0
    continued = values[("ft_tokens_total", (("kind", "continued"),))]
    assert values[("ft_tokens_total", (("kind", "prefilled"),))] == prompt["prefilled"]
    assert values[("ft_tokens_total", (("kind", "reused"),))] + continued >= prompt["reused"] > 0
    assert values[("ft_live_sequences", ())] == len(server.runtime.live)
    assert values[("ft_memory_bytes", (("part", "weights"),))] > 0
    assert values[("ft_scheduler_steps_total", ())] > 0 and ("ft_store_puts", ()) in values
    assert len(recent) == n and sum(r["prefilled"] for r in recent) == prompt["prefilled"]
    assert all(r["ttft_s"] > 0 and set(r["phases"]) >= {"queue", "restore", "prefill"} for r in recent)
