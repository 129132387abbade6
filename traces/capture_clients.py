"""Ground truth for the readers: drive the real agent CLIs through multi-turn sessions against a
capture server, and keep every request body next to the rollout / transcript the CLI wrote.

The capture server answers each protocol (Anthropic Messages for Claude Code, Responses for
Codex) with a scripted model: for every user turn of a session plan, the tool calls of that
turn in order (one model call per step; a step may hold parallel calls), then a text answer.
Which step a request is at is read from the request itself (the turn's prompt and the tool
results after it), so a re-run answers identically. The CLIs really run the tools.

    python -m traces.capture_clients --cli claude --cli codex --out tests/data/clients

writes `<out>/<cli>-<version>/<session>/requests.json.xz` (a list of `{"method", "path",
"headers", "body"}`, auth headers redacted; not `.jsonl`, so `ft replay` on the folder reads
only the session file) and the CLI's own `transcript.jsonl.xz` / `rollout.jsonl.xz` (xz: the
bodies repeat a 50 KB prompt; 1 MB becomes 20 KB). HOME,
CODEX_HOME and the project folder are temporary folders under `--work`. For Codex it also
records what the rollout cannot carry (tool schemas, parameters, trimmed instruction
sections) in adapters/readers/codex_profiles.json under the CLI's version.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from adapters.agents import ServedModel, claude_plan, codex_plan
from adapters.launch import find_cli
from adapters.readers.codex_profiles import PROFILES_FILE, drop_sections, heading_level

MODEL = "m"
REDACTED = ("authorization", "x-api-key")
PROJECT_FILES = {
    "notes.txt": "first line\nsecond line\nthird line\n",
    "main.py": 'print("hello")\n',
}


@dataclass(frozen=True)
class Turn:
    """One user turn: the prompt, then one model call per step (each a list of shell commands,
    run in parallel when more than one), then the text answer."""

    prompt: str
    steps: tuple[tuple[str, ...], ...]
    answer: str


SESSIONS: dict[str, tuple[Turn, ...]] = {
    "files": (
        Turn("List the files here, then show notes.txt.", (("ls",), ("cat notes.txt",)),
             "There are two files; notes.txt has three lines."),
        Turn("How many lines does notes.txt have?", (("wc -l notes.txt",),), "notes.txt has 3 lines."),
        Turn("Thanks. Summarise what you did in one sentence.", (),
             "I listed the folder, showed notes.txt and counted its lines."),
    ),
    "echoes": (
        Turn("Echo alpha and beta at the same time.", (("echo alpha", "echo beta"),), "Both echoes ran."),
        Turn("Now echo gamma, then echo delta.", (("echo gamma",), ("echo delta",)), "gamma, then delta."),
        Turn("Echo done and finish.", (("echo done",),), "Finished."),
    ),
}  # fmt: skip


# -- the scripted model ------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    reasoning: str
    text: str | None
    commands: tuple[str, ...]


def plan_answer(turns: tuple[Turn, ...], history: list[tuple[str, str]]) -> Answer:
    """The answer to a request whose history is `history`: (kind, text) pairs in order, kind
    "user" for user text and "tool" for one tool result. The turn is the last user text that
    holds a turn's prompt; the step is how many tool-calling answers followed it."""
    turn_at, turn = None, None
    for i, (kind, text) in enumerate(history):
        for candidate in turns:
            if kind == "user" and candidate.prompt in text:
                turn_at, turn = i, candidate
    if turn is None:
        return Answer("Nothing to do.", "OK.", ())
    results = sum(kind == "tool" for kind, _ in history[turn_at + 1 :])
    step, done = 0, 0
    while step < len(turn.steps) and done + len(turn.steps[step]) <= results:
        done += len(turn.steps[step])
        step += 1
    if step < len(turn.steps):
        commands = turn.steps[step]
        return Answer(f"I will run {' and '.join(commands)}.", None, commands)
    return Answer("All steps are done; time to answer.", turn.answer, ())


