#!/usr/bin/env bash
# One whole GPU round in one command: install (build the extension), GPU tests, benchmarks, a table.
#
#   bash scripts/gpu_round.sh                      # everything
#   TESTS="tests/test_elementwise_cuda.py" BENCH="bench_elementwise.py" bash scripts/gpu_round.sh
#   TESTS=none BENCH=none ENGINE=none bash scripts/gpu_round.sh  # build only
#   SKIP_BUILD=1 ...                               # reuse the build of an earlier call
#   ENGINE="--size 8B --batch1" bash scripts/gpu_round.sh   # engine runs, ";"-separated; leading
#                         # NAME=VALUE words set the environment of that run only
#   TEST_TIMEOUT=300 FILE_TIMEOUT=900  # a test past 300 s dumps its stacks; a file past 900 s is killed
#   PARALLEL=1 ...        # on a machine with >= 2 GPUs: the test files run at once (each file one
#                         # process, round-robin over all GPUs but the last) while the benchmarks run
#                         # alone on the last GPU; tests needing 2 GPUs do not belong in such a round
#
# On the lent H200 (no internet) the nvidia-cutlass wheel travels in .whl/ (see README). Logs and
# the benchmark table go to $OUT (or ./out) so they come back.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true

if ! python3 -c "import cutlass_library" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps .whl/nvidia_cutlass-*.whl || exit 1
fi
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  start=$(date +%s)
  MAX_JOBS=${MAX_JOBS:-$(nproc)} python3 -m pip install --no-build-isolation --no-deps -e . \
    >"$OUT/build.log" 2>&1
  rc=$?
  echo "build: rc=$rc in $(( $(date +%s) - start )) s"
  if [ $rc -ne 0 ]; then grep -E "error|Error" "$OUT/build.log" | head -40; tail -20 "$OUT/build.log"; exit 1; fi
fi
(cd /tmp && python3 -c "import torch, qwen3_kernels; assert qwen3_kernels.has_cuda_kernels(), qwen3_kernels.cuda_kernels_import_error(); print('extension loaded:', torch.ops.qwen3_kernels.silu_and_mul)") || exit 1

TESTS=${TESTS:-$(ls tests/test_*cuda*.py | tr '\n' ' ')}
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "${PARALLEL:-0}" = 1 ] && [ "$NGPU" -ge 2 ] && [ "$TESTS" != none ]; then
  # tests in the background on GPUs 0..N-2, benchmarks below on GPU N-1: they never share a GPU
  : > "$OUT/tests.log"
  i=0
  for f in $TESTS; do  # FILE@EXPR runs FILE -k EXPR ('+' for spaces): a big file as several shards
    gpu=$(( i % (NGPU - 1) )); i=$(( i + 1 ))
    log="$OUT/.tests_$i.log"
    kexpr=()
    if [[ "$f" == *@* ]]; then k="${f#*@}"; kexpr=(-k "${k//+/ }"); f="${f%%@*}"; fi
    ( start=$(date +%s)
      CUDA_VISIBLE_DEVICES=$gpu timeout "${FILE_TIMEOUT:-900}" python3 -m pytest -q -rf --maxfail=25 \
        -o faulthandler_timeout=${TEST_TIMEOUT:-300} \
        -p no:cacheprovider "$f" "${kexpr[@]}" ${PYTEST_ARGS:-} > "$log" 2>&1
      echo "tests $f ${kexpr[*]} (GPU $gpu): rc=$? $(grep -E '(passed|failed|error)' "$log" | tail -1) ($(( $(date +%s) - start )) s)" >> "$log.sum" ) &
  done
  TESTS=none
  export CUDA_VISIBLE_DEVICES=$(( NGPU - 1 ))
  BG_TESTS=1
fi
if [ "$TESTS" != none ]; then
  # One pytest process per file: a crash in one file cannot hide the others' results.
  : > "$OUT/tests.log"
  for f in $TESTS; do  # FILE@EXPR runs FILE -k EXPR ('+' for spaces), as above
    start=$(date +%s)
    kexpr=()
    if [[ "$f" == *@* ]]; then k="${f#*@}"; kexpr=(-k "${k//+/ }"); f="${f%%@*}"; fi
    # faulthandler_timeout (built into pytest) dumps every thread's stack when one test runs past
    # TEST_TIMEOUT, so a hang shows where it is; FILE_TIMEOUT then kills the file's process.
    timeout "${FILE_TIMEOUT:-900}" python3 -m pytest -q -rf --maxfail=25 -o faulthandler_timeout=${TEST_TIMEOUT:-300} \
      -p no:cacheprovider "$f" "${kexpr[@]}" ${PYTEST_ARGS:-} >> "$OUT/tests.log" 2>&1
    echo "tests $f ${kexpr[*]}: rc=$? $(grep -E '(passed|failed|error)' "$OUT/tests.log" | tail -1) ($(( $(date +%s) - start )) s)"
  done
  grep -E "^FAILED|^ERROR|Segmentation|Fatal" "$OUT/tests.log" | head -40
fi

BENCH=${BENCH:-$(cd benchmarks && ls bench_*.py | grep -v bench_engine | tr '\n' ' ')}
if [ "$BENCH" != none ]; then
  rm -f "$OUT/bench.md"; : > "$OUT/bench.log"
  for f in $BENCH; do  # one process per file, each under a time limit
    (cd benchmarks && BENCH_RESULTS="$OUT/bench.md" timeout "${BENCH_TIMEOUT:-300}" \
       python3 -m pytest -q -s -p no:cacheprovider --benchmark-disable $f ${BENCH_ARGS:-} 2>&1) \
       >> "$OUT/bench.log"
  done
  grep -E "FAILED|Error" "$OUT/bench.log" | head -20
  echo; echo "== benchmark table =="; cat "$OUT/bench.md" 2>/dev/null
fi

if [ "${BG_TESTS:-0}" = 1 ]; then
  wait
  cat "$OUT"/.tests_*.log >> "$OUT/tests.log"; cat "$OUT"/.tests_*.log.sum
  rm -f "$OUT"/.tests_*.log "$OUT"/.tests_*.log.sum
  grep -E "^FAILED|^ERROR|Segmentation|Fatal" "$OUT/tests.log" | head -40
fi

# Engine throughput (benchmarks/bench_engine.py): the nano-vllm workload at real shapes, random weights.
ENGINE=${ENGINE:-"--size 0.6B;--size 0.6B --num-seqs 32 --baseline hf;--size 8B --batch1;--size 8B"}
if [ "$ENGINE" != none ]; then
  : > "$OUT/engine.log"
  IFS=';' read -ra runs <<< "$ENGINE"
  for args in "${runs[@]}"; do
    echo "== bench_engine.py $args ==" | tee -a "$OUT/engine.log"
    # leading NAME=VALUE words are environment for this run only, e.g. "QWEN3_GEMV_VARIANT=nopdl --size 8B"
    envs=(); flags=()
    for word in $args; do
      if [ ${#flags[@]} -eq 0 ] && [[ "$word" =~ ^[A-Z][A-Z0-9_]*= ]]; then envs+=("$word"); else flags+=("$word"); fi
    done
    (cd benchmarks && env "${envs[@]}" timeout "${ENGINE_TIMEOUT:-180}" python3 bench_engine.py "${flags[@]}" 2>&1) \
      | grep -v "Generating" | tee -a "$OUT/engine.log" | tail -6
  done
fi
