import msgspec
import pytest
import torch

from checkpoint_store.record import (
    KV_PART,
    PREFIX,
    STATE_PART,
    CorruptRecord,
    RecordMeta,
    decode_frame,
    encode_frame,
    pack,
    split_parts,
)

from .synth import make_snapshot

META = RecordMeta(b"a1", b"a0", 5, 9)


def frame(part: str = STATE_PART, fingerprint: str = "fp") -> tuple[bytes, dict[str, torch.Tensor]]:
    tensors = split_parts(make_snapshot(1, 5, 9, with_state=True).tensors)[part]
    return encode_frame(META, part, pack(tensors), fingerprint), tensors


@pytest.mark.parametrize("part", [KV_PART, STATE_PART])
def test_round_trip_keeps_dtype_shape_and_bits(part: str) -> None:
    value, tensors = frame(part)
    header, views = decode_frame(memoryview(value), META.anchor, part, "fp")
    assert header.meta == META
    assert views.keys() == tensors.keys()
    for name, t in tensors.items():
        assert views[name].dtype == t.dtype and views[name].shape == t.shape
        assert torch.equal(views[name], t)


def test_bfloat16_bits_survive() -> None:
    t = torch.tensor([1.0, -0.0, float("inf"), 3.140625, 1e-38], dtype=torch.bfloat16)
    value = encode_frame(RecordMeta(b"x", None, 0, 0), STATE_PART, pack({"rec.0": t}), "fp")
    _, views = decode_frame(memoryview(value), b"x", STATE_PART, "fp")
    assert torch.equal(views["rec.0"].view(torch.int16), t.view(torch.int16))


def test_pack_copies_non_contiguous_tensors() -> None:
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2]
    packed = pack({"rec.0": t})
    t.fill_(0)  # the caller reuses its tensor: the packed copy must not change
    assert torch.equal(packed.views()["rec.0"], torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2])


def test_header_is_plain_msgpack() -> None:
    value, _ = frame()
    header_len = PREFIX.unpack_from(value)[2]
    decoded = msgspec.msgpack.decode(value[PREFIX.size : PREFIX.size + header_len])
    assert decoded["anchor"] == b"a1" and decoded["parent"] == b"a0" and decoded["fingerprint"] == "fp"
    assert [t[0] for t in decoded["tensors"]] == ["conv.1", "rec.1"]


@pytest.mark.parametrize(
    "mangle, why",
    [
        (lambda v: v[:10], "truncated frame"),
        (lambda v: v[:-1], "truncated payload"),
        (lambda v: b"XXXX" + v[4:], "bad magic"),
        (lambda v: v[:30] + bytes([v[30] ^ 1]) + v[31:], "header checksum"),
        (lambda v: v[:-5] + bytes([v[-5] ^ 0x40]) + v[-4:], "payload checksum"),
    ],
)
def test_damaged_frames_are_rejected(mangle, why: str) -> None:
    value, _ = frame()
    with pytest.raises(CorruptRecord, match=why):
        decode_frame(memoryview(mangle(value)), META.anchor, STATE_PART, "fp")


def test_wrong_fingerprint_anchor_or_part_is_rejected() -> None:
    value, _ = frame()
    for anchor, part, fp in [
        (META.anchor, STATE_PART, "other"),
        (b"zz", STATE_PART, "fp"),
        (META.anchor, KV_PART, "fp"),
    ]:
        with pytest.raises(CorruptRecord):
            decode_frame(memoryview(value), anchor, part, fp)
