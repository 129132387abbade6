"""`ft launch claude|codex|opencode`: point a coding agent at a running ft server and start it.

The served model is discovered from `GET /v1/models`. The agent is configured through
environment variables and inline config (Codex `-c`, OpenCode `OPENCODE_CONFIG_CONTENT`), so
the user's own configuration files are left alone; only `--config` writes a file (a Codex
profile, `$CODEX_HOME/ft.config.toml`, backing up any previous one). Cloud API keys are
removed from the agent's environment. A CLI that is not on PATH (nor in the project's
`.agents/` npm prefix) can be installed with npm.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.markup import escape
from rich.prompt import Confirm

from adapters import server_start
from adapters.agents import (
    AGENTS,
    LOCAL_KEY,
    Agent,
    LaunchPlan,
    ServedModel,
    claude_plan,
    codex_home,
    codex_plan,
    opencode_plan,
)
from adapters.server_start import ServerStartError, Wanted
from ft import env, servers

DEFAULT_SERVER = "http://127.0.0.1:1919"
AGENTS_PREFIX = Path(__file__).resolve().parents[1] / ".agents"
SECRET_ENV = ("ANTHROPIC_AUTH_TOKEN", "FT_API_KEY")


class LaunchError(Exception):
    """A user-facing failure: printed as one line, exit code 1."""


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default=None,
                        help=f"ft server URL (default {DEFAULT_SERVER}, or --host/--port among the serve options)")
    parser.add_argument("--model", default=None,
                        help="model to serve: a folder, a .gguf file or a Hugging Face repo id[:QUANT] (default: "
                             "whatever the running server serves, else the embedded preset)")
    parser.add_argument("--api-key", default=None, help="key for a server started with one (default: $FT_API_KEY)")
    parser.add_argument("--dry-run", action="store_true", help="print what would be written and run; touch nothing")
    parser.add_argument("--config", action="store_true", help="codex: also write a reusable profile file")
    parser.add_argument("-y", "--yes", action="store_true", help="agree to install a missing CLI with npm")
    parser.add_argument("--stop-after", action="store_true",
                        help="stop the server when the agent exits (default: it keeps running for the next session)")
    parser.add_argument("--replace", action="store_true",
                        help="stop a running server that serves another model and start the one asked for")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("Any `ft serve` option (ft serve --help) may follow: a server started for this launch gets it, "
                     "e.g. ft launch claude --model unsloth/Qwen3.6-35B-A3B-GGUF:Q4_K_M --gpu-memory 8 -- -p 'hi'")
    _add_options(parser)
    parser.add_argument("agent", choices=sorted(AGENTS), help="the agent CLI to start")
    # Options may also follow the agent name; `ft serve`'s options start a server when none answers;
    # everything after `--` goes to the agent untouched.
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="[options] [serve options] [-- agent arguments]")


def serve_parser() -> argparse.ArgumentParser:
    from gateway.serve import add_arguments as add_serve_arguments  # noqa: PLC0415 (torch: only to start one)

    parser = argparse.ArgumentParser(prog="ft serve", add_help=False, exit_on_error=False)
    add_serve_arguments(parser)
    return parser


def parse_rest(args: argparse.Namespace) -> tuple[argparse.Namespace, list[str]]:
    """Launch options given after the agent name, the `ft serve` options among them
    (`args.serve_argv`, checked as `ft serve` parses them) and the agent's own arguments (after `--`)."""
    rest = list(args.rest)
    split = rest.index("--") if "--" in rest else len(rest)
    options, agent_args = rest[:split], rest[split + 1 :]
    parser = argparse.ArgumentParser(prog=f"ft launch {args.agent}", add_help=False)
    _add_options(parser)
    parsed, serve_argv = parser.parse_known_args(options, namespace=argparse.Namespace(**vars(args)))
    try:
        serve, unknown = serve_parser().parse_known_args(serve_argv)
    except argparse.ArgumentError as exc:
        raise LaunchError(f"serve option {exc}") from None
    if unknown:
        raise LaunchError(f"unknown option {unknown[0]!r}; put the agent's own arguments after `--`")
    parsed.serve_argv = serve_argv
    parsed.server = (parsed.server or f"http://{serve.host}:{serve.port}").rstrip("/")
    parsed.served = parsed.model or serve.preset
    return parsed, agent_args


