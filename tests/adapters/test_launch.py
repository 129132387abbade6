"""`ft launch`: dry runs against the real `ft serve` app on a loopback port, the down-server error,
missing CLIs, and a real launch of a stand-in agent (exec, environment, exit code)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from adapters import launch
from adapters.agents import CLOUD_ENV, ServedModel, claude_plan, codex_plan, opencode_plan
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]


def ft_launch(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ft", "launch", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )


@pytest.fixture
def home(tmp_path) -> dict[str, str]:
    """An environment with a private, empty HOME and CODEX_HOME, and cloud keys that must not leak."""
    (tmp_path / "home").mkdir()
    env = dict(os.environ, HOME=str(tmp_path / "home"), CODEX_HOME=str(tmp_path / "home" / ".codex"))
    env.update(ANTHROPIC_API_KEY="sk-ant-secret", OPENAI_API_KEY="sk-secret", COLUMNS="250")
    return env


@pytest.mark.parametrize(
    ("agent", "expected"),
    [
        ("claude", ["ANTHROPIC_BASE_URL={url}", "ANTHROPIC_MODEL=tiny", "CLAUDE_CODE_SUBAGENT_MODEL=tiny",
                    "ANTHROPIC_SMALL_FAST_MODEL=tiny", "CLAUDE_CODE_ATTRIBUTION_HEADER=0",
                    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1", "CLAUDE_CODE_MAX_CONTEXT_TOKENS=65536", "-p hello"]),
        ("codex", ["'model_providers.ft.base_url=\"{url}/v1\"'", "'model_providers.ft.wire_api=\"responses\"'",
                   "'model=\"tiny\"'", "model_context_window=65536", "exec hello"]),
        ("opencode", ['"npm": "@ai-sdk/openai-compatible"', '"baseURL": "{url}/v1"', '"context": 65536',
                      '"model": "ft/tiny"', "run hello"]),
    ],
)
def test_dry_run_prints_the_plan_and_touches_nothing(live_server, home, agent, expected):
    args = {"claude": ["-p", "hello"], "codex": ["exec", "hello"], "opencode": ["run", "hello"]}[agent]
    result = ft_launch(agent, "--server", live_server.url, "--dry-run", "--", *args, env=home)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"server   {live_server.url}" in out and "model    tiny (context 65,536 tokens)" in out
    for text in expected:
        assert text.format(url=live_server.url) in out
    assert "removed: ANTHROPIC_API_KEY, OPENAI_API_KEY" in out
    assert "sk-secret" not in out and "sk-ant-secret" not in out
    assert list(Path(home["HOME"]).iterdir()) == []


def test_codex_config_dry_run_names_the_profile_file_without_writing_it(live_server, home):
    result = ft_launch("codex", "--server", live_server.url, "--dry-run", "--config", env=home)
    profile = Path(home["CODEX_HOME"]) / "ft.config.toml"
    assert result.returncode == 0, result.stderr
    assert f"write    {profile}" in result.stdout and 'wire_api = "responses"' in result.stdout
    assert "--profile ft" in result.stdout and not profile.exists()


def test_a_down_server_on_another_machine_is_one_line_saying_how_to_start_one(home):
    if launch.find_cli("claude") is None:  # checked first: its absence is the line then
        pytest.skip("claude not installed (npm install --prefix .agents ...)")
    result = ft_launch("claude", "--server", f"http://127.0.0.2:{free_port()}", env=home)  # not this machine's name
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "ft serve" in result.stderr and "Traceback" not in result.stderr
    assert "only on this machine" in result.stderr


def test_dry_run_without_a_server_shows_the_server_it_would_start(home):
    port = free_port()
    result = ft_launch("claude", "--server", f"http://127.0.0.1:{port}", "--model", "small", "--gpu-memory", "8",
                       "--dry-run", env=home)
    assert result.returncode == 0, result.stderr
    assert f"-m ft serve --host 127.0.0.1 --port {port} --model small --gpu-memory 8" in result.stdout
    assert "ANTHROPIC_MODEL=small" in result.stdout


def test_serve_options_are_checked_as_ft_serve_checks_them(home):
    result = ft_launch("claude", "--gpu-memory", "lots", "--dry-run", env=home)
    assert result.returncode == 1 and "--gpu-memory" in result.stderr and "Traceback" not in result.stderr


def test_agent_arguments_must_follow_the_separator(live_server, home):
    result = ft_launch("claude", "--server", live_server.url, "-p", "hi", env=home)
    assert result.returncode == 1 and "after `--`" in result.stderr and "Traceback" not in result.stderr


def test_launch_execs_the_agent_with_a_clean_environment_and_passes_its_exit_code(
    live_server, home, tmp_path
):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "claude"  # a stand-in for the real CLI: records what it was given
    fake.write_text('#!/bin/sh\nenv > "$OUT/env"\necho "$@" > "$OUT/args"\nexit 7\n')
    fake.chmod(0o755)
    env = dict(home, PATH=f"{bin_dir}:{home['PATH']}", OUT=str(tmp_path))
    result = ft_launch("claude", "--server", live_server.url, "--", "-p", "hi there", env=env)
    assert result.returncode == 7, result.stderr
    child = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines() if "=" in line)
    assert child["ANTHROPIC_BASE_URL"] == live_server.url and child["ANTHROPIC_DEFAULT_OPUS_MODEL"] == "tiny"
    assert "OPENAI_API_KEY" not in child and child["ANTHROPIC_AUTH_TOKEN"] == "ft-local"
    assert (tmp_path / "args").read_text().strip() == "-p hi there"


def test_missing_cli_without_a_terminal_or_y_is_a_one_line_error(live_server, monkeypatch, capsys):
    from ft.cli import main

    monkeypatch.setattr(launch, "find_cli", lambda binary: None)
    monkeypatch.setattr(sys, "stdin", io.StringIO())  # not a terminal
    assert main(["launch", "opencode", "--server", live_server.url, "--", "run", "hi"]) == 1
    err = capsys.readouterr().err
    assert "opencode is not installed" in err and "npm install --prefix" in err and "-y" in err
    assert main(["launch", "opencode", "--server", live_server.url, "--dry-run"]) == 0
    assert "not installed: would offer `npm install" in capsys.readouterr().out


def test_config_writes_the_codex_profile_with_a_backup_of_the_old_one(tmp_path):
    profile = tmp_path / "ft.config.toml"
    profile.write_text("# mine\n")
    plan = codex_plan("codex", ServedModel("m", 4096), "http://127.0.0.1:1", "k", [], profile)
    launch.write_files(Console(file=io.StringIO()), plan)
    [backup] = [p for p in tmp_path.iterdir() if ".ft-backup-" in p.name]
    assert backup.read_text() == "# mine\n"
    written = tomllib.loads(profile.read_text())
    assert written["model_provider"] == "ft" and written["model_context_window"] == 4096
    assert written["model_providers"]["ft"] == {
        "name": "ft (local)", "base_url": "http://127.0.0.1:1/v1", "wire_api": "responses", "env_key": "FT_API_KEY",
    }


def test_plans_remove_cloud_credentials_and_fill_every_model_slot():
    model = ServedModel("qwen", None)
    claude = claude_plan("claude", model, "http://h:1", "k", [])
    slots = [k for k in claude.env if k.endswith("_MODEL")]
    assert len(slots) == 6 and all(claude.env[k] == "qwen" for k in slots)
    env = claude.child_env({"OPENAI_API_KEY": "x", "ANTHROPIC_API_KEY": "y", "PATH": "/bin"})
    assert "OPENAI_API_KEY" not in env and "ANTHROPIC_API_KEY" not in env and env["PATH"] == "/bin"
    assert {"ANTHROPIC_API_KEY", "OPENAI_API_KEY"} <= set(CLOUD_ENV)
    codex = codex_plan("codex", model, "http://h:1", "k", ["exec", "x"])
    assert "model_context_window" not in " ".join(codex.command) and codex.command[-2:] == ["exec", "x"]
    opencode = opencode_plan("opencode", model, "http://h:1", "k", [])
    config = json.loads(opencode.env["OPENCODE_CONFIG_CONTENT"])
    assert config["provider"]["ft"]["models"]["qwen"]["limit"]["context"] == 32768 and opencode.notes


# -- a stand-in server for what the real one never answers: a model list without a context length,
#    and an error status. (The dry runs above use the real `ft serve` app.)


@pytest.fixture(scope="module")
def odd_server() -> Iterator[str]:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route

    async def models(request):
        return JSONResponse({"data": [{"id": "a"}, {"id": "b", "max_model_len": 8192}]})

    async def broken(request):
        return PlainTextResponse("nope", status_code=500)

    app = Starlette(routes=[Route("/v1/models", models), Route("/broken/v1/models", broken)])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_discovery_reads_whichever_context_field_the_server_reports(odd_server):
    assert launch.discover_model(odd_server) == ServedModel("a", None)
    assert launch.discover_model(odd_server, "b") == ServedModel("b", 8192)
    with pytest.raises(launch.LaunchError, match="does not serve 'c'"):
        launch.discover_model(odd_server, "c")
    with pytest.raises(launch.LaunchError, match="answered 500"):
        launch.discover_model(odd_server + "/broken")


@pytest.mark.agents
@pytest.mark.parametrize(
    ("binary", "version"), [("claude", "Claude Code"), ("codex", "codex-cli"), ("opencode", ".")]
)
def test_installed_agent_clis_run_from_the_project_prefix(binary, version):
    cli = launch.find_cli(binary)
    if cli is None:
        pytest.skip(f"{binary} not installed (npm install --prefix .agents ...)")
    result = subprocess.run([cli, "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and version in result.stdout
