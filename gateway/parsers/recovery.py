"""Tool calls a model wrote in a form other than the template's, read back where the intent is
unambiguous and checked against the request's tool schemas.

Qwen3.5/3.6 are trained on the qwen3_coder XML form but sometimes write the Hermes form (a JSON
object inside ``<tool_call>``): ``{"name": "bash", "arguments": {"command": "ls"}}``. Such a
call counts only when it names a function tool of the request and its arguments satisfy that
tool's schema (required properties present, declared types matched); anything else stays text.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.parsers.values import matches_type


def hermes_call(text: str, tools: dict[str, dict]) -> tuple[str, dict] | None:
    """(name, arguments) of a Hermes-form call in `text` (the body of ``<tool_call>``), or None
    when it is not one call of a known function tool with arguments its schema accepts."""
    try:
        value = msgspec.json.decode(text.strip())
    except msgspec.DecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(name := value.get("name"), str) or name not in tools:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = msgspec.json.decode(args) if args.strip() else {}
        except msgspec.DecodeError:
            return None
    if not isinstance(args, dict) or not accepts(tools[name], args):
        return None
    return name, args


def accepts(schema: Any, args: dict) -> bool:
    """Whether a tool's `parameters` schema accepts `args`: every required property is present,
    every declared property has its declared type, and no undeclared one where the schema
    forbids them (`additionalProperties: false`)."""
    if not isinstance(schema, dict):
        return True
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = schema.get("required") if isinstance(schema.get("required"), list) else []
    if any(r not in args for r in required):
        return False
    if schema.get("additionalProperties") is False and any(k not in props for k in args):
        return False
    for key, value in args.items():
        prop = props.get(key)
        type_ = prop.get("type") if isinstance(prop, dict) else None
        if type_ is not None and not matches_type(value, type_):
            return False
    return True

