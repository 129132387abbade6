"""A synthetic coding-agent session, protocol-neutral: user turns, each a loop of model calls and tool runs.

`simulate(seed, num_requests, num_turns, scale)` is deterministic in its arguments. Each
model call (a `Step`) carries its reasoning, optional text and tool calls; each `ToolRun`
its output. Timestamps follow a plausible clock: model time grows with output length, tool
time with the kind of tool, and the user pauses between turns.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from traces import prose
from traces import tool_outputs as out
from traces.prompts import SYSTEM_PROMPT, TOOLS
from traces.repo import FakeRepo

START_TS = 1768471200.0  # 2026-01-15T10:00:00Z


@dataclass
class ToolRun:
    call_id: str
    name: str
    arguments: dict[str, Any]
    output: str
    seconds: float
    is_error: bool = False


@dataclass
class Step:
    """One model call: what it answered, and when it started and ended (Unix seconds)."""

    reasoning: str | None
    content: str | None
    runs: list[ToolRun]
    start: float = 0.0
    end: float = 0.0


@dataclass
class Turn:
    user: str
    ts: float
    steps: list[Step] = field(default_factory=list)


@dataclass
class Session:
    session_id: str
    seed: int
    model: str
    system: str
    tools: list[dict[str, Any]]
    turns: list[Turn]
    cwd: str = "/home/dev/ledgerly"


class _Agent:
    """Decides each step's tool calls from what the turn has seen so far."""

    def __init__(self, rng: random.Random, repo: FakeRepo, scale: float) -> None:
        self.rng, self.repo, self.scale = rng, repo, scale
        self.focus = rng.choice(repo.sources)
        self.read: list[str] = []
        self.edits: list[tuple[str, int, list[str], list[str]]] = []

    def new_turn(self) -> None:
        self.focus = self.rng.choice(self.repo.sources)
        self.edits = []

    def call_id(self) -> str:
        return f"call_{self.rng.getrandbits(96):024x}"

    def step(self, kind: str) -> Step:
        runs = getattr(self, f"_{kind}")()
        names = [r.name for r in runs]
        reasoning = prose.reasoning(self.rng, kind, self.focus, names)
        content = prose.note(self.rng) if self.rng.random() < 0.15 else None
        return Step(reasoning, content, runs)

    def _run(self, name: str, arguments: dict[str, Any], output: str, seconds: float) -> ToolRun:
        return ToolRun(self.call_id(), name, arguments, output, seconds)

    def _todo(self) -> list[ToolRun]:
        items = [
            {"content": prose.todo(self.rng, self.focus), "status": "pending"}
            for _ in range(self.rng.randint(3, 6))
        ]
        items[0]["status"] = "in_progress"
        return [self._run("todo_write", {"items": items}, "Todos have been modified successfully.", 0.01)]

    def _glob(self) -> list[ToolRun]:
        pattern = self.rng.choice(["ledgerly/**/*.py", "tests/**/*.py", "**/*.md", "ledgerly/*/**"])
        prefix = pattern.split("*")[0]
        files = [
            f
            for f in self.repo.files
            if f.startswith(prefix) and (not pattern.endswith(".py") or f.endswith(".py"))
        ]
        return [self._run("glob", {"pattern": pattern}, out.listing(files), 0.05)]

    def _grep(self) -> list[ToolRun]:
        runs = []
        for _ in range(1 if self.rng.random() < 0.7 else 2):
            symbol = self.rng.choice(self.repo.symbols(self.focus) or ["logger"])
            context = self.rng.choice([0, 0, 0, 2, int(4 * self.scale)])
            args: dict[str, Any] = {"pattern": symbol, "glob": "*.py"}
            if context:
                args["context"] = context
            text = out.grep(self.repo, symbol, self.repo.files, context, max_hits=int(120 * self.scale))
            runs.append(self._run("grep", args, text, 0.1))
        return runs

    def _read(self) -> list[ToolRun]:
        runs = []
        for _ in range(self.rng.choice([1, 1, 1, 2, 3])):
            path = self.rng.choice([self.focus, *self.rng.sample(self.repo.files, 2)])
            size = len(self.repo.lines(path))
            limit = int(self.rng.uniform(40, 400) * self.scale)
            args: dict[str, Any] = {"path": path}
            offset = 1
            if size > limit:
                offset = self.rng.randint(1, size - limit)
                args.update(offset=offset, limit=limit)
            self.read.append(path)
            runs.append(
                self._run("read_file", args, out.read_file(self.repo, path, offset, args.get("limit")), 0.02)
            )
        return runs

    def _edit(self) -> list[ToolRun]:
        path = self.read[-1] if self.read and self.read[-1].endswith(".py") else self.focus
        lines = self.repo.lines(path)
        at = self.rng.randint(0, max(0, len(lines) - 4))
        old = lines[at : at + self.rng.randint(1, 4)]
        new = prose.edited(self.rng, old)
        self.edits.append((path, at + 1, old, new))
        args = {"path": path, "old_string": "\n".join(old), "new_string": "\n".join(new)}
        return [self._run("edit_file", args, out.edit_result(self.repo, path, at + 1), 0.02)]

    def _test(self, passing: bool | None = None) -> list[ToolRun]:
        targets = sorted(self.rng.sample(self.repo.tests, self.rng.randint(1, max(1, int(6 * self.scale)))))
        passing = self.rng.random() < 0.6 if passing is None else passing
        failing = [] if passing else [(targets[0], f"test_{prose.test_name(self.rng)}")]
        text = out.pytest_run(self.repo, self.rng, targets, failing)
        return [self._run("run_tests", {"target": " ".join(targets)}, text, self.rng.uniform(0.8, 12.0))]

    def _test_pass(self) -> list[ToolRun]:
        return self._test(passing=True)

    def _diff(self) -> list[ToolRun]:
        return [
            self._run(
                "shell",
                {"command": "git diff", "description": "Show the changes so far"},
                out.diff(self.edits) or "",
                0.05,
            )
        ]

    def _shell(self) -> list[ToolRun]:
        command = self.rng.choice(
            [
                "git status",
                "git log --oneline -15",
                f"ls -la {self.focus.rsplit('/', 1)[0]}",
                "pip install -e .",
            ]
        )
        seconds = 4.0 if command.startswith("pip") else 0.05
        return [self._run("shell", {"command": command}, out.shell(self.repo, self.rng, command), seconds)]


