"""Two `ft serve` replicas of `tiny` sharing one disk cache behind the real smg router, started by the
command line README.md documents, against one `ft serve` alone on its own disk cache.

Eight sessions over the three protocols run four rounds, each round's eight requests at once. Every
request of a session lands on one replica and restores as many tokens as the single server restores
for the same request. After round two the replica serving more sessions (the hash ring may give it
all eight) is killed (SIGKILL, once its
checkpoints are on disk); its sessions go on on the other one with no failed request (smg retries
there), restoring from the shared disk tier as much as the single server restores, and every answer,
forced or greedy, equals the single server's.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from gateway.conversation import Message
from gateway.embedded import serve_process
from gateway.memo import MemoFile, TokenMemo
from gateway.ports import free_port

pytestmark = pytest.mark.skipif(shutil.which("smg") is None, reason="smg (pip install smg) is not installed")

README = Path(__file__).resolve().parents[2] / "README.md"
PROTOCOLS = ("messages", "chat", "responses")
SESSIONS = [(f"s{i}-{PROTOCOLS[i % 3]}", PROTOCOLS[i % 3]) for i in range(8)]
ROUNDS = 4
KILL_AFTER = 2
FORCED_ROUNDS = 3  # rounds 1..3 answer a forced output (except on /v1/responses, see below), round 4 greedily
WAIT = 180


def router_command(port: int, metrics_port: int, workers: list[str]) -> list[str]:
    """README's `smg launch` line with this test's ports in place of 8000, 29000 and the two workers."""
    (line,) = re.findall(r"^\s*(smg launch .*)$", README.read_text(), re.MULTILINE)
    argv = shlex.split(line)
    documented = [a for a in argv if a.startswith("http://")]
    assert len(documented) == len(workers)
    values = {"8000": str(port), "29000": str(metrics_port), **dict(zip(documented, workers, strict=True))}
    return [values.get(a, a) for a in argv]


def start_router(workers: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(os.environ["FT_HOME"] + f"/smg-{port}.log", "w")  # noqa: SIM115 (kept open for the process)
    proc = subprocess.Popen(router_command(port, free_port(), workers), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            listed = httpx.get(url + "/workers", timeout=5).json()["workers"]
            if sum(w["status"] == "ready" and w["is_healthy"] for w in listed) == len(workers):
                return proc, url
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("smg did not register the workers: " + Path(log.name).read_text()[-2000:])


def stop(proc: subprocess.Popen, sig: int = signal.SIGINT) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(name)


def settle(url: str) -> None:
    """Until the server is idle (answers, their checkpoints and precompute done) and every
    checkpoint it made is committed to disk."""
    deadline = time.monotonic() + WAIT
    while not (httpx.get(url + "/health", timeout=30).json()["idle"] and metric(url, "ft_store_write_queue_depth") == 0):
        assert time.monotonic() < deadline, f"{url} never settled"
        time.sleep(0.1)


class Session:
    """One agent session: its own system prompt, its history as the protocol sends it back."""

    def __init__(self, sid: str, protocol: str) -> None:
        self.sid, self.protocol = sid, protocol
        self.system = f"You are agent {sid}. " + "Keep answers short and exact. " * 12
        self.history: list[dict] = []

    def request(self, turn: int) -> tuple[str, dict, dict]:
        """Path, body and headers of this session's request in round `turn` (from 1)."""
        user = f"Round {turn} of {self.sid}: list the files."
        # no reasoning: the next request's history renders as generated, so what it restores does not
        # hang on whether the precompute of a reasoning-less history found a step with no live request
        forced = {"content": f"Done {turn} for {self.sid}: a.py, b.py."}
        force = turn <= FORCED_ROUNDS
        if self.protocol == "messages":
            self.history.append({"role": "user", "content": user})
            body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "system": self.system, "messages": self.history}
            headers = {"x-claude-code-session-id": self.sid, "anthropic-version": "2023-06-01"}
            path = "/v1/messages?beta=true"
        elif self.protocol == "chat":
            self.history.append({"role": "user", "content": user})
            body = {"model": "tiny", "max_tokens": 8, "temperature": 0,
                    "messages": [{"role": "system", "content": self.system}, *self.history]}
            headers, path = {"x-session-id": self.sid}, "/v1/chat/completions"
        else:  # smg's schema refuses unknown fields here (ft_forced_output): greedy answers only
            self.history.append({"role": "user", "content": user})
            body = {"model": "tiny", "max_output_tokens": 8, "temperature": 0,
                    "input": [{"role": "developer", "content": self.system}, *self.history]}
            headers, path, force = {"session-id": self.sid}, "/v1/responses", False
        if force:
            body = {**body, "max_tokens": 64, "ft_forced_output": forced}
        return path, dict(body), headers

    def answered(self, answer: dict) -> None:
        if self.protocol == "messages":
            self.history.append({"role": "assistant", "content": answer["content"]})
        elif self.protocol == "chat":
            message = answer["choices"][0]["message"]
            self.history.append({"role": "assistant", "content": message["content"],
                                 "reasoning_content": message.get("reasoning_content")})
        else:  # smg refuses a reasoning item whose content is null: sent back without it
            self.history += [{k: v for k, v in item.items() if v is not None} for item in answer["output"]]


