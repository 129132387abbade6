"""Bad input, limits, auth, disconnects and concurrency on the live server: the protocol's
error JSON every time, and a healthy server afterwards."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import start_server

ENDPOINTS = {"/v1/messages": "anthropic", "/v1/responses": "openai", "/v1/chat/completions": "openai"}


def assert_error_shape(response: httpx.Response, style: str, status: int) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    if style == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] and body["error"]["message"]
    else:
        assert body["error"]["message"] and body["error"]["type"]


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("payload", [
    b"{not json", b"[1, 2]", b'"text"', b"\xff\xfe\x00invalid utf-8",
    b'{"model": "tiny", "messages": []}', b'{"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "hologram"}]}]}',
    b'{"model": "tiny", "messages": "hello", "input": 5}', b'{"model": 7, "max_tokens": "many"}',
])
def test_malformed_bodies_get_the_protocols_400(live_server, path, payload):
    with live_server.client() as client:
        r = client.post(path, content=payload, headers={"content-type": "application/json"})
    assert_error_shape(r, ENDPOINTS[path], 400)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
request_like = st.fixed_dictionaries({"model": st.just("tiny"), "max_tokens": st.just(2)}, optional={
    "messages": json_values, "input": json_values, "system": json_values, "tools": json_values,
    "instructions": json_values, "stream": json_values, "temperature": json_values,
})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(sorted(ENDPOINTS)), body=request_like)
def test_arbitrary_json_never_gives_a_500(live_server, path, body):
    with live_server.client() as client:
        r = client.post(path, json=body)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert_error_shape(r, ENDPOINTS[path], 400)


def test_oversized_body_is_413_and_server_stays_healthy(live_server):
    big = b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"x" * (33 << 20) + b'"}]}'
    with live_server.client() as client:
        r = client.post("/v1/messages", content=big, headers={"content-type": "application/json"})
        assert_error_shape(r, "anthropic", 413)
        assert client.get("/health").json()["status"] == "ok"


def test_context_overflow_is_each_protocols_context_error(live_server):
    words = "lorem ipsum dolor sit amet " * 20000  # far beyond the tiny preset's 65536 positions
    with live_server.client() as client:
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": words}]})
        assert_error_shape(r, "openai", 400)
        assert r.json()["error"]["code"] == "context_length_exceeded"
        r = client.post("/v1/messages", json={"model": "tiny", "max_tokens": 4,
                                              "messages": [{"role": "user", "content": words}]})
        assert_error_shape(r, "anthropic", 400)


def test_unknown_route_is_a_404_in_protocol_shape(live_server):
    with live_server.client() as client:
        assert_error_shape(client.get("/v1/nothing"), "openai", 404)


def test_api_key_is_enforced_when_set():
    server = start_server(preset="tiny", api_key="sekret")
    try:
        with server.client() as client:
            body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
            assert_error_shape(client.post("/v1/messages", json=body), "anthropic", 401)
            assert_error_shape(client.post("/v1/chat/completions", json=body,
                                           headers={"authorization": "Bearer wrong"}), "openai", 401)
            assert client.post("/v1/messages", json=body, headers={"x-api-key": "sekret"}).status_code == 200
            ok = client.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer sekret"})
            assert ok.status_code == 200
            assert client.get("/health").status_code == 200
    finally:
        server.stop()


def test_a_client_that_disconnects_mid_stream_cancels_its_generation(live_server):
    body = {"model": "tiny", "stream": True, "max_tokens": 5000, "temperature": 0,
            "messages": [{"role": "user", "content": "write forever"}]}
    with live_server.client() as client:
        before = _generated(client)
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            for _ in zip(range(5), r.iter_lines(), strict=False):
                pass
        live_server.wait_idle(timeout=60)
        generated = _generated(client) - before
    assert generated < 1000  # stopped long before max_tokens


def _generated(client) -> int:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith('ft_tokens_total{kind="generated"}'):
            return int(float(line.split()[-1]))
    raise AssertionError("no generated-token counter")


def test_concurrent_requests_all_complete(live_server):
    def one(i: int) -> int:
        with live_server.client() as client:
            r = client.post("/v1/chat/completions", json={
                "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": f"request {i}"}]})
            return r.status_code

    start = time.time()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(one, range(16)))
    assert statuses == [200] * 16 and time.time() - start < 120


def test_models_health_and_metrics(live_server):
    with live_server.client() as client:
        model = client.get("/v1/models").json()["data"][0]
        assert model["id"] == "tiny" and model["context_length"] == 65536
        metrics = client.get("/metrics").text
    for name in ("ft_requests_total", "ft_ttft_seconds_bucket", 'ft_tokens_total{kind="reused"}', "ft_store_"):
        assert name in metrics


def test_a_failure_after_the_first_token_is_the_protocols_error(monkeypatch):
    """The engine failing mid-answer (driven by a test double: the real engine does not fail on
    demand) gives a non-streamed request the protocol's error JSON, a streamed one an in-stream
    error event, and leaves the server serving."""
    server = start_server(preset="tiny", policy="anchor", default_max_tokens=16)
    engine = server.runtime.engine
    real_run = engine.run

    def failing_run(plan):
        if plan.decode or plan.riding:  # the first decode step after the first token
            raise RuntimeError("device lost")
        return real_run(plan)

    body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    try:
        with server.client() as client:
            monkeypatch.setattr(engine, "run", failing_run)
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 500 and r.json()["error"]["type"] and "device lost" not in r.text
            anthropic = client.post("/v1/messages", json={**body, "messages": [{"role": "user", "content": "yo"}]})
            assert anthropic.status_code == 500 and anthropic.json()["type"] == "error"
            with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
                lines = [line for line in s.iter_lines() if line.startswith("data: ")]
            assert s.status_code == 200 and any('"error"' in line for line in lines)
            monkeypatch.setattr(engine, "run", real_run)
            assert client.post("/v1/chat/completions", json=body).status_code == 200
    finally:
        server.stop()


def test_running_out_of_device_memory_is_a_retryable_503_naming_the_fix(monkeypatch):
    """The GPU running out of memory in a step (driven by a test double: the CPU has no device
    memory to run out of) fails that step's request as a busy server's 503 that says what to
    change, in each protocol's shape, and the server goes on serving."""
    import torch

    server = start_server(preset="tiny", policy="anchor", default_max_tokens=4)
    engine = server.runtime.engine
    real_run = engine.run

    def failing_run(plan):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

    body = {"model": "tiny", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    try:
        with server.client() as client:
            monkeypatch.setattr(engine, "run", failing_run)
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert error["code"] == "out_of_device_memory" and "--gpu-memory" in error["message"]
            assert "64.00 MiB" not in r.text  # the engine's own text stays in the log
            anthropic = client.post("/v1/messages", json=body)
            assert anthropic.status_code == 503 and anthropic.json()["error"]["type"] == "overloaded_error"
            monkeypatch.setattr(engine, "run", real_run)
            assert client.post("/v1/chat/completions", json=body).status_code == 200
    finally:
        server.stop()


numeric_extremes = (
    st.integers(min_value=-(10**400), max_value=10**400)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([5e-324, 1e-300, 1e-3, 2.0, 1.7976931348623157e308, -0.0, 2**63, 2**64 - 1, 2**64, -(2**63) - 1])
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(sorted(ENDPOINTS)), field=st.sampled_from(["temperature", "top_p", "top_k", "seed", "n"]),
       value=numeric_extremes)
def test_numeric_extremes_never_give_a_500(live_server, path, field, value):
    body = {"model": "tiny", "max_tokens": 2, "max_output_tokens": 2, "input": "hi",
            "messages": [{"role": "user", "content": "hi"}], field: value}
    with live_server.client() as client:
        r = client.post(path, json=body)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert_error_shape(r, ENDPOINTS[path], 400)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from([*sorted(ENDPOINTS), "/v1/messages/count_tokens"]),
       field=st.sampled_from(["messages", "tools", "metadata", "input", "system"]),
       depth=st.integers(min_value=1, max_value=5000), brackets=st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
def test_nesting_at_any_depth_never_gives_a_500(live_server, path, field, depth, brackets):
    """JSON built as bytes: Python's own encoder cannot write what the server must survive."""
    opening, closing = brackets
    nested = opening * depth + b"1" + closing * depth
    payload = b'{"model": "tiny", "max_tokens": 2, "input": "hi", "messages": [{"role": "user", "content": "hi"}], "'
    with live_server.client() as client:
        r = client.post(path, content=payload.replace(b'"' + field.encode() + b'": ', b'"_": ') + field.encode()
                        + b'": ' + nested + b"}", headers={"content-type": "application/json"})
        assert r.status_code in (200, 400), r.text
        assert client.get("/health").status_code == 200
