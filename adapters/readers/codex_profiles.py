"""What a Codex rollout cannot carry, per CLI version: the tool schemas, the request parameters
and how the base instructions are trimmed before they are sent.

A rollout records the full `base_instructions` and no tools. Codex sends its tools with every
request and drops sections of the base instructions that its enabled features do not use
(0.171 drops `## Planning` and ``## `update_plan` `` since `update_plan` is not among its
tools). `codex_profiles.json` holds, per version, what `codex exec` sent with the settings of
`ft launch codex` (captured by `python -m traces.capture_clients`; ground truth under
tests/data/clients/codex-<version>/). A rollout of another version is rebuilt with the
nearest known profile and marked approximate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

PROFILES_FILE = Path(__file__).with_name("codex_profiles.json")


@dataclass(frozen=True)
class CodexProfile:
    """How one Codex version builds a request beyond the rollout's history.

    `params`: the body fields after `tools` (tool_choice, parallel_tool_calls, reasoning,
    store, include) in the order Codex sends them; `drop_sections`: the markdown headings whose
    sections are cut from the base instructions; `originator`: the client it was captured with.
    """

    version: str
    originator: str
    tools: list[dict[str, Any]]
    params: dict[str, Any]
    drop_sections: tuple[str, ...]

    def instructions(self, base: str) -> str:
        """The base instructions as this version sends them."""
        return drop_sections(base, self.drop_sections)


def heading_level(line: str) -> int:
    """The level of a markdown heading line (`## x` is 2); 0 for any other line."""
    text = line.lstrip("#")
    level = len(line) - len(text)
    return level if level and text.startswith(" ") else 0


def drop_sections(text: str, headings: tuple[str, ...]) -> str:
    """`text` without the sections opened by `headings` (exact heading lines): each runs from its
    heading to the next heading of the same or a higher level outside code fences, or the end."""
    kept: list[str] = []
    skipping = 0  # level of the section being dropped, 0 when keeping
    fenced = False
    for line in text.splitlines(keepends=True):
        bare = line.rstrip("\n")
        if bare.startswith("```"):
            fenced = not fenced
        level = 0 if fenced else heading_level(bare)
        if skipping and level and level <= skipping:
            skipping = 0
        if not skipping and level and bare in headings:
            skipping = level
        if not skipping:
            kept.append(line)
    return "".join(kept)


@cache
def profiles() -> dict[str, CodexProfile]:
    data = json.loads(PROFILES_FILE.read_text(encoding="utf-8"))
    return {
        version: CodexProfile(
            version, entry["originator"], entry["tools"], entry["params"], tuple(entry["drop_sections"])
        )
        for version, entry in data.items()
    }


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) if part.isdigit() else -1 for part in version.split("."))


def nearest_profile(version: str | None) -> CodexProfile:
    """The profile of `version`, else of the newest known version not after it, else the oldest."""
    known = profiles()
    if version in known:
        return known[version]
    ordered = sorted(known, key=version_key)
    if version is None:
        return known[ordered[-1]]
    earlier = [v for v in ordered if version_key(v) <= version_key(version)]
    return known[earlier[-1] if earlier else ordered[0]]
