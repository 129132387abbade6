"""The record codec: tensors as raw bytes behind a msgspec header; never pickle.

A checkpoint record has up to two *parts*, each stored as one self-describing frame:

- ``kv``: the KV delta of positions ``[start, end)`` (tensors named ``kv.*``);
- ``state``: the conv/recurrent state at ``end`` (every other tensor).

Keeping the parts apart lets either tier drop a large state while keeping its small KV
delta, which later records of the chain still need.

Frame layout (little endian)::

    magic "FTCK" | version u8 | 3 pad | header_len u32 | header_xxh3_64 u64   (20 bytes)
    header (msgpack RecordHeader, header_len bytes) | zero padding to a multiple of ALIGN
    payload: each tensor's raw bytes at its ``offset`` (ALIGN-aligned)

The header names the anchor, the parent anchor, positions, the model fingerprint, the
part, every tensor's name, dtype, shape and byte offset, and an xxh3_64 checksum of the
payload. Decoding checks all of it; anything off raises ``CorruptRecord``.
"""

from __future__ import annotations

import math
import struct
import time
import warnings
from dataclasses import dataclass

import msgspec
import numpy as np
import torch
import xxhash

from .snapshot import is_kv

MAGIC = b"FTCK"
VERSION = 1
ALIGN = 64
PREFIX = struct.Struct("<4sB3xIQ")  # magic, version, header_len, header_xxh3_64
MAX_HEADER_BYTES = 1 << 24

KV_PART = "kv"
STATE_PART = "state"
PARTS = (KV_PART, STATE_PART)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class CorruptRecord(Exception):
    """A stored frame that cannot be trusted; the message says why."""


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class RecordMeta(msgspec.Struct, frozen=True):
    """Where a record sits in its chain: positions ``[start, end)`` after ``parent``."""

    anchor: bytes
    parent: bytes | None
    start: int
    end: int


class RecordHeader(msgspec.Struct, frozen=True):
    anchor: bytes
    parent: bytes | None
    part: str
    start: int
    end: int
    fingerprint: str
    tensors: tuple[TensorSpec, ...]
    payload_bytes: int
    checksum: int  # xxh3_64 of the payload
    created: float  # unix seconds; orders records after a restart

    @property
    def meta(self) -> RecordMeta:
        return RecordMeta(self.anchor, self.parent, self.start, self.end)


_HEADER_DECODER = msgspec.msgpack.Decoder(RecordHeader)
_HEADER_ENCODER = msgspec.msgpack.Encoder()


@dataclass(frozen=True)
class Packed:
    """One part's tensors copied into a single private uint8 buffer."""

    specs: tuple[TensorSpec, ...]
    buf: torch.Tensor  # [payload_bytes] uint8, owned by the store

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    def views(self) -> dict[str, torch.Tensor]:
        """Typed views into ``buf`` (no copy); callers must not write through them."""
        return {s.name: _view(self.buf, s) for s in self.specs}


