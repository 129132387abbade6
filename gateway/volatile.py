"""Volatile content: per-request text that means nothing to a local model but would
break every anchor after it.

Rule `billing_header` (on by default): Claude Code (unless run with
`CLAUDE_CODE_ATTRIBUTION_HEADER=0`) starts its system prompt with a block like

    x-anthropic-billing-header: cc_version=2.1.332.0b8; cc_entrypoint=sdk-cli; cch=1a2b3;

whose values (notably the `cch=` nonce) change between requests and versions. Modes:
`"drop"` (default) removes such lines from system blocks (and blocks left empty),
`"mask"` keeps the line with every value replaced by `*`, `"keep"` leaves it alone.
It is an HTTP-style metadata line, not an instruction, so dropping it loses nothing.

Not volatile (left alone on purpose): Codex's `Wall time: 0.0000 seconds` and
`Chunk ID: …` lines inside `function_call_output`: they are part of the tool result the
model should read, they sit after the point where the conversation was extended, and
the result is only sent once per call id, so they never break an earlier anchor.
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

from gateway.conversation import Conversation

BillingMode = Literal["drop", "mask", "keep"]
BILLING_LINE = re.compile(r"^x-anthropic-billing-header:[^\n]*(\n|$)", re.MULTILINE | re.IGNORECASE)
BILLING_VALUE = re.compile(r"=[^;\n]*")


class VolatileRules(msgspec.Struct, frozen=True):
    """Which normalisations to apply (a server setting)."""

    billing_header: BillingMode = "drop"


DEFAULT_RULES = VolatileRules()


def _billing(text: str, mode: BillingMode) -> str:
    if mode == "drop":
        return BILLING_LINE.sub("", text)
    return BILLING_LINE.sub(lambda m: BILLING_VALUE.sub("=*", m.group(0)), text)


def normalize(conv: Conversation, rules: VolatileRules = DEFAULT_RULES) -> Conversation:
    """`conv` with volatile content normalised by `rules` (system blocks only)."""
    if rules.billing_header == "keep" or not any(BILLING_LINE.search(s) for s in conv.system):
        return conv
    blocks = tuple(b for b in (_billing(s, rules.billing_header) for s in conv.system) if b)
    return msgspec.structs.replace(conv, system=blocks)
