"""A GGUF file's header (metadata and tensor index) and its tensors as memory-mapped views.

`gguf.GGUFReader` builds several numpy views per metadata string: for the Qwen vocabulary (248K
tokens, 500K merges) that is millions of small objects, slower to open than the model itself is
to load. This reader parses the same format (GGUF v2/v3, little-endian) with `struct` over a
memory map, each numeric array in one `np.frombuffer`. Tensor data stays in the map; nothing is
read until a tensor is used. The `gguf` package still provides the type tables and is the
reference its tests compare against.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
V = GGUFValueType
SCALARS = {
    V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
    V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d",
}
NUMPY = {
    V.UINT8: np.uint8, V.INT8: np.int8, V.UINT16: np.uint16, V.INT16: np.int16, V.UINT32: np.uint32,
    V.INT32: np.int32, V.FLOAT32: np.float32, V.BOOL: np.bool_, V.UINT64: np.uint64, V.INT64: np.int64,
    V.FLOAT64: np.float64,
}


class GGUFFormatError(ValueError):
    """Not a GGUF file we can read, or one cut short."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: GGMLQuantizationType | int  # an int where the type is unknown to the `gguf` package
    ne: tuple[int, ...]  # GGML order: ne[0] is the row (the last PyTorch dim)
    offset: int  # absolute, in the file
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """PyTorch order."""
        return tuple(reversed(self.ne))


U64 = struct.Struct("<Q")


class Cursor:
    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise GGUFFormatError(f"header ends early (needs byte {self.pos + n} of {len(self.buf)})")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, vtype: GGUFValueType) -> Any:
        fmt = SCALARS[vtype]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.scalar(V.UINT64)).decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """`count` strings (a vocabulary: the one loop of the header that runs 10^5-10^6 times)."""
        buf, pos, end, unpack = self.buf, self.pos, len(self.buf), U64.unpack_from
        out = []
        for _ in range(count):
            if pos + 8 > end:
                raise GGUFFormatError("header ends early (in a string array)")
            (n,) = unpack(buf, pos)
            out.append(buf[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace"))
            pos += 8 + n
        if pos > end:
            raise GGUFFormatError("header ends early (in a string array)")
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        vtype = GGUFValueType(vtype)
        if vtype == V.STRING:
            return self.string()
        if vtype != V.ARRAY:
            return self.scalar(vtype)
        etype, count = GGUFValueType(self.scalar(V.UINT32)), self.scalar(V.UINT64)
        if etype in NUMPY:
            dtype = np.dtype(NUMPY[etype])
            return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
        if etype == V.STRING:
            return self.strings(count)
        return [self.value(etype) for _ in range(count)]


@dataclass
class GGUFFile:
    path: Path
    meta: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data: np.ndarray  # the whole file, memory-mapped, read-only uint8

    def tensor_bytes(self, t: TensorInfo) -> np.ndarray:
        return self.data[t.offset : t.offset + t.n_bytes]


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse the header of `path` and map its data; `GGUFFormatError` if it is not a GGUF file,
    is cut short (a tensor's bytes past the end of the file), or has a malformed header."""
    path = Path(path)
    with path.open("rb") as f:
        if path.stat().st_size == 0:
            raise GGUFFormatError("empty file")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    data = np.frombuffer(mm, dtype=np.uint8)
    cur = Cursor(mm)
    try:
        if cur.take(4) != MAGIC:
            raise GGUFFormatError("no GGUF magic")
        version = cur.scalar(V.UINT32)
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} (big-endian or unknown) is not supported")
        n_tensors, n_kv = cur.scalar(V.UINT64), cur.scalar(V.UINT64)
        meta = {}
        for _ in range(n_kv):
            key = cur.string()
            meta[key] = cur.value(cur.scalar(V.UINT32))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            ne = tuple(cur.scalar(V.UINT64) for _ in range(cur.scalar(V.UINT32)))
            infos.append((name, cur.scalar(V.UINT32), ne, cur.scalar(V.UINT64)))
    except (ValueError, struct.error, UnicodeDecodeError) as exc:
        raise GGUFFormatError(str(exc)) from None
    alignment = int(meta.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, raw_type, ne, offset in infos:
        if name in tensors:
            raise GGUFFormatError(f"tensor {name} appears twice")
        qtype = _type(raw_type)
        block = GGML_QUANT_SIZES.get(qtype, (1, 0))[0]  # an unknown type: the loader names it
        if ne and ne[0] % block:
            raise GGUFFormatError(
                f"tensor {name}: rows of {ne[0]} values are not whole blocks of {block} ({qtype.name})"
            )
        tensors[name] = info = TensorInfo(name, qtype, ne, start + offset, _n_bytes(raw_type, ne))
        if info.offset + info.n_bytes > len(data):
            raise GGUFFormatError(
                f"truncated: tensor {name} ends at byte {info.offset + info.n_bytes}, the file has {len(data)}"
            )
    return GGUFFile(path, meta, tensors, data)


def _type(raw: int) -> GGMLQuantizationType | int:
    try:
        return GGMLQuantizationType(raw)
    except ValueError:
        return raw


def _n_bytes(raw_type: int, ne: tuple[int, ...]) -> int:
    """Bytes of a tensor; 0 for a type without a known block size (rejected by the loader)."""
    qtype = _type(raw_type)
    if qtype not in GGML_QUANT_SIZES:
        return 0
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return int(np.prod(ne, dtype=np.int64)) // block_size * type_size
