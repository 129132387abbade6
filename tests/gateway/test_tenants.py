"""Tenants apart, on the real server (tiny, a real LMDB folder): with several named keys, each key's
checkpoints are its own. Another tenant's identical prompt restores nothing and learns nothing from
the headers (x-cached-tokens, x-prefill-reasons, x-prefill-edited-at), the usage or the metrics; two
tenants that both opt in share the system prompt and tools and nothing after them; a restart on the
same disk cache restores a tenant's checkpoints to it and to no other; a salt or namespace the
client sends changes nothing. Outputs are teacher-forced, so every answer is deterministic."""

from __future__ import annotations

import signal
import stat
import time

import httpx
import lmdb
import pytest

from gateway.anchors import Namespace, boundaries, public_prefix, root_anchor
from gateway.embedded import serve_process
from gateway.prefill_reasons import REASONS
from gateway.protocols import anthropic, chat
from gateway.render import segment_ids
from gateway.serve import api_key
from gateway.tenants import SECRET_BYTES, SECRET_FILE, TenantKey, parse_keys, tenant_salt
from tests.conftest import serve_args, start_server

KEYS = "alice:key-alice\nbob:key-bob\n\ncarol:key-carol:public\ndave:key-dave:public\n"
FORCED = {"content": "Done."}
SPOOFS = {"x-ft-namespace": "alice", "x-ft-salt": "00" * 16, "x-tenant": "alice", "x-ft-tenant": "alice",
          "openai-organization": "alice", "anthropic-organization-id": "alice"}


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def chat_body(system: str, user: str = "List the files.") -> dict:
    """A prompt of tools, a system prompt and a user message, each naming the system prompt (each
    test's contents its own: a tenant's own history would explain its prompt otherwise)."""
    user = f"{user} ({system[:40]})"
    tools = [{"type": "function", "function": {
        "name": "bash", "description": f"Run a shell command for: {system[:40]}",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
    return {"model": "tiny", "ft_forced_output": FORCED, "tools": tools,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def counters(client: httpx.Client) -> dict[str, float]:
    """ft_tokens_total by kind and ft_prefill_tokens_by_reason_total by reason, read from /metrics."""
    found = {}
    for line in client.get("/metrics").text.splitlines():
        for family in ("ft_tokens_total", "ft_prefill_tokens_by_reason_total"):
            if line.startswith(family + "{"):
                found[line[len(family):].split("}")[0] + "}"] = float(line.split()[-1])
    return found


class Answer:
    """One request's answer: tokens restored and prefilled as the headers, the usage and the metrics say."""

    def __init__(self, client: httpx.Client, key: str, body: dict, headers: dict | None = None):
        before = counters(client)
        r = client.post("/v1/chat/completions", json=body, headers={**auth(key), **(headers or {})})
        assert r.status_code == 200, r.text
        after = counters(client)
        self.delta = {name: after[name] - before.get(name, 0) for name in after}
        self.cached, self.prefilled = int(r.headers["x-cached-tokens"]), int(r.headers["x-prefill-tokens"])
        self.reasons = r.headers["x-prefill-reasons"]
        self.edited_at = r.headers.get("x-prefill-edited-at")
        usage = r.json()["usage"]
        self.prompt = usage["prompt_tokens"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == self.cached
        assert self.cached + self.prefilled == self.prompt
        assert self.delta['{kind="reused"}'] == self.cached
        assert self.delta['{kind="prefilled"}'] == self.prefilled

    def assert_all_new(self) -> None:
        """Prefilled whole, every token `new`: nothing restored, no reason that tells of a history."""
        assert (self.cached, self.prefilled) == (0, self.prompt)
        assert self.reasons == f"new={self.prompt}" and self.edited_at is None
        assert self.delta['{reason="new"}'] == self.prompt
        assert all(self.delta[f'{{reason="{r}"}}'] == 0 for r in REASONS if r != "new")


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text(KEYS)
    return path


@pytest.fixture(scope="module")
def server(keys_file, tmp_path_factory):
    server = start_server(preset="tiny", policy="anchor", api_key=api_key(serve_args("--api-key-file", str(keys_file))),
                          disk_cache=tmp_path_factory.mktemp("cache"), disk_cache_gib=1.0)
    yield server
    server.stop()


def prompt_ends(server, body: dict) -> tuple[list[int], int]:
    """The prompt's segment ends and how many segments are its system prompt and tools."""
    segments = server.runtime.renderer.render(chat.parse_request(body))
    return boundaries(segments), public_prefix(segments)


def test_the_key_file_names_tenants():
    assert parse_keys("just-one-key\n", "f") == "just-one-key"
    assert parse_keys(KEYS, "f") == (TenantKey("alice", "key-alice"), TenantKey("bob", "key-bob"),
                                     TenantKey("carol", "key-carol", True), TenantKey("dave", "key-dave", True))
    assert parse_keys("ops:a:b:c\n", "f") == (TenantKey("ops", "a:b:c"),)
    for text, why in (("one\ntwo\n", "each be named"), ("a:k1\nb\n", "each be named"), ("a:\n", "empty"),
                      ("a:k1\na:k2\n", "same name"), ("a:k\nb:k\n", "same key"), ("bad name:k\n", "name")):
        with pytest.raises(ValueError, match=why):
            parse_keys(text, "f")


def test_every_key_is_answered_and_no_other(server):
    body = chat_body("Answer keys. " * 20)
    with server.client() as client:
        for key in ("key-alice", "key-bob", "key-carol", "key-dave"):
            assert client.post("/v1/chat/completions", json=body, headers=auth(key)).status_code == 200
        for headers in ({}, auth("key-alic"), auth("key-alice2"), {"x-api-key": "alice"}):
            assert client.post("/v1/chat/completions", json=body, headers=headers).status_code == 401
        assert client.post("/v1/chat/completions", json=body, headers={"x-api-key": "key-bob"}).status_code == 200


def test_two_keys_with_the_same_prompt_share_nothing(server):
    first = chat_body("You are a careful coding agent. " * 30)
    with server.client() as client:
        alice = Answer(client, "key-alice", first)
        alice.assert_all_new()
        assert Answer(client, "key-alice", first).cached == prompt_ends(server, first)[0][-2]  # all but the last
        bob = Answer(client, "key-bob", first)
        bob.assert_all_new()
        # a second turn that re-sends alice's history: every segment's content was computed, by alice
        turn = {**first, "messages": [*first["messages"], {"role": "assistant", "content": "Listed them all."},
                                      {"role": "user", "content": "Now the tests."}]}
        Answer(client, "key-alice", turn)
        Answer(client, "key-carol", turn).assert_all_new()
        # the public prefix, computed further by carol: dave restores it, the rest is new to him
        dave = Answer(client, "key-dave", turn)
        ends, shared = prompt_ends(server, turn)
        assert dave.cached == ends[shared - 1] and dave.reasons == f"new={dave.prefilled}" and dave.edited_at is None


def test_the_public_prefix_is_shared_only_between_tenants_that_opt_in(server):
    body = chat_body("You review pull requests. " * 30)
    ends, shared = prompt_ends(server, body)
    assert shared == 2  # the tools block, then the system prompt
    with server.client() as client:
        Answer(client, "key-carol", body).assert_all_new()
        dave = Answer(client, "key-dave", body)
        assert dave.cached == ends[shared - 1]  # the system prompt and tools, nothing after them
        assert dave.reasons == f"new={dave.prompt - dave.cached}" and dave.edited_at is None
        Answer(client, "key-alice", body).assert_all_new()  # private: not the public prefix
        other = chat_body("You review pull requests. " * 30, user="Review the last commit.")
        assert Answer(client, "key-dave", other).cached == ends[shared - 1]
        Answer(client, "key-bob", other).assert_all_new()
        assert Answer(client, "key-dave", other).cached == prompt_ends(server, other)[0][-2]  # its own, whole


def test_the_next_turn_is_precomputed_in_the_tenant_s_namespace(server):
    """An answer's reasoning is dropped from the next turn's history: only the precompute, run after
    the answer, checkpoints that history. It is the answering tenant's, and no other's."""
    body = {**chat_body("You write release notes. " * 30),
            "ft_forced_output": {"reasoning": "Group them by area.", "content": "Notes written."}}
    turn = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "Notes written."},
                                 {"role": "user", "content": "Shorter, please."}]}
    precomputed = '{kind="precomputed"}'
    with server.client() as client:
        before = counters(client).get(precomputed, 0)
        Answer(client, "key-alice", body)
        server.wait_idle(timeout=120)
        assert counters(client)[precomputed] > before
        Answer(client, "key-bob", turn).assert_all_new()
        assert Answer(client, "key-alice", turn).cached == prompt_ends(server, turn)[0][-3]  # through the answer


def test_a_salt_or_namespace_the_client_sends_changes_nothing(server):
    body = chat_body("You fix flaky tests. " * 30)
    spoofed = {**body, "namespace": "alice", "salt": "00" * 16, "tenant": "alice", "user": "alice",
               "metadata": {"tenant": "alice", "namespace": "alice"}}
    with server.client() as client:
        Answer(client, "key-alice", body).assert_all_new()
        Answer(client, "key-bob", spoofed, SPOOFS).assert_all_new()
        mine = Answer(client, "key-alice", spoofed, {**SPOOFS, "x-ft-namespace": "bob", "x-tenant": "bob"})
        assert mine.cached == prompt_ends(server, body)[0][-2]


def test_a_tenant_s_memo_does_not_render_another_s_messages(server):
    """An answer's handle, sent back by another tenant with the thinking omitted, is not that answer's
    ids: its prompt is the text's (no reasoning), as counted with no memo; its own tenant's has them."""
    forced = {"reasoning": "The secret plan is to read the config.", "tool_calls": [
        {"name": "bash", "arguments": {"command": "cat config.toml"}}]}
    tools = [{"name": "bash", "description": "Run a shell command",
              "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]
    first = {"model": "tiny", "max_tokens": 64, "tools": tools, "ft_forced_output": forced,
             "thinking": {"type": "enabled", "budget_tokens": 1024},
             "messages": [{"role": "user", "content": "Read the config."}]}
    with server.client() as client:
        r = client.post("/v1/messages", json=first, headers={"x-api-key": "key-alice"})
        assert r.status_code == 200, r.text
        thinking, call = r.json()["content"][0], r.json()["content"][-1]
        assert thinking["signature"] and call["type"] == "tool_use"
        omitted = {**thinking, "thinking": ""}
        turn = {k: v for k, v in first.items() if k != "ft_forced_output"} | {"messages": [
            *first["messages"], {"role": "assistant", "content": [omitted, call]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": "x = 1"}]}]}
        count = {k: v for k, v in turn.items() if k in ("model", "messages", "tools", "thinking")}
        counted = {key: client.post("/v1/messages/count_tokens", json=count, headers={"x-api-key": key}).json()
                   for key in ("key-alice", "key-bob")}
    text_only = len(segment_ids(server.runtime.renderer.render(anthropic.parse_request(count))))
    assert counted["key-bob"]["input_tokens"] == text_only < counted["key-alice"]["input_tokens"]


# -- a restart on the same disk cache


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(name)


def serve(keys_file, cache) -> tuple:
    return serve_process(["--api-key-file", str(keys_file), "--disk-cache", str(cache), "--disk-cache-size", "1"])


def post(url: str, key: str, body: dict) -> httpx.Response:
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=auth(key), timeout=120)
    assert r.status_code == 200, r.text
    return r


def stop(proc) -> None:
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0


def test_a_restart_restores_a_tenant_s_checkpoints_to_it_and_no_other(keys_file, tmp_path):
    cache = tmp_path / "cache"
    body = chat_body("You keep the build green. " * 30)
    proc, url = serve(keys_file, cache)
    try:
        first = post(url, "key-alice", body)
        assert first.headers["x-cached-tokens"] == "0"
        deadline = time.monotonic() + 60
        while metric(url, "ft_store_write_queue_depth") > 0 or metric(url, "ft_store_disk_records") == 0:
            assert time.monotonic() < deadline, "disk tier never caught up"
            time.sleep(0.1)
    finally:
        stop(proc)
    secret = (cache / SECRET_FILE).read_bytes()
    assert len(secret) == SECRET_BYTES and stat.S_IMODE((cache / SECRET_FILE).stat().st_mode) == 0o600

    proc, url = serve(keys_file, cache)
    try:
        bob = post(url, "key-bob", body)
        prompt = bob.json()["usage"]["prompt_tokens"]
        assert (bob.headers["x-cached-tokens"], bob.headers["x-prefill-reasons"]) == ("0", f"new={prompt}")
        assert "x-prefill-edited-at" not in bob.headers
        alice = post(url, "key-alice", body)
        assert int(alice.headers["x-cached-tokens"]) >= prompt - 8  # all but the generation prompt, from disk
        assert (cache / SECRET_FILE).read_bytes() == secret
    finally:
        stop(proc)
    assert_disk_keys_are_each_tenant_s(cache, secret, body)


def assert_disk_keys_are_each_tenant_s(cache, secret: bytes, body: dict) -> None:
    """The same prompt, sent by alice and bob, is kept under two sets of LMDB keys (anchor + part),
    each the tenant's anchors, none the keyless server's."""
    from engine import Engine
    from gateway.render import load_renderer

    engine = Engine.from_preset("tiny")
    renderer = load_renderer(engine.model_dir)
    segments = renderer.render(chat.parse_request(body))
    root = root_anchor(engine.fingerprint, renderer.template_id)
    chains = {name: Namespace.private(root, tenant_salt(secret, name)).chain(segments) for name in ("alice", "bob")}
    chains["keyless"] = Namespace(root).chain(segments)
    env = lmdb.open(str(cache), readonly=True, lock=False)
    try:
        with env.begin() as txn:
            anchors = {key[:-1] for key, _ in txn.cursor()}
    finally:
        env.close()
    assert set(chains["alice"][:-1]) <= anchors and set(chains["bob"][:-1]) <= anchors
    assert not set(chains["alice"]) & set(chains["bob"]) and not anchors & set(chains["keyless"])
