"""Continuous batching through the real server: concurrent sessions over the three protocols get
exactly the answers each gets alone (greedy), also with stop strings and streamed, a client that
leaves does not disturb the others, and a request does not wait for the previous answer's checkpoint
writes."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.engine_config import EngineConfig
from tests.conftest import start_server

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server():
    s = start_server(preset="tiny", policy="anchor", engine=EngineConfig(max_running=8))
    yield s
    s.stop()


def _request(i: int) -> tuple[str, dict]:
    """Session i's request: a distinct prompt, on one of the three protocols, greedy but for sessions 4
    and 7 (Chat Completions, sampled with a seed of their own)."""
    text = f"Session {i}: list the files under src/module_{i} and explain " + "why " * (5 + 7 * i)
    common = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0}
    if i in (4, 7):
        common.update(temperature=0.9, top_p=0.95, seed=100 + i)
    match i % 3:
        case 0:
            return "/v1/messages", {**common, "messages": [{"role": "user", "content": text}]}
        case 1:
            return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}]}
        case _:
            body = {**common, "input": text, "max_output_tokens": MAX_TOKENS}
            del body["max_tokens"]
            return "/v1/responses", body


def _answer(path: str, body: dict) -> dict:
    """What the client sees: output text/reasoning and usage, read per protocol."""
    if path == "/v1/messages":
        blocks = {b["type"]: b.get("text") or b.get("thinking") for b in body["content"]}
        u = body["usage"]
        return {"out": blocks, "stop": body["stop_reason"], "prompt": u["input_tokens"] + u["cache_read_input_tokens"],
                "output": u["output_tokens"]}
    if path == "/v1/chat/completions":
        m = body["choices"][0]["message"]
        u = body["usage"]
        return {"out": [m.get("content"), m.get("reasoning_content")], "stop": body["choices"][0]["finish_reason"],
                "prompt": u["prompt_tokens"], "output": u["completion_tokens"]}
    u = body["usage"]
    texts = [(item["type"], [part.get("text") for part in item.get("summary") or item.get("content") or []])
             for item in body["output"]]  # item ids are fresh per response
    return {"out": texts, "stop": body["status"], "prompt": u["input_tokens"], "output": u["output_tokens"]}


def _post(server, i: int) -> tuple[dict, dict]:
    path, body = _request(i)
    with server.client() as c:
        r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    return _answer(path, r.json()), dict(r.headers)


def _metric(server, name: str) -> float:
    with server.client() as c:
        text = c.get("/metrics").text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_concurrent_sessions_get_their_solo_answers(server):
    """Eight sessions' first requests at once (their prompts prefilled together, nothing cached yet), then
    each alone again: the same answers (two of them sampled with their own seeds), truthful usage."""
    sessions = range(8)
    steps, seqs = _metric(server, "ft_scheduler_steps_total"), _metric(server, "ft_scheduler_step_sequences_total")
    with ThreadPoolExecutor(len(sessions)) as pool:
        together = dict(zip(sessions, pool.map(lambda i: _post(server, i), sessions), strict=True))
    batched = (_metric(server, "ft_scheduler_step_sequences_total") - seqs) / (_metric(server, "ft_scheduler_steps_total") - steps)
    assert batched > 1.5  # the sessions really shared forwards
    server.wait_idle()
    alone = {i: _post(server, i) for i in sessions}
    for i in sessions:
        (answer, headers), (again, again_headers) = together[i], alone[i]
        assert answer == again, f"session {i}"
        assert answer["output"] > 0
        assert (int(headers["x-cached-tokens"]), int(headers["x-prefill-tokens"])) == (0, answer["prompt"])
        assert int(again_headers["x-cached-tokens"]) + int(again_headers["x-prefill-tokens"]) == answer["prompt"]


def test_a_client_that_leaves_mid_stream_does_not_disturb_the_others(server):
    others = [1, 2, 3]
    alone = {i: _post(server, i)[0] for i in others}
    server.wait_idle()
    generated = _metric(server, 'ft_tokens_total{kind="generated"}')
    left = threading.Event()

    def leave() -> None:
        path, body = _request(10)
        body = {**body, "stream": True, "max_tokens": 400}
        with server.client() as c, c.stream("POST", path, json=body) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n > 6:
                    break
        left.set()

    with ThreadPoolExecutor(4) as pool:
        gone = pool.submit(leave)
        together = dict(zip(others, pool.map(lambda i: _post(server, i)[0], others), strict=True))
        gone.result()
    assert left.is_set() and together == alone
    server.wait_idle(timeout=60)
    # the departed generation was cancelled where its client left, not run to its 400 tokens
    departed = _metric(server, 'ft_tokens_total{kind="generated"}') - generated - sum(a["output"] for a in together.values())
    assert 0 < departed < 200, departed


def _chat(server, i: int, stop: str | None = None, stream: bool = False) -> tuple[str, str]:
    """Session i's answer text (thinking off) and finish reason, streamed or not, with `stop`."""
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream,
            "chat_template_kwargs": {"enable_thinking": False},
            "messages": [{"role": "user", "content": f"Session {i}: show the diff of module_{i} " + "now " * i}]}
    if stop is not None:
        body["stop"] = [stop]
    with server.client() as c:
        if not stream:
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice["message"]["content"] or "", choice["finish_reason"]
        text, finish = "", None
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    for choice in chunk["choices"]:
                        text += choice["delta"].get("content") or ""
                        finish = choice.get("finish_reason") or finish
        return text, finish


