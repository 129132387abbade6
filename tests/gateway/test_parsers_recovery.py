"""QwenParser on tool calls as Qwen3.5/3.6 write them wrongly: read back as the call meant where
that is unambiguous (checked against the tool schemas), else text, counted; at any split."""

from __future__ import annotations

import itertools

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.events import ToolCallArgsDelta, ToolCallStart, collect
from gateway.parsers import QwenParser
from tests.gateway.test_parsers import JUNK, _merged, split

TOOLS = {
    "Bash": {
        "type": "object",
        "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
        "required": ["command"],
    },
    "Write": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}},
    "Configure": {"type": "object", "properties": {"body": {"type": "object"}}},
}


def run(chunks: list[str], reasoning: bool = False) -> tuple[list, QwenParser]:
    counter = itertools.count()
    p = QwenParser(TOOLS, custom_tools={"apply_patch"}, reasoning=reasoning, call_id=lambda: f"call_{next(counter)}")
    events = [e for c in chunks for e in p.feed(c)]
    return events + p.close(), p


def calls(events: list) -> list[tuple[str, dict | None]]:
    return [(c.name, c.arguments) for c in collect(events).tool_calls]


def streamed(events: list, index: int = 0) -> str:
    return "".join(e.text for e in events if isinstance(e, ToolCallArgsDelta) and e.index == index)


def xml(name: str, params: str) -> str:
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def test_hermes_json_call_of_a_known_tool_is_a_call():
    text = 'Listing.\n\n<tool_call>\n{"name": "Bash", "arguments": {"command": "ls -l", "timeout": 5}}\n</tool_call>'
    events, p = run([text])
    assert calls(events) == [("Bash", {"command": "ls -l", "timeout": 5})]
    assert collect(events).text == "Listing."
    assert msgspec.json.decode(streamed(events)) == {"command": "ls -l", "timeout": 5}
    assert (p.recovered, p.kept_as_text) == (1, 0)


def test_hermes_arguments_as_a_json_string_and_without_closing_tag():
    events, p = run(['<tool_call>\n{"name": "Bash", "arguments": "{\\"command\\": \\"pwd\\"}"}'])
    assert calls(events) == [("Bash", {"command": "pwd"})] and p.recovered == 1


def test_hermes_json_the_schema_refuses_stays_text_and_is_counted():
    for body in (
        '{"name": "Nope", "arguments": {}}',  # no such tool
        '{"name": "Bash", "arguments": {"timeout": 5}}',  # required command missing
        '{"name": "Bash", "arguments": {"command": "ls", "timeout": "soon"}}',  # integer expected
        '{"name": "Bash", "arguments": {"command": "ls"}',  # not JSON
    ):
        text = f"<tool_call>\n{body}\n</tool_call>"
        events, p = run([text])
        assert calls(events) == [] and collect(events).text == text
        assert (p.recovered, p.kept_as_text) == (0, 1)


def test_missing_parameter_close_before_function_close():
    text = xml("Bash", "<parameter=command>\nls -la\n<parameter=timeout>\n30\n</parameter>\n")
    events, p = run([text])
    assert calls(events) == [("Bash", {"command": "ls -la", "timeout": 30})] and p.recovered == 1
    text = xml("Configure", '<parameter=body>\n{"mode": "AIR_CLEAN", "on": true}\n')
    events, p = run([text])
    assert calls(events) == [("Configure", {"body": {"mode": "AIR_CLEAN", "on": True}})] and p.recovered == 1


def test_missing_function_close():
    text = "<tool_call>\n<function=Bash>\n<parameter=command>\nls\n</parameter>\n</tool_call>\n<tool_call>\n" + (
        "<function=Bash>\n<parameter=command>\npwd\n</parameter>\n</function>\n</tool_call>"
    )
    events, p = run([text])
    assert calls(events) == [("Bash", {"command": "ls"}), ("Bash", {"command": "pwd"})] and p.recovered == 1


def test_end_tags_inside_a_value_stay_in_the_value():
    content = "a </function> tag\n<parameter=other>\nand </function>\nmore"
    text = xml("Write", f"<parameter=content>\n{content}\n</parameter>\n")
    events, p = run([text])
    assert calls(events) == [("Write", {"content": content})] and p.recovered == 0