def anthropic_history(body: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for message in body.get("messages") or []:
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        for block in blocks:
            if message.get("role") == "user" and block.get("type") == "text":
                out.append(("user", block["text"]))
            elif block.get("type") == "tool_result":
                out.append(("tool", json.dumps(block.get("content"))))
    return out


def responses_history(body: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for item in body.get("input") or []:
        if item.get("type") == "message" and item.get("role") == "user":
            out += [("user", c.get("text", "")) for c in item.get("content") or []]
        elif item.get("type") == "function_call_output":
            out.append(("tool", json.dumps(item.get("output"))))
    return out


# -- protocol streams --------------------------------------------------------------------------


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def anthropic_stream(answer: Answer, n: int) -> Iterator[bytes]:
    """An Anthropic Messages stream: a thinking block (with signature), text, tool_use blocks."""
    usage = {"input_tokens": 10, "output_tokens": 1}
    message = {"id": f"msg_{n}", "type": "message", "role": "assistant", "model": MODEL, "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": usage}  # fmt: skip
    yield sse("message_start", {"type": "message_start", "message": message})
    blocks: list[tuple[dict[str, Any], list[dict[str, Any]]]] = [
        (
            {"type": "thinking", "thinking": "", "signature": ""},
            [
                {"type": "thinking_delta", "thinking": answer.reasoning},
                {"type": "signature_delta", "signature": f"sig-{n}"},
            ],
        )  # fmt: skip
    ]
    if answer.text:
        blocks.append(({"type": "text", "text": ""}, [{"type": "text_delta", "text": answer.text}]))
    for j, command in enumerate(answer.commands):
        arguments = json.dumps({"command": command, "description": f"Run {command}"})
        blocks.append(
            (
                {"type": "tool_use", "id": f"toolu_{n}_{j}", "name": "Bash", "input": {}},
                [{"type": "input_json_delta", "partial_json": arguments}],
            )
        )
    for index, (start, deltas) in enumerate(blocks):
        yield sse(
            "content_block_start", {"type": "content_block_start", "index": index, "content_block": start}
        )
        for delta in deltas:
            yield sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
        yield sse("content_block_stop", {"type": "content_block_stop", "index": index})
    stop = "tool_use" if answer.commands else "end_turn"
    yield sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                                "usage": {"output_tokens": 5}})  # fmt: skip
    yield sse("message_stop", {"type": "message_stop"})


def responses_stream(answer: Answer, n: int) -> Iterator[bytes]:
    """A Responses stream: a reasoning item (summary + encrypted_content), function calls, a message."""
    response = {
        "id": f"resp_{n}",
        "object": "response",
        "model": MODEL,
        "status": "in_progress",
        "output": [],
    }
    seq = iter(range(1_000_000))

    def event(kind: str, **fields: Any) -> bytes:
        return sse(kind, {"type": kind, "sequence_number": next(seq), **fields})

    yield event("response.created", response=response)
    items: list[dict[str, Any]] = [
        {
            "type": "reasoning",
            "id": f"rs_{n}",
            "summary": [{"type": "summary_text", "text": answer.reasoning}],
            "encrypted_content": f"opaque-{n}",
        }  # fmt: skip
    ]
    for j, command in enumerate(answer.commands):
        items.append({"type": "function_call", "id": f"fc_{n}_{j}", "call_id": f"call_{n}_{j}",
                      "name": "exec_command", "arguments": json.dumps({"cmd": command}), "status": "completed"})  # fmt: skip
    if answer.text:
        part = {"type": "output_text", "text": answer.text, "annotations": []}
        items.append({"type": "message", "id": f"msg_{n}", "role": "assistant", "status": "completed",
                      "content": [part]})  # fmt: skip
    for index, item in enumerate(items):
        yield event("response.output_item.added", output_index=index, item=item)
        if item["type"] == "message":
            yield event("response.output_text.delta", output_index=index, item_id=item["id"], content_index=0,
                        delta=answer.text)  # fmt: skip
        yield event("response.output_item.done", output_index=index, item=item)
    usage = {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 15}  # fmt: skip
    yield event(
        "response.completed", response={**response, "status": "completed", "output": items, "usage": usage}
    )


