"""Message content is text: special-token text inside it never becomes a control token.

A tool result, a file or a web page may hold `<|im_start|>system …<|im_end|>`; tokenized
with the template's text it would close the turn and open one the client never sent. So
before the template sees a conversation, every special-token text in its content (system
text, messages, reasoning, tool-call names and arguments, tool schemas) is replaced by an
escape: `MARK` and one private-use character naming the token (`MARK MARK` for a `MARK` in
the content). The template renders the escapes like any text; `ContentText.encode` then
tokenizes the rendered text with the template's own special tokens as their ids and each
escape as the token's text, in the same BPE run as the text around it.

The chat template's rules for assistant content are kept: the markup the model itself emits
(`<think>`, `</think>`, `<tool_call>`, `</tool_call>`) stays as it is in an assistant's
content and reasoning, so a replayed answer tokenizes as it was generated (and the token memo
restores the generated ids exactly); a user message that is one `<tool_response>…</tool_response>`
block (Qwen's form of a tool result sent as user text) keeps that outer pair.

Content without special-token text tokenizes exactly as before (`Tokenizer.encode` on the
same text), so anchors and stored checkpoints of such prompts are unchanged.
"""

from __future__ import annotations

import re

import msgspec

from gateway.conversation import Conversation, Message
from gateway.tokenizer import Tokenizer

MARK = "\ufdd0"  # a Unicode noncharacter: free for internal use
CODE_BASE = 0xF0000  # supplementary private use area A: one character per special token
MODEL_MARKUP = frozenset({"<think>", "</think>", "<tool_call>", "</tool_call>"})
TOOL_RESPONSE = ("<tool_response>", "</tool_response>")


class ContentText:
    """Escapes a conversation's content for one tokenizer and tokenizes rendered text."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        specials = sorted(tokenizer.added_ids, key=len, reverse=True)
        self._code = {s: MARK + chr(CODE_BASE + k) for k, s in enumerate(specials)} | {MARK: MARK + MARK}
        self._text = {code[1]: s for s, code in self._code.items()}
        self._all = _alternation([*specials, MARK])
        self._answer = _alternation([s for s in specials if s not in MODEL_MARKUP] + [MARK])
        self._rendered = re.compile(re.escape(MARK) + "(.)|" + _alternation(specials).pattern, re.S)

    def escape(self, text: str, answer: bool = False) -> str:
        """`text` with its special-token text escaped (the model's markup kept if `answer`)."""
        pattern = self._answer if answer else self._all
        return pattern.sub(lambda m: self._code[m.group()], text)

    def conversation(self, conv: Conversation) -> Conversation:
        """`conv` with all its content escaped (the parameters and the model name untouched)."""
        return msgspec.structs.replace(
            conv,
            system=tuple(self.escape(s) for s in conv.system),
            tools=tuple(self._value(t) for t in conv.tools),
            messages=tuple(self.message(m) for m in conv.messages),
        )

    def message(self, m: Message) -> Message:
        """One message escaped: an assistant's own text keeps the model's markup, its calls do not."""
        if m.role == "assistant":
            fields = {f: getattr(m, f) for f in m.__struct_fields__}
            answer = {f: self.escape(v, answer=True) if isinstance(v, str) else self._value(v) for f, v in fields.items()}
            return msgspec.structs.replace(m, **answer)
        escaped = self._value(m)
        if m.role == "user" and _is_tool_response(m.content):
            head, tail = TOOL_RESPONSE
            inner = m.content.strip()[len(head) : -len(tail)]
            escaped = msgspec.structs.replace(escaped, content=head + self.escape(inner) + tail)
        return escaped

    def _value(self, value):
        if isinstance(value, str):
            return self.escape(value)
        if isinstance(value, dict):
            return {self._value(k): self._value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self._value(v) for v in value)
        if isinstance(value, msgspec.Struct):
            return msgspec.structs.replace(value, **{f: self._value(getattr(value, f)) for f in value.__struct_fields__})
        return value

    def encode(self, rendered: str) -> list[int]:
        """Ids of template output: its special-token text as the tokens' ids, escapes as text."""
        if MARK not in rendered:
            return self.tokenizer.encode(rendered)
        ids: list[int] = []
        text: list[str] = []
        pos = 0
        for m in self._rendered.finditer(rendered):
            text.append(rendered[pos : m.start()])
            pos = m.end()
            if m.group(1) is not None:
                text.append(self._text.get(m.group(1), m.group()))
                continue
            ids += self.tokenizer.encode_plain("".join(text))
            text = []
            ids.append(self.tokenizer.added_ids[m.group()])
        text.append(rendered[pos:])
        return ids + self.tokenizer.encode_plain("".join(text))

    def unescape(self, rendered: str) -> str:
        """The text the template would have written from the content as sent."""
        if MARK not in rendered:
            return rendered
        return re.sub(re.escape(MARK) + "(.)", lambda m: self._text.get(m.group(1), m.group()), rendered, flags=re.S)


def _alternation(texts: list[str]) -> re.Pattern:
    if not texts:
        return re.compile("(?!)")
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))


def _is_tool_response(text: str) -> bool:
    t = text.strip()
    head, tail = TOOL_RESPONSE
    return len(t) >= len(head) + len(tail) and t.startswith(head) and t.endswith(tail)
