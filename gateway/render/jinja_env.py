"""A Jinja environment with Hugging Face's chat-template conventions.

Same settings as `transformers`: sandboxed, `trim_blocks`, `lstrip_blocks`, loop
controls, a `tojson` that does not escape HTML (`json.dumps(ensure_ascii=False)`),
`raise_exception(msg)`, `strftime_now(fmt)`, and a pass-through `{% generation %}` tag.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateRaised(Exception):
    """The template called `raise_exception(message)`."""


def _raise(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class GenerationTag(Extension):
    """`{% generation %}…{% endgeneration %}` (HF's assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template (cached by its source text)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