def _plan(rng: random.Random, num_steps: int, first_turn: bool) -> list[str]:
    """Tool kinds for a turn's steps before its final answer: explore, then edit and test, then check."""
    kinds: list[str] = []
    for j in range(num_steps - 1):
        frac = j / max(1, num_steps - 1)
        if j == 0 and first_turn and num_steps > 4:
            kinds.append("todo")
        elif frac < 0.4:
            kinds.append(rng.choice(["glob", "grep", "grep", "read", "read", "read", "shell"]))
        elif frac < 0.85:
            kinds.append(rng.choice(["edit", "edit", "read", "grep", "test"]))
        else:
            kinds.append(rng.choice(["test_pass", "diff", "test_pass"]))
    if num_steps > 2:
        kinds[-1] = "test_pass"
    return kinds


def _split(rng: random.Random, total: int, parts: int) -> list[int]:
    """`total` steps over `parts` turns, each at least 2 (first turns get the long loops)."""
    weights = sorted((rng.uniform(0.3, 1.0) for _ in range(parts)), reverse=True)
    sizes = [max(2, int(total * w / sum(weights))) for w in weights]
    sizes[0] += total - sum(sizes)
    return sizes


def simulate(seed: int, num_requests: int = 24, num_turns: int = 3, scale: float = 1.0) -> Session:
    """A session of exactly `num_requests` model calls over `num_turns` user turns."""
    if num_requests < 2 * num_turns:
        raise ValueError(f"{num_requests} requests cannot hold {num_turns} turns (each needs two calls)")
    rng = random.Random(seed)
    repo = FakeRepo(seed)
    agent = _Agent(rng, repo, scale)
    session_id = f"{rng.getrandbits(32):08x}-{rng.getrandbits(16):04x}-4{rng.getrandbits(12):03x}-a{rng.getrandbits(12):03x}-{rng.getrandbits(48):012x}"
    clock = START_TS + seed * 3600
    turns = []
    for index, num_steps in enumerate(_split(rng, num_requests, num_turns)):
        agent.new_turn()
        turn = Turn(prose.user_request(rng, repo, agent.focus, index), clock)
        for kind in _plan(rng, num_steps, index == 0):
            clock = _timed(rng, agent.step(kind), clock, turn)
        final = Step(
            prose.reasoning(rng, "final", agent.focus, []), prose.summary(rng, agent.edits, agent.focus), []
        )
        clock = _timed(rng, final, clock, turn) + rng.uniform(20, 240)  # the user reads and types
        turns.append(turn)
    return Session(session_id, seed, "local-model", SYSTEM_PROMPT, TOOLS, turns)


def _timed(rng: random.Random, step: Step, clock: float, turn: Turn) -> float:
    """Stamp a step (model time grows with its output) and return the clock after its tools ran."""
    produced = (
        len(step.reasoning or "") + len(step.content or "") + sum(len(str(r.arguments)) for r in step.runs)
    )
    step.start = clock + 0.05
    step.end = step.start + rng.uniform(0.4, 1.5) + produced / 4 * 0.02
    turn.steps.append(step)
    return step.end + max((r.seconds for r in step.runs), default=0.0)
