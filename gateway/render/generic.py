"""`JinjaRenderer`: any model folder's own chat template (Hugging Face conventions).

Segments are found by rendering growing prefixes of the message list (without the
generation prompt) and diffing against the full prompt: where the render of
`messages[:k]` is a prefix of the full render, a segment for message k-1 ends there.

Limits (documented, tested):
- one segment per message (no reasoning / text / tool-call split); the tools block and
  the system prompt come out as one segment with the first message the template puts
  them in;
- a prefix whose render raises (e.g. "No user query found") or is not a prefix of the
  full render (templates that rewrite history, like Qwen dropping earlier reasoning)
  gives no cut: that message is merged into the next segment;
- cuts are moved back over whitespace to the end of a special token, and any cut where
  per-segment tokenization differs from tokenizing the whole prompt is removed, so the
  concatenated ids always equal the whole prompt's ids;
- cost is one template render per message (quadratic in conversation length);
- the token memo is not applied (generated ids are used only by `QwenRenderer`);
- content is escaped before the template renders it and tokenized as text
  (gateway/render/content.py): only the template's own markup becomes special-token ids.
"""

from __future__ import annotations

from pathlib import Path

import jinja2
import xxhash

from gateway.conversation import Conversation, Message
from gateway.errors import RenderError
from gateway.memo import TokenMemo
from gateway.render.content import ContentText
from gateway.render.jinja_env import TemplateRaised, compile_template
from gateway.render.messages import message_dict, template_inputs
from gateway.render.segment import Segment
from gateway.tokenizer import Tokenizer

KIND_OF_ROLE = {"system": "system", "user": "user", "assistant": "assistant_text", "tool": "tool_result"}


def find_chat_template(model_dir: str | Path) -> str | None:
    """`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template` (string, or
    the entry named "default" of a list), else None."""
    import json

    folder = Path(model_dir)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class JinjaRenderer:
    """Renders with a chat template's Jinja source; see the module doc for segmentation."""

    def __init__(self, source: str, tokenizer: Tokenizer, context: dict | None = None):
        self.tokenizer = tokenizer
        self.template = compile_template(source)
        self.context = dict(context or {})
        self.template_id = f"jinja/{xxhash.xxh3_64_hexdigest(source.encode())}/{tokenizer.name}"
        self._specials = tuple(sorted(tokenizer.special_ids, key=len, reverse=True))
        self.content = ContentText(tokenizer)

    def _text(self, messages: list[dict], tools: list[dict] | None, prompt: bool, thinking: bool) -> str:
        kwargs = self.context | ({} if thinking else {"enable_thinking": False})
        try:
            return self.template.render(
                messages=messages, tools=tools, add_generation_prompt=prompt, **kwargs
            )
        except TemplateRaised as e:
            raise RenderError(str(e)) from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise RenderError(f"chat template failed: {e}") from None

    def render_text(self, conv: Conversation) -> str:
        messages, tools = template_inputs(conv)
        return self._text(messages, tools, True, conv.params.enable_thinking)

    def render(self, conv: Conversation, memo: TokenMemo | None = None) -> list[Segment]:
        conv = self.content.conversation(conv)
        messages, tools = template_inputs(conv)
        full = self._text(messages, tools, True, conv.params.enable_thinking)
        cuts = self._cuts(conv, messages, tools, full)
        return self._tokenize(full, cuts)

    def _cuts(
        self, conv: Conversation, messages: list[dict], tools: list[dict] | None, full: str
    ) -> list[tuple]:
        """(end position, kind, message index) per segment, the generation prompt last."""
        offset = 1 if conv.system else 0
        cuts: list[tuple] = []
        for k in range(1, len(messages) + 1):
            try:
                text = self._text(messages[:k], tools, False, conv.params.enable_thinking)
            except RenderError:
                continue
            end = self._snap(full, text, cuts[-1][0] if cuts else 0)
            index = k - 1 - offset
            kind = "system" if index < 0 else KIND_OF_ROLE[conv.messages[index].role]
            if end is not None and (not cuts or end > cuts[-1][0]):
                cuts.append((end, kind, None if index < 0 else index))
        cuts.append((len(full), "generation_prompt", None))
        return cuts

    def _snap(self, full: str, prefix: str, floor: int) -> int | None:
        """Where a segment may end for this prefix render: None if it is not a prefix;
        moved back over whitespace to a special token's end when there is one."""
        if not full.startswith(prefix):
            return None
        end = len(prefix)
        stripped = len(prefix.rstrip())
        if stripped < end and stripped > floor and prefix[:stripped].endswith(self._specials):
            return stripped
        return end

    def _tokenize(self, full: str, cuts: list[tuple]) -> list[Segment]:
        whole = self.content.encode(full)
        while True:
            segments, start = [], 0
            for end, kind, index in cuts:
                segments.append(Segment(kind, self.content.encode(full[start:end]), index))
                start = end
            bad = _first_bad_cut(segments, whole)
            if bad is None:
                return [s for s in segments if s.token_ids]
            del cuts[bad]  # merge segment `bad` into the next one

    def render_generation(self, conv: Conversation, message: Message) -> list[int]:
        conv, message = self.content.conversation(conv), self.content.message(message)
        messages, tools = template_inputs(conv)
        thinking = conv.params.enable_thinking
        prompt = self._text(messages, tools, True, thinking)
        text = self._text(messages + [message_dict(message)], tools, False, thinking)
        if not text.startswith(prompt):
            raise RenderError("this chat template does not render a reply as a continuation of its prompt")
        rest = text[len(prompt) :]
        ends = [
            rest.rfind(t) + len(t) for t in map(self.tokenizer.decode, ([i] for i in self.tokenizer.eos_ids))
        ]
        end = max([e for e in ends if e > 0 and e - 1 < len(rest)] or [len(rest)])
        return self.content.encode(rest[:end])

    def generation_segments(self, token_ids: list[int], message_index: int) -> list[Segment]:
        return [Segment("assistant_text", list(token_ids), message_index)]


def _first_bad_cut(segments: list[Segment], whole: list[int]) -> int | None:
    """The cut to remove: the end of the first segment whose ids differ from the whole
    prompt's ids at its position (its start is a true boundary, so its end is not)."""
    pos = 0
    for k, s in enumerate(segments):
        n = len(s.token_ids)
        if whole[pos : pos + n] != s.token_ids:
            return min(k, len(segments) - 2)
        pos += n
    return None
