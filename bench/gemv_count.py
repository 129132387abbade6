"""Quantized GEMV launches a decode step makes, with the shared expert folded into the routed stacks
and apart (`FT_FOLD_SHARED=0`), on the random Q4_K_M of a preset (llama-quantize's tensor types and
layout, `peer.gguf_random`). Counted, not timed: on a CPU the kernels run in Triton's interpreter
(this script starts it), so the count needs no GPU.

    python bench/gemv_count.py [--preset small] [--gguf FILE]

Session 11, `small` (8 layers): 49 GEMVs a decode step apart, 33 folded.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from unittest import mock

if "--in-interpreter" not in sys.argv and not os.environ.get("TRITON_INTERPRET"):
    import torch

    if not torch.cuda.is_available():  # Triton picks its interpreter at import: start again with it
        os.execve(sys.executable, [sys.executable, *sys.argv, "--in-interpreter"], {**os.environ, "TRITON_INTERPRET": "1"})

sys.path[0] = str(Path(__file__).resolve().parents[1])  # bench/engine.py would shadow the `engine` package


def count(path: Path, fold: bool) -> int:
    from engine import Engine  # noqa: PLC0415
    from engine.ops.gpu import quant  # noqa: PLC0415

    with mock.patch.dict(os.environ, {"FT_FOLD_SHARED": "1" if fold else "0"}):
        engine = Engine.load(path, keep_quantized=True)
    state = engine.new_state()
    engine.prefill(state, list(range(100, 104)))
    with mock.patch.object(quant, "_gemv", wraps=quant._gemv) as gemv:
        engine.decode(state, 7)
    return gemv.call_count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", help="its random Q4_K_M (written under .peer/models on first use)")
    p.add_argument("--gguf", type=Path, help="count on this file instead")
    p.add_argument("--in-interpreter", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.gguf is None:
        from peer.gguf_random import random_gguf  # noqa: PLC0415
        from peer.llama_server import PEER_HOME  # noqa: PLC0415

        args.gguf = random_gguf(args.preset, PEER_HOME / "models")
    apart, folded = count(args.gguf, False), count(args.gguf, True)
    print(f"{args.gguf.name}: {apart} GEMV launches a decode step with the shared expert apart, {folded} folded")


if __name__ == "__main__":
    main()
