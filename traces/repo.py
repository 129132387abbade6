"""A fake Python repository (`ledgerly`, a small accounting service) whose files are generated on demand.

Every file's text is a pure function of the repository seed and the path, so reading a file
twice gives the same text and a search finds what a later read shows.
"""

from __future__ import annotations

import random
import zlib

NOUNS = [
    "account",
    "entry",
    "ledger",
    "invoice",
    "balance",
    "currency",
    "journal",
    "posting",
    "period",
    "report",
    "rate",
    "schedule",
    "batch",
    "payment",
    "customer",
    "statement",
    "tax",
    "discount",
    "refund",
    "transfer",
    "budget",
    "audit",
    "export",
    "reminder",
    "session",
    "token",
    "cache",
]
VERBS = [
    "load",
    "save",
    "compute",
    "apply",
    "parse",
    "render",
    "validate",
    "merge",
    "split",
    "resolve",
    "fetch",
    "post",
    "close",
    "open",
    "reconcile",
    "normalize",
    "format",
    "round",
    "convert",
    "group",
]
PACKAGES = ["core", "billing", "reports", "api", "storage", "jobs", "utils"]


def plural(noun: str) -> str:
    return noun[:-1] + "ies" if noun.endswith("y") else noun + "s"


def camel(*words: str) -> str:
    return "".join(w.capitalize() for w in words)


class FakeRepo:
    """The file tree and file contents of the fake repository."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        rng = random.Random(seed)
        self.files: list[str] = []
        for package in PACKAGES:
            for noun in rng.sample(NOUNS, rng.randint(3, 7)):
                self.files.append(f"ledgerly/{package}/{plural(noun)}.py")
            self.files.append(f"ledgerly/{package}/__init__.py")
        sources = [f for f in self.files if not f.endswith("__init__.py")]
        self.files += [f"tests/{f.split('/')[1]}/test_{f.rsplit('/', 1)[1]}" for f in sources]
        self.files += ["pyproject.toml", "README.md", "Makefile", "ledgerly/__init__.py", "tests/conftest.py"]
        self.files += ["docs/index.md", "docs/api.md", "docs/deployment.md", ".github/workflows/ci.yml"]
        self.files.sort()

    def rng_for(self, *key: object) -> random.Random:
        """A random source fixed by the repository seed and `key` (stable across runs)."""
        return random.Random(zlib.crc32(repr((self.seed, *key)).encode()))

    @property
    def sources(self) -> list[str]:
        return [f for f in self.files if f.startswith("ledgerly/") and not f.endswith("__init__.py")]

    @property
    def tests(self) -> list[str]:
        return [f for f in self.files if "/test_" in f]

    def lines(self, path: str) -> list[str]:
        """The file's lines (without newlines)."""
        rng = self.rng_for("file", path)
        if path.endswith(".py") and "/test_" in path:
            return _test_module(rng, path)
        if path.endswith(".py") and not path.endswith("__init__.py"):
            return _module(rng, path)
        if path.endswith("__init__.py"):
            return [f'"""{path.split("/")[-2]} package."""', ""]
        return [f"# {path}", "", *(_sentence(rng) for _ in range(rng.randint(8, 40)))]

    def symbols(self, path: str) -> list[str]:
        """Function and class names defined in a module (what a search can look for)."""
        names = []
        for line in self.lines(path):
            stripped = line.strip()
            if stripped.startswith(("def ", "class ")):
                names.append(stripped.split()[1].split("(")[0].rstrip(":"))
        return names


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(NOUNS + VERBS) for _ in range(rng.randint(6, 16))]
    return " ".join(words).capitalize() + "."


