"""JinjaRenderer: a model folder's own template, segmented by prefix diffing."""

from __future__ import annotations

import json

import pytest

from gateway.anchors import anchor_chain, root_anchor
from gateway.conversation import Conversation, Message, ToolCall
from gateway.errors import RenderError
from gateway.render import load_renderer, segment_ids
from gateway.render.generic import JinjaRenderer, find_chat_template
from gateway.render.qwen import QwenRenderer, template_source
from gateway.tokenizer import QwenTokenizer
from tests.gateway.test_render_fixtures import all_conversations, trajectory_conversations

TOK = QwenTokenizer()
QWEN_JINJA = JinjaRenderer(template_source(), TOK)
CHATML = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CASES = all_conversations()[::2]


@pytest.mark.parametrize("name,conv", CASES, ids=[n for n, _ in CASES])
def test_qwen_template_through_generic_renderer(name, conv):
    text = QWEN_JINJA.render_text(conv)
    assert text == QwenRenderer(TOK).render_text(conv)
    segments = QWEN_JINJA.render(conv)
    assert segment_ids(segments) == TOK.encode(text)
    assert segments[-1].kind == "generation_prompt"


def test_chatml_segments_per_message_and_stable_prefixes():
    renderer = JinjaRenderer(CHATML, TOK)
    root = root_anchor("fp", renderer.template_id)
    for _, turns in trajectory_conversations()[:3]:
        previous: list[bytes] = []
        for conv in turns:
            segments = renderer.render(conv)
            assert segment_ids(segments) == TOK.encode(renderer.render_text(conv))
            assert len(segments) == len(conv.messages) + 2  # system, messages, generation prompt
            chain = anchor_chain(segments, root)
            if previous:
                assert chain[: len(previous) - 1] == previous[:-1]
            previous = chain


def test_segments_end_at_special_tokens():
    renderer = JinjaRenderer(CHATML, TOK)
    conv = Conversation(system=("s",), messages=(Message(role="user", content="hi"),))
    segments = renderer.render(conv)
    assert [TOK.decode(s.token_ids) for s in segments] == [
        "<|im_start|>system\ns<|im_end|>",
        "\n<|im_start|>user\nhi<|im_end|>",
        "\n<|im_start|>assistant\n",
    ]


def test_unsafe_cut_is_removed():
    """A template that glues messages with no separator: a cut between "a" and "b"
    would split one BPE token, so that cut is dropped."""
    renderer = JinjaRenderer("{% for m in messages %}{{ m.content }}{% endfor %}", TOK)
    conv = Conversation(messages=(Message(role="user", content="hel"), Message(role="user", content="lo")))
    assert TOK.encode("hel") + TOK.encode("lo") != TOK.encode("hello")
    segments = renderer.render(conv)
    assert segment_ids(segments) == TOK.encode("hello")


def test_template_errors_become_render_errors():
    conv = Conversation(messages=(Message(role="assistant", content="no user"),))
    with pytest.raises(RenderError):
        QWEN_JINJA.render(conv)
    with pytest.raises(RenderError):
        JinjaRenderer("{{ messages[0].nope.deeper }}", TOK).render_text(conv)


def test_render_generation_matches_history():
    call = ToolCall(id="c", name="f", arguments={"a": 1})
    reply = Message(role="assistant", reasoning="r", content="t", tool_calls=(call,))
    conv = Conversation(messages=(Message(role="user", content="q"),))
    ids = QWEN_JINJA.render_generation(conv, reply)
    assert ids == QwenRenderer(TOK).render_generation(conv, reply)
    assert QWEN_JINJA.generation_segments(ids, 1)[0].token_ids == ids


def test_find_chat_template_and_load_renderer(tmp_path):
    assert find_chat_template(tmp_path) is None
    assert isinstance(load_renderer(tmp_path, TOK), QwenRenderer)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "default", "template": CHATML}]})
    )
    assert find_chat_template(tmp_path) == CHATML
    (tmp_path / "chat_template.jinja").write_text(template_source())
    renderer = load_renderer(tmp_path, TOK)
    assert (
        isinstance(renderer, JinjaRenderer) and renderer.template_id != JinjaRenderer(CHATML, TOK).template_id
    )
