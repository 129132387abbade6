"""The official anthropic and openai SDKs against the live server: streaming and not, with
tools and reasoning (outputs teacher-forced so the random preset answers meaningfully)."""

from __future__ import annotations

import anthropic
import openai
import pytest

FORCED_CALL = {"reasoning": "The user wants the date.", "content": "Checking.",
               "tool_calls": [{"name": "get_date", "arguments": {"timezone": "UTC"}}]}
FORCED_TEXT = {"reasoning": "Simple.", "content": "Hello there!"}
SCHEMA = {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}


@pytest.fixture(scope="module")
def anthropic_client(live_server):
    return anthropic.Anthropic(base_url=live_server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def openai_client(live_server):
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0)


def _anthropic_args(forced):
    return dict(model="tiny", max_tokens=64, messages=[{"role": "user", "content": "What's the date?"}],
                tools=[{"name": "get_date", "description": "today's date", "input_schema": SCHEMA}],
                extra_body={"ft_forced_output": forced})


def test_anthropic_tool_use_not_streamed(anthropic_client):
    msg = anthropic_client.messages.create(**_anthropic_args(FORCED_CALL))
    kinds = [b.type for b in msg.content]
    assert kinds == ["thinking", "text", "tool_use"] and msg.stop_reason == "tool_use"
    assert msg.content[0].thinking == "The user wants the date." and msg.content[0].signature
    assert msg.content[2].name == "get_date" and msg.content[2].input == {"timezone": "UTC"}
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens > 0


def test_anthropic_streamed_round_trip_restores_the_generation(anthropic_client):
    with anthropic_client.messages.stream(**_anthropic_args(FORCED_CALL)) as stream:
        first = stream.get_final_message()
    tool = first.content[-1]
    args = _anthropic_args(FORCED_TEXT)
    args["messages"] = [*args["messages"], {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool.id, "content": "2026-11-29"}]}]
    with anthropic_client.messages.stream(**args) as stream:
        second = stream.get_final_message()
    assert [b.type for b in second.content] == ["thinking", "text"] and second.content[1].text == "Hello there!"
    assert second.stop_reason == "end_turn"
    total = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens > 0.6 * total  # the first request and its generation restored


def test_anthropic_count_tokens(anthropic_client):
    count = anthropic_client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "hello"}])
    assert count.input_tokens > 3


def _responses_args(forced, stream):
    return dict(model="tiny", input="What's the date?", stream=stream, extra_body={"ft_forced_output": forced},
                tools=[{"type": "function", "name": "get_date", "description": "date", "parameters": SCHEMA}])


def test_responses_function_call_streamed_and_not(openai_client):
    plain = openai_client.responses.create(**_responses_args(FORCED_CALL, False))
    types = [item.type for item in plain.output]
    assert types == ["reasoning", "message", "function_call"]
    call = plain.output[-1]
    assert call.name == "get_date" and call.arguments == '{"timezone":"UTC"}'
    events = list(openai_client.responses.create(**_responses_args(FORCED_CALL, True)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    completed = events[-1].response
    assert [i.type for i in completed.output] == types
    assert completed.usage.input_tokens_details.cached_tokens > 0  # same prompt as the first request


def test_chat_completions_streamed_with_usage_and_reasoning(openai_client):
    stream = openai_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True, stream_options={"include_usage": True},
        extra_body={"ft_forced_output": FORCED_TEXT})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert text == "Hello there!" and reasoning == "Simple."
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_chat_completions_tool_call_not_streamed(openai_client):
    out = openai_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "date?"}],
        tools=[{"type": "function", "function": {"name": "get_date", "parameters": SCHEMA}}],
        extra_body={"ft_forced_output": FORCED_CALL})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "get_date"


def test_sampling_without_forcing_respects_max_tokens(openai_client):
    out = openai_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=5, temperature=0.8, seed=1)
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"


def test_stop_strings_end_the_answer_before_the_match(openai_client, anthropic_client):
    forced = {"reasoning": "ok", "content": "Hello there! Goodbye now."}
    out = openai_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                stop=["Good"], extra_body={"ft_forced_output": forced})
    assert out.choices[0].message.content == "Hello there! " and out.choices[0].finish_reason == "stop"
    msg = anthropic_client.messages.create(model="tiny", max_tokens=64, stop_sequences=["Good"],
                                           messages=[{"role": "user", "content": "hi"}],
                                           extra_body={"ft_forced_output": forced})
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "Good"
    assert msg.content[-1].text == "Hello there! "