# -- the capture server ------------------------------------------------------------------------


class CaptureServer:
    """A loopback HTTP server that records every request and answers from a session plan."""

    def __init__(self, turns: tuple[Turn, ...]) -> None:
        self.turns = turns
        self.captured: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def answer(
        self, method: str, path: str, headers: dict[str, str], raw: bytes
    ) -> tuple[int, str, Iterator[bytes]]:
        body = json.loads(raw) if raw else None
        with self.lock:
            n = len(self.captured)
            redacted = {k: ("<redacted>" if k.lower() in REDACTED else v) for k, v in headers.items()}
            self.captured.append({"method": method, "path": path, "headers": redacted, "body": body})
        route = path.split("?")[0]
        if method == "POST" and route.endswith("/messages"):
            answer = plan_answer(self.turns, anthropic_history(body))
            return 200, "text/event-stream", anthropic_stream(answer, n)
        if method == "POST" and route.endswith("/responses"):
            answer = plan_answer(self.turns, responses_history(body))
            return 200, "text/event-stream", responses_stream(answer, n)
        if route.endswith("/models"):
            return (
                200,
                "application/json",
                iter([json.dumps({"object": "list", "data": [{"id": MODEL}]}).encode()]),
            )
        return 404, "application/json", iter([b'{"error": {"message": "not here"}}'])

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                status, kind, chunks = server.answer(self.command, self.path, dict(self.headers), raw)
                self.send_response(status)
                self.send_header("content-type", kind)
                self.send_header("connection", "close")
                self.end_headers()
                for chunk in chunks:
                    self.wfile.write(chunk)
                    self.wfile.flush()
                self.close_connection = True

            do_GET = do_POST = do_HEAD = _serve  # noqa: N815

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


# -- driving the CLIs --------------------------------------------------------------------------


def cli_version(cli: str) -> str:
    out = subprocess.run([cli, "--version"], capture_output=True, text=True, check=True).stdout
    return next(word for word in out.split() if word[:1].isdigit())


