#!/usr/bin/env bash
# Builds build/ab: linear.cu's batch-invariant bf16 tiles (the production TUs, linked) and the
# candidates of candidates.cu, timed data-parallel on Qwen3-8B's projections (main.cu). Needs nvcc
# and the nvidia-cutlass package (CUTLASS_DIR to override); no torch, no GPU. Several minutes.
#   bash benchmarks/linear_bi_ab/build.sh && benchmarks/linear_bi_ab/build/ab [rounds]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
py="${PYTHON:-python3}"
cutlass="${CUTLASS_DIR:-$("$py" -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source"))')}"
mkdir -p "$here/build"
flags=(-std=c++17 -O3 --expt-relaxed-constexpr --expt-extended-lambda -DNDEBUG --use_fast_math
       -gencode=arch=compute_90a,code=sm_90a -I"$root/csrc/include" -I"$root/csrc/kernels/gemm"
       -I"$root/benchmarks" -I"$cutlass/include" -I"$cutlass/tools/util/include")
g="$root/csrc/kernels/gemm"
srcs=("$here/main.cu" "$here/candidates.cu:-DCAND_PART=1" "$here/candidates.cu:-DCAND_PART=2"
      "$here/candidates.cu:-DCAND_PART=3" "$here/candidates.cu:-DCAND_PART=4" "$here/candidates.cu:-DCAND_PART=5"
      "$g/linear_gemv.cu")
for t in swap_64x16 swap_64x32 swap_64x64 swap_64x128 swap_128x64 swap_128x96 swap_128x128 swap_128x192 \
         tile_128x128 tile_128x256; do
  srcs+=("$g/linear_${t}_bf16.cu")
done
objs=()
i=0
for s in "${srcs[@]}"; do
  f=${s%%:*}; d=""; [ "$f" != "$s" ] && d=${s#*:}
  o="$here/build/o$i.o"; objs+=("$o"); i=$((i + 1))
  nvcc "${flags[@]}" $d -c "$f" -o "$o" &
  while [ "$(jobs -rp | wc -l)" -ge "${JOBS:-$(nproc)}" ]; do sleep 1; done
done
wait
nvcc "${flags[@]}" "${objs[@]}" -o "$here/build/ab"
echo "built $here/build/ab"
