"""The words of the synthetic sessions: user requests, reasoning, progress notes, final summaries."""

from __future__ import annotations

import random

from traces.repo import NOUNS, VERBS, FakeRepo

BUGS = [
    "rounds before converting currencies, so totals drift by a cent on multi-currency invoices",
    "raises KeyError when a customer has no default currency",
    "returns None instead of an empty list when the period has no postings",
    "double-counts refunds that were issued in the same batch as the payment",
    "ignores the timezone of the statement period and closes it a day early",
    "swallows the ValueError from the tax lookup and posts a zero-tax entry",
]
FEATURES = [
    "a `--dry-run` option that prints what would be posted without writing anything",
    "pagination to the export endpoint (a `cursor` and a `limit`, 100 by default)",
    "a retry with exponential backoff around the payment provider call",
    "structured logging of every reconcile run (counts, duration, mismatches)",
]
FOLLOW_UPS = [
    "Thanks. Can you also run the whole suite and tell me if anything else broke?",
    "Looks good. Please add a short note about this to docs/api.md.",
    "One more thing: the same pattern is probably in {module}. Can you check it and fix it there too?",
    "Can you explain why the old code worked for single-currency ledgers?",
    "Rename the helper you added to something clearer and update the callers.",
]
OPENERS = ["", "Okay. ", "Right, ", "Hmm. ", "Good. ", "So ", "Now "]


def user_request(rng: random.Random, repo: FakeRepo, focus: str, index: int) -> str:
    symbol = rng.choice(repo.symbols(focus) or ["main"])
    if index > 0 and rng.random() < 0.6:
        return rng.choice(FOLLOW_UPS).format(module=rng.choice(repo.sources))
    if rng.random() < 0.6:
        bug = rng.choice(BUGS)
        return (
            f"`{symbol}` in {focus} {bug}. I noticed it in production logs this morning:\n\n"
            f"```\nERROR ledgerly.jobs.worker: job {rng.randint(1000, 9999)} failed: {_error(rng)}\n```\n\n"
            "Can you find the cause, fix it and add a regression test?"
        )
    return f"Please add {rng.choice(FEATURES)} in {focus}. Follow the existing style and add tests."


def _error(rng: random.Random) -> str:
    return rng.choice(
        ["KeyError: 'EUR'", "decimal.InvalidOperation", "AssertionError: totals differ by 0.01"]
    )


def reasoning(rng: random.Random, kind: str, focus: str, tools: list[str]) -> str:
    """A few sentences of planning, longer when the agent has something to think through."""
    noun, verb = rng.choice(NOUNS), rng.choice(VERBS)
    pools = {
        "todo": [f"This touches {focus} and its tests. I'll lay out the steps first so the user can follow."],
        "glob": [
            f"I need the layout of the package before reading anything. Let me list the {noun} modules."
        ],
        "grep": [
            f"I should find where `{verb}_{noun}` is defined and who calls it before changing anything.",
            f"The {noun} handling could also live in another module; a search will tell me.",
        ],
        "read": [
            f"The search points at {focus}. I'll read it around the {noun} code path.",
            f"I want to see how `{verb}` handles a missing {noun} before deciding where the check goes.",
        ],
        "edit": [
            f"The {noun} is converted after rounding; swapping the two lines keeps the precision until the end.",
            f"I'll guard the lookup so a missing {noun} raises a clear ValueError instead of a KeyError.",
        ],
        "test": [f"Let me run the {noun} tests to see where things stand."],
        "test_pass": [f"Now the tests around {focus} should pass; let me run them."],
        "diff": ["Before reporting, let me look at the whole diff once more."],
        "shell": ["Let me check the state of the working tree."],
        "final": ["The tests pass and the diff is what I intended. Time to summarise for the user."],
    }
    sentences = [rng.choice(pools.get(kind, pools["read"]))]
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3, 5])):
        sentences.append(_musing(rng))
    return " ".join(sentences)


def _musing(rng: random.Random) -> str:
    a, b, v = rng.choice(NOUNS), rng.choice(NOUNS), rng.choice(VERBS)
    return rng.choice(
        [
            f"Note that `{v}_{a}` is also used by the {b} export, so its signature has to stay the same.",
            f"The {a} amounts are Decimals, which is good; the problem is the order of operations, not the type.",
            f"If the {a} is empty the loop never runs and `total` is never bound, which would be a separate bug.",
            f"I am not sure yet whether {b}s can span two periods; the tests should tell me.",
            f"There is a helper for {a} conversion in core already; reusing it beats adding another one.",
            f"Hmm, the {b} path logs at debug level only, which is why nobody saw this before.",
        ]
    )


def note(rng: random.Random) -> str:
    return rng.choice(
        ["Let me check the tests next.", "Found it.", "That explains the failure.", "One more place to look."]
    )


def todo(rng: random.Random, focus: str) -> str:
    return f"{rng.choice(VERBS).capitalize()} the {rng.choice(NOUNS)} handling in {focus.rsplit('/', 1)[1]}"


def test_name(rng: random.Random) -> str:
    return f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}_{rng.choice(['rounding', 'missing', 'empty', 'twice'])}"


def edited(rng: random.Random, old: list[str]) -> list[str]:
    """A plausible rewrite of a few lines: a guard added, a name changed, a line moved."""
    indent = old[0][: len(old[0]) - len(old[0].lstrip())] if old else ""
    noun = rng.choice(NOUNS)
    guard = [f"{indent}if {noun} is None:", f'{indent}    raise ValueError("{noun} is required")']
    choice = rng.randint(0, 2)
    if choice == 0:
        return guard + old
    if choice == 1:
        return [
            line.replace(" = ", f" = normalize_{noun}(", 1) + (")" if " = " in line else "") for line in old
        ]
    return old[1:] + old[:1]


def summary(rng: random.Random, edits: list[tuple[str, int, list[str], list[str]]], focus: str) -> str:
    files = sorted({path for path, *_ in edits}) or [focus]
    lines = ["I fixed the issue.", "", "**What changed**"]
    lines += [
        f"- `{path}:{line}`: {rng.choice(['guarded the lookup', 'reordered rounding and conversion', 'renamed the helper'])}"
        for path, line, *_ in edits[:6]
    ]
    lines += ["", "**Why**", _musing(rng) + " " + _musing(rng), "", "**Verification**"]
    lines += [f"- Ran the tests for {', '.join(f'`{f}`' for f in files[:3])}: all pass."]
    if rng.random() < 0.4:
        lines += ["", f"One thing I did not change: {_musing(rng).lower()}"]
    return "\n".join(lines)
