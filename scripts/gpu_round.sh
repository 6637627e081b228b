#!/usr/bin/env bash
# One whole GPU round in one command: install (build the extension), GPU tests, benchmarks, results.
#
#   bash scripts/gpu_round.sh                      # everything
#   TESTS="tests/test_elementwise_cuda.py" BENCH="bench_elementwise.py" bash scripts/gpu_round.sh
#   TESTS="tests/test_linear_cuda.py@T1 @ring:tests/test_fp8_gemv_cuda.py" ...  # FILE@EXPR: FILE
#                         # -k EXPR ('+' for spaces); @NAME:FILE: .prebuilt/NAME's own tests/FILE
#                         # on its packages and extension (see ENGINE's @NAME below)
#   TESTS=none BENCH=none ENGINE=none bash scripts/gpu_round.sh  # build only
#   SKIP_BUILD=1 ...                               # reuse the build of an earlier call
#   (a matching extension in .prebuilt/, from scripts/prebuild.sh on a CPU machine and carried
#   along, is installed instead of building: see that script)
#   ENGINE="--size 8B --batch1;--size 8B --no-overlap-steps" bash scripts/gpu_round.sh
#                         # bench_engine.py runs, ";"-separated (each its flags)
#   ENGINE="--size 8B;PYTHONPATH=$PWD/scratch/b --size 8B" ...  # a run's leading NAME=value
#                         # words are its environment: here the second run imports the Python
#                         # package copied to scratch/b/ (another branch's engine on this build)
#   ENGINE="@ring --size 8B --batch1;--size 8B --batch1" ...  # "@NAME": the run imports the
#                         # packages and extension scripts/prebuild.sh wrote as .prebuilt/NAME.*
#                         # (another branch, kernels included, beside this tree's build)
#   SERVE='--size 8B;--size 8B --workload chat;--size 8B --engine-args "--max-num-seqs 176"' \
#     bash scripts/gpu_round.sh  # bench_serve.py runs (server + offline baselines each), as ENGINE
#                         # but shell-quoted; SERVE=none skips them; SERVE_TIMEOUT=1200 (s) each
#   TEST_TIMEOUT=300 FILE_TIMEOUT=900  # a test past 300 s dumps its stacks; a file past 900 s dies
#   PARALLEL=1 ...        # on a machine with >= 2 GPUs: the test files run at once (each file one
#                         # process, round-robin over all GPUs but the last) while the benchmarks
#                         # run alone on the last GPU; tests needing 2 GPUs do not belong in it
#
# Where things go: logs to $OUT (or ./out); every benchmark writes its JSON to $OUT/results
# (--results-dir), and the round ends with $OUT/RESULTS.md made from them (report.py, tables only).
# To publish a round: copy $OUT/results/*.json into benchmarks/results/, then run
# `python benchmarks/report.py` on any machine with matplotlib: it rewrites benchmarks/RESULTS.md,
# benchmarks/plots/*.png and README's results table; commit the four.
#
# A machine without internet (the lent H200) cannot fetch the build's nvidia-cutlass: put its wheel
# in .whl/ first (`pip download --no-deps nvidia-cutlass==4.2.0.0 -d .whl`, on a machine that has
# the index) and carry it along: .whl/ is git-ignored, so the device call must name it
# (`carry: [".whl"]`); this script installs it from there before the build.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader || true

# CUTLASS headers, for a build (a prebuilt extension, below, needs none)
if ! python3 -c "import cutlass_library" 2>/dev/null && ls .whl/nvidia_cutlass-*.whl >/dev/null 2>&1
then
  python3 -m pip install -q --no-index --no-deps .whl/nvidia_cutlass-*.whl || exit 1
fi
# the server's (FastAPI, uvicorn) and its tests' (openai) wheels, carried in .whl/ likewise
# (`pip download fastapi uvicorn openai -d .whl --only-binary=:all: --python-version 3.12`)
if ! python3 -c "import fastapi, uvicorn, openai" 2>/dev/null && ls .whl/fastapi-*.whl >/dev/null 2>&1
then
  python3 -m pip install -q --no-index --find-links .whl fastapi uvicorn openai || exit 1
