"""Streaming parser for Qwen3.5/3.6 output: reasoning, text, qwen3_coder XML tool calls.

The generated text (after the prompt's ``<|im_start|>assistant\\n<think>\\n``) looks like::

    REASONING\\n</think>\\n\\nTEXT\\n\\n<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE
    \\n</parameter>\\n</function>\\n</tool_call>\\n<tool_call>...

Text may arrive split anywhere (even inside a tag). The parser holds back only what could
still be the start of a tag or of whitespace the template strips, so its events do not
depend on where the text was split, and a call's start (a parameter's key) goes out with
the ``>`` that closes ``<function=NAME>`` (``<parameter=P>``). Malformed markup never raises.

Models also write calls the template would not (`recovery.py`). Where the intent is
unambiguous the parser reads them as the call meant, and counts them in `recovered`:

- a Hermes-form call (JSON inside ``<tool_call>``) of a known tool whose schema accepts it;
- a value without ``</parameter>``, ended by ``</function>`` and ``</tool_call>`` or by
  ``<parameter=P>`` naming another parameter of the tool;
- ``</tool_call>`` where ``</function>`` was due;
- a call opened inside the reasoning (``<tool_call>`` then ``<function=NAME>`` of a known tool):
  the reasoning ends there.

A string-typed value written as JSON stays the string the model wrote (`ToolCallBuilder`).

Other markup becomes text and is counted in `kept_as_text`.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Collection, Mapping

from gateway.events import Event, ReasoningDelta, TextDelta
from gateway.parsers.recovery import hermes_call
from gateway.parsers.tool_call import ToolCallBuilder, whole_call
from gateway.parsers.value_end import CALL_CLOSE, FUNC_CLOSE, PARAM_OPEN, value_end

THINK_END = "</think>"
CALL_OPEN = "<tool_call>"
FUNC_OPEN = "<function="
MAX_NAME = 256


def new_call_id(prefix: str = "call_") -> str:
    """A fresh tool-call id: ``call_...`` for OpenAI, pass ``toolu_`` for Anthropic."""
    return prefix + secrets.token_hex(12)


def held(buf: str, token: str) -> int:
    """Length of the longest proper prefix of `token` that `buf` ends with."""
    for k in range(min(len(token) - 1, len(buf)), 0, -1):
        if buf.endswith(token[:k]):
            return k
    return 0


class QwenParser:
    """Feed generated text with `feed`, then call `close` once; both return events.

    `tools` maps function-tool names to their JSON-schema `parameters` (values are typed
    with it); `custom_tools` names free-form tools, whose input is their first parameter's
    raw text. `reasoning=False` when the prompt disabled thinking (no leading think)."""

    def __init__(
        self,
        tools: Mapping[str, dict] | None = None,
        *,
        custom_tools: Collection[str] = (),
        reasoning: bool = True,
        call_id: Callable[[], str] = new_call_id,
    ):
        self._tools = dict(tools or {})
        self._custom = set(custom_tools)
        self._call_id = call_id
        self._state = "reasoning_start" if reasoning else "text_start"
        self._buf = ""
        self._out: list[Event] = []
        self._call: ToolCallBuilder | None = None
        self._n_calls = 0
        self.recovered = 0  # calls read from markup the template would not write
        self.kept_as_text = 0  # tool-call markup too ambiguous to read, passed on as text
        self._think_open = False  # a call ended the reasoning: a later </think> is dropped

    @property
    def saw_tool_call(self) -> bool:
        return self._n_calls > 0

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        while getattr(self, "_step_" + self._state)():
            pass
        out, self._out = self._out, []
        return out

    def close(self) -> list[Event]:
        """End of generation: flush what was held back and close an open tool call."""
        getattr(self, "_close_" + self._state, self._close_quiet)()
        self._buf, self._state = "", "done"
        out, self._out = self._out, []
        return out

    # -- reasoning and text -------------------------------------------------------------

    def _step_reasoning_start(self) -> bool:
        return self._skip_leading("\n", "reasoning")

    def _step_text_start(self) -> bool:
        return self._skip_leading(None, "text")

    def _skip_leading(self, chars: str | None, next_state: str) -> bool:
        self._buf = self._buf.lstrip(chars)
        if not self._buf:
            return False
        self._state = next_state
        return True

    def _step_reasoning(self) -> bool:
        i = self._buf.find(CALL_OPEN)
        if i < 0 or 0 <= self._buf.find(THINK_END) < i:
            held_call = held(self._buf, CALL_OPEN)
            if held_call and THINK_END not in self._buf:
                return self._hold_reasoning(len(self._buf) - held_call)
            return self._scan(THINK_END, ReasoningDelta, "\n", "text_start")
        verdict = self._reasoning_call(self._buf[i + len(CALL_OPEN) :])
        if verdict is None:
            return self._hold_reasoning(i)
        if verdict:
            self._emit(ReasoningDelta, self._buf[:i].rstrip("\n"))
            self._buf, self._state = self._buf[i + len(CALL_OPEN) :], "call_open"
            self.recovered, self._think_open = self.recovered + 1, True
            return True
        self.kept_as_text += 1
        self._emit(ReasoningDelta, self._buf[: i + len(CALL_OPEN)])
        self._buf = self._buf[i + len(CALL_OPEN) :]
        return True

    def _hold_reasoning(self, end: int) -> bool:
        """Emit the reasoning before `end` (less the newlines that may precede a tag); hold the rest."""
        safe = self._buf[:end].rstrip("\n")
        self._emit(ReasoningDelta, safe)
        self._buf = self._buf[len(safe) :]
        return False

    def _reasoning_call(self, after: str) -> bool | None:
        """Whether ``<tool_call>`` inside the reasoning opens a call: `<function=NAME>` of a
        known tool follows; None while the text so far cannot tell."""
        s = after.lstrip()
        if len(s) < len(FUNC_OPEN):
            return None if FUNC_OPEN.startswith(s) else False
        if not s.startswith(FUNC_OPEN):
            return False
        j = s.find(">", len(FUNC_OPEN))
        name = s[len(FUNC_OPEN) : j if j >= 0 else len(s)]
        if j < 0:
            plausible = len(name) <= MAX_NAME and not any(c.isspace() or c == "<" for c in name)
            return None if plausible else False
        return name in self._tools or name in self._custom

    def _step_text(self) -> bool:
        return self._scan(CALL_OPEN, TextDelta, None, "call_open")

    def _scan(self, tag: str, kind: type, strip: str | None, next_state: str) -> bool:
        """Emit text up to `tag` (then switch state), holding back a partial tag and the
        trailing `strip` characters the template drops before it."""
        i = self._buf.find(tag)
        if i >= 0:
            self._emit(kind, self._buf[:i].rstrip(strip))
            self._buf, self._state = self._buf[i + len(tag) :], next_state
            return True
        safe = self._buf[: len(self._buf) - held(self._buf, tag)].rstrip(strip)
        self._emit(kind, safe)
        self._buf = self._buf[len(safe) :]
        return False

    def _emit(self, kind: type, text: str) -> None:
        if text:
            self._out.append(kind(text))

    def _close_reasoning(self) -> None:
        self._emit(ReasoningDelta, self._buf.rstrip("\n"))

    def _close_text(self) -> None:
        self._emit(TextDelta, self._buf.rstrip())

    def _close_quiet(self) -> None:
        pass

    # -- tool calls ---------------------------------------------------------------------

    def _step_call_open(self) -> bool:
        if self._buf.lstrip().startswith("{"):
            self._state = "json_call"
            return True
        name, rest = self._tag_name(FUNC_OPEN)
        if name is None:
            return False
        if not name:
            return self._to_text(CALL_OPEN + self._buf)
        self._start_call(name)
        self._buf, self._state = rest, "params"
        return True

    def _tag_name(self, opener: str, final: bool = False) -> tuple[str | None, str]:
        """Parse ``WS <opener>NAME>`` at the buffer start: (NAME, the text after ``>``) as soon
        as the ``>`` arrives. Returns (None, _) to wait for more text, ("", _) when malformed."""
        s = self._buf.lstrip()
        if not s.startswith(opener):
            return ("" if final or not opener.startswith(s) else None), ""
        j = s.find(">", len(opener))
        name = s[len(opener) : j if j >= 0 else len(s)]
        if any(c.isspace() or c == "<" for c in name) or len(name) > MAX_NAME:
            return "", ""
        if j < 0:
            return ("" if final else None), ""
        return name, s[j + 1 :]

    def _start_call(self, name: str) -> None:
        custom = name in self._custom
        known = custom or name in self._tools
        self._call = ToolCallBuilder(
            self._n_calls, self._call_id(), name, self._tools.get(name), custom, known
        )
        self._n_calls += 1
        self._out += self._call.open()

    def _step_json_call(self) -> bool:
        i = self._buf.find(CALL_CLOSE)
        if i < 0:
            return False
        body, self._buf = self._buf[:i], self._buf[i + len(CALL_CLOSE) :]
        self._state = "between" if self._json_call(body, CALL_CLOSE) else "text"
        return True

    def _close_json_call(self) -> None:
        self._json_call(self._buf.rstrip(), "")

    def _json_call(self, body: str, close: str) -> bool:
        """A Hermes-form call's events, or its markup as text (counted); whether it was a call."""
        found = hermes_call(body, self._tools)
        if found is None:
            self.kept_as_text += 1
            self._emit(TextDelta, CALL_OPEN + body + close)
            return False
        self.recovered += 1
        self._out += whole_call(self._n_calls, self._call_id(), *found)
        self._n_calls += 1
        return True

    def _to_text(self, text: str) -> bool:
        """Malformed markup: what was buffered is plain text after all."""
        self.kept_as_text += 1
        self._buf, self._state = text, "text"
        if text.startswith(CALL_OPEN):
            self._emit(TextDelta, CALL_OPEN)
            self._buf = text[len(CALL_OPEN) :]
        return True

    def _step_params(self) -> bool:
        s = self._buf.lstrip()
        if s.startswith(FUNC_CLOSE):
            self._end_call()
            self._buf, self._state = s[len(FUNC_CLOSE) :], "call_close"
            return True
        if s.startswith(CALL_CLOSE):
            self.recovered += 1
            self._end_call()
            self._buf, self._state = s[len(CALL_CLOSE) :], "between"
            return True
        if not s or FUNC_CLOSE.startswith(s) or CALL_CLOSE.startswith(s):
            return False
        name, rest = self._tag_name(PARAM_OPEN)
        if name is None:
            return False
        if not name:  # not a parameter: the call ends, and what follows is read as text (a new call may open)
            self._end_call()
            self.kept_as_text += 1
            self._buf, self._state = s, "text"
            return True
        assert self._call is not None
        self._out += self._call.begin_param(name)
        self._buf, self._state = rest, "value_start"
        return True

    def _step_value_start(self) -> bool:
        """The newline the template writes after ``<parameter=P>`` is not the value's."""
        if not self._buf:
            return False
        self._buf, self._state = self._buf.removeprefix("\n"), "value"
        return True

    def _step_value(self) -> bool:
        return self._value(final=False)

    def _value(self, final: bool) -> bool:
        """Stream the current value up to where its end may begin; at its end, move on."""
        assert self._call is not None
        end = value_end(self._buf, self._call.unused_params(), final)
        if end.at is None:
            stop = len(self._buf) if end.wait is None else end.wait
            keep = stop - 1 if stop and self._buf[stop - 1] == "\n" else stop
            self._out += self._call.param_text(self._buf[:keep])
            self._buf = self._buf[keep:]
            return False
        raw = self._buf[: end.at]
        self._out += self._call.param_text(raw[:-1] if raw.endswith("\n") else raw)
        self._out += self._call.end_param()
        self._buf, self._state = self._buf[end.resume :], end.state
        self.recovered += end.recovered
        if end.state == "between":
            self._end_call()
        return True

    def _end_call(self) -> None:
        assert self._call is not None
        self._out += self._call.close()
        self._call = None

    def _step_call_close(self) -> bool:
        return self._skip_tag(CALL_CLOSE, "between")

    def _step_between(self) -> bool:
        if self._think_open:
            s = self._buf.lstrip()
            if not s or (THINK_END.startswith(s) and s != THINK_END):
                self._buf = s
                return False
            self._think_open = False
            if s.startswith(THINK_END):
                self._buf = s[len(THINK_END) :]
                return True
        return self._skip_tag(CALL_OPEN, "call_open", otherwise="text")

    def _skip_tag(self, tag: str, next_state: str, otherwise: str | None = None) -> bool:
        """Skip whitespace and `tag`; on anything else go to `otherwise` (default: the
        same next state, i.e. the tag was optional)."""
        s = self._buf.lstrip()
        if not s or (tag.startswith(s) and len(s) < len(tag)):
            self._buf = s
            return False
        if s.startswith(tag):
            self._buf, self._state = s[len(tag) :], next_state
        else:
            self._buf, self._state = s, otherwise or next_state
        return True

    def _close_call_open(self) -> None:
        name, _ = self._tag_name(FUNC_OPEN, final=True)
        if name:
            self._start_call(name)
            self._end_call()
        else:
            self._emit(TextDelta, (CALL_OPEN + self._buf).rstrip())

    def _close_params(self) -> None:
        self._end_call()

    def _close_value_start(self) -> None:
        self._close_value()

    def _close_value(self) -> None:
        if self._value(final=True):
            if self._state == "params":
                self._end_call()
            return
        assert self._call is not None
        self._out += self._call.end_param()  # the held newline is the template's, not the value's
        self._end_call()
