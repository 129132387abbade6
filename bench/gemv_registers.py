"""Registers and resident warps of the quantized GEMV kernel on the H200 (sm_90), compiled on this
machine (no GPU): Triton's cubin read by its bundled `cuobjdump -res-usage`. For trying kernel
variants offline before a lease measures the promising ones.

    python bench/gemv_registers.py                      # the launch's own BN and warps
    python bench/gemv_registers.py --bn 16,32,64 --warps 4,8

Per mode (a dense projection; one reading x through a column map, `mapped`; the format's weight and
a Q4_K one in one launch, `pair`; MoE decode's up with SiLU and routing weight, `glu`; its down summing
a token's experts, `topk`) and format: registers a thread, and the warps an SM keeps resident
(65,536 registers, at most 64 warps): what hides the latency of each program's dependent loads.
Compiled as the launcher specialises the kernel (pointers 16-byte aligned; N, N2, K, K_SPLIT
divisible by 16: `launch_attrs`), session 12, 4 warps and 32 rows a program: 30-96 registers, 20-64
warps an SM (Q4_K dense 40, its MoE up 56, Q6_K's up 96), the weights loaded 8 or 16 bytes a thread.
Sessions 10 and 11 compiled without that specialisation: byte-wide loads and 64-255 registers, figures
of a kernel that never ran.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # bench/engine.py would shadow the `engine` package

import triton  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine.ops.gpu import quant  # noqa: E402
from tests.engine.test_kernels_compile import GEMV, GEMV_DIVISIBLE, H200, PARTS, launch_attrs  # noqa: E402  (the signature the compile test uses)

# a token reads 9 experts, its 8 routed and the shared one folded in (engine.model.SparseMoe.fold_shared)
# (grouped, x_per, top_k, glu, x through a column map, a second weight's format or -1)
MODES = {"linear": (False, 1, 1, False, False, -1), "mapped": (False, 1, 1, False, True, -1),
         "pair": (False, 1, 1, False, False, quant.Q4_K), "glu": (True, 9, 1, True, False, -1),
         "topk": (True, 1, 9, False, False, -1)}  # fmt: skip
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def registers(fmt: int, mode: str, bn: int, warps: int, stages=None, unroll=None) -> int:
    grouped, x_per, top_k, glu, xmap, fmt2 = MODES[mode]
    signature = {**GEMV, **{f"P{i}": t for i, t in enumerate(PARTS[fmt])},
                 **{f"Q{i}": t for i, t in enumerate(PARTS[fmt if fmt2 < 0 else fmt2])}}  # fmt: skip
    constexprs = {**quant.gemv_constexprs(fmt, bn, grouped, x_per, top_k, glu, xmap, fmt2),
                  "STAGES": stages, "UNROLL": unroll}  # fmt: skip
    attrs = launch_attrs(quant._gemv_kernel, signature, GEMV_DIVISIBLE)
    source = ASTSource(fn=quant._gemv_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(source, target=H200, options={"num_warps": warps})
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "gemv.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([str(CUOBJDUMP), "-res-usage", str(cubin)], capture_output=True, text=True, check=True)
    return int(usage.stdout.split("REG:")[1].split()[0])


def resident_warps(regs: int, warps: int) -> int:
    """Warps an SM keeps of CTAs of `warps` warps at `regs` registers a thread."""
    return min(64 // warps, 65536 // (regs * 32 * warps)) * warps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bn", default=str(quant.GEMV_BLOCK_N), help="rows a program, comma-separated")
    p.add_argument("--warps", default="4", help="warps a program, comma-separated (the launch uses Triton's 4)")
    p.add_argument("--formats", default="q4_k,q6_k,q8_0", help="of " + ",".join(n.lower() for n in quant.NAMES.values()))
    args = p.parse_args()
    formats = [f for f, name in quant.NAMES.items() if name.lower() in args.formats.split(",")]
    print(f"{'BN':>4} {'warps':>5}  " + "  ".join(f"{m + '/' + quant.NAMES[f]:>14}" for m in MODES for f in formats))
    for bn in map(int, args.bn.split(",")):
        for warps in map(int, args.warps.split(",")):
            cells = []
            for mode in MODES:
                for fmt in formats:
                    regs = registers(fmt, mode, bn, warps)
                    cells.append(f"{regs:>4}r {resident_warps(regs, warps):>2}w")
            print(f"{bn:>4} {warps:>5}  " + "  ".join(f"{c:>14}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
