"""Conversation → segments of token ids, in the model's chat format.

A `Segment` is a contiguous run of prompt tokens with one meaning; the template's glue
tokens belong to the segment they open or close. Renderers tokenize per segment, and
choose boundaries where BPE cannot merge across them, so the concatenated segment ids
equal the tokenization of the whole rendered prompt and a change inside one segment
never changes the tokens of an earlier one.

Two renderers share the `Renderer` interface: `QwenRenderer` (presets; Python, exact
Qwen3.6 template text, fine-grained segments) and `JinjaRenderer` (model folders with a
chat template; one segment per message, found by rendering growing prefixes).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from gateway.render.segment import Segment, SegmentKind, segment_ids

__all__ = ["Renderer", "Segment", "SegmentKind", "load_renderer", "segment_ids"]

if TYPE_CHECKING:
    from gateway.conversation import Conversation, Message
    from gateway.memo import TokenMemo
    from gateway.tokenizer import Tokenizer


class Renderer(Protocol):
    """Renders conversations for one model (template + tokenizer).

    `template_id` names the template and tokenizer exactly (feeds the root anchor)."""

    template_id: str
    tokenizer: Tokenizer

    def render(self, conv: Conversation, memo: TokenMemo | None = None) -> list[Segment]:
        """Segments of the whole prompt, ending with the generation prompt. With a memo,
        assistant messages it knows use the generated ids (see gateway/memo.py)."""
        ...

    def render_text(self, conv: Conversation) -> str:
        """The prompt as text: exactly the chat template's output (with generation prompt)."""
        ...

    def render_generation(self, conv: Conversation, message: Message) -> list[int]:
        """The ids a model would generate to produce `message` as the reply to `conv`:
        what follows the generation prompt, through the end-of-turn token."""
        ...

    def generation_segments(self, token_ids: list[int], message_index: int) -> list[Segment]:
        """Generated ids (through end-of-turn) as segments, exactly as `render` will
        segment them once this message comes back in the history (memo hit)."""
        ...


def load_renderer(model_dir: str | Path | None = None, tokenizer: Tokenizer | None = None) -> Renderer:
    """The renderer for a model folder: its own chat template when it has one
    (`chat_template.jinja` or `tokenizer_config.json`, a GGUF's metadata), else Qwen3.6 (presets)."""
    from engine.gguf_loader import is_gguf
    from engine.gguf_tokenizer import gguf_chat_template
    from gateway.render.generic import JinjaRenderer, find_chat_template
    from gateway.render.qwen import QwenRenderer, template_source
    from gateway.tokenizer import load_tokenizer

    tokenizer = tokenizer or load_tokenizer(model_dir)
    source = find_chat_template(model_dir) if model_dir is not None else None
    if model_dir is not None and is_gguf(model_dir):  # its metadata's template; Qwen3.6's → QwenRenderer
        source = gguf_chat_template(model_dir)
        source = None if source == template_source() else source
    if source is None:
        return QwenRenderer(tokenizer)
    return JinjaRenderer(source, tokenizer)
