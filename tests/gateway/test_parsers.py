"""QwenParser: rendered Qwen output, split anywhere, parses back to what was rendered."""

from __future__ import annotations

import itertools

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.events import (
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    collect,
)
from gateway.parsers import QwenParser

TOOLS = {
    "Bash": {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}}},
    "Edit": {
        "type": "object",
        "properties": {
            "path": {"type": "string"},
            "replace_all": {"type": "boolean"},
            "edits": {"type": "array"},
            "opts": {"type": "object"},
            "ratio": {"type": "number"},
        },
    },
}
CUSTOM = {"apply_patch"}
TYPED = {
    "timeout": st.integers(-(10**6), 10**6),
    "replace_all": st.booleans(),
    "ratio": st.floats(-1e6, 1e6),
    "edits": st.lists(st.integers() | st.text(max_size=5), max_size=3),
    "opts": st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
}

ALPHABET = st.sampled_from(
    list('ab <>/=\n"\\é{}') + ["</think>", "<tool_call>", "</parameter>", "<function=x>"]
)


def free_text(banned: list[str], strip: str | None) -> st.SearchStrategy[str]:
    raw = st.lists(ALPHABET, max_size=12).map("".join)
    return raw.map(lambda s: _remove(s, banned).strip(strip))


def _remove(s: str, banned: list[str]) -> str:
    while any(b in s for b in banned):
        for b in banned:
            s = s.replace(b, "")
    return s


@st.composite
def tool_calls(draw):
    name = draw(st.sampled_from([*TOOLS, "apply_patch", "unknown_tool"]))
    if name == "apply_patch":
        return name, draw(free_text(["</parameter>"], None))
    params = list(TOOLS.get(name, {"properties": {"a": 0, "b": 0}})["properties"])
    args = {}
    for p in draw(st.lists(st.sampled_from(params), unique=True, max_size=4)):
        args[p] = draw(TYPED[p]) if p in TYPED else draw(free_text(["</parameter>"], None))
    return name, args


def render(reasoning: str | None, text: str, calls: list) -> str:
    out = "" if reasoning is None else reasoning + "\n</think>\n\n"
    out += text
    for i, (name, args) in enumerate(calls):
        out += ("\n\n" if text else "") if i == 0 else "\n"
        out += f"<tool_call>\n<function={name}>\n"
        items = {"input": args}.items() if isinstance(args, str) else args.items()
        for k, v in items:
            value = v if isinstance(v, str) else msgspec.json.encode(v).decode()
            out += f"<parameter={k}>\n{value}\n</parameter>\n"
        out += "</function>\n</tool_call>"
    return out


def parse(chunks: list[str], reasoning: bool = True) -> list:
    p = QwenParser(TOOLS, custom_tools=CUSTOM, reasoning=reasoning, call_id=_ids())
    events = [e for c in chunks for e in p.feed(c)]
    return events + p.close()


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


@settings(max_examples=400, deadline=None)
@given(
    reasoning=st.none() | free_text(["</think>"], "\n"),
    text=free_text(["<tool_call>"], None),
    calls=st.lists(tool_calls(), max_size=3),
    cuts=st.lists(st.integers(0, 400), max_size=30),
)
def test_roundtrip_any_split(reasoning, text, calls, cuts):
    rendered = render(reasoning, text, calls)
    events = parse(split(rendered, cuts), reasoning=reasoning is not None)
    got = collect(events)
    assert got.reasoning == (reasoning or "")
    assert got.text == text
    assert [(c.name, c.input if c.is_custom else c.arguments) for c in got.tool_calls] == calls
    for i, c in enumerate(got.tool_calls):
        assert streamed_arguments(events, i) == c.wire_arguments
    assert _merged(events) == _merged(parse([rendered], reasoning=reasoning is not None))


def streamed_arguments(events, index: int) -> str:
    """The concatenated argument deltas of tool call `index`: what a streaming client holds."""
    return "".join(e.text for e in events if isinstance(e, ToolCallArgsDelta) and e.index == index)


