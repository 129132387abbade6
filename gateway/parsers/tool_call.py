"""One tool call being assembled: turns parameter pieces into argument events."""

from __future__ import annotations

from typing import Any

from gateway.events import Event, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from gateway.parsers.values import convert, encode_json, escape_fragment, is_verbatim, param_type


class ToolCallBuilder:
    """Builds one call's events. Function tools stream compact JSON of the arguments
    object (string values progressively, typed values when complete); custom tools
    stream the raw text of their first parameter.

    A string-typed value stays the text the model wrote even when that text is JSON (an
    object, a number, a quoted string): the schema says the tool wants a string, and the
    template writes a string argument verbatim, so decoding it would not round-trip."""

    def __init__(self, index: int, call_id: str, name: str, schema: dict | None, custom: bool, known: bool):
        self.index, self.name, self.custom = index, name, custom
        self._schema, self._known = schema, known
        self.start = ToolCallStart(index, call_id, name, custom)
        self._args: dict[str, Any] = {}
        self._input: str | None = None
        self._param = ""
        self._type: str | list | None = None
        self._verbatim = True
        self._raw: list[str] = []
        self._skip = False
        self._n_params = 0

    def unused_params(self) -> list[str]:
        """The schema's parameters this call has not given yet (nor the current one)."""
        props = self._schema.get("properties") if isinstance(self._schema, dict) else None
        if not isinstance(props, dict):
            return []
        return [p for p in props if p not in self._args and p != self._param]

    def open(self) -> list[Event]:
        events: list[Event] = [self.start]
        return events if self.custom else events + [self._delta("{")]

    def begin_param(self, name: str) -> list[Event]:
        self._param, self._raw = name, []
        self._type = param_type(self._schema, name)
        self._verbatim = is_verbatim(self._type, self._known)
        if self.custom:
            self._skip = self._input is not None
            return []
        sep = "," if self._n_params else ""
        self._n_params += 1
        head = sep + encode_json(name) + ":"
        return [self._delta(head + '"' if self._verbatim else head)]

    def param_text(self, text: str) -> list[Event]:
        """More of the current value; streamed now when the value is a verbatim string."""
        self._raw.append(text)
        if not text or self._skip or not (self._verbatim or self.custom):
            return []
        return [self._delta(text if self.custom else escape_fragment(text))]

    def end_param(self) -> list[Event]:
        raw = "".join(self._raw)
        if self.custom:
            if not self._skip:
                self._input = raw
            return []
        value = raw if self._verbatim else convert(raw, self._type)
        self._args[self._param] = value
        return [self._delta('"' if self._verbatim else encode_json(value))]


    def close(self) -> list[Event]:
        if self.custom:
            return [ToolCallEnd(self.index, self._input or "")]
        return [self._delta("}"), ToolCallEnd(self.index, dict(self._args))]

    def _delta(self, text: str) -> ToolCallArgsDelta:
        return ToolCallArgsDelta(self.index, text)


def whole_call(index: int, call_id: str, name: str, arguments: dict) -> list[Event]:
    """The events of a function call known whole at once (a recovered Hermes-form call)."""
    return [
        ToolCallStart(index, call_id, name),
        ToolCallArgsDelta(index, encode_json(arguments)),
        ToolCallEnd(index, arguments),
    ]
