"""`QwenRenderer`: the Qwen3.5/3.6 chat format (presets), rendered and tokenized per segment.

Its text is identical to templates/qwen3_6.jinja on the whole conversation (tested on
every captured client request and every SWE-agent turn). Pieces come from
`qwen_text`; each is tokenized alone. A cut where BPE could merge across (any cut not
at a special token's edge and not "newline | non-space") is merged away before
tokenizing, so the concatenated ids always equal tokenizing the whole prompt.

Content is escaped before it is rendered and tokenized as text (gateway/render/content.py):
only the template's own markup becomes special-token ids.

Memo: an assistant message whose reasoning the template keeps, and that the memo
knows, is replaced by the generated ids (see gateway/memo.py); messages whose
reasoning Qwen's rule drops are always rendered from text.
"""

from __future__ import annotations

from importlib import resources

import xxhash

from gateway.conversation import Conversation, Message
from gateway.memo import TokenMemo
from gateway.render.content import ContentText
from gateway.render.qwen_text import (
    GEN_NO_THINK,
    GEN_THINK,
    IM_END,
    Piece,
    assistant_pieces,
    attach_newlines,
    conversation_pieces,
    header_pieces,
    last_query_index,
)
from gateway.render.segment import Segment
from gateway.tokenizer import Tokenizer

TEMPLATE_FILE = "qwen3_6.jinja"
BOUNDARY_SPECIALS = (
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)


def template_source() -> str:
    """The Jinja source this renderer reproduces."""
    return resources.files("gateway.render").joinpath("templates", TEMPLATE_FILE).read_text()


class QwenRenderer:
    """Qwen3.6 renderer. `preserve_thinking=True` keeps every assistant message's
    reasoning (Qwen3.6's template switch); the default follows Qwen's rule."""

    def __init__(self, tokenizer: Tokenizer, preserve_thinking: bool = False):
        self.tokenizer = tokenizer
        self.preserve_thinking = preserve_thinking
        self._specials = tuple(s for s in BOUNDARY_SPECIALS if s in tokenizer.special_ids)
        self.content = ContentText(tokenizer)
        digest = xxhash.xxh3_64_hexdigest(template_source().encode())
        self.template_id = f"qwen3_6/{digest}/preserve={int(preserve_thinking)}/{tokenizer.name}"
        self._think_end = tokenizer.special_ids["</think>"]
        self._call_open = tokenizer.special_ids["<tool_call>"]
        self._call_close = tokenizer.special_ids["</tool_call>"]

    def render_text(self, conv: Conversation) -> str:
        pieces = attach_newlines(conversation_pieces(self.content.conversation(conv), self.preserve_thinking))
        return self.content.unescape("".join(p.text for p in pieces))

    def render(self, conv: Conversation, memo: TokenMemo | None = None) -> list[Segment]:
        pieces = attach_newlines(conversation_pieces(self.content.conversation(conv), self.preserve_thinking))
        if memo is not None:
            pieces = self._apply_memo(conv, pieces, memo)
        return [
            Segment(p.kind, p.ids if p.ids is not None else self.content.encode(p.text), p.index)
            for p in self._merge_unsafe(pieces)
        ]

    def render_generation(self, conv: Conversation, message: Message) -> list[int]:
        thinking = conv.params.enable_thinking
        message = self.content.message(message)
        text = "".join(p.text for p in assistant_pieces(message, 0, keep_reasoning=True))
        prompt = GEN_THINK if thinking else GEN_NO_THINK
        if not text.startswith(prompt):  # reasoning given while thinking is off: it cannot be shown
            text = "".join(p.text for p in assistant_pieces(message, 0, keep_reasoning=False))
            text = prompt + text.removeprefix("<|im_start|>assistant\n")
        return self.content.encode(text[len(prompt) :])

    def generation_segments(self, token_ids: list[int], message_index: int) -> list[Segment]:
        """Cut generated ids where the text form is cut: after `</think>`, before each
        `<tool_call>` (a "\\n" between calls goes with the next call)."""
        return self._split_generated(token_ids, message_index)

    def _split_generated(self, ids: list[int], index: int) -> list[Segment]:
        """Cut generated ids where the text form is cut: after `</think>`, before each
        `<tool_call>` (a "\\n" between calls goes with the next call)."""
        out: list[Segment] = []
        start = 0
        kind = "reasoning" if self._think_end in ids else "assistant_text"
        for k, t in enumerate(ids):
            if t == self._think_end:
                out.append(Segment("reasoning", ids[start : k + 1], index))
                start, kind = k + 1, "assistant_text"
            elif (
                t == self._call_open
                and k > start
                and not (kind == "tool_call" and self._only_newlines(ids[start:k]))
            ):
                out.append(Segment(kind, ids[start:k], index))
                start, kind = k, "tool_call"
            elif t == self._call_open:
                kind = "tool_call"
        out.append(Segment(kind, ids[start:], index))
        return [s for s in out if s.token_ids]

    def _only_newlines(self, ids: list[int]) -> bool:
        return self.tokenizer.decode(ids).strip("\n") == ""

    def _apply_memo(self, conv: Conversation, pieces: list[Piece], memo: TokenMemo) -> list[Piece]:
        """Replace each kept-reasoning assistant message the memo knows by its generated
        ids, after a generation prompt of the form it was generated from."""
        last_query = last_query_index(conv.messages)
        replaced: set[int] = set()
        out: list[Piece] = []
        for p in pieces:
            if p.index is not None and p.index in replaced:
                continue
            ids = self._memo_ids(conv, p.index, last_query, memo)
            if ids is None or p.index is None:
                out.append(p)
                continue
            replaced.add(p.index)
            head = ("\n" if p.text.startswith("\n") else "") + (
                GEN_THINK if self._think_end in ids else GEN_NO_THINK
            )
            out.append(Piece("generation_prompt", head, p.index))
            out += [Piece(s.kind, "", p.index, s.token_ids) for s in self._split_generated(ids, p.index)]
        return out

    def _memo_ids(
        self, conv: Conversation, i: int | None, last_query: int, memo: TokenMemo
    ) -> list[int] | None:
        if i is None or conv.messages[i].role != "assistant":
            return None
        if not (self.preserve_thinking or i > last_query):
            return None
        return memo.lookup(conv.messages[i])

    def _safe_cut(self, left: str, right: str) -> bool:
        if left.endswith(self._specials) or right.startswith(self._specials):
            return True
        return left.endswith(("\n", "\r")) and right[:1] != "" and not right[0].isspace()

    def _merge_unsafe(self, pieces: list[Piece]) -> list[Piece]:
        """Join text pieces whose cut BPE might merge across (the right piece's kind wins)."""
        out: list[Piece] = []
        for p in pieces:
            prev = out[-1] if out else None
            if (
                prev is not None
                and prev.ids is None
                and p.ids is None
                and not self._safe_cut(prev.text, p.text)
            ):
                out[-1] = Piece(p.kind, prev.text + p.text, p.index if p.index is not None else prev.index)
            else:
                out.append(p)
        return out


__all__ = ["QwenRenderer", "template_source", "header_pieces", "IM_END"]
