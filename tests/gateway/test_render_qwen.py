"""QwenRenderer: exact template text, token-exact segments, stable prefixes, memo."""

from __future__ import annotations

import pytest

from gateway.anchors import anchor_chain, root_anchor
from gateway.conversation import Conversation, GenerationParams, Message, ToolCall
from gateway.memo import TokenMemo
from gateway.render import segment_ids
from gateway.render.jinja_env import compile_template
from gateway.render.messages import template_inputs
from gateway.render.qwen import QwenRenderer, template_source
from gateway.tokenizer import QwenTokenizer
from tests.gateway.test_render_fixtures import all_conversations, trajectory_conversations

TOK = QwenTokenizer()
RENDERER = QwenRenderer(TOK)
CASES = all_conversations()
TEMPLATE = compile_template(template_source())


def jinja_text(conv: Conversation, **kwargs) -> str:
    messages, tools = template_inputs(conv)
    thinking = {} if conv.params.enable_thinking else {"enable_thinking": False}
    return TEMPLATE.render(messages=messages, tools=tools, add_generation_prompt=True, **thinking, **kwargs)


def test_fixtures_present():
    if not CASES:
        pytest.skip("../shared is absent")
    assert len(CASES) > 50


@pytest.mark.parametrize("name,conv", CASES, ids=[n for n, _ in CASES])
def test_text_matches_template_and_ids_match_whole(name, conv):
    text = RENDERER.render_text(conv)
    assert text == jinja_text(conv)
    segments = RENDERER.render(conv)
    assert all(s.token_ids for s in segments)
    assert segment_ids(segments) == TOK.encode(text)
    assert segments[-1].kind == "generation_prompt"


def test_template_matches_transformers_renderer():
    from transformers.utils.chat_template_utils import render_jinja_template

    for _, conv in CASES[:12]:
        messages, tools = template_inputs(conv)
        hf = render_jinja_template(
            [messages], tools=tools, chat_template=template_source(), add_generation_prompt=True
        )
        assert hf[0][0] == RENDERER.render_text(conv)


def _prefix_kept(a: list[bytes], b: list[bytes]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize(
    "name,turns", trajectory_conversations(), ids=[n for n, _ in trajectory_conversations()]
)
def test_next_turn_extends_previous_prompt(name, turns):
    """A turn's prompt (less its generation prompt) is a segment prefix of the next turn."""
    root = root_anchor("fp", RENDERER.template_id)
    for a, b in zip(turns, turns[1:], strict=False):
        chain_a = anchor_chain(RENDERER.render(a), root)
        chain_b = anchor_chain(RENDERER.render(b), root)
        assert _prefix_kept(chain_a, chain_b) >= len(chain_a) - 1


def _tool_turn(extra: tuple[Message, ...] = ()) -> Conversation:
    return Conversation(
        system=("You are helpful.",),
        messages=(Message(role="user", content="list files"),) + extra,
        params=GenerationParams(),
    )


def test_generation_then_history_share_anchors_with_memo():
    """Prompt N + generated segments is an exact prefix of prompt N+1 (memo hit)."""
    call = ToolCall(id="c1", name="bash", arguments={"cmd": "ls -la", "n": 3})
    reply = Message(role="assistant", reasoning="Look first.", content="Listing.", tool_calls=(call,))
    conv_n = _tool_turn()
    generated = RENDERER.render_generation(conv_n, reply)
    memo = TokenMemo()
    handle = memo.remember(reply, generated)
    echoed = Message(
        role="assistant", reasoning="", content="Listing.", tool_calls=(call,), memo_handle=handle
    )
    conv_next = _tool_turn((echoed, Message(role="tool", tool_call_id="c1", content="a\nb")))
    root = root_anchor("fp", RENDERER.template_id)
    prompt_n = RENDERER.render(conv_n)
    chain_gen = anchor_chain(prompt_n + RENDERER.generation_segments(generated, 1), root)
    chain_next = anchor_chain(RENDERER.render(conv_next, memo), root)
    assert chain_next[: len(chain_gen)] == chain_gen
    # without the memo, the echoed message (reasoning omitted) renders differently
    assert anchor_chain(RENDERER.render(conv_next), root)[: len(chain_gen)] != chain_gen


def test_forced_output_equals_history_rendering():
    call = ToolCall(id="c1", name="bash", arguments={"cmd": "echo hi"})
    reply = Message(role="assistant", reasoning="Think.", content="", tool_calls=(call,))
    conv_n = _tool_turn()
    generated = RENDERER.render_generation(conv_n, reply)
    assert generated[-1] == TOK.special_ids["<|im_end|>"]
    conv_next = _tool_turn((reply, Message(role="tool", tool_call_id="c1", content="hi")))
    gen_prompt = RENDERER.render(conv_n)[-1].token_ids
    history = segment_ids([s for s in RENDERER.render(conv_next) if s.message_index == 1])
    assert history == gen_prompt + generated


def test_reasoning_dropped_after_new_user_query():
    reply = Message(role="assistant", reasoning="secret plan", content="done")
    conv = _tool_turn((reply, Message(role="user", content="thanks")))
    assert "secret plan" not in RENDERER.render_text(conv)
    assert "secret plan" in QwenRenderer(TOK, preserve_thinking=True).render_text(conv)
    assert "secret plan" in RENDERER.render_text(_tool_turn((reply,)))


def test_memo_not_used_when_reasoning_is_dropped():
    reply = Message(role="assistant", reasoning="plan", content="done")
    memo = TokenMemo()
    memo.remember(reply, RENDERER.render_generation(_tool_turn(), reply))
    conv = _tool_turn((reply, Message(role="user", content="next")))
    assert RENDERER.render(conv, memo) == RENDERER.render(conv)
    assert memo.hits == 0


def test_empty_reasoning_cut_cannot_merge_newlines():
    """A naive cut after the generation prompt's "<think>\\n" would tokenize "\\n" "\\n"
    where the whole prompt has one "\\n\\n" token; the renderer never cuts there."""
    assert TOK.encode("\n") + TOK.encode("\n") != TOK.encode("\n\n")
    conv = _tool_turn((Message(role="assistant", content="ok"),))
    segments = RENDERER.render(conv)
    assert segment_ids(segments) == TOK.encode(RENDERER.render_text(conv))
    assert [s.kind for s in segments if s.message_index == 1] == ["generation_prompt", "assistant_text"]


def test_unsafe_cut_is_merged():
    """Content that starts with spaces after an inline think block (the template keeps
    them) would let BPE merge across the cut; the renderer joins those pieces."""
    conv = _tool_turn((Message(role="assistant", content="<think>x</think>\n \n  hi"),))
    text = RENDERER.render_text(conv)
    assert text == jinja_text(conv)
    assert segment_ids(RENDERER.render(conv)) == TOK.encode(text)


def test_thinking_disabled_prompt():
    conv = Conversation(
        messages=(Message(role="user", content="hi"),), params=GenerationParams(enable_thinking=False)
    )
    assert RENDERER.render_text(conv).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert RENDERER.render_text(conv) == jinja_text(conv)
