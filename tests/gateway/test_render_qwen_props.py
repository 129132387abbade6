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

MARKUP = ["<think>", "</think>", "<tool_call>"]
words = st.sampled_from(
    [
        *["hello", " world", "\n", "\n\n", "  ", ".", "...", ">", "<", "</", "\t", "é", "漢字", "🦜", "123", "'s"],
        *["\r\n", *MARKUP, "<|im_start|>", "<|im_end|>", "x=1;", "`code`", " \n ", "—", "\ufdd0"],
    ]
)
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
    """The model sees the template's text; its special-token ids are the template's markup only
    (and the model's own markup in assistant messages); content without special-token text
    tokenizes as the whole text does."""
    text = RENDERER.render_text(conv)
    assert text == jinja_text(conv)
    ids = segment_ids(RENDERER.render(conv))
    assert TOK.decode(ids) == text
    markup = TOK.encode(jinja_text(neutral(conv)))
    specials = set(TOK.special_ids.values())
    assert [i for i in ids if i in specials] == [i for i in markup if i in specials]
    if neutral(conv) == conv:
        assert ids == TOK.encode(text)


def neutral(conv: Conversation) -> Conversation:
    """`conv` with special-token text in its content replaced by plain text, except the model's
    markup in assistant content and reasoning."""

    def plain(text: str, answer: bool = False) -> str:
        for s in ("<|im_start|>", "<|im_end|>") if answer else ("<|im_start|>", "<|im_end|>", *MARKUP):
            text = text.replace(s, "x")
        return text

    def value(v):
        if isinstance(v, str):
            return plain(v)
        if isinstance(v, dict):
            return {k: value(x) for k, x in v.items()}
        return [value(x) for x in v] if isinstance(v, list) else v

    def message(m: Message) -> Message:
        answer = m.role == "assistant"
        calls = tuple(ToolCall(id=c.id, name=c.name, arguments=value(c.arguments)) for c in m.tool_calls)
        return Message(
            role=m.role, content=plain(m.content, answer), reasoning=plain(m.reasoning, answer),
            tool_calls=calls, tool_call_id=m.tool_call_id,
        )

    return Conversation(
        system=tuple(map(plain, conv.system)),
        tools=tuple(Tool(name=t.name, description=plain(t.description)) for t in conv.tools),
        messages=tuple(map(message, conv.messages)),
        params=conv.params,
    )


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
