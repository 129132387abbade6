"""Volatile content rules on Claude Code's billing header."""

from __future__ import annotations

import json

import pytest

from gateway.anchors import anchor_chain, root_anchor
from gateway.protocols import anthropic
from gateway.render.qwen import QwenRenderer
from gateway.tokenizer import QwenTokenizer
from gateway.volatile import VolatileRules, normalize
from tests.gateway.test_render_fixtures import CLIENTS


def load(name: str):
    path = CLIENTS / "claude-code-2.1.332" / name
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    return anthropic.parse_request(json.loads(path.read_text())["body"])


def test_dropping_the_header_gives_the_prompt_without_it():
    with_header, without = load("plain-000-with-billing-header.json"), load("000.json")
    assert with_header.system[0].startswith("x-anthropic-billing-header:")
    assert normalize(with_header).system == without.system
    renderer = QwenRenderer(QwenTokenizer())
    root = root_anchor("fp", renderer.template_id)
    a = anchor_chain(renderer.render(normalize(with_header)), root)
    b = anchor_chain(renderer.render(without), root)
    assert a[:2] == b[:2]  # tools and system segments are shared


def test_nonce_change_does_not_change_the_normalised_prompt():
    conv = load("plain-000-with-billing-header.json")
    header = "x-anthropic-billing-header: cc_version=2.1.332.0b8; cc_entrypoint=sdk-cli; cch={};"
    variants = [conv.__class__(system=(header.format(n),) + conv.system[1:]) for n in ("1a2b3", "9f9f9")]
    for mode in ("drop", "mask"):
        rules = VolatileRules(billing_header=mode)
        assert normalize(variants[0], rules).system == normalize(variants[1], rules).system
    masked = normalize(variants[0], VolatileRules(billing_header="mask")).system[0]
    assert masked == "x-anthropic-billing-header: cc_version=*; cc_entrypoint=*; cch=*;"
    assert normalize(variants[0], VolatileRules(billing_header="keep")) is variants[0]


def test_header_line_inside_a_longer_block():
    conv = load("000.json")
    block = "x-anthropic-billing-header: cch=abc;\nYou are an agent."
    changed = normalize(conv.__class__(system=(block,)))
    assert changed.system == ("You are an agent.",)


def test_codex_wall_time_lines_are_kept():
    from gateway.protocols import responses

    path = CLIENTS / "codex-0.171.0" / "001.json"
    if not path.is_file():
        pytest.skip("codex capture absent")
    conv = responses.parse_request(json.loads(path.read_text())["body"])
    assert normalize(conv) is conv and "Wall time:" in conv.messages[-1].content
