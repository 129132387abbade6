"""The real agent CLIs (from npm, in `.agents/` or on PATH), started by `ft launch` against a
live `ft serve`, each completing a tool round trip: the server teacher-forces a tool call
(`--replay-outputs`), the agent runs the tool and sends its result back, and the server's
answer to that comes from restored checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from adapters.launch import find_cli
from tests.conftest import free_port

pytestmark = pytest.mark.agents
MARKER = "hi-from-tool"
FINAL = "The command printed hi-from-tool."
AGENTS = {
    "claude": ({"name": "Bash", "arguments": {"command": f"echo {MARKER}", "description": "Echo a marker"}},
               ["-p", f"run echo {MARKER}", "--allowedTools", "Bash(echo:*)"]),
    "codex": ({"name": "exec_command", "arguments": {"cmd": f"echo {MARKER}"}},
              ["exec", "--skip-git-repo-check", "--sandbox", "danger-full-access", f"run echo {MARKER}"]),
    "opencode": ({"name": "bash", "arguments": {"command": f"echo {MARKER}", "description": "Echo a marker"}},
                 ["run", f"run echo {MARKER}"]),
}


@pytest.fixture
def served(tmp_path):
    def start(tool_call: dict) -> tuple[str, Path]:
        outputs = tmp_path / "outputs.jsonl"
        outputs.write_text(json.dumps({"reasoning": "I will run echo.", "tool_calls": [tool_call]}) + "\n"
                           + json.dumps({"reasoning": "It printed the marker.", "content": FINAL}) + "\n")
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "ft", "serve", "--port", str(port), "--replay-outputs", str(outputs),
             "--record", str(tmp_path / "rec"), "--max-tokens-cap", "24", "--log-level", "warning"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    return url, tmp_path / "rec"
            except httpx.HTTPError:
                time.sleep(0.3)
        raise RuntimeError("ft serve did not come up")

    procs: list[subprocess.Popen] = []
    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_agent_completes_a_tool_round_trip_through_ft_launch(agent, served, tmp_path):
    if find_cli(agent) is None:
        pytest.skip(f"{agent} CLI not installed (npm install --prefix .agents ...)")
    tool_call, args = AGENTS[agent]
    url, record_dir = served(tool_call)
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "NO_COLOR": "1"}
    done = subprocess.run([sys.executable, "-m", "ft", "launch", agent, "--server", url, "-y", "--", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert MARKER in done.stdout
    lines = [json.loads(line) for f in record_dir.glob("*.jsonl") for line in f.read_text().splitlines()]
    after_tool = [r for r in lines if MARKER in json.dumps(r["body"]) and r["body"].get("tools")
                  and r["output"].get("content") == FINAL]
    assert after_tool, [r["output"] for r in lines]
    timings = after_tool[-1]["timings"]
    assert timings["cached_tokens"] > 0.9 * (timings["cached_tokens"] + timings["prefill_tokens"])
