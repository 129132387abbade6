"""The tokenizer and chat template in a GGUF file's metadata, as a `tokenizers` tokenizer.

llama.cpp's `gpt2` tokenizer model is byte-level BPE: `tokenizer.ggml.tokens` (GPT-2's printable
stand-ins for bytes), `tokenizer.ggml.merges` ("left right", in merge order), token types
(control and user-defined tokens are matched whole in text, as added tokens), and a named
pre-tokenizer split (`tokenizer.ggml.pre`). The same pieces make a Hugging Face `tokenizers`
BPE; `gateway.tokenizer.GGUFTokenizer` serves it like any model folder's tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from engine.gguf_file import read_gguf
from engine.gguf_loader import GGUFError, gguf_parts

CONTROL, USER_DEFINED = 3, 4  # gguf.TokenType
# llama.cpp's pre-tokenizer names → the split regex (as the models' own tokenizer.json has it)
QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
SPLITS = {"qwen2": QWEN2_SPLIT, "qwen35": QWEN35_SPLIT}


@dataclass(frozen=True)
class GGUFVocab:
    tokenizer: object  # tokenizers.Tokenizer
    eos_ids: tuple[int, ...]
    chat_template: str | None


def gguf_metadata(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """The first part of the GGUF model at `path` (a file, split or folder) and its metadata."""
    first = gguf_parts(path)[0]
    return first, _metadata(first, first.stat().st_mtime_ns)


@lru_cache(maxsize=2)
def _metadata(first: Path, mtime_ns: int) -> dict[str, Any]:
    return read_gguf(first).meta  # the vocabulary: read once for the tokenizer and the template


def gguf_chat_template(path: str | Path) -> str | None:
    return gguf_metadata(path)[1].get("tokenizer.chat_template")


def gguf_vocab(path: str | Path) -> GGUFVocab:
    """The tokenizer of the GGUF model at `path`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415

    first, meta = gguf_metadata(path)
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if kind != "gpt2" or pre not in SPLITS:
        raise GGUFError(
            f"{first}: tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported (gpt2: {list(SPLITS)})"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # every control and user-defined token is matched whole (as the Qwen tokenizer does for both)
    added = [
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k in (CONTROL, USER_DEFINED)
    ]
    tok.add_special_tokens(added)
    eos = [meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")]
    eos += [tokens.index(t) for t in ("<|endoftext|>",) if t in tokens and types[tokens.index(t)] == CONTROL]
    return GGUFVocab(
        tok, tuple(dict.fromkeys(int(e) for e in eos if e is not None)), meta.get("tokenizer.chat_template")
    )
