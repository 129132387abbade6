"""The real-client ground truth (tests/data/clients, written by `python -m traces.capture_clients`)
as the tests read it: the sessions, what each CLI sent, its session file, and token ids of a
body through the gateway's renderer (the tiny preset's)."""

from __future__ import annotations

import json
import lzma
from pathlib import Path
from typing import Any

from gateway.protocols import anthropic, responses
from gateway.render import segment_ids
from gateway.render.qwen import QwenRenderer
from gateway.tokenizer import QwenTokenizer

DATA = Path(__file__).resolve().parents[1] / "data" / "clients"
SESSIONS = sorted(p.parent for p in DATA.glob("*/*/requests.json.xz"))
CLAUDE = sorted(p for p in SESSIONS if p.parent.name.startswith("claude"))
CODEX = sorted(p for p in SESSIONS if p.parent.name.startswith("codex"))
RENDERER = QwenRenderer(QwenTokenizer())
PARSERS = {"anthropic": anthropic, "responses": responses}


def ids(protocol: str, body: dict[str, Any]) -> list[int]:
    """The prompt's token ids as the gateway renders the body."""
    return segment_ids(RENDERER.render(PARSERS[protocol].parse_request(body)))


def sent(folder: Path) -> list[dict[str, Any]]:
    """The model requests the CLI sent, in order."""
    captured = json.loads(lzma.decompress((folder / "requests.json.xz").read_bytes()))
    return [
        c["body"]
        for c in captured
        if c["method"] == "POST" and c["path"].split("?")[0].endswith(("/messages", "/responses"))
    ]


def session_file(folder: Path) -> Path:
    """The transcript or rollout the CLI wrote."""
    return next(folder.glob("*.jsonl.xz"))


def transcript_lines(folder: Path) -> list[dict[str, Any]]:
    """The session file's lines, decoded (to corrupt or strip in a test)."""
    return [json.loads(line) for line in lzma.decompress(session_file(folder).read_bytes()).splitlines()]


def write_lines(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path
