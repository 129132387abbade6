"""Typing qwen3_coder XML parameter values with the tool's JSON schema."""

from __future__ import annotations

from typing import Any

import msgspec

_STRING_TYPES = {"string", "str", "text"}


def param_type(schema: dict | None, param: str) -> str | list | None:
    """The JSON-schema `type` of `param` in a tool's parameters schema, if declared."""
    if not isinstance(schema, dict):
        return None
    props = schema.get("properties")
    prop = props.get(param) if isinstance(props, dict) else None
    return prop.get("type") if isinstance(prop, dict) else None


def is_verbatim(type_: str | list | None, known_tool: bool) -> bool:
    """Strings stay verbatim; so does any parameter of a tool we have no schema for."""
    if not known_tool:
        return True
    return isinstance(type_, str) and type_ in _STRING_TYPES


def convert(raw: str, type_: str | list | None) -> Any:
    """Parse `raw` as JSON for non-string types, falling back to the string itself
    (booleans also accept Jinja's ``True``/``False``)."""
    if type_ == "boolean" and raw.strip() in ("True", "False"):
        return raw.strip() == "True"
    try:
        value = msgspec.json.decode(raw.strip())
    except msgspec.DecodeError:
        return raw
    if isinstance(type_, list) and "string" in type_ and not _listed(value, type_):
        return raw
    return value


JSON_TYPE_NAMES = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
    type(None): "null",
}


def _listed(value: Any, types: list) -> bool:
    name = JSON_TYPE_NAMES.get(type(value), "")
    return name in types or (name == "integer" and "number" in types)


def matches_type(value: Any, type_: str | list) -> bool:
    """Whether `value` has the JSON-schema `type_` (a name or a list of names); an integer is
    also a number; a type name this check does not know accepts anything."""
    types = type_ if isinstance(type_, list) else [type_]
    if not all(isinstance(t, str) and t in JSON_TYPE_NAMES.values() for t in types):
        return True
    return _listed(value, types)


def encode_json(value: Any) -> str:
    """Compact JSON text, the same encoder the streamed argument fragments use."""
    return msgspec.json.encode(value).decode()


def escape_fragment(text: str) -> str:
    """JSON string escaping of a fragment (without quotes); fragments concatenate."""
    return msgspec.json.encode(text).decode()[1:-1]
