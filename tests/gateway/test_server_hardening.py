"""What operators and clients do to a running server (issue 12): values that used to crash it are
400s naming the field, a client that leaves frees the engine, the key is checked safely, slow and
too many connections are cut, and SIGTERM ends every answer in its protocol's shape."""

from __future__ import annotations

import os
import stat

import httpx
import pytest

from gateway.recorder import Recorder
from tests.conftest import start_server
from tests.gateway.test_server_errors import ENDPOINTS, _generated, assert_error_shape

CHAT = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def post_raw(client: httpx.Client, path: str, payload: bytes, **headers: str) -> httpx.Response:
    return client.post(path, content=payload, headers={"content-type": "application/json", **headers})


def field_of(response: httpx.Response) -> str:
    """The field a 400 names: OpenAI's `param`, the start of Anthropic's message."""
    error = response.json()["error"]
    return error.get("param") or error["message"].split(":")[0]


@pytest.mark.parametrize("path", [*ENDPOINTS, "/v1/messages/count_tokens"])
@pytest.mark.parametrize("depth", [1000, 5000, 150])
def test_deeply_nested_json_is_a_400(live_server, path, depth):
    nested = b"[" * depth + b"]" * depth
    payload = b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "metadata": ' + nested + b"}"
    with live_server.client() as client:
        r = post_raw(client, path, payload)
        assert_error_shape(r, "anthropic" if path.startswith("/v1/messages") else "openai", 400)
        assert field_of(r) == "body" and "nested" in r.json()["error"]["message"]
        assert client.get("/health").json()["status"] == "ok"


@pytest.mark.parametrize(("field", "raw"), [
    ("temperature", b"1e-300"), ("temperature", b"-1"), ("temperature", b"9" * 400), ("top_p", b"-0.5"),
    ("top_p", b"1" + b"0" * 400), ("max_tokens", b"1.5"),
])
@pytest.mark.parametrize("path", ENDPOINTS)
def test_numeric_extremes_are_400s_naming_the_field(live_server, path, field, raw):
    if path == "/v1/responses" and field == "max_tokens":
        field = "max_output_tokens"
    payload = (b'{"model": "tiny", "max_tokens": 2, "input": "hi", "messages": [{"role": "user", "content": "hi"}], "'
               + field.encode() + b'": ' + raw + b"}")
    with live_server.client() as client:
        r = post_raw(client, path, payload)
    assert_error_shape(r, ENDPOINTS[path], 400)
    assert field_of(r) == field


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**400])
def test_a_chat_seed_beyond_64_bits_is_a_400(live_server, seed):
    payload = b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "seed": '
    with live_server.client() as client:
        r = post_raw(client, "/v1/chat/completions", payload + str(seed).encode() + b"}")
        assert_error_shape(r, "openai", 400)
        assert field_of(r) == "seed"
        ok = client.post("/v1/chat/completions", json={**CHAT, "seed": 2**64 - 1, "temperature": 0.7})
        assert ok.status_code == 200, ok.text


def test_the_smallest_temperature_still_samples(live_server):
    with live_server.client() as client:
        r = client.post("/v1/chat/completions", json={**CHAT, "temperature": 0.001, "top_p": 0})
    assert r.status_code == 200, r.text


def test_a_body_longer_than_the_context_can_hold_is_refused_unread(live_server):
    """The tiny preset's 65,536 tokens at 32 bytes a token: 2 MiB. A 3 MiB prompt is a 413
    before any of it is decoded or tokenized."""
    text = "word " * (600 << 10)
    with live_server.client() as client:
        r = client.post("/v1/messages", json={**CHAT, "messages": [{"role": "user", "content": text}]})
    assert_error_shape(r, "anthropic", 413)
    assert "2097152" in r.json()["error"]["message"]


def test_the_key_is_checked_safely():
    server = start_server(preset="tiny", api_key="sekret")
    try:
        with server.client() as client:
            bad = client.post("/v1/messages", json=CHAT, headers={"x-api-key": b"\xff\xfe sekret"})
            assert_error_shape(bad, "anthropic", 400)
            assert field_of(bad) == "headers.x-api-key"
            bad = client.post("/v1/chat/completions", json=CHAT, headers={"authorization": b"Bearer \xc3\x28"})
            assert_error_shape(bad, "openai", 400)
            assert field_of(bad) == "headers.authorization"
            other = client.post("/v1/chat/completions", json=CHAT,
                                headers={"authorization": "bearer sekret", "x-trace": b"\xff"})
            assert other.status_code == 200, other.text
            assert_error_shape(client.post("/v1/messages", json=CHAT, headers={"x-api-key": "sekre"}),
                               "anthropic", 401)
    finally:
        server.stop()


def test_a_non_streaming_client_that_leaves_frees_the_engine(live_server):
    """The client gives up after 1 s; its 5,000-token answer stops within a step or two."""
    body = {**CHAT, "max_tokens": 5000, "temperature": 0, "messages": [{"role": "user", "content": "write forever"}]}
    with live_server.client() as client:
        before = _generated(client)
        with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=live_server.url, timeout=1.0) as impatient:
            impatient.post("/v1/chat/completions", json=body)
        live_server.wait_idle(timeout=120)
        assert _generated(client) - before < 1000
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_the_recording_is_private_and_never_follows_a_planted_link(tmp_path, monkeypatch):
    monkeypatch.setattr("gateway.recorder.time.strftime", lambda fmt: "20250101-000000")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    folder = tmp_path / "rec"
    folder.mkdir()
    (folder / "session-20250101-000000.jsonl").symlink_to(victim)
    recorder = Recorder(folder)
    try:
        assert not recorder.path.is_symlink() and recorder.path.name != "session-20250101-000000.jsonl"
        assert stat.S_IMODE(os.stat(recorder.path).st_mode) == 0o600
        assert victim.read_text() == "precious\n"
    finally:
        recorder.close()