def run(args: argparse.Namespace) -> int:
    console, errors = Console(), Console(stderr=True)
    try:
        args, agent_args = parse_rest(args)
        server = args.server
        key = args.api_key or env.api_key() or LOCAL_KEY
        wanted = Wanted(server, args.served, tuple(args.serve_argv), args.api_key)
        if args.dry_run:
            return dry_run(console, args, wanted, key, agent_args)
        agent = AGENTS[args.agent]
        cli = find_cli(agent.binary) or install_cli(console, agent, args.yes)
        started = server_start.ensure(wanted, errors, args.replace)
        model = discover_model(server)
        plan = build_plan(agent, cli, model, server, key, agent_args, args.config)
        write_files(console, plan)
        if started and not args.stop_after:
            errors.print(f"ft serve keeps running on {server} (`ft stop {wanted.port}` ends it)", highlight=False)
        return run_then_stop(plan, wanted) if args.stop_after else execute(plan)
    except (LaunchError, ServerStartError) as exc:
        errors.print(f"[red]ft launch:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 1


def dry_run(console: Console, args: argparse.Namespace, wanted: Wanted, key: str, agent_args: list[str]) -> int:
    """What would be started, written and run; nothing is."""
    agent = AGENTS[args.agent]
    cli = find_cli(agent.binary)
    if server_start.answers(wanted.url):
        server_start.check_model(wanted)
        model = discover_model(wanted.url)
    else:
        model = ServedModel(args.served or "tiny", None)
        console.print(f"[bold]{'start':<8}[/bold] {escape(shlex.join(wanted.command()))}", highlight=False,
                      soft_wrap=True)
    plan = build_plan(agent, cli or agent.binary, model, wanted.url, key, agent_args, args.config)
    show_plan(console, agent, wanted.url, model, cli, plan)
    return 0


def discover_model(server: str, wanted: str | None = None) -> ServedModel:
    """The served model (its id and context length) from `GET {server}/v1/models`."""
    try:
        response = httpx.get(f"{server}/v1/models", timeout=5.0)
        response.raise_for_status()
        models = response.json()["data"]
    except httpx.HTTPStatusError as exc:
        raise LaunchError(
            f"{server}/v1/models answered {exc.response.status_code}; is this an ft server?"
        ) from None
    except httpx.HTTPError as exc:
        reason = type(exc).__name__ if not str(exc) else str(exc)
        raise LaunchError(
            f"no server at {server} ({reason}); start one with `ft serve` or pass --server URL"
        ) from None
    except (ValueError, KeyError, TypeError):
        raise LaunchError(f"{server}/v1/models did not answer a model list; is this an ft server?") from None
    if not models:
        raise LaunchError(f"{server} serves no model")
    chosen = next((m for m in models if m.get("id") == wanted), None) if wanted else models[0]
    if chosen is None:
        raise LaunchError(
            f"{server} does not serve {wanted!r} (it serves {', '.join(m.get('id', '?') for m in models)})"
        )
    return ServedModel(str(chosen["id"]), _context_length(chosen))


def _context_length(entry: dict[str, Any]) -> int | None:
    for key in ("context_length", "max_model_len", "context_window", "max_context_length"):
        value = entry.get(key) or (entry.get("meta") or {}).get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def find_cli(binary: str) -> str | None:
    """The agent's executable: on PATH, else in the project's npm prefix (`.agents/node_modules/.bin`)."""
    local = AGENTS_PREFIX / "node_modules" / ".bin" / binary
    return shutil.which(binary) or (str(local) if os.access(local, os.X_OK) else None)


def install_cli(console: Console, agent: Agent, yes: bool) -> str:
    """Install a missing CLI into the project's npm prefix, after asking (or with -y)."""
    command = ["npm", "install", "--prefix", str(AGENTS_PREFIX), agent.npm_package]
    if not yes:
        if not sys.stdin.isatty():
            raise LaunchError(
                f"{agent.binary} is not installed; run `{shlex.join(command)}` or pass -y to install it"
            )
        if not Confirm.ask(
            f"{agent.binary} is not installed. Install it with `{shlex.join(command)}`?", console=console
        ):
            raise LaunchError(f"{agent.binary} is not installed")
    if shutil.which("npm") is None:
        raise LaunchError("npm is not on PATH; install Node.js 20+ first")
    if subprocess.run(command).returncode != 0:
        raise LaunchError(f"`{shlex.join(command)}` failed")
    cli = find_cli(agent.binary)
    if cli is None:
        raise LaunchError(f"installed {agent.npm_package} but found no `{agent.binary}` executable")
    return cli


def build_plan(
    agent: Agent, cli: str, model: ServedModel, server: str, key: str, args: list[str], write_config: bool
) -> LaunchPlan:
    if agent.name == "claude":
        plan = claude_plan(cli, model, server, key, args)
    elif agent.name == "codex":
        profile = codex_home() / "ft.config.toml" if write_config else None
        return codex_plan(cli, model, server, key, args, profile)
    else:
        plan = opencode_plan(cli, model, server, key, args)
    if write_config:
        plan.notes.append(f"--config: nothing to write, {agent.name} is configured through its environment")
    return plan


def show_plan(
    console: Console, agent: Agent, server: str, model: ServedModel, cli: str | None, plan: LaunchPlan
) -> None:
    """The dry run: what would be written and run."""

    def row(label: str, value: str) -> None:
        console.print(f"[bold]{label:<8}[/bold] {escape(value)}", highlight=False, soft_wrap=True)

    context = f"{model.context_length:,} tokens" if model.context_length else "not reported"
    row("server", server)
    row("model", f"{model.id} (context {context})")
    install = f"not installed: would offer `npm install --prefix {AGENTS_PREFIX} {agent.npm_package}`"
    row("cli", cli or install)
    for file in plan.files:
        row("write", str(file.path) + (f" (existing file backed up to {file.backup})" if file.backup else ""))
        console.print(file.content.rstrip(), highlight=False, markup=False, soft_wrap=True)
    if not plan.files:
        row("write", "nothing")
    row("command", shlex.join(plan.command))
    row("env", "")
    for name, value in plan.env.items():
        shown = "<set>" if name in SECRET_ENV and value != LOCAL_KEY else value
        console.print(f"  {name}={shown}", highlight=False, markup=False, soft_wrap=True)
    removed = [name for name in plan.unset if name in os.environ]
    console.print(
        f"  removed: {', '.join(removed) or 'none present'} (cloud credentials)",
        highlight=False,
        markup=False,
    )
    for note in plan.notes:
        console.print(f"note: {note}", style="dim", highlight=False, markup=False, soft_wrap=True)


def write_files(console: Console, plan: LaunchPlan) -> None:
    for file in plan.files:
        try:
            file.path.parent.mkdir(parents=True, exist_ok=True)
            if file.backup is not None:
                shutil.copy2(file.path, file.backup)
                console.print(f"backed up {file.path} to {file.backup}", highlight=False)
            file.path.write_text(file.content, encoding="utf-8")
        except OSError as exc:
            raise LaunchError(f"cannot write {file.path}: {exc.strerror or exc}") from None
        console.print(f"wrote {file.path}", highlight=False)


def run_then_stop(plan: LaunchPlan, wanted: Wanted) -> int:
    """Run the agent as a child (Ctrl-C is the agent's: this process ignores it meanwhile), then
    stop the server; the agent's exit code."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code = subprocess.run(plan.command, env=plan.child_env(dict(os.environ))).returncode
    except OSError as exc:
        raise LaunchError(f"cannot start {plan.command[0]}: {exc.strerror or exc}") from None
    finally:
        signal.signal(signal.SIGINT, previous)
    if (record := servers.at_port(wanted.port)) is not None and not servers.stop(record):
        raise LaunchError(f"the server on port {wanted.port} (pid {record.pid}) did not stop")
    return code


def execute(plan: LaunchPlan) -> int:
    """Replace this process with the agent (signals and the exit code are the agent's own)."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(plan.command[0], plan.command, plan.child_env(dict(os.environ)))
    except OSError as exc:
        raise LaunchError(f"cannot start {plan.command[0]}: {exc.strerror or exc}") from None
    return 1  # not reached: execvpe returns only by raising