def _merged(events):
    """Adjacent deltas of one kind joined: the split-independent form of a stream."""
    out = []
    for e in events:
        if out and type(e) is type(out[-1]) and isinstance(e, (ReasoningDelta, TextDelta)):
            out[-1] = type(e)(out[-1].text + e.text)
        elif out and isinstance(e, ToolCallArgsDelta) and isinstance(out[-1], ToolCallArgsDelta):
            out[-1] = ToolCallArgsDelta(e.index, out[-1].text + e.text)
        else:
            out.append(e)
    return out


JUNK = st.lists(
    st.sampled_from(
        list("ab \n>")
        + [
            "<tool_call>",
            "</tool_call>",
            "<function=",
            "</function>",
            "<parameter=",
            "</parameter>",
            "</think>",
            "<function=Bash>",
            "<parameter=timeout>",
            "<parameter=command>",
            '{"name": "Bash", "arguments": {"command": "ls"}}',
            '"',
            "{",
            "\n",
            "<",
            "</",
        ]
    ),
    max_size=40,
).map("".join)


@settings(max_examples=400, deadline=None)
@given(text=JUNK, cuts=st.lists(st.integers(0, 300), max_size=30), reasoning=st.booleans())
def test_malformed_never_raises_and_is_split_independent(text, cuts, reasoning):
    events = parse(split(text, cuts), reasoning)
    assert _merged(events) == _merged(parse([text], reasoning))
    starts = [e.index for e in events if isinstance(e, ToolCallStart)]
    ends = [e.index for e in events if isinstance(e, ToolCallEnd)]
    assert starts == ends == list(range(len(starts)))


def test_an_empty_value_closed_across_chunks():
    """`<parameter=timeout></parameter>` with the closing tag split after its '<': the value stays
    empty (the close without the template's leading newline is held back too)."""
    text = "<tool_call><function=Bash><parameter=timeout></parameter>"
    assert _merged(parse([text[:46], text[46:]], False)) == _merged(parse([text], False))


def test_qwen_example_streams_string_arguments_progressively():
    text = (
        "Let me run it.\n</think>\n\nRunning.\n\n<tool_call>\n<function=Bash>\n<parameter=command>\necho hi\n"
    )
    p = QwenParser(TOOLS, call_id=lambda: "call_1")
    events = p.feed(text)
    assert events[:2] == [ReasoningDelta("Let me run it."), TextDelta("Running.")]
    assert events[2] == ToolCallStart(0, "call_1", "Bash", False)
    assert "".join(e.text for e in events[3:]) == '{"command":"echo hi'
    rest = (
        p.feed("</parameter>\n<parameter=timeout>\n30\n</parameter>\n</function>\n</tool_call>") + p.close()
    )
    assert rest[-1] == ToolCallEnd(0, {"command": "echo hi", "timeout": 30})


def test_tag_split_across_chunks_is_held_back():
    p = QwenParser()
    assert p.feed("abc</thi") == [ReasoningDelta("abc")]
    assert p.feed("nk>\n\nhi") == [TextDelta("hi")]


def test_schema_typing_falls_back_to_string():
    out = parse(
        [
            "x</think>\n\n<tool_call>\n<function=Bash>\n<parameter=timeout>\nsoon\n</parameter>\n"
            "<parameter=command>\n42\n</parameter>\n</function>\n</tool_call>"
        ]
    )
    assert collect(out).tool_calls[0].arguments == {"timeout": "soon", "command": "42"}


def test_jinja_style_booleans():
    out = parse(
        ["<tool_call>\n<function=Edit>\n<parameter=replace_all>\nTrue\n</parameter>\n</function>"],
        reasoning=False,
    )
    assert collect(out).tool_calls[0].arguments == {"replace_all": True}


def test_truncated_generation_closes_open_call():
    out = parse(["r</think>\n\n<tool_call>\n<function=Bash>\n<parameter=command>\nls -l"])
    call = collect(out).tool_calls[0]
    assert (
        call.arguments == {"command": "ls -l"} and msgspec.json.decode(streamed_arguments(out, 0)) == call.arguments
    )


def test_reasoning_without_end_stays_reasoning():
    assert collect(parse(["still thinking <tool_call>\n"])).reasoning == "still thinking <tool_call>"
