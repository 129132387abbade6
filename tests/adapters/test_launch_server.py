"""`ft launch` with no server running, against the real agent CLIs from npm: it starts `ft serve` in
the background and the agent's first request is answered; `ft ps` lists the server; a second launch
(another agent) reuses it; `ft stop` ends it gracefully, and its disk cache reopens with the
checkpoints intact (a recorded request restores its prefix from them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapters.launch import find_cli
from ft import servers
from tests.conftest import free_port, start_server

pytestmark = pytest.mark.agents
ROOT = Path(__file__).resolve().parents[2]
ANSWERS = ["Hello from ft.", "Hello again from ft."]


def ft(*argv: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ft", *argv], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=300)


@pytest.fixture
def port():
    """A free port; whatever server is left on it at the end is stopped."""
    port = free_port()
    yield port
    if (record := servers.at_port(port)) is not None:
        servers.stop(record, timeout=60)


def test_launch_starts_a_server_that_outlives_the_agent_until_ft_stop(tmp_path, port):
    if find_cli("claude") is None or find_cli("codex") is None:
        pytest.skip("claude and codex CLIs not installed (npm install --prefix .agents ...)")
    outputs, disk, record = tmp_path / "outputs.jsonl", tmp_path / "disk", tmp_path / "rec"
    outputs.write_text("".join(json.dumps({"content": a}) + "\n" for a in ANSWERS))
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "NO_COLOR": "1"}
    url = f"http://127.0.0.1:{port}"
    serve = ["--disk-cache", str(disk), "--record", str(record), "--replay-outputs", str(outputs),
             "--max-tokens-cap", "24", "--log-level", "warning"]

    first = ft("launch", "claude", "--server", url, *serve, "-y", "--", "-p", "say hi", env=env, cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "starting ft serve" in first.stderr and ANSWERS[0] in first.stdout
    [listed] = [json.loads(line) for line in ft("ps", "--json", env=env, cwd=ROOT).stdout.splitlines()
                if json.loads(line)["port"] == port]
    assert listed["model"] == "tiny" and listed["answering"] and listed["memory_gib"]["weights"] > 0

    second = ft("launch", "codex", "--server", url, "--model", "tiny", "--", "exec", "--skip-git-repo-check",
                "say hi again", env=env, cwd=tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "starting ft serve" not in second.stderr and ANSWERS[1] in second.stdout
    assert servers.at_port(port).pid == listed["pid"]  # the same server

    stopped = ft("stop", str(port), env=env, cwd=ROOT)
    assert stopped.returncode == 0 and f"stopped the server on port {port}" in stopped.stdout
    assert servers.at_port(port) is None and not servers.alive(listed["pid"])

    claude_request = json.loads(next(record.glob("*.jsonl")).read_text().splitlines()[0])
    body = {**claude_request["body"], "stream": False, "max_tokens": 4}
    with start_server(preset="tiny", disk_cache=disk) as reopened, reopened.client() as c:
        stats = reopened.runtime.store.stats()
        assert stats.disk_records > 0 and stats.corrupt_records == 0
        answer = c.post(claude_request["path"], json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["cache_read_input_tokens"] > 0  # restored from the reopened disk cache
