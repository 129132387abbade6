"""Nothing lost: checkpoints written to the disk tier survive `kill -9` of `ft serve`, and a
restarted server restores from them; Ctrl-C shuts down cleanly with the store flushed."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest

from gateway.embedded import serve_process

BODY = {"model": "tiny", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "system", "content": "You are terse. " * 200}, {"role": "user", "content": "hello"}]}


def serve(disk, *extra) -> tuple[subprocess.Popen, str]:
    return serve_process(["--disk-cache", str(disk), "--disk-cache-size", "1", *extra], timeout=120)


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(name)


def test_checkpoints_survive_kill_9_and_restore_after_restart(tmp_path):
    proc, url = serve(tmp_path / "ckpt")
    try:
        first = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=120)
        assert first.status_code == 200 and first.headers["x-cached-tokens"] == "0"
        deadline = time.time() + 60
        while metric(url, "ft_store_write_queue_depth") > 0 or metric(url, "ft_store_disk_records") == 0:
            assert time.time() < deadline, "disk tier never caught up"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    proc, url = serve(tmp_path / "ckpt")
    try:
        again = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=120)
        prompt = again.json()["usage"]["prompt_tokens"]
        assert int(again.headers["x-cached-tokens"]) >= prompt - 8  # all but the generation prompt
        assert again.json()["choices"][0] == first.json()["choices"][0]  # same greedy answer
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0


def test_a_port_in_use_is_a_one_line_error(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "ft", "serve", "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == f"ft serve: cannot listen on 127.0.0.1:{port}: Address already in use"


def test_the_token_memo_survives_kill_9(tmp_path):
    """A generated message's ids are on disk once its answer has ended: a restart renders the
    message with them (here: read back from the memo folder after kill -9)."""
    from gateway.conversation import Message
    from gateway.memo import MemoFile, content_hash

    forced = {"reasoning": "Short.", "content": "Hello there."}
    proc, url = serve(tmp_path / "ckpt")
    try:
        r = httpx.post(url + "/v1/chat/completions", json={**BODY, "max_tokens": 64, "ft_forced_output": forced},
                       timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello there."
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    (folder,) = (tmp_path / "ckpt").glob("memo-*")
    entries = list(MemoFile(folder).entries())
    assert len(entries) == 1
    _, entry = entries[0]
    assert entry.content_hash == content_hash(Message(role="assistant", reasoning="Short.", content="Hello there."))
    assert entry.token_ids[-1] == 248046  # through <|im_end|>


def test_the_port_is_held_while_the_model_loads():
    """From its "loading" line on, `ft serve` keeps its port bound, so nothing else (an outgoing
    connection's source port included) takes it before the server listens."""
    import socket

    from gateway.ports import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ft", "serve", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("ft serve: loading"):
                break
        with socket.socket() as other, pytest.raises(OSError, match="in use"):
            other.bind(("127.0.0.1", port))
    finally:
        proc.terminate()
        proc.wait(60)


def test_a_home_it_cannot_write_leaves_the_server_unlisted_not_down(tmp_path):
    """The server records (ft ps, ft stop, ft launch) live under FT_HOME; where that cannot be
    written, `ft serve` of a preset built in memory says so in one line and serves all the same."""
    import os

    home = tmp_path / "a-file"
    home.write_text("")
    env = dict(os.environ, FT_HOME=str(home), FT_MATERIALISE="1")
    proc, url = serve_process(["--preset", "tiny"], env=env)
    try:
        assert httpx.get(url + "/health").json()["status"] == "ok"
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    warning = [line for line in out.splitlines() if line.startswith("ft serve: warning")]
    assert len(warning) == 1 and str(home) in warning[0] and "not listed" in warning[0]
