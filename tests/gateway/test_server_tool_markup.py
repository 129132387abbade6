"""Tool calls written wrongly, teacher-forced through the real server (tiny preset, loopback port)
on all three protocols, streamed and not: each malformed form arrives as the call it meant, and
markup that names no tool of the request arrives as text and is counted on /metrics."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

SCHEMA = {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}
CALL = '<tool_call>\n<function=get_date>\n{params}</function>\n</tool_call>'
FORMS = {
    "hermes json": {"content": '<tool_call>\n{"name": "get_date", "arguments": {"timezone": "UTC"}}\n</tool_call>'},
    "no </parameter>": {"content": CALL.format(params="<parameter=timezone>\nUTC\n")},
    "no </function>": {"content": "<tool_call>\n<function=get_date>\n<parameter=timezone>\nUTC\n</parameter>\n</tool_call>"},
    "call in reasoning": {"reasoning": "The user wants the date.\n" + CALL.format(params="<parameter=timezone>\nUTC\n</parameter>\n")},
}
JSON_FOR_A_STRING = '{"zone": "UTC", "dst": false}'  # a string-typed argument the model wrote as JSON
UNKNOWN = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
ARGS = {"timezone": "UTC"}


@pytest.fixture(scope="module")
def anthropic_client(live_server):
    return anthropic.Anthropic(base_url=live_server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def openai_client(live_server):
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0)


def anthropic_answer(client, forced: dict, stream: bool) -> tuple[list, str]:
    """(tool calls as (name, input), text) of one forced answer."""
    args = dict(model="tiny", max_tokens=512, messages=[{"role": "user", "content": "What's the date?"}],
                tools=[{"name": "get_date", "description": "today's date", "input_schema": SCHEMA}],
                extra_body={"ft_forced_output": forced})
    if stream:
        with client.messages.stream(**args) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**args)
    calls = [(b.name, b.input) for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == ("tool_use" if calls else "end_turn")
    return calls, "".join(b.text for b in msg.content if b.type == "text")


def responses_answer(client, forced: dict, stream: bool) -> tuple[list, str]:
    args = dict(model="tiny", input="What's the date?", max_output_tokens=512, extra_body={"ft_forced_output": forced},
                tools=[{"type": "function", "name": "get_date", "description": "date", "parameters": SCHEMA}])
    if stream:
        events = list(client.responses.create(stream=True, **args))
        assert events[-1].type == "response.completed"
        response = events[-1].response
    else:
        response = client.responses.create(**args)
    calls = [(i.name, json.loads(i.arguments)) for i in response.output if i.type == "function_call"]
    text = "".join(c.text for i in response.output if i.type == "message" for c in i.content)
    return calls, text


def chat_answer(client, forced: dict, stream: bool) -> tuple[list, str]:
    args = dict(model="tiny", max_tokens=512, messages=[{"role": "user", "content": "date?"}],
                tools=[{"type": "function", "function": {"name": "get_date", "parameters": SCHEMA}}],
                extra_body={"ft_forced_output": forced})
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
        assert choice.finish_reason == ("tool_calls" if calls else "stop")
        return calls, choice.message.content or ""
    text, names, arguments = "", {}, {}
    for chunk in client.chat.completions.create(stream=True, **args):
        delta = chunk.choices[0].delta if chunk.choices else None
        text += (delta.content or "") if delta else ""
        for c in (delta.tool_calls or []) if delta else []:
            names[c.index] = names.get(c.index, "") + (c.function.name or "")
            arguments[c.index] = arguments.get(c.index, "") + (c.function.arguments or "")
    return [(names[i], json.loads(arguments[i])) for i in sorted(names)], text


PROTOCOLS = {"anthropic": anthropic_answer, "responses": responses_answer, "chat": chat_answer}


def client_for(protocol, anthropic_client, openai_client):
    return anthropic_client if protocol == "anthropic" else openai_client


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_malformed_call_arrives_as_the_call_it_meant(form, protocol, stream, anthropic_client, openai_client):
    client = client_for(protocol, anthropic_client, openai_client)
    calls, text = PROTOCOLS[protocol](client, FORMS[form], stream)
    assert calls == [("get_date", ARGS)] and text == ""


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_json_written_for_a_string_argument_arrives_as_that_string(protocol, anthropic_client, openai_client):
    client = client_for(protocol, anthropic_client, openai_client)
    forced = {"content": CALL.format(params=f"<parameter=timezone>\n{JSON_FOR_A_STRING}\n</parameter>\n")}
    for stream in (False, True):
        assert PROTOCOLS[protocol](client, forced, stream) == ([("get_date", {"timezone": JSON_FOR_A_STRING})], "")


def markup_counts(live_server) -> dict[str, float]:
    with live_server.client() as client:
        exposition = client.get("/metrics").text
    family = next(f for f in text_string_to_metric_families(exposition) if f.name == "ft_tool_call_markup")
    return {s.labels["outcome"]: s.value for s in family.samples if s.name.endswith("_total")}


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_markup_naming_no_tool_of_the_request_is_text_and_counted(protocol, live_server, anthropic_client,
                                                                   openai_client):
    client = client_for(protocol, anthropic_client, openai_client)
    before = markup_counts(live_server)
    calls, text = PROTOCOLS[protocol](client, {"content": UNKNOWN}, False)
    after = markup_counts(live_server)
    assert calls == [] and text == UNKNOWN
    assert after["kept_as_text"] == before["kept_as_text"] + 1 and after["recovered"] == before["recovered"]
