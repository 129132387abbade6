"""`ft top` renders a frame from a real server (the tiny preset on a loopback port) after requests."""

from __future__ import annotations

import re

from rich.console import Console

from ft import top
from tests.conftest import start_server


def test_one_frame_shows_sessions_requests_caches_and_steps(capsys):
    with start_server(preset="tiny", default_max_tokens=4) as server, server.client() as c:
        for turn in range(2):
            history = [{"role": "user", "content": f"question {i}"} for i in range(turn + 1)]
            r = c.post("/v1/chat/completions", json={"messages": history, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
        server.wait_idle()
        first = top.read(server.url, None)
        second = top.read(server.url, None)
        console = Console(record=True, width=160)
        console.print(top.frame(server.url, second, first))
        text = console.export_text()
        assert top.run(top_args(server.url)) == 0
        once = capsys.readouterr().out
    assert "sessions" in text and "running 0  queued 0" in text and "steps/s" in text
    assert "checkpoints, RAM" in text and "checkpoints, disk" in text
    rows = [line.strip("│ ").split() for line in text.splitlines() if re.match(r"^│\s*\d\d:\d\d:\d\d\s", line)]
    assert len(rows) == 2  # one a request, newest first
    recent = second.requests
    assert [int(row[2].replace(",", "")) for row in rows] == [r["restored"] for r in reversed(recent)]
    assert [int(row[3].replace(",", "")) for row in rows] == [r["prefilled"] for r in reversed(recent)]
    assert recent[1]["restored"] > 0  # the second turn restored the first's prefix
    assert "recent requests" in once and "checkpoints, RAM" in once


def top_args(url: str):
    import argparse

    return argparse.Namespace(server=url, interval=1.0, once=True, api_key=None)
