"""The Qwen3.5/3.6 chat format as text pieces, one per future segment.

Joined, the pieces are exactly what templates/qwen3_6.jinja renders with
`add_generation_prompt=True`. Where the pieces are cut:

- a turn's opening "\\n<|im_start|>…" starts a piece: the "\\n" the template writes after
  `<|im_end|>` belongs to the next turn, so a generation's segments end at `<|im_end|>`;
- tools | system: after "</IMPORTANT>\\n\\n" (the system text is trimmed, so a non-space
  character follows a newline: no BPE pre-token can span that cut);
- assistant (reasoning kept): generation prompt `<|im_start|>assistant\\n<think>\\n` |
  reasoning through `</think>` | "\\n\\n" text "\\n\\n" | `<tool_call>…</tool_call>` | …;
  with empty reasoning the first piece is the thinking-off generation prompt
  `<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n` (same text);
- tool results: one piece per `<tool_response>` block of the grouped user turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gateway.conversation import Conversation, Message, ToolCall
from gateway.errors import RenderError
from gateway.render.messages import call_arguments, tool_schema

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
GEN_THINK = "<|im_start|>assistant\n<think>\n"
GEN_NO_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
TOOLS_HEAD = "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>"
TOOLS_TAIL = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified "
    "format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in "
    "natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer "
    "the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>"
)


@dataclass
class Piece:
    """Text of one future segment; `ids` set when the ids are known (memo) and must
    not be re-tokenized."""

    kind: str
    text: str
    index: int | None
    ids: list[int] | None = None


def arg_text(value: object) -> str:
    """A parameter value as the template writes it (`tojson` for objects and arrays,
    else Jinja's `string` filter, i.e. Python's `str`)."""
    if isinstance(value, dict | list | tuple):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def call_text(call: ToolCall) -> str:
    params = "".join(
        f"<parameter={k}>\n{arg_text(v)}\n</parameter>\n" for k, v in call_arguments(call).items()
    )
    return f"<tool_call>\n<function={call.name}>\n{params}</function>\n</tool_call>"


def is_tool_response(text: str) -> bool:
    t = text.strip()
    return t.startswith("<tool_response>") and t.endswith("</tool_response>")


def last_query_index(messages: tuple[Message, ...]) -> int:
    """Index of the last user message that is a real query (Qwen's rule)."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].role == "user" and not is_tool_response(messages[i].content):
            return i
    raise RenderError("No user query found in messages.")


def split_think(m: Message) -> tuple[str, str]:
    """(reasoning, content) as the template derives them, both trimmed as it trims."""
    content = m.content.strip()
    reasoning = m.reasoning
    if not reasoning and "</think>" in content:
        reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
        content = content.split("</think>")[-1].lstrip("\n")
    return reasoning.strip(), content


def header_pieces(conv: Conversation) -> list[Piece]:
    """The system turn: tools block (if any) and system text."""
    system = conv.system_text.strip()
    if conv.tools:
        tools = "".join("\n" + json.dumps(tool_schema(t), ensure_ascii=False) for t in conv.tools)
        if not system:
            return [Piece("tools", TOOLS_HEAD + tools + TOOLS_TAIL + IM_END, None)]
        return [
            Piece("tools", TOOLS_HEAD + tools + TOOLS_TAIL + "\n\n", None),
            Piece("system", system + IM_END, None),
        ]
    if conv.system:
        return [Piece("system", f"{IM_START}system\n{system}{IM_END}", None)]
    return []


def assistant_pieces(m: Message, index: int, keep_reasoning: bool) -> list[Piece]:
    """One assistant message; the last piece ends with `<|im_end|>`."""
    reasoning, content = split_think(m)
    out: list[Piece] = []
    opening = ""
    if keep_reasoning and reasoning:
        out += [
            Piece("generation_prompt", GEN_THINK, index),
            Piece("reasoning", reasoning + "\n</think>", index),
        ]
        lead = "\n\n"
    elif keep_reasoning:
        out.append(Piece("generation_prompt", GEN_NO_THINK, index))
        lead = ""
    else:
        opening, lead = "<|im_start|>assistant\n", ""
    if content:
        sep = "\n\n" if content.strip() and m.tool_calls else ""
        out.append(Piece("assistant_text", opening + lead + content + sep, index))
        opening = lead = ""
    for j, call in enumerate(m.tool_calls):
        prefix = opening + lead if j == 0 else "\n"
        out.append(Piece("tool_call", prefix + call_text(call), index))
    if not content and not m.tool_calls:
        out.append(Piece("assistant_text", opening + lead, index))
    out[-1].text += IM_END
    return out


def tool_piece(conv: Conversation, i: int) -> Piece:
    m = conv.messages[i]
    has_prev = i > 0 or bool(conv.system)
    prev_is_tool = i > 0 and conv.messages[i - 1].role == "tool"
    opening = f"{IM_START}user" if has_prev and not prev_is_tool else ""
    is_last = i == len(conv.messages) - 1 or conv.messages[i + 1].role != "tool"
    text = opening + "\n<tool_response>\n" + m.content.strip() + "\n</tool_response>"
    return Piece("tool_result", text + (IM_END if is_last else ""), i)


def message_pieces(conv: Conversation, i: int, last_query: int, preserve_thinking: bool) -> list[Piece]:
    m = conv.messages[i]
    if m.role == "assistant":
        return assistant_pieces(m, i, preserve_thinking or i > last_query)
    if m.role == "tool":
        return [tool_piece(conv, i)]
    return [Piece(m.role, f"{IM_START}{m.role}\n{m.content.strip()}{IM_END}", i)]


def conversation_pieces(conv: Conversation, preserve_thinking: bool = False) -> list[Piece]:
    """All pieces of the prompt, generation prompt included, before the "\\n" shift."""
    if not conv.messages and not conv.system:
        raise RenderError("No messages provided.")
    last_query = last_query_index(conv.messages)
    pieces = header_pieces(conv)
    for i in range(len(conv.messages)):
        pieces += message_pieces(conv, i, last_query, preserve_thinking)
    pieces.append(
        Piece("generation_prompt", GEN_THINK if conv.params.enable_thinking else GEN_NO_THINK, None)
    )
    return pieces


def attach_newlines(pieces: list[Piece]) -> list[Piece]:
    """Give the "\\n" after each `<|im_end|>` to the turn that follows (in place)."""
    for k, p in enumerate(pieces):
        if k > 0 and p.text.startswith(IM_START):
            p.text = "\n" + p.text
    return pieces
