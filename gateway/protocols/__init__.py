"""Protocol adapters: request bodies of each API → one `Conversation`.

`anthropic.parse_request`, `responses.parse_request`, `chat.parse_request` take the
decoded JSON body and return a `Conversation` or raise `BadRequest` naming the field
(`messages[2].content[0].type`). They never raise anything else for any JSON value.
The helpers below are the shared validation vocabulary of the three adapters.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

from gateway.conversation import AssistantOutput, Conversation, GenerationParams, Message, ToolCall
from gateway.errors import BadRequest


def join(path: str, key: str | int) -> str:
    """`messages` + 2 → `messages[2]`; `messages[2]` + `content` → `messages[2].content`."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def kind_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def obj(value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise BadRequest(path, f"expected an object, got {kind_name(value)}")
    return value


def arr(value: Any, path: str) -> list:
    if not isinstance(value, list):
        raise BadRequest(path, f"expected an array, got {kind_name(value)}")
    return value


def string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise BadRequest(path, f"expected a string, got {kind_name(value)}")
    return value


def opt(body: dict, key: str, check: Callable[[Any, str], Any], path: str = "", default: Any = None) -> Any:
    """`body[key]` validated by `check`, or `default` when absent or null."""
    value = body.get(key)
    return default if value is None else check(value, join(path, key))


def req(body: dict, key: str, check: Callable[[Any, str], Any], path: str = "") -> Any:
    """`body[key]` validated by `check`; missing or null is an error."""
    if body.get(key) is None:
        raise BadRequest(join(path, key), "is required")
    return check(body[key], join(path, key))


def integer(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(path, f"expected an integer, got {kind_name(value)}")
    if isinstance(value, float) and not value.is_integer():
        raise BadRequest(path, f"expected an integer, got {value!r}")
    return int(value)


def positive_int(value: Any, path: str) -> int:
    n = integer(value, path)
    if n < 1:
        raise BadRequest(path, "must be at least 1")
    return n


def number(value: Any, path: str) -> float:
    """A finite number (a JSON integer too large for a float is out of range, not a crash)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(path, f"expected a number, got {kind_name(value)}")
    try:
        result = float(value)
    except OverflowError:
        raise BadRequest(path, "is out of range") from None
    if not math.isfinite(result):
        raise BadRequest(path, f"expected a finite number, got {result}")
    return result


# below MIN_TEMPERATURE the scaled logits overflow float32 for no gain over greedy
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 2.0
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes


def temperature(value: Any, path: str) -> float:
    """`temperature`: 0 (greedy) or a sampling temperature in [0.001, 2]."""
    t = number(value, path)
    if t != 0 and not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
        raise BadRequest(path, f"must be 0 (greedy) or between {MIN_TEMPERATURE} and {MAX_TEMPERATURE}")
    return t


def probability(value: Any, path: str) -> float:
    """`top_p`: a number in [0, 1]."""
    p = number(value, path)
    if not 0 <= p <= 1:
        raise BadRequest(path, f"must be between 0 and 1, got {p!r}")
    return p


TOP_K_MAX = (1 << 31) - 1  # above any vocabulary: keeps every token


def top_k(value: Any, path: str) -> int:
    """`top_k`: 0 (off) or how many of the most likely tokens to sample from."""
    n = integer(value, path)
    if not 0 <= n <= TOP_K_MAX:
        raise BadRequest(path, f"must be between 0 (off) and {TOP_K_MAX}")
    return n


def penalty(value: Any, path: str) -> float:
    """`presence_penalty`, `frequency_penalty`: a number in [-2, 2] (OpenAI's range)."""
    x = number(value, path)
    if not -2 <= x <= 2:
        raise BadRequest(path, f"must be between -2 and 2, got {x!r}")
    return x


def seed(value: Any, path: str) -> int:
    """`seed`: an integer a 64-bit generator can take."""
    n = integer(value, path)
    low, high = SEED_RANGE
    if not low <= n <= high:
        raise BadRequest(path, f"must be between {low} and {high}")
    return n


def boolean(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(path, f"expected a boolean, got {kind_name(value)}")
    return value


def stop_list(value: Any, path: str) -> tuple[str, ...]:
    """`stop`: a string or an array of strings."""
    if isinstance(value, str):
        return (value,)
    return tuple(string(s, join(path, i)) for i, s in enumerate(arr(value, path)))


def json_arguments(text: Any, path: str) -> dict:
    """Tool-call arguments sent as a JSON string (OpenAI): must decode to an object."""
    text = string(text, path)
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise BadRequest(path, f"is not valid JSON: {e}") from None
    return obj(value, path)


def check_tool_results(messages: list[Message], path: str) -> None:
    """Every tool result answers a call made earlier in the conversation."""
    called: set[str] = set()
    for i, m in enumerate(messages):
        called.update(c.id for c in m.tool_calls)
        if m.role == "tool" and m.tool_call_id not in called:
            raise BadRequest(join(path, i), f"tool result for unknown tool call id {m.tool_call_id!r}")


def conversation(
    body: dict, system: Sequence[str], messages: Sequence, tools: Sequence, notes: Sequence[str],
    params: GenerationParams,
) -> Conversation:
    """The parsed request: what the protocol read, plus what all three read alike (`model`,
    `ft_forced_output`)."""
    return Conversation(
        model=opt(body, "model", string, default=""),
        system=tuple(system),
        tools=tuple(tools),
        messages=tuple(messages),
        params=params,
        forced_output=forced_output(body),
        notes=tuple(notes),
    )


def forced_output(body: dict) -> AssistantOutput | None:
    """`ft_forced_output` (see notes/CONTRACTS.md), shared by all three protocols."""
    raw = opt(body, "ft_forced_output", obj)
    if raw is None:
        return None
    path = "ft_forced_output"
    calls = []
    for i, c in enumerate(opt(raw, "tool_calls", arr, path, [])):
        p = join(join(path, "tool_calls"), i)
        c = obj(c, p)
        calls.append(
            ToolCall(
                name=req(c, "name", string, p),
                arguments=opt(c, "arguments", obj, p) if "input" not in c else None,
                input=opt(c, "input", string, p),
            )
        )
    return AssistantOutput(
        reasoning=opt(raw, "reasoning", string, path),
        content=opt(raw, "content", string, path),
        tool_calls=calls,
    )


def nonempty(messages: list, path: str) -> None:
    if not messages:
        raise BadRequest(path, "must contain at least one message")


TOOL_CHOICE_MODES = ("auto", "none", "required")


def tool_choice_mode(body: dict) -> str | dict:
    """OpenAI `tool_choice`: a mode string (absent = "auto"), or the object naming a tool,
    which each protocol spells differently."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in TOOL_CHOICE_MODES:
            raise BadRequest("tool_choice", f"unknown tool_choice {choice!r}")
        return choice
    return obj(choice, "tool_choice")