def test_stop_strings_and_streams_inside_a_batch_end_each_answer_as_alone(server):
    """Six sessions, each with a stop string from the middle of its own answer, half of them
    streamed, run together: each ends where it ends alone, just before its stop string."""
    sessions = range(6)
    stops, alone = {}, {}
    for i in sessions:
        text, _ = _chat(server, i)
        stops[i] = text[len(text) // 2 : len(text) // 2 + 2]
        alone[i] = _chat(server, i, stops[i])
        assert alone[i] == (text[: text.index(stops[i])], "stop"), f"session {i}"
    server.wait_idle()
    with ThreadPoolExecutor(len(sessions)) as pool:
        answers = pool.map(lambda i: _chat(server, i, stops[i], stream=i % 2 == 1), sessions)
        together = dict(zip(sessions, answers, strict=True))
    assert together == alone


def test_a_request_does_not_wait_for_the_previous_answers_checkpoint_writes(server, monkeypatch):
    """The store is made slow (a disk at its limit, 2 s a write): the next request starts while the
    previous answer's checkpoints are still being written."""
    store = server.runtime.store
    slow_put = store.put

    def put(*args, **kw):
        time.sleep(2.0)  # far beyond a step, even on a loaded machine
        return slow_put(*args, **kw)

    monkeypatch.setattr(store, "put", put)
    _post(server, 20)
    assert not server.runtime.store_queue.idle  # its checkpoints are still on their way
    within = 'ft_scheduler_queue_steps_bucket{le="1"}'
    before = _metric(server, within), _metric(server, 'ft_scheduler_queue_steps_bucket{le="+Inf"}')
    _, headers = _post(server, 21)
    # it started within one engine step of its arrival
    assert (_metric(server, within), _metric(server, 'ft_scheduler_queue_steps_bucket{le="+Inf"}')) == (
        before[0] + 1,
        before[1] + 1,
    )
    phases = dict(p.split(";dur=") for p in headers["server-timing"].split(", "))
    assert float(phases["queue"]) < 1000  # waiting for a write would be >= 2,000 ms
    assert float(phases["restore"]) < 1000
    server.wait_idle()


def test_metrics_report_resident_memory(server):
    """Weights counted once (fused projections are views of one storage), decode slots sized by
    --max-running (the warm-up binds them), the RAM cache's budget."""
    engine = server.runtime.engine
    params = sum(p.nbytes for p in engine.model.parameters())
    assert _metric(server, 'ft_memory_bytes{part="weights"}') == pytest.approx(params, rel=0.01)
    assert _metric(server, 'ft_memory_bytes{part="decode_slots"}') == engine.runner.nbytes > 0
    assert engine.runner.slots >= engine.engine_config.max_running == 8
    assert _metric(server, 'ft_memory_bytes{part="ram_cache_budget"}') == int(server.runtime.config.ram_cache_gib * (1 << 30))
    with server.client() as c:  # a CPU has no allocator holding to report
        assert "device_reserved" not in c.get("/metrics").text


def test_memory_report_names_the_workspace_beyond_the_device_parts(server, monkeypatch):
    """On a GPU the engine reports its allocator's whole holding (tests/engine/test_gpu.py); the rest
    beyond the parts resident there is the workspace. A CPU holds none: the engine's report is
    given one here, the arithmetic over the real parts is what is tested."""
    runtime = server.runtime
    parts = runtime.memory()
    on_device = parts["weights"] + parts["decode_slots"] + parts["live_sequences"]
    engine_memory = runtime.engine.memory
    monkeypatch.setattr(runtime.engine, "memory", lambda: {**engine_memory(), "device_reserved": on_device + 12345})
    assert runtime.memory()["workspace"] == 12345
    assert _metric(server, 'ft_memory_bytes{part="workspace"}') == 12345


def test_metrics_report_the_live_sequences_memory(server):
    """A sequence kept on the device after its answer (continued in place by the next turn) is
    counted beyond the decode slots, each storage once; once the next turn has taken it over and
    its own answer is kept instead, the figure follows."""
    body = {"model": "tiny", "max_tokens": 64, "messages": [{"role": "user", "content": "Kept?"}],
            "ft_forced_output": {"reasoning": "Short.", "content": "Yes."}}  # a complete answer: kept live
    with server.client() as c:
        assert c.post("/v1/chat/completions", json=body).status_code == 200
    server.wait_idle()
    live = server.runtime.live.states()
    held = _metric(server, 'ft_memory_bytes{part="live_sequences"}')
    assert live and held == server.runtime.engine.held_bytes(live) > 0
    kv = {c.k.untyped_storage().data_ptr(): c.k.untyped_storage().nbytes() for s in live for c in s.kv.values()}
    slots = server.runtime.engine.runner.storages()
    assert held >= 2 * sum(n for ptr, n in kv.items() if ptr not in slots)  # keys, and values as large


def _parts_of(server, tokens: list[int]):
    """The parts the served engine's scheduler gives a step over running tasks whose feeds have
    `tokens` each (a 1 is a decode row)."""
    from engine import Feed

    engine = server.runtime.engine
    feeds = [Feed(engine.new_state(), list(range(n))) for n in tokens]
    return feeds, engine.scheduler.parts(feeds)


def test_a_short_prefill_joins_the_next_step_beside_a_long_one(server):
    """The step's prefill budget goes to the fewest remaining tokens first: a 300-token tool result
    admitted after another session's long prompt gets all of its tokens into the next step, the
    long prompt the rest of the budget; the decode tokens come first."""
    budget = server.runtime.engine.step_tokens
    (long, decoding, short, other), parts = _parts_of(server, [3 * budget, 1, 300, 300])
    assert parts == [(decoding, 1), (short, 300), (other, 300), (long, budget - 601)]


def test_a_step_with_decode_rows_carries_at_most_decode_step_prefill_tokens(server, monkeypatch):
    """`ft serve --decode-step-prefill N`: beside decode rows a step's prefill is at most N tokens
    (the shortest first as ever); with no decode row it takes the whole budget."""
    budget = server.runtime.engine.step_tokens
    scheduler = server.runtime.engine.scheduler
    monkeypatch.setattr(scheduler, "limits", dataclasses.replace(scheduler.limits, decode_step_prefill=512))
    (long, decoding, short), parts = _parts_of(server, [3 * budget, 1, 300])
    assert parts == [(decoding, 1), (short, 300), (long, 212)]
    (long, short), parts = _parts_of(server, [3 * budget, 300])
    assert parts == [(short, 300), (long, budget - 300)]


def test_decode_step_prefill_flag_reaches_the_config_and_refuses_tiny_chunks(capsys):
    from gateway.serve import config_from_args
    from tests.conftest import serve_args

    assert config_from_args(serve_args("--decode-step-prefill", "2048")).engine.decode_step_prefill == 2048
    assert config_from_args(serve_args()).engine.decode_step_prefill is None
    with pytest.raises(SystemExit):
        serve_args("--decode-step-prefill", "100")
    assert "expected a whole number >= 256, got '100'" in capsys.readouterr().err