def answer_of(protocol: str, answer: dict) -> object:
    """What the model said, without the ids and handles that differ between servers."""
    if protocol == "messages":
        return [{k: v for k, v in block.items() if k != "signature"} for block in answer["content"]]
    if protocol == "chat":
        return answer["choices"][0]
    return [{k: v for k, v in item.items() if k not in ("id", "encrypted_content")} for item in answer["output"]]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    shared = tmp_path_factory.mktemp("replicas") / "ckpt"
    alone = tmp_path_factory.mktemp("single") / "ckpt"
    args = [["--disk-cache", str(disk), "--disk-cache-size", "1"] for disk in (shared, shared, alone)]
    with ThreadPoolExecutor(3) as pool:
        servers = list(pool.map(lambda a: serve_process(a, timeout=WAIT), args))
    procs = [proc for proc, _ in servers]
    try:
        router, router_url = start_router([url for _, url in servers[:2]])
        procs.append(router)
        yield {"replicas": {url: proc for proc, url in servers[:2]}, "single": servers[2][1], "router": router_url}
    finally:
        for proc in reversed(procs):
            stop(proc)


def ft_ps() -> set[str]:
    """The URLs of the servers `ft ps` lists."""
    out = subprocess.run([sys.executable, "-m", "ft", "ps", "--json"], capture_output=True, text=True, timeout=60).stdout
    return {json.loads(line)["url"] for line in out.splitlines() if line.strip()}


def test_sessions_stay_on_a_replica_and_move_when_it_dies(fleet) -> None:
    replicas, single, router = fleet["replicas"], fleet["single"], fleet["router"]
    assert ft_ps() == {*replicas, single}
    sessions = [Session(sid, protocol) for sid, protocol in SESSIONS]
    served: dict[str, list[str]] = {s.sid: [] for s in sessions}
    cached: dict[str, list[int]] = {s.sid: [] for s in sessions}
    client = httpx.Client(timeout=WAIT)

    def turn(session: Session, number: int) -> tuple[httpx.Response, httpx.Response]:
        path, body, headers = session.request(number)
        return client.post(router + path, json=body, headers=headers), client.post(single + path, json=body,
                                                                                      headers=headers)

    victim = survivor = ""
    disk_hits_before = 0.0
    for number in range(1, ROUNDS + 1):
        for url in [single, *(url for url, proc in replicas.items() if proc.poll() is None)]:
            settle(url)  # what a request restores does not hang on how far the last turn's precompute got
        with ThreadPoolExecutor(len(sessions)) as pool:
            results = list(pool.map(turn, sessions, [number] * len(sessions)))
        for session, (routed, alone) in zip(sessions, results, strict=True):
            assert routed.status_code == 200, (session.sid, number, routed.text)
            assert alone.status_code == 200, (session.sid, number, alone.text)
            served[session.sid].append(routed.headers["x-smg-routed-worker-id"])
            cached[session.sid].append(int(routed.headers["x-cached-tokens"]))
            assert cached[session.sid][-1] == int(alone.headers["x-cached-tokens"]), (session.sid, number)
            assert answer_of(session.protocol, routed.json()) == answer_of(session.protocol, alone.json())
            session.answered(routed.json())
        if number == KILL_AFTER:
            for sid, urls in served.items():
                assert len(set(urls)) == 1, (sid, urls)  # session affinity
            victim, _ = Counter(urls[0] for urls in served.values()).most_common(1)[0]
            (survivor,) = set(replicas) - {victim}
            settle(victim)
            disk_hits_before = metric(survivor, "ft_store_disk_hits")
            replicas[victim].send_signal(signal.SIGKILL)
            replicas[victim].wait(30)
    moved = [sid for sid, urls in served.items() if urls[0] == victim]
    assert moved and all(cached[sid][KILL_AFTER] > cached[sid][KILL_AFTER - 1] > 0 for sid in moved)
    for sid, urls in served.items():
        assert urls[KILL_AFTER:] == [survivor] * (ROUNDS - KILL_AFTER), (sid, urls)
    assert metric(survivor, "ft_store_disk_hits") > disk_hits_before  # moved sessions restored from disk
    assert ft_ps() == {survivor, single}  # the killed replica's record is gone
    client.close()


REMEMBER = """
import sys
from gateway.conversation import Message
from gateway.memo import MemoFile, TokenMemo
memo = TokenMemo(file=MemoFile(sys.argv[1]))
handle = memo.remember(Message(role="assistant", reasoning="r", content="moved"), [5, 6, 7])
memo.written().result()
print(handle, flush=True)
sys.stdin.read()  # keeps the memo open until the test is done
"""


def test_a_replica_finds_the_ids_another_replica_generated_after_it_started(tmp_path) -> None:
    """The token memo on a shared disk cache: a message generated by one replica after another opened
    the memo is found by the other, by its content (OpenCode) and by its handle (Claude Code, Codex)."""
    folder, generated = tmp_path / "memo", Message(role="assistant", reasoning="r", content="moved")
    memo = TokenMemo(file=MemoFile(folder))
    assert memo.lookup(generated) is None
    root = Path(__file__).resolve().parents[2]
    other = subprocess.Popen([sys.executable, "-c", REMEMBER, str(folder)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    try:
        handle = other.stdout.readline().strip() if other.stdout else ""
        assert handle.startswith("ft1.")
        assert memo.lookup(generated) == [5, 6, 7]
        echoed = Message(role="assistant", content="moved", memo_handle=handle)  # reasoning omitted
        assert memo.lookup(echoed) == [5, 6, 7]
    finally:
        other.communicate("", timeout=60)
        memo.close()
