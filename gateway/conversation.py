"""One protocol-neutral conversation: what every protocol adapter parses a request into.

The three protocols (Anthropic Messages, OpenAI Responses, Chat Completions) differ in
shape, not in meaning: a system prompt, tool schemas, and a list of messages where the
assistant reasons, answers and calls tools, and tool results come back. The renderer
only ever sees this form.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

Role = Literal["system", "user", "assistant", "tool"]


class Tool(msgspec.Struct, frozen=True, kw_only=True):
    """A tool the model may call.

    `kind="function"`: `parameters` is a JSON schema of the arguments object.
    `kind="custom"`: a Codex free-form tool; the model writes raw text (`format` holds the
    client's grammar description, kept for the record). `namespace` is set for tools that
    a Responses `namespace` tool grouped."""

    name: str
    description: str = ""
    parameters: dict = msgspec.field(default_factory=lambda: {"type": "object", "properties": {}})
    kind: Literal["function", "custom"] = "function"
    format: dict | None = None
    namespace: str | None = None


class ToolCall(msgspec.Struct, frozen=True, omit_defaults=True):
    """One tool call, wherever it travels: in a request's history, in a generation's events,
    in a forced output and in a recording.

    `arguments` for function tools, `input` (raw text) for custom tools; exactly one of the
    two is set. `id` is the call's id on the wire; recorded and forced calls have none ("").
    Encoded as ``{"name", "arguments"}`` (the record format), with `input` and `id` only
    where set."""

    name: str
    arguments: dict | None = None
    input: str | None = None
    id: str = ""

    @property
    def is_custom(self) -> bool:
        return self.input is not None

    @property
    def wire_arguments(self) -> str:
        """The arguments as OpenAI's wire carries them: compact JSON text, or the raw input."""
        if self.input is not None:
            return self.input
        return msgspec.json.encode(self.arguments or {}).decode()


class Message(msgspec.Struct, frozen=True, kw_only=True):
    """One message. Fields used per role:

    - system/user: `content`.
    - assistant: `reasoning` (may be empty), `content`, `tool_calls`, `memo_handle`
      (the opaque string the gateway issued with this message: Anthropic thinking
      `signature` or Responses reasoning `encrypted_content`).
    - tool: `tool_call_id`, `content` (the result text), `is_error`, `name` when known.
    """

    role: Role
    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    memo_handle: str | None = None
    tool_call_id: str | None = None
    name: str | None = None
    is_error: bool = False


class AssistantOutput(msgspec.Struct, frozen=True):
    """What the model answered one request with, independent of protocol: the `ft_forced_output`
    request field (the engine teacher-forces exactly this message) and the `output` of a record
    line (`gateway.record`), which a replay sends back as that field."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] = []

    def to_forced(self) -> dict[str, Any]:
        """The `ft_forced_output` value (plain JSON types)."""
        return msgspec.to_builtins(self)

    def to_message(self, call_id_prefix: str = "call_forced_") -> Message:
        """The assistant message to render (see `Renderer.render_generation`); calls get ids."""
        calls = tuple(
            msgspec.structs.replace(
                c, id=f"{call_id_prefix}{i}", arguments=None if c.is_custom else (c.arguments or {})
            )
            for i, c in enumerate(self.tool_calls)
        )
        return Message(
            role="assistant", reasoning=self.reasoning or "", content=self.content or "", tool_calls=calls
        )


class GenerationParams(msgspec.Struct, frozen=True, kw_only=True):
    """Sampling and output options; `None` means the server default.

    `tool_choice`: "auto", "none", "required", or a tool name that must be called.
    `enable_thinking=False` renders Qwen's empty think block into the prompt."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True
    enable_thinking: bool = True


class Conversation(msgspec.Struct, frozen=True, kw_only=True):
    """A parsed request.

    `system` holds the leading system text as blocks (joined with "\\n" when rendered);
    `messages` the rest in order (a `system` message here is one the client placed
    mid-conversation). `notes` lists what the adapter accepted but ignored."""

    model: str = ""
    system: tuple[str, ...] = ()
    tools: tuple[Tool, ...] = ()
    messages: tuple[Message, ...] = ()
    params: GenerationParams = GenerationParams()
    forced_output: AssistantOutput | None = None
    notes: tuple[str, ...] = ()

    @property
    def system_text(self) -> str:
        return "\n".join(self.system)

    def tool(self, name: str) -> Tool | None:
        """The tool called `name`, if any."""
        return next((t for t in self.tools if t.name == name), None)
