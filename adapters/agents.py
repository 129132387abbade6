"""How each agent CLI is pointed at the local server: environment, inline config, profile files.

Pure functions from (served model, server URL, agent arguments) to a `LaunchPlan`; nothing
here touches the disk or the environment. The settings follow what worked for the captured
clients (/work/shared/clients/README.md).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

# Cloud credentials and routing switches that must not reach an agent pointed at a local server.
CLOUD_ENV = (
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_AUTH_TOKEN",
    "CLAUDE_CODE_OAUTH_TOKEN",
    "CLAUDE_CODE_USE_BEDROCK",
    "CLAUDE_CODE_USE_VERTEX",
    "AWS_BEARER_TOKEN_BEDROCK",
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
    "OPENAI_ORG_ID",
    "OPENAI_PROJECT_ID",
    "CODEX_API_KEY",
    "AZURE_OPENAI_API_KEY",
    "OPENROUTER_API_KEY",
    "GEMINI_API_KEY",
    "GOOGLE_API_KEY",
    "GROQ_API_KEY",
    "MISTRAL_API_KEY",
    "DEEPSEEK_API_KEY",
    "XAI_API_KEY",
    "TOGETHER_API_KEY",
)
PROVIDER = "ft"
LOCAL_KEY = "ft-local"  # sent when the server requires no key
DEFAULT_CONTEXT = 32768  # assumed when /v1/models does not say


@dataclass(frozen=True)
class ServedModel:
    """The model the server serves, as `GET /v1/models` describes it."""

    id: str
    context_length: int | None = None


@dataclass(frozen=True)
class PlannedFile:
    """A file the launch writes; an existing file is first copied to `backup`."""

    path: Path
    content: str
    backup: Path | None = None


@dataclass
class LaunchPlan:
    """Everything a launch does: files to write, the command, and the child's environment changes."""

    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    unset: list[str] = field(default_factory=list)
    files: list[PlannedFile] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def child_env(self, base: dict[str, str]) -> dict[str, str]:
        """`base` without cloud credentials, with this plan's variables set."""
        env = {k: v for k, v in base.items() if k not in self.unset}
        env.update(self.env)
        return env


@dataclass(frozen=True)
class Agent:
    name: str
    binary: str
    npm_package: str


AGENTS = {
    "claude": Agent("claude", "claude", "@anthropic-ai/claude-code"),
    "codex": Agent("codex", "codex", "@openai/codex"),
    "opencode": Agent("opencode", "opencode", "opencode-ai"),
}


def claude_plan(cli: str, model: ServedModel, server: str, key: str, args: list[str]) -> LaunchPlan:
    """Claude Code: every model slot and the base URL through environment variables."""
    env = {"ANTHROPIC_BASE_URL": server, "ANTHROPIC_AUTH_TOKEN": key}
    for slot in (
        "ANTHROPIC_MODEL",
        "ANTHROPIC_DEFAULT_OPUS_MODEL",
        "ANTHROPIC_DEFAULT_SONNET_MODEL",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL",
        "ANTHROPIC_SMALL_FAST_MODEL",
        "CLAUDE_CODE_SUBAGENT_MODEL",
    ):
        env[slot] = model.id
    env["CLAUDE_CODE_ATTRIBUTION_HEADER"] = "0"  # else a per-request billing nonce opens the system prompt
    env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] = "1"
    if model.context_length:  # else it assumes a 1M-token window for a model id it does not know
        env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(model.context_length)
    return LaunchPlan([cli, *args], env, list(CLOUD_ENV))


def codex_provider(model: ServedModel, server: str) -> dict[str, object]:
    """The `model_providers.ft` table and the top-level keys that select it."""
    settings: dict[str, object] = {
        "model_provider": PROVIDER,
        "model": model.id,
        f"model_providers.{PROVIDER}.name": "ft (local)",
        f"model_providers.{PROVIDER}.base_url": f"{server}/v1",
        f"model_providers.{PROVIDER}.wire_api": "responses",
        f"model_providers.{PROVIDER}.env_key": "FT_API_KEY",
    }
    if model.context_length:
        settings["model_context_window"] = model.context_length
    return settings


def toml_value(value: object) -> str:
    return str(value) if isinstance(value, int) else json.dumps(value)


def codex_plan(
    cli: str, model: ServedModel, server: str, key: str, args: list[str], profile_file: Path | None = None
) -> LaunchPlan:
    """Codex: inline `-c key=value` overrides, or with `profile_file` a profile written beside config.toml."""
    settings = codex_provider(model, server)
    env = {"FT_API_KEY": key}
    if profile_file is None:
        overrides = [part for k, v in settings.items() for part in ("-c", f"{k}={toml_value(v)}")]
        return LaunchPlan([cli, *overrides, *args], env, list(CLOUD_ENV))
    content = codex_profile_toml(settings)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    backup = (
        profile_file.with_name(f"{profile_file.name}.ft-backup-{stamp}") if profile_file.exists() else None
    )
    profile = profile_file.name.removesuffix(".config.toml")
    plan = LaunchPlan(
        [cli, "--profile", profile, *args], env, list(CLOUD_ENV), [PlannedFile(profile_file, content, backup)]
    )
    plan.notes.append(f"later: `FT_API_KEY={key} codex --profile {profile}` uses the same settings")
    return plan


def codex_profile_toml(settings: dict[str, object]) -> str:
    top = {k: v for k, v in settings.items() if "." not in k}
    table = {k.rsplit(".", 1)[1]: v for k, v in settings.items() if "." in k}
    lines = ["# Written by `ft launch codex --config`: Codex pointed at a local ft server.", ""]
    lines += [f"{k} = {toml_value(v)}" for k, v in top.items()]
    lines += ["", f"[model_providers.{PROVIDER}]", *(f"{k} = {toml_value(v)}" for k, v in table.items())]
    return "\n".join(lines) + "\n"


def opencode_plan(cli: str, model: ServedModel, server: str, key: str, args: list[str]) -> LaunchPlan:
    """OpenCode: an `@ai-sdk/openai-compatible` provider passed inline in OPENCODE_CONFIG_CONTENT."""
    context = model.context_length or DEFAULT_CONTEXT
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            PROVIDER: {
                "npm": "@ai-sdk/openai-compatible",
                "name": "ft (local)",
                "options": {"baseURL": f"{server}/v1", "apiKey": key},
                "models": {
                    model.id: {
                        "name": model.id,
                        "limit": {"context": context, "output": min(32768, context // 4)},
                    }
                },
            }
        },
        "model": f"{PROVIDER}/{model.id}",
        "small_model": f"{PROVIDER}/{model.id}",
    }
    plan = LaunchPlan([cli, *args], {"OPENCODE_CONFIG_CONTENT": json.dumps(config)}, list(CLOUD_ENV))
    if model.context_length is None:
        plan.notes.append(f"the server did not report a context length; assumed {DEFAULT_CONTEXT}")
    return plan


def codex_home() -> Path:
    return Path(os.environ.get("CODEX_HOME") or Path.home() / ".codex")
