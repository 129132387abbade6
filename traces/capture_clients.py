"""Ground truth for the readers: drive the real agent CLIs through multi-turn sessions against
the capture server (traces/capture_server.py), and keep every request body next to the
rollout / transcript the CLI wrote. The CLIs really run the tools.

    python -m traces.capture_clients --cli claude --cli codex --out tests/data/clients

writes `<out>/<cli>-<version>/<session>/requests.json.xz` (a list of `{"method", "path",
"headers", "body"}`, auth headers redacted; not `.jsonl`, so `ft replay` on the folder reads
only the session file) and the CLI's own `transcript.jsonl.xz` / `rollout.jsonl.xz` (xz: the
bodies repeat a 50 KB prompt; 1 MB becomes 20 KB). HOME, CODEX_HOME and the project folder
are temporary folders under `--work`; turns continue with `claude -p --continue` and
`codex exec resume --last`, with the settings of `ft launch`. For Codex it also records what
the rollout cannot carry (tool schemas, parameters, trimmed instruction sections) in
adapters/readers/codex_profiles.json under the CLI's version.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from adapters.agents import ServedModel, claude_plan, codex_plan
from adapters.launch import find_cli
from adapters.readers.codex_profiles import PROFILES_FILE, drop_sections, heading_level
from traces.capture_server import MODEL, CaptureServer, Turn

XZ = 9 | lzma.PRESET_EXTREME
PROJECT_FILES = {
    "notes.txt": "first line\nsecond line\nthird line\n",
    "main.py": 'print("hello")\n',
}


SESSIONS: dict[str, tuple[Turn, ...]] = {
    "files": (
        Turn(
            "List the files here, then show notes.txt.",
            (("ls",), ("cat notes.txt",)),
            "There are two files; notes.txt has three lines.",
        ),
        Turn("How many lines does notes.txt have?", (("wc -l notes.txt",),), "notes.txt has 3 lines."),
        Turn(
            "Thanks. Summarise what you did in one sentence.",
            (),
            "I listed the folder, showed notes.txt and counted its lines.",
        ),
    ),
    "echoes": (
        Turn("Echo alpha and beta at the same time.", (("echo alpha", "echo beta"),), "Both echoes ran."),
        Turn("Now echo gamma, then echo delta.", (("echo gamma",), ("echo delta",)), "gamma, then delta."),
        Turn("Echo done and finish.", (("echo done",),), "Finished."),
    ),
}


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
    return [
        [cli, "-p", turn.prompt, *(["--continue"] if i else []), "--allowedTools", *allowed]
        for i, turn in enumerate(turns)
    ]


def codex_commands(cli: str, turns: tuple[Turn, ...], url: str) -> list[list[str]]:
    flags = ["--skip-git-repo-check", "--sandbox", "danger-full-access"]
    plan = codex_plan(cli, ServedModel(MODEL), url, "capture", [])
    return [
        [*plan.command, "exec", *flags, *(["resume", "--last"] if i else []), turn.prompt]
        for i, turn in enumerate(turns)
    ]


def run_session(kind: str, cli: str, name: str, work: Path, out: Path) -> Path:
    """Run one session plan through one CLI; returns the folder its ground truth went to."""
    turns = SESSIONS[name]
    root = fresh_folder(work / f"{kind}-{name}")
    home, project = fresh_folder(root / "home"), fresh_folder(root / "project")
    (home / ".codex").mkdir()
    for file, text in PROJECT_FILES.items():
        (project / file).write_text(text)
    server = CaptureServer(turns)
    try:
        drive(kind, cli, turns, server.url, home, project)
    finally:
        server.close()
    return save(kind, cli, name, home, server.captured, out)


def drive(kind: str, cli: str, turns: tuple[Turn, ...], url: str, home: Path, project: Path) -> None:
    """One CLI invocation per turn, the first starting the session and the others continuing it."""
    if kind == "claude":
        plan, commands = claude_plan(cli, ServedModel(MODEL), url, "capture", []), claude_commands(cli, turns)
    else:
        plan, commands = (
            codex_plan(cli, ServedModel(MODEL), url, "capture", []),
            codex_commands(cli, turns, url),
        )
    env = plan.child_env(dict(os.environ))
    env.update(
        HOME=str(home), CODEX_HOME=str(home / ".codex"), XDG_CONFIG_HOME=str(home / ".config"), NO_COLOR="1"
    )
    for command in commands:
        done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{command[0]} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")


def save(kind: str, cli: str, name: str, home: Path, captured: list[dict[str, Any]], out: Path) -> Path:
    """The session file the CLI wrote and the requests it sent, xz-compressed, in a fresh folder."""
    target = fresh_folder(out / f"{kind}-{cli_version(cli)}" / name)
    pattern = ".claude/projects/*/*.jsonl" if kind == "claude" else ".codex/sessions/**/rollout-*.jsonl"
    written = sorted(home.glob(pattern))
    if len(written) != 1:
        raise RuntimeError(f"expected one session file under {home}, found {[str(p) for p in written]}")
    session_file = target / ("transcript.jsonl.xz" if kind == "claude" else "rollout.jsonl.xz")
    session_file.write_bytes(lzma.compress(written[0].read_bytes(), preset=XZ))
    listing = json.dumps(captured, ensure_ascii=False, indent=0)
    (target / "requests.json.xz").write_bytes(lzma.compress(listing.encode(), preset=XZ))
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


def update_codex_profile(folder: Path) -> str:
    """Record in codex_profiles.json what the Codex of this capture sent beyond its rollout;
    returns the version."""
    meta = json.loads(lzma.decompress((folder / "rollout.jsonl.xz").read_bytes()).splitlines()[0])["payload"]
    captured = json.loads(lzma.decompress((folder / "requests.json.xz").read_bytes()))
    body = next(c["body"] for c in captured if c["path"].endswith("/responses") and c["body"].get("tools"))
    keys = list(body)
    params = {k: body[k] for k in keys[keys.index("tools") + 1 : keys.index("prompt_cache_key")]}
    sent = body["input"][0]["content"][0]["text"]
    version = meta["cli_version"]
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
    return version


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
    parser.add_argument("--no-profile", action="store_true", help="leave codex_profiles.json alone")
    args = parser.parse_args(argv)
    for kind in args.cli or ["claude", "codex"]:
        cli = find_cli(kind)
        if cli is None:
            parser.error(f"{kind} is not installed (npm install --prefix .agents ...)")
        for name in args.session or sorted(SESSIONS):
            folder = run_session(kind, cli, name, args.work, args.out)
            print(f"{kind} {name}: {folder}")
            if kind == "codex" and not args.no_profile:
                print(f"  profile of codex {update_codex_profile(folder)}: {PROFILES_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
