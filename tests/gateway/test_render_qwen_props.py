"""Property tests of QwenRenderer on generated conversations: template text, token-exact
segments, and prefix stability when a tool result is appended."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.anchors import anchor_chain, root_anchor
from gateway.conversation import Conversation, GenerationParams, Message, Tool, ToolCall
from gateway.render import segment_ids
from gateway.render.qwen import QwenRenderer
from gateway.tokenizer import QwenTokenizer
from tests.gateway.test_render_qwen import jinja_text

TOK = QwenTokenizer()
RENDERER = QwenRenderer(TOK)
ROOT = root_anchor("fp", RENDERER.template_id)

words = st.sampled_from(
    ["hello", " world", "\n", "\n\n", "  ", ".", "...", ">", "<", "</", "\t", "é", "漢字", "🦜", "123", "'s", "\r\n",
     "<think>", "</think>", "<tool_call>", "x=1;", "`code`", " \n ", "—"]
)  # fmt: skip
texts = st.lists(words, max_size=8).map("".join)
values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 500) | st.floats(-10, 10, allow_nan=False) | texts,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["a", "b"]), inner, max_size=2)
    ),
    max_leaves=5,
)
calls = st.lists(
    st.builds(
        ToolCall,
        id=st.uuids().map(str),
        name=st.sampled_from(["bash", "read"]),
        arguments=st.dictionaries(st.sampled_from(["cmd", "path", "n"]), values, max_size=3),
    ),
    max_size=2,
)


@st.composite
def conversations(draw) -> Conversation:
    messages = [Message(role="user", content=draw(texts))]
    for _ in range(draw(st.integers(0, 4))):
        turn_calls = draw(calls)
        messages.append(
            Message(
                role="assistant", reasoning=draw(texts), content=draw(texts), tool_calls=tuple(turn_calls)
            )
        )
        messages += [Message(role="tool", tool_call_id=c.id, content=draw(texts)) for c in turn_calls]
        if not turn_calls or draw(st.booleans()):
            messages.append(Message(role=draw(st.sampled_from(["user", "system"])), content=draw(texts)))
    tools = (Tool(name="bash", description=draw(texts)),) if draw(st.booleans()) else ()
    system = tuple(draw(st.lists(texts, max_size=2)))
    return Conversation(
        system=system,
        tools=tools,
        messages=tuple(messages),
        params=GenerationParams(enable_thinking=draw(st.booleans())),
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations())
def test_generated_conversations(conv):
    text = RENDERER.render_text(conv)
    assert text == jinja_text(conv)
    assert segment_ids(RENDERER.render(conv)) == TOK.encode(text)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations(), texts, texts)
def test_appending_a_tool_round_keeps_the_prefix(conv, reasoning, output):
    call = ToolCall(id="new", name="bash", arguments={"cmd": "ls"})
    longer = Conversation(
        system=conv.system,
        tools=conv.tools,
        params=conv.params,
        messages=conv.messages
        + (
            Message(role="assistant", reasoning=reasoning, tool_calls=(call,)),
            Message(role="tool", tool_call_id="new", content=output),
        ),
    )
    before = anchor_chain(RENDERER.render(conv), ROOT)[:-1]
    assert anchor_chain(RENDERER.render(longer), ROOT)[: len(before)] == before
