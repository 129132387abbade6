"""The standing goals at scale, as slow tests against the real server:

- 200 `kill -9` restarts of `ft serve` under load: every acknowledged answer's token ids are on
  disk, the checkpoint store opens with nothing corrupt and the restarted server serves; and 200
  kills of a checkpoint writer: every acknowledged checkpoint restorable (tests/checkpoint_store);
- 16 sessions for 10 minutes: no error; RSS growth and TTFT percentiles reported;
- at least 1,000 fuzzed bodies per protocol, numeric extremes and nesting included: never a 5xx.

`FT_SLOW_SCALE` (default 1) scales every size, for a shorter run of the same tests.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import threading
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.conversation import Message
from gateway.embedded import serve_process
from gateway.memo import MemoFile, content_hash
from tests.checkpoint_store.test_crash import run_and_kill, verify
from tests.gateway.test_server_errors import ENDPOINTS, assert_error_shape
from tests.gateway.test_server_restart import metric

pytestmark = pytest.mark.slow
SCALE = float(os.environ.get("FT_SLOW_SCALE", "1"))
IM_END = 248046


def scaled(n: float, least: int = 1) -> int:
    return max(least, round(n * SCALE))


# -- kill -9 under load


def forced_body(tag: str) -> dict:
    return {
        "model": "tiny",
        "max_tokens": 64,
        "messages": [
            {"role": "system", "content": f"Session {tag}. " * 40},
            {"role": "user", "content": tag},
        ],
        "ft_forced_output": {"reasoning": f"About {tag}.", "content": f"Answer {tag}."},
    }


def load(url: str, prefix: str, stop: threading.Event, acked: list[str], errors: list[str]) -> None:
    """One client: requests until stopped; an answer read to its end is acknowledged."""
    k = 0
    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.is_set():
            tag = f"{prefix}-{k}"
            k += 1
            try:
                r = client.post("/v1/chat/completions", json=forced_body(tag))
            except httpx.HTTPError:
                return  # the server was killed under this request
            if r.status_code != 200 or r.json()["choices"][0]["message"]["content"] != f"Answer {tag}.":
                errors.append(f"{r.status_code} {r.text[:300]}")
                return
            acked.append(tag)


def memo_hashes(disk: Path) -> dict[str, list[int]]:
    return {
        e.content_hash: e.token_ids for folder in disk.glob("memo-*") for _, e in MemoFile(folder).entries()
    }


def settle(url: str, tag: str) -> httpx.Response:
    """One answer whose checkpoints are then on disk (the store's write queue empty): acknowledged."""
    r = httpx.post(url + "/v1/chat/completions", json=forced_body(tag), timeout=120)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 120
    while metric(url, "ft_store_write_queue_depth") > 0 or metric(url, "ft_store_disk_records") == 0:
        assert time.monotonic() < deadline, "the disk tier never caught up"
        time.sleep(0.05)
    return r


def test_kill_9_restarts_under_load_lose_no_acknowledged_answer(tmp_path):
    """Each run: the previous run's settled conversation is restored from disk, a new one settles,
    four clients load the server, and it is killed at a random moment."""
    rng = random.Random(48)
    disk = tmp_path / "ckpt"
    acked: list[str] = []
    errors: list[str] = []
    settled: str | None = None
    for run in range(scaled(200)):
        proc, url = serve_process(["--disk-cache", str(disk), "--disk-cache-size", "1"], timeout=300)
        if settled is not None:
            again = httpx.post(url + "/v1/chat/completions", json=forced_body(settled), timeout=120)
            assert int(again.headers["x-cached-tokens"]) >= again.json()["usage"]["prompt_tokens"] - 8
        settled = f"settled-{run}"
        settle(url, settled)
        stop = threading.Event()
        clients = [
            threading.Thread(target=load, args=(url, f"{run}-{w}", stop, acked, errors)) for w in range(4)
        ]
        for t in clients:
            t.start()
        time.sleep(rng.uniform(0.2, 3.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        stop.set()
        for t in clients:
            t.join(120)
    assert not errors, errors[:5]
    memo = memo_hashes(disk)
    for tag in acked:
        ids = memo[
            content_hash(Message(role="assistant", reasoning=f"About {tag}.", content=f"Answer {tag}."))
        ]
        assert ids[-1] == IM_END
    assert len(acked) >= scaled(200)
    print(
        f"\n{scaled(200)} kills under load: {len(acked)} acknowledged answers, all on disk; every settled "
        "conversation restored after the kill that followed it"
    )


def test_acknowledged_checkpoints_survive_200_kills(tmp_path):
    rng = random.Random(200)
    last_acked = -1
    for _ in range(scaled(200)):
        acks = run_and_kill(tmp_path, last_acked + 1, rng)
        assert acks == list(range(last_acked + 1, last_acked + 1 + len(acks)))
        last_acked = max([last_acked, *acks])
        if last_acked >= 0:
            verify(tmp_path, last_acked)
    assert last_acked >= scaled(200)


# -- 16 sessions for 10 minutes

SESSION_TOKENS = 6000  # a session that grows past this starts over, as an agent starts a new task


def session(url: str, n: int, until: float, ttfts: list[float], errors: list[str]) -> None:
    """An agent-shaped session: a tool call, its result, again; streamed, TTFT measured."""
    system = f"You are agent {n}. " + "Follow the repository's rules. " * 60
    messages: list[dict] = []
    turn = 0
    with httpx.Client(base_url=url, timeout=300) as client:
        while time.monotonic() < until:
            if not messages:
                messages = [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"task {turn}"},
                ]
            call = {"name": "bash", "arguments": {"cmd": f"ls step{turn}"}}
            body = {
                "model": "tiny",
                "max_tokens": 64,
                "stream": True,
                "messages": messages,
                "stream_options": {"include_usage": True},
                "tools": [
                    {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}
                ],
                "ft_forced_output": {"reasoning": f"Step {turn}.", "tool_calls": [call]},
            }
            prompt = stream_once(client, body, ttfts, errors)
            turn += 1
            messages = messages + [
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": f"Step {turn - 1}.",
                    "tool_calls": [
                        {
                            "id": f"c{turn}",
                            "type": "function",
                            "function": {"name": "bash", "arguments": json.dumps(call["arguments"])},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": f"c{turn}", "content": f"file{turn}.py\n" * 20},
            ]
            if prompt is None or prompt > SESSION_TOKENS:
                messages = []


def stream_once(client: httpx.Client, body: dict, ttfts: list[float], errors: list[str]) -> int | None:
    """Prompt tokens of one streamed answer (None on an error, which is recorded)."""
    sent = time.perf_counter()
    first, prompt, done = None, None, False
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            errors.append(f"{r.status_code} {r.read()[:300]!r}")
            return None
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(line[:300])
            if first is None and chunk.get("choices"):
                first = time.perf_counter()
            prompt = (chunk.get("usage") or {}).get("prompt_tokens", prompt)
    if not done or first is None:
        errors.append("stream ended early")
        return None
    ttfts.append(first - sent)
    return prompt


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_sixteen_sessions_for_ten_minutes(tmp_path):
    proc, url = serve_process(["--disk-cache", str(tmp_path / "ckpt"), "--max-running", "4"], timeout=300)
    try:
        ttfts: list[float] = []
        errors: list[str] = []
        warm = rss_bytes(proc.pid)
        until = time.monotonic() + 600 * SCALE
        sessions = [threading.Thread(target=session, args=(url, n, until, ttfts, errors)) for n in range(16)]
        for t in sessions:
            t.start()
        rss = [warm]
        while any(t.is_alive() for t in sessions):
            time.sleep(1)
            rss.append(rss_bytes(proc.pid))
        for t in sessions:
            t.join()
        assert not errors, errors[:5]
        assert httpx.get(url + "/health").json()["status"] == "ok"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    q = statistics.quantiles(ttfts, n=100)
    print(
        f"\n16 sessions, {600 * SCALE:.0f} s: {len(ttfts)} answers, no error; TTFT p50 {q[49] * 1000:.0f} ms, "
        f"p90 {q[89] * 1000:.0f} ms, p99 {q[98] * 1000:.0f} ms; RSS {warm / 2**20:.0f} MiB at start, "
        f"{max(rss) / 2**20:.0f} MiB at most, {rss[-1] / 2**20:.0f} MiB at the end "
        f"({(rss[-1] - warm) / 2**20:+.0f} MiB)"
    )
    assert len(ttfts) >= 16


# -- fuzzed bodies

extreme_numbers = (
    st.integers(min_value=-(10**400), max_value=10**400)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**400, 5e-324, 1.7976931348623157e308])
)
json_leaf = st.none() | st.booleans() | extreme_numbers | st.text(max_size=30)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=25,
)
text_or_parts = st.text(max_size=40) | st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "input_text", "image", "tool_result"]), "text": json_value}
    ),
    max_size=3,
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "system", "tool", "developer", "x"]),
        "content": text_or_parts,
    },
    optional={"tool_calls": json_value, "tool_call_id": json_value, "reasoning_content": json_value},
)
SAMPLING = [
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "max_completion_tokens",
]
limit = (
    st.integers(min_value=1, max_value=4) | extreme_numbers | json_value
)  # decodes stay short: --max-tokens-cap
request_body = st.fixed_dictionaries(
    {
        "model": st.text(max_size=20) | json_value,
        "max_tokens": limit,
        "max_output_tokens": limit,
        "messages": st.lists(message, min_size=1, max_size=4) | json_value,
        "input": st.text(max_size=30) | st.lists(message, max_size=3) | json_value,
    },
    optional={
        **{name: extreme_numbers | json_value for name in SAMPLING},
        "stream": st.booleans() | json_value,
        "tools": json_value,
        "tool_choice": json_value,
        "system": json_value,
        "stop": json_value,
        "metadata": json_value,
        "thinking": json_value,
    },
)
nesting = st.tuples(
    st.sampled_from(["messages", "tools", "metadata", "input", "system"]),
    st.integers(min_value=1, max_value=20_000),
    st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]),
)