def fresh_folder(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def claude_commands(cli: str, turns: tuple[Turn, ...]) -> list[list[str]]:
    allowed = sorted({f"Bash({cmd.split()[0]}:*)" for turn in turns for step in turn.steps for cmd in step})
    return [[cli, "-p", turn.prompt, *(["--continue"] if i else []), "--allowedTools", *allowed]
            for i, turn in enumerate(turns)]  # fmt: skip


def codex_commands(cli: str, turns: tuple[Turn, ...], url: str) -> list[list[str]]:
    flags = ["--skip-git-repo-check", "--sandbox", "danger-full-access"]
    plan = codex_plan(cli, ServedModel(MODEL), url, "capture", [])
    return [[*plan.command, "exec", *flags, *(["resume", "--last"] if i else []), turn.prompt]
            for i, turn in enumerate(turns)]  # fmt: skip


def run_session(kind: str, cli: str, name: str, work: Path, out: Path) -> Path:
    """Run one session plan through one CLI; returns the folder its ground truth went to."""
    turns = SESSIONS[name]
    root = fresh_folder(work / f"{kind}-{name}")
    home, project = fresh_folder(root / "home"), fresh_folder(root / "project")
    for file, text in PROJECT_FILES.items():
        (project / file).write_text(text)
    server = CaptureServer(turns)
    try:
        if kind == "claude":
            plan = claude_plan(cli, ServedModel(MODEL), server.url, "capture", [])
            commands = claude_commands(cli, turns)
        else:
            plan = codex_plan(cli, ServedModel(MODEL), server.url, "capture", [])
            commands = codex_commands(cli, turns, server.url)
        env = plan.child_env(dict(os.environ))
        env.update(HOME=str(home), CODEX_HOME=str(home / ".codex"), XDG_CONFIG_HOME=str(home / ".config"),
                   NO_COLOR="1")  # fmt: skip
        (home / ".codex").mkdir()
        for command in commands:
            done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"{command[0]} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    finally:
        server.close()
    target = fresh_folder(out / f"{kind}-{cli_version(cli)}" / name)
    pattern = ".claude/projects/*/*.jsonl" if kind == "claude" else ".codex/sessions/**/rollout-*.jsonl"
    written = sorted(home.glob(pattern))
    if len(written) != 1:
        raise RuntimeError(f"expected one session file under {home}, found {[str(p) for p in written]}")
    session_file = target / ("transcript.jsonl.xz" if kind == "claude" else "rollout.jsonl.xz")
    session_file.write_bytes(lzma.compress(written[0].read_bytes(), preset=9 | lzma.PRESET_EXTREME))
    listing = json.dumps(server.captured, ensure_ascii=False, indent=0)
    (target / "requests.json.xz").write_bytes(lzma.compress(listing.encode(), preset=9 | lzma.PRESET_EXTREME))
    if kind == "codex":
        update_codex_profile(cli_version(cli), server.captured, written[0])
    return target


# -- the Codex profile -------------------------------------------------------------------------


def dropped_headings(base: str, sent: str) -> list[str]:
    """The outermost headings of `base` whose sections `sent` lacks."""
    present = {line for line in sent.splitlines() if heading_level(line)}
    dropped: list[str] = []
    dropping = 0
    for line in base.splitlines():
        level = heading_level(line)
        if not level or (dropping and level > dropping):
            continue
        dropping = 0 if line in present else level
        if dropping:
            dropped.append(line)
    if drop_sections(base, tuple(dropped)) != sent:
        raise RuntimeError("the sent base instructions are not the rollout's minus whole sections")
    return dropped


def update_codex_profile(version: str, captured: list[dict[str, Any]], rollout: Path) -> None:
    """Record in codex_profiles.json what this version sent beyond the rollout's history."""
    meta = json.loads(rollout.read_text().splitlines()[0])["payload"]
    body = next(c["body"] for c in captured if c["path"].endswith("/responses") and c["body"].get("tools"))
    keys = list(body)
    params = {k: body[k] for k in keys[keys.index("tools") + 1 : keys.index("prompt_cache_key")]}
    sent = body["input"][0]["content"][0]["text"]
    profile = {
        "originator": meta["originator"],
        "captured": f"codex exec with the settings of `ft launch codex` (tests/data/clients/codex-{version})",
        "drop_sections": dropped_headings(meta["base_instructions"]["text"], sent),
        "params": params,
        "tools": body["tools"],
    }
    known = json.loads(PROFILES_FILE.read_text()) if PROFILES_FILE.exists() else {}
    if known.get(version, profile) != profile:
        raise RuntimeError(f"codex {version} sent other tools or parameters than its recorded profile")
    known[version] = profile
    PROFILES_FILE.write_text(json.dumps(known, indent=1, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cli", action="append", choices=["claude", "codex"], help="which CLIs (default both)"
    )
    parser.add_argument(
        "--session", action="append", choices=sorted(SESSIONS), help="which plans (default all)"
    )
    parser.add_argument("--out", type=Path, default=Path("tests/data/clients"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/ft-capture"))
    args = parser.parse_args(argv)
    for kind in args.cli or ["claude", "codex"]:
        cli = find_cli(kind)
        if cli is None:
            parser.error(f"{kind} is not installed (npm install --prefix .agents ...)")
        for name in args.session or sorted(SESSIONS):
            print(f"{kind} {name}: {run_session(kind, cli, name, args.work, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