def _module(rng: random.Random, path: str) -> list[str]:
    module = path.rsplit("/", 1)[1][:-3]
    noun = next((n for n in NOUNS if plural(n) == module), module)
    out = [
        f'"""{module.capitalize()}: {_sentence(rng).lower()}"""',
        "",
        "from __future__ import annotations",
        "",
    ]
    out += ["import logging", "from dataclasses import dataclass, field", "from decimal import Decimal", ""]
    other = rng.choice(NOUNS)
    out += [
        f"from ledgerly.core.{plural(other)} import {camel(other)}",
        "",
        "logger = logging.getLogger(__name__)",
        "",
    ]
    for _ in range(rng.randint(1, 3)):
        out += _class(rng, noun)
    for _ in range(rng.randint(2, 6)):
        out += _function(rng, noun, indent="")
    return out


def _class(rng: random.Random, noun: str) -> list[str]:
    name = camel(rng.choice(NOUNS), noun) if rng.random() < 0.5 else camel(noun)
    out = ["", "@dataclass", f"class {name}:", f'    """A {noun} as stored in the ledger."""', ""]
    for attr in rng.sample(NOUNS, rng.randint(2, 6)):
        kind = rng.choice(
            ["str", "int", "Decimal", "bool", f"list[{camel(attr)}] = field(default_factory=list)"]
        )
        out.append(f"    {attr}_id: {kind}" if "list" not in kind else f"    {attr}s: {kind}")
    for _ in range(rng.randint(1, 4)):
        out += _function(rng, noun, indent="    ")
    return out


def _function(rng: random.Random, noun: str, indent: str) -> list[str]:
    verb, obj = rng.choice(VERBS), rng.choice(NOUNS)
    args = ", ".join(f"{a}: {camel(a)}" for a in rng.sample(NOUNS, rng.randint(0, 3)))
    self_arg = "self, " if indent else ""
    head = f"{indent}def {verb}_{obj}({self_arg}{args}".rstrip(", ") + f") -> {camel(obj)} | None:"
    body = [f'{indent}    """{verb.capitalize()} the {obj} of this {noun}."""']
    for _ in range(rng.randint(3, 14)):
        body += _statement(rng, indent + "    ", obj)
    body.append(f"{indent}    return {obj}")
    return ["", head, *body]


def _statement(rng: random.Random, indent: str, obj: str) -> list[str]:
    a, b = rng.choice(NOUNS), rng.choice(NOUNS)
    templates = [
        [f"{a} = {b}.{rng.choice(VERBS)}_{a}()"],
        [f"if {a} is None:", f'    raise ValueError(f"missing {a} for {{{b}!r}}")'],
        [f"for item in {a}.{b}s:", f"    total += item.amount * {a}.rate"],
        [f'logger.debug("{rng.choice(VERBS)} %s -> %s", {a}, {b})'],
        [f"{obj} = {camel(obj)}({a}={a}, {b}={b})"],
        [
            "try:",
            f"    {a}.{rng.choice(VERBS)}()",
            "except KeyError as exc:",
            f'    logger.warning("no {b}: %s", exc)',
        ],
        [f"{a}_total = sum((p.amount for p in {b}.postings), Decimal(0))"],
        [f"if {a}.currency != {b}.currency:", f"    {a} = convert({a}, {b}.currency)"],
    ]
    return [indent + line for line in rng.choice(templates)]


def _test_module(rng: random.Random, path: str) -> list[str]:
    module = path.rsplit("/test_", 1)[1][:-3]
    noun = next((n for n in NOUNS if plural(n) == module), module)
    out = ["import pytest", "", f"from ledgerly.{path.split('/')[1]}.{module} import *  # noqa: F403", ""]
    for _ in range(rng.randint(3, 12)):
        case = f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}"
        out += ["", f"def test_{case}():", f"    {noun} = make_{noun}()"]
        out += [f"    assert {noun}.{rng.choice(VERBS)}_{rng.choice(NOUNS)}() == {rng.randint(0, 999)}"]
        if rng.random() < 0.3:
            out += ["    with pytest.raises(ValueError):", f"        {noun}.{rng.choice(VERBS)}(None)"]
    return out
