"""Tool outputs shaped like real ones: numbered file reads, search hits, listings, pytest runs, diffs."""

from __future__ import annotations

import random
import zlib

from traces.repo import NOUNS, VERBS, FakeRepo


def read_file(repo: FakeRepo, path: str, offset: int = 1, limit: int | None = None) -> str:
    lines = repo.lines(path)
    end = len(lines) if limit is None else min(len(lines), offset - 1 + limit)
    return "\n".join(f"{n:>6}\t{lines[n - 1]}" for n in range(offset, end + 1))


def grep(repo: FakeRepo, pattern: str, files: list[str], context: int = 0, max_hits: int = 200) -> str:
    hits: list[str] = []
    for path in files:
        lines = repo.lines(path)
        for n, line in enumerate(lines, start=1):
            if pattern in line:
                lo, hi = max(1, n - context), min(len(lines), n + context)
                hits.extend(
                    f"{path}{':' if i == n else '-'}{i}{':' if i == n else '-'}{lines[i - 1]}"
                    for i in range(lo, hi + 1)
                )
                if context:
                    hits.append("--")
        if len(hits) >= max_hits:
            break
    return "\n".join(hits[:max_hits]) or "No matches found."


def listing(paths: list[str]) -> str:
    return "\n".join(paths) if paths else "No files found."


def edit_result(repo: FakeRepo, path: str, line: int) -> str:
    lines = repo.lines(path)
    lo, hi = max(1, line - 4), min(len(lines), line + 6)
    snippet = "\n".join(f"{n:>6}\t{lines[n - 1]}" for n in range(lo, hi + 1))
    return f"The file {path} has been updated. Here's the result of running `cat -n` on a snippet of the edited file:\n{snippet}"


def pytest_run(repo: FakeRepo, rng: random.Random, targets: list[str], failing: list[tuple[str, str]]) -> str:
    """Pytest output over test files `targets`; `failing` = (test file, test name) that fail."""
    out = [
        "============================= test session starts ==============================",
        "platform linux -- Python 3.12.3, pytest-8.3.4, pluggy-1.5.0",
        "rootdir: /home/dev/ledgerly",
        "configfile: pyproject.toml",
        "plugins: cov-5.0.0, xdist-3.6.1",
    ]
    counts = {t: sum(1 for line in repo.lines(t) if line.startswith("def test_")) for t in targets}
    out.append(f"collected {sum(counts.values())} items\n")
    failed_files = {f for f, _ in failing}
    for target, count in counts.items():
        marks = "".join("F" if target in failed_files and i == count // 2 else "." for i in range(count))
        done = int(100 * (list(counts).index(target) + 1) / len(counts))
        out.append(f"{target} {marks:<50} [{done:>3}%]")
    for test_file, test_name in failing:
        out += _failure(repo, rng, test_file, test_name)
    passed = sum(counts.values()) - len(failing)
    seconds = rng.uniform(0.2, 1.5) * max(1, len(targets))
    if failing:
        out.append("=========================== short test summary info ============================")
        out += [
            f"FAILED {f}::{name} - AssertionError: assert {rng.randint(0, 999)} == {rng.randint(0, 999)}"
            for f, name in failing
        ]
        out.append(
            f"========================= {len(failing)} failed, {passed} passed in {seconds:.2f}s ========================="
        )
    else:
        out.append(
            f"============================== {passed} passed in {seconds:.2f}s =============================="
        )
    return "\n".join(out)


def _failure(repo: FakeRepo, rng: random.Random, test_file: str, test_name: str) -> list[str]:
    source = rng.choice(repo.sources)
    lines = repo.lines(source)
    at = rng.randint(10, max(11, len(lines) - 5))
    out = [
        "",
        "=================================== FAILURES ===================================",
        f"_{'_' * 20} {test_name} {'_' * 20}",
        "",
        f"    def {test_name}():",
    ]
    out += [
        f"        {line.strip()}"
        for line in rng.sample(repo.lines(test_file), min(3, len(repo.lines(test_file))))
    ]
    out += [
        ">       assert result == expected",
        f"E       AssertionError: assert Decimal('{rng.randint(1, 999)}.{rng.randint(0, 99):02d}') == Decimal('{rng.randint(1, 999)}.00')",
        "",
    ]
    out += [
        f"{test_file}:{rng.randint(5, 60)}: ",
        "_ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _",
        "",
    ]
    out += [f"    {line}" for line in lines[max(0, at - 8) : at]]
    out += [
        f">   {lines[at]}",
        f"E   KeyError: '{rng.choice(['EUR', 'USD', 'GBP', 'JPY', 'CHF'])}'",
        "",
        f"{source}:{at + 1}: KeyError",
    ]
    out += ["----------------------------- Captured log call ------------------------------"]
    out += [
        f"DEBUG    ledgerly.{source.split('/')[1]}:{source.rsplit('/', 1)[1]}:{rng.randint(10, 300)} {rng.choice(['load', 'post', 'round'])} {rng.randint(1, 99)} -> {rng.randint(1, 99)}"
        for _ in range(rng.randint(1, 8))
    ]
    return out


def diff(edits: list[tuple[str, int, list[str], list[str]]]) -> str:
    """A `git diff` of edits given as (path, first line, old lines, new lines)."""
    out: list[str] = []
    for path, line, old, new in edits:
        out += [
            f"diff --git a/{path} b/{path}",
            f"index {zlib.crc32(path.encode()) % 16**7:07x}..{zlib.crc32(repr(new).encode()) % 16**7:07x} 100644",
            f"--- a/{path}",
            f"+++ b/{path}",
            f"@@ -{line},{len(old)} +{line},{len(new)} @@",
        ]
        out += [f"-{x}" for x in old] + [f"+{x}" for x in new]
    return "\n".join(out)


def shell(repo: FakeRepo, rng: random.Random, command: str) -> str:
    if command.startswith("git status"):
        changed = rng.sample(repo.sources, rng.randint(1, 4))
        return "On branch main\nChanges not staged for commit:\n" + "\n".join(
            f"\tmodified:   {p}" for p in changed
        )
    if command.startswith("git log"):
        return "\n".join(f"{rng.getrandbits(28):07x} {_subject(rng)}" for _ in range(rng.randint(5, 20)))
    if command.startswith("ls"):
        folder = command.split()[-1]
        rows = [p for p in repo.files if p.startswith(folder)]
        return "\n".join(
            f"-rw-r--r-- 1 dev dev {rng.randint(200, 30000):>6} Jan 14 09:{rng.randint(10, 59)} {p.rsplit('/', 1)[1]}"
            for p in rows
        )
    if command.startswith("pip"):
        pkgs = ["ledgerly", "babel", "pydantic", "sqlalchemy", "httpx", "anyio", "idna", "certifi", "sniffio"]
        return (
            "\n".join(
                f"Requirement already satisfied: {p} in ./.venv/lib/python3.12/site-packages" for p in pkgs
            )
            + "\nSuccessfully installed ledgerly-0.9.3"
        )
    answers = ["OK", "done", "Decimal('12.50')", '{"status": "ok"}']
    return rng.choice(answers)


def _subject(rng: random.Random) -> str:
    return f"{rng.choice(VERBS).capitalize()} {rng.choice(NOUNS)} {rng.choice(['handling', 'rounding', 'export', 'validation', 'tests'])}"