def raw_body(body: dict, nested: tuple | None) -> bytes:
    """`body` as JSON bytes (integers of any size), with one field replaced by deep nesting."""
    raw = json.dumps(body, default=str).encode()
    if nested is None:
        return raw
    field, depth, (opening, closing) = nested
    body = {k: v for k, v in body.items() if k != field}
    return (
        json.dumps(body, default=str).encode()[:-1]
        + f', "{field}": '.encode()
        + opening * depth
        + b"1"
        + closing * depth
        + b"}"
    )


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    proc, url = serve_process(["--max-tokens-cap", "4"], timeout=300)
    yield url
    proc.send_signal(signal.SIGINT)
    proc.wait(60)


@pytest.mark.parametrize("path", ENDPOINTS)
def test_a_thousand_fuzzed_bodies_per_protocol_never_give_a_5xx(fuzz_server, path):
    client = httpx.Client(base_url=fuzz_server, timeout=120)
    statuses: dict[int, int] = {}

    @settings(
        max_examples=scaled(1000, 20),
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(body=request_body, nested=st.none() | nesting)
    def one(body: dict, nested: tuple | None) -> None:
        r = client.post(path, content=raw_body(body, nested), headers={"content-type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code in (200, 400, 413), r.text[:500]
        if r.status_code != 200:
            assert_error_shape(r, ENDPOINTS[path], r.status_code)

    try:
        one()
        assert client.get("/health").json()["status"] == "ok"
    finally:
        client.close()
    print(f"\n{path}: {sum(statuses.values())} fuzzed bodies, statuses {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) >= scaled(1000, 20)