def test_call_opened_inside_the_reasoning():
    text = "I should list the files.\n<tool_call>\n<function=Bash>\n<parameter=command>\nls\n</parameter>\n" + (
        "</function>\n</tool_call>\n</think>\n\n"
    )
    events, p = run([text], reasoning=True)
    got = collect(events)
    assert got.reasoning == "I should list the files." and got.text == ""
    assert calls(events) == [("Bash", {"command": "ls"})] and p.recovered == 1


def test_tool_call_tag_mentioned_in_reasoning_stays_reasoning_and_is_counted():
    text = "The format is <tool_call> then a function.\n</think>\n\nDone."
    events, p = run([text], reasoning=True)
    got = collect(events)
    assert got.reasoning == "The format is <tool_call> then a function." and got.text == "Done."
    assert calls(events) == [] and p.kept_as_text == 1


def test_json_for_a_string_argument_stays_the_string_written():
    for value in ('{"dir": "src", "depth": 2}', "42", "true", '"ls -l"', "[1, 2]"):
        events, p = run([xml("Bash", f"<parameter=command>\n{value}\n</parameter>\n")])
        assert calls(events) == [("Bash", {"command": value})] and (p.recovered, p.kept_as_text) == (0, 0)
        assert msgspec.json.decode(streamed(events)) == {"command": value}


def test_markup_that_is_no_call_stays_text_and_is_counted():
    events, p = run(["<tool_call>\nnot a call"])
    assert calls(events) == [] and collect(events).text == "<tool_call>\nnot a call" and p.kept_as_text == 1


MALFORMED = {
    "hermes": lambda a: '<tool_call>\n{"name": "Bash", "arguments": ' + msgspec.json.encode(a).decode() + "}\n</tool_call>",
    "no_parameter_close": lambda a: xml("Bash", f"<parameter=command>\n{a['command']}\n<parameter=timeout>\n{a['timeout']}\n</parameter>\n"),
    "no_last_parameter_close": lambda a: xml("Bash", f"<parameter=timeout>\n{a['timeout']}\n</parameter>\n<parameter=command>\n{a['command']}\n"),
    "no_function_close": lambda a: "<tool_call>\n<function=Bash>\n" + "".join(
        f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in a.items()) + "</tool_call>",
}
COMMANDS = st.text(alphabet=list("ab -|/\"'{}\\\né<>"), min_size=1, max_size=20).filter(
    lambda s: s.strip() == s and "<parameter=" not in s and "</" not in s
)


@settings(max_examples=300, deadline=None)
@given(
    form=st.sampled_from(sorted(MALFORMED)),
    command=COMMANDS,
    timeout=st.integers(0, 10**6),
    prose=st.sampled_from(["", "Running it.", "Let me check.\n"]),
    in_reasoning=st.booleans(),
    cuts=st.lists(st.integers(0, 300), max_size=25),
)
def test_every_malformed_form_is_the_call_it_meant_at_any_split(form, command, timeout, prose, in_reasoning, cuts):
    args = {"command": command, "timeout": timeout}
    call = MALFORMED[form](args)
    if in_reasoning and form != "hermes":
        text, reasoning = prose + "\n" + call, True
    else:
        text, reasoning = (prose.strip() + "\n</think>\n\n" + call), True
    whole, p = run([text], reasoning)
    assert calls(whole) == [("Bash", args)] and p.recovered >= 1 and p.kept_as_text == 0
    assert msgspec.json.decode(streamed(whole)) == args
    events, _ = run(split(text, cuts), reasoning)
    assert _merged(events) == _merged(whole)
    assert [e.index for e in events if isinstance(e, ToolCallStart)] == [0]


@settings(max_examples=400, deadline=None)
@given(text=JUNK, cuts=st.lists(st.integers(0, 300), max_size=30), reasoning=st.booleans())
def test_the_counts_do_not_depend_on_the_split(text, cuts, reasoning):
    _, whole = run([text], reasoning)
    _, pieces = run(split(text, cuts), reasoning)
    assert (pieces.recovered, pieces.kept_as_text) == (whole.recovered, whole.kept_as_text)