def split_parts(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    kv = {n: t for n, t in tensors.items() if is_kv(n)}
    state = {n: t for n, t in tensors.items() if not is_kv(n)}
    return {KV_PART: kv, STATE_PART: state} if state else {KV_PART: kv}


def pack(tensors: dict[str, torch.Tensor]) -> Packed:
    """Copy ``tensors`` (any layout, on any device) into one aligned buffer (``allocate``): one copy
    per byte."""
    packed = allocate(tensors)
    for spec, t in zip(packed.specs, tensors.values(), strict=True):
        copy_bytes(_view(packed.buf, spec), t)
    return packed


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, as one memcpy where both are contiguous host tensors.

    numpy's copy is a single-threaded memcpy; torch's CPU copy splits work across its
    intra-op threads, which crawls when the cores are busy, and converts bf16 element by element.
    """
    if _plain(dst) and _plain(src) and dst.dtype == src.dtype and dst.shape == src.shape:
        np.copyto(_bytes(dst), _bytes(src))
    else:
        dst.copy_(src)


def _plain(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_contiguous()


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def allocate(like: dict[str, torch.Tensor]) -> Packed:
    """One uninitialised host buffer laid out for tensors shaped like ``like`` (meta tensors will do)."""
    specs, offset = [], 0
    for name, t in like.items():
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"unsupported dtype {t.dtype} for {name}")
        nbytes = t.numel() * t.element_size()
        specs.append(TensorSpec(name, DTYPE_NAMES[t.dtype], tuple(t.shape), offset, nbytes))
        offset += _aligned(nbytes)
    # numpy's allocator advises huge pages for large buffers: far fewer first-touch page faults
    return Packed(tuple(specs), torch.from_numpy(np.empty(offset, dtype=np.uint8)))


def encode_frame(meta: RecordMeta, part: str, packed: Packed, fingerprint: str) -> bytes:
    """The bytes stored on disk for one part (one copy of the payload)."""
    payload = memoryview(packed.buf.numpy())  # type: ignore[arg-type]  # ndarray is a buffer
    header = RecordHeader(
        anchor=meta.anchor,
        parent=meta.parent,
        part=part,
        start=meta.start,
        end=meta.end,
        fingerprint=fingerprint,
        tensors=packed.specs,
        payload_bytes=packed.nbytes,
        checksum=xxhash.xxh3_64_intdigest(payload),
        created=time.time(),
    )
    raw = _HEADER_ENCODER.encode(header)
    pad = bytes(_aligned(PREFIX.size + len(raw)) - PREFIX.size - len(raw))
    prefix = PREFIX.pack(MAGIC, VERSION, len(raw), xxhash.xxh3_64_intdigest(raw))
    return b"".join((prefix, raw, pad, payload))


def decode_header(value: bytes | memoryview, anchor: bytes, part: str, fingerprint: str) -> RecordHeader:
    """Parse and check a frame's header and its length (not the payload checksum)."""
    if len(value) < PREFIX.size:
        raise CorruptRecord(f"truncated frame: {len(value)} bytes")
    magic, version, header_len, header_hash = PREFIX.unpack_from(value)
    if magic != MAGIC or version != VERSION:
        raise CorruptRecord(f"bad magic/version {magic!r}/{version}")
    if header_len > MAX_HEADER_BYTES or PREFIX.size + header_len > len(value):
        raise CorruptRecord(f"truncated header: {header_len} bytes declared")
    raw = value[PREFIX.size : PREFIX.size + header_len]
    if xxhash.xxh3_64_intdigest(raw) != header_hash:
        raise CorruptRecord("header checksum mismatch")
    try:
        header = _HEADER_DECODER.decode(raw)
    except msgspec.DecodeError as e:
        raise CorruptRecord(f"unparsable header: {e}") from e
    _check_header(header, anchor, part, fingerprint, len(value) - _aligned(PREFIX.size + header_len))
    return header


def decode_frame(value: bytes | memoryview, anchor: bytes, part: str, fingerprint: str) -> tuple[RecordHeader, dict]:
    """Check a whole frame; return its header and typed views into ``value`` (valid as long as it is)."""
    header = decode_header(value, anchor, part, fingerprint)
    payload = value[len(value) - header.payload_bytes :]
    if xxhash.xxh3_64_intdigest(payload) != header.checksum:
        raise CorruptRecord("payload checksum mismatch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we never write through it
        buf = (
            torch.frombuffer(payload, dtype=torch.uint8)
            if header.payload_bytes
            else torch.empty(0, dtype=torch.uint8)
        )
    return header, {s.name: _view(buf, s) for s in header.tensors}


def _check_header(h: RecordHeader, anchor: bytes, part: str, fingerprint: str, payload_len: int) -> None:
    if h.fingerprint != fingerprint:
        raise CorruptRecord(f"fingerprint mismatch: {h.fingerprint!r} != {fingerprint!r}")
    if h.anchor != anchor or h.part != part:
        raise CorruptRecord("header names another anchor or part")
    if not 0 <= h.start <= h.end:
        raise CorruptRecord(f"bad positions [{h.start}, {h.end})")
    if h.payload_bytes != payload_len:
        raise CorruptRecord(f"truncated payload: {payload_len} of {h.payload_bytes} bytes")
    for s in h.tensors:
        _check_spec(s, h, part)


def _check_spec(s: TensorSpec, h: RecordHeader, part: str) -> None:
    dtype = DTYPES.get(s.dtype)
    if dtype is None or any(d < 0 for d in s.shape):
        raise CorruptRecord(f"bad dtype or shape for {s.name}")
    if s.nbytes != math.prod(s.shape) * dtype.itemsize or s.offset % ALIGN:
        raise CorruptRecord(f"bad size or offset for {s.name}")
    if s.offset < 0 or s.offset + s.nbytes > h.payload_bytes:
        raise CorruptRecord(f"{s.name} lies outside the payload")
    if is_kv(s.name) != (part == KV_PART):
        raise CorruptRecord(f"{s.name} does not belong to a {part} part")
    if part == KV_PART and (not s.shape or s.shape[0] != h.end - h.start):
        raise CorruptRecord(f"{s.name} does not hold {h.end - h.start} positions")


def _view(buf: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    dtype = DTYPES[spec.dtype]
    raw = buf[spec.offset : spec.offset + spec.nbytes]
    return raw.view(dtype).view(spec.shape) if spec.nbytes else torch.empty(spec.shape, dtype=dtype)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