fi
check_extension() {
  (cd /tmp && python3 -c "import torch, qwen3_kernels as q
assert q.has_cuda_kernels(), q.cuda_kernels_import_error()
print('extension loaded:', torch.ops.qwen3_kernels.silu_and_mul)")
}
# unxz_to SRC.xz DST: a prebuilt extension decompressed (no xz binary needed)
unxz_to() {
  python3 -c "import lzma, shutil, sys
with lzma.open(sys.argv[1]) as f, open(sys.argv[2], 'wb') as g: shutil.copyfileobj(f, g)" "$1" "$2"
}
# A prebuilt extension (scripts/prebuild.sh, carried in .prebuilt/) built from exactly this tree's
# csrc/ and setup.py for this torch and TORCH_CUDA_ARCH_LIST: installed instead of building.
prebuilt_matching() {
  [ -d .prebuilt ] || return 1
  local want h tv arch so s
  want="$(bash scripts/sources_hash.sh) $(python3 -c 'import torch; print(torch.__version__)')"
  want="$want $(echo ${TORCH_CUDA_ARCH_LIST:-8.0 9.0a} | tr ' ' ',')"
  for s in .prebuilt/*.sources; do
    [ -f "$s" ] || continue
    read -r h tv arch so < "$s"
    if [ "$h $tv $arch" = "$want" ]; then echo "${s%.sources}.so.xz qwen3_kernels/$so"; return 0; fi
  done
  return 1
}
built=0
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  if pre=$(prebuilt_matching); then
    read -r xz so <<< "$pre"
    QWEN3_KERNELS_NO_CUDA=1 python3 -m pip install --no-build-isolation --no-deps -e . \
      >"$OUT/build.log" 2>&1 && unxz_to "$xz" "$so" && check_extension && built=1 &&
      echo "build: prebuilt $xz"
    [ $built = 1 ] || echo "build: prebuilt $xz did not load; building"
  fi
  if [ $built = 0 ]; then
    start=$(date +%s)
    MAX_JOBS=${MAX_JOBS:-$(nproc)} python3 -m pip install --no-build-isolation --no-deps -e . \
      >"$OUT/build.log" 2>&1
    rc=$?
    echo "build: rc=$rc in $(( $(date +%s) - start )) s"
    if [ $rc -ne 0 ]; then
      grep -E "error|Error" "$OUT/build.log" | head -40; tail -20 "$OUT/build.log"; exit 1
    fi
  fi
fi
[ $built = 1 ] || check_extension || exit 1

# .prebuilt/NAME's Python packages with its extension in a folder of their own (once): its path.
variant_dir() {
  local name=$1 dir="${TMPDIR:-/tmp}/qwen3_variants/$1" h tv arch so
  [ -f ".prebuilt/$name.py.tar.xz" ] && [ -f ".prebuilt/$name.so.xz" ] || return 1
  if [ ! -d "$dir" ]; then
    read -r h tv arch so < ".prebuilt/$name.sources" || return 1
    mkdir -p "$dir" && tar -C "$dir" -xJf ".prebuilt/$name.py.tar.xz" &&
      unxz_to ".prebuilt/$name.so.xz" "$dir/qwen3_kernels/$so" || { rm -rf "$dir"; return 1; }
  fi
  echo "$dir"
}

# run_tests SPEC LOG [LABEL]: one pytest process for a TESTS entry (FILE, FILE@EXPR,
# @NAME:FILE[@EXPR]), its output appended to LOG, its summary (LABEL after SPEC) on stdout.
# @NAME:FILE runs in NAME's folder, on NAME's own tests/ (python -m pytest puts the working
# directory ahead of PYTHONPATH, so a PYTHONPATH alone would test this tree's packages).
run_tests() {
  local f=$1 log=$2 label=${3:-} dir=. start=$(date +%s) kexpr=() k name rc
  if [[ "$f" == @*:* ]]; then
    name=${f%%:*}; name=${name#@}; f=${f#*:}
    dir=$(variant_dir "$name") || { echo "tests $1: no usable .prebuilt/$name.*: skipped"; return; }
  fi
  if [[ "$f" == *@* ]]; then k="${f#*@}"; kexpr=(-k "${k//+/ }"); f="${f%%@*}"; fi
  # faulthandler_timeout (built into pytest) dumps every thread's stack when one test runs past
  # TEST_TIMEOUT, so a hang shows where it is; FILE_TIMEOUT then kills the file's process.
  (cd "$dir" && timeout "${FILE_TIMEOUT:-900}" python3 -m pytest -q -rf --maxfail=25 \
     -o faulthandler_timeout=${TEST_TIMEOUT:-300} -p no:cacheprovider "$f" "${kexpr[@]}" \
     ${PYTEST_ARGS:-}) >> "$log" 2>&1
  rc=$?
  echo "tests $1$label: rc=$rc $(grep -E '(passed|failed|error)' "$log" | tail -1)" \
    "($(( $(date +%s) - start )) s)"
}
TESTS=${TESTS:-$(ls tests/test_*cuda*.py | tr '\n' ' ')}
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "${PARALLEL:-0}" = 1 ] && [ "$NGPU" -ge 2 ] && [ "$TESTS" != none ]; then
  # tests in the background on GPUs 0..N-2, benchmarks below on GPU N-1: they never share a GPU
  : > "$OUT/tests.log"
  i=0
  for f in $TESTS; do  # FILE@EXPR: a big file as several shards
    gpu=$(( i % (NGPU - 1) )); i=$(( i + 1 ))
    CUDA_VISIBLE_DEVICES=$gpu run_tests "$f" "$OUT/.tests_$i.log" " (GPU $gpu)" \
      > "$OUT/.tests_$i.log.sum" &
  done
  TESTS=none
  export CUDA_VISIBLE_DEVICES=$(( NGPU - 1 ))
  BG_TESTS=1
fi
if [ "$TESTS" != none ]; then
  # One pytest process per file: a crash in one file cannot hide the others' results.
  : > "$OUT/tests.log"
  for f in $TESTS; do run_tests "$f" "$OUT/tests.log"; done
  grep -E "^FAILED|^ERROR|Segmentation|Fatal" "$OUT/tests.log" | head -40
fi

BENCH=${BENCH:-$(cd benchmarks && ls bench_*.py | grep -v -e bench_engine -e bench_serve \
  | tr '\n' ' ')}
RESULTS="$(cd "$OUT" && pwd)/results"
mkdir -p "$RESULTS"
if [ "$BENCH" != none ]; then
  : > "$OUT/bench.log"
  for f in $BENCH; do  # one process per file, under a time limit; each writes $RESULTS/<bench>.json
    (cd benchmarks && timeout "${BENCH_TIMEOUT:-300}" \
       python3 -m pytest -q -s -p no:cacheprovider $f --results-dir "$RESULTS" ${BENCH_ARGS:-} \
       2>&1) \
       >> "$OUT/bench.log"
  done
  grep -E "FAILED|Error" "$OUT/bench.log" | head -20
fi

if [ "${BG_TESTS:-0}" = 1 ]; then
  wait
  cat "$OUT"/.tests_*.log >> "$OUT/tests.log"; cat "$OUT"/.tests_*.log.sum
  rm -f "$OUT"/.tests_*.log "$OUT"/.tests_*.log.sum
  grep -E "^FAILED|^ERROR|Segmentation|Fatal" "$OUT/tests.log" | head -40
fi

# Engine throughput (benchmarks/bench_engine.py): the nano-vllm workload at real shapes, random
# weights; the defaults (scheduling_policy "auto"), first come first served, and batch 1.
ENGINE=${ENGINE:-"--size 0.6B;--size 0.6B --num-seqs 32 --baseline hf;--size 8B --batch1;--size 8B;\
--size 8B --scheduling-policy fcfs"}
if [ "$ENGINE" != none ]; then
  : > "$OUT/engine.log"
  IFS=';' read -ra runs <<< "$ENGINE"
  for args in "${runs[@]}"; do
    echo "== bench_engine.py $args ==" | tee -a "$OUT/engine.log"
    read -ra flags <<< "$args"
    envs=()
    if [[ "${flags[0]:-}" == @* ]]; then  # @NAME: .prebuilt/NAME's packages and extension
      name=${flags[0]#@}; flags=("${flags[@]:1}")
      variant=$(variant_dir "$name") || { echo "no usable .prebuilt/$name.*: skipped"; continue; }
      envs+=("PYTHONPATH=$variant")
    fi
    while [ ${#flags[@]} -gt 0 ] && [[ "${flags[0]}" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; do
      envs+=("${flags[0]}"); flags=("${flags[@]:1}")
    done
    (cd benchmarks && env "${envs[@]}" timeout "${ENGINE_TIMEOUT:-180}" python3 bench_engine.py \
       "${flags[@]}" --results-dir "$RESULTS" 2>&1) | grep -v "Generating" \
       | tee -a "$OUT/engine.log" | tail -6
  done
fi

# Serving (benchmarks/bench_serve.py): the server under Poisson arrivals, the offline baselines in
# a process of their own; the server's output goes to $OUT/serve_server_<n>.log.
SERVE=${SERVE:-"--size 8B"}
if [ "$SERVE" != none ]; then
  : > "$OUT/serve.log"
  IFS=';' read -ra runs <<< "$SERVE"
  n=0
  for args in "${runs[@]}"; do
    n=$(( n + 1 ))
    echo "== bench_serve.py $args ==" | tee -a "$OUT/serve.log"
    eval "flags=($args)"  # (shell quoting: --engine-args "...")
    (cd benchmarks && timeout "${SERVE_TIMEOUT:-1200}" python3 bench_serve.py "${flags[@]}" \
       --results-dir "$RESULTS" --server-log "$OUT/serve_server_$n.log" 2>&1) \
       | tee -a "$OUT/serve.log" | tail -14
  done
fi

# Every table of this round, from its JSON (the plots and README come from report.py at home).
python3 benchmarks/report.py --results-dir "$RESULTS" --results-md "$OUT/RESULTS.md" --no-plots \
  --no-readme && cat "$OUT/RESULTS.md" | sed -n '/^## /,$p'
