"""Where a qwen3_coder parameter value ends, including the ends a model writes without
``</parameter>``: ``</function>`` followed by ``</tool_call>``, or ``<parameter=P>`` naming
another parameter of the tool."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

CALL_CLOSE = "</tool_call>"
FUNC_CLOSE = "</function>"
PARAM_OPEN = "<parameter="
PARAM_CLOSE = "</parameter>"


@dataclass(frozen=True)
class ValueEnd:
    """`at`: where the value ends (None: not in the text so far); `resume`: where parsing goes
    on, in parser state `state`; `recovered`: the end is one the template would not write;
    `wait`: no end yet, but the text from here on may still become one."""

    at: int | None = None
    resume: int = 0
    state: str = "params"
    recovered: bool = False
    wait: int | None = None


def value_end(buf: str, params: Collection[str], final: bool) -> ValueEnd:
    """The first end of the value that starts `buf`; `params` are the tool's parameters not
    given yet; `final`: no text follows (a partial end tag then ends the value)."""
    pos = 0
    while (i := buf.find("<", pos)) >= 0:
        end = _end_at(buf, i, params, final)
        if end is not None:
            return end
        pos = i + 1
    return ValueEnd()


def _end_at(buf: str, i: int, params: Collection[str], final: bool) -> ValueEnd | None:
    rest = buf[i:]
    if rest.startswith(PARAM_CLOSE):
        return ValueEnd(i, i + len(PARAM_CLOSE))
    if rest.startswith(FUNC_CLOSE):
        after = rest[len(FUNC_CLOSE) :].lstrip()
        if after.startswith(CALL_CLOSE):
            return ValueEnd(i, len(buf) - len(after) + len(CALL_CLOSE), "between", True)
        if not after or CALL_CLOSE.startswith(after):
            return ValueEnd(i, len(buf), "between", True) if final else ValueEnd(wait=i)
        return None
    if rest.startswith(PARAM_OPEN):
        j = rest.find(">")
        name = rest[len(PARAM_OPEN) : j if j >= 0 else len(rest)]
        if j >= 0:
            return ValueEnd(i, i, "params", True) if name in params else None
        return None if final or not any(p.startswith(name) for p in params) else ValueEnd(wait=i)
    if PARAM_CLOSE.startswith(rest) or FUNC_CLOSE.startswith(rest):
        return ValueEnd(i, len(buf)) if final else ValueEnd(wait=i)
    if PARAM_OPEN.startswith(rest) and params and not final:
        return ValueEnd(wait=i)
    return None
