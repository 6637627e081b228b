#!/usr/bin/env bash
# Builds build/ab from main.cu and the variants of decode.cu given as name:file (paths from the
# repository root or absolute), each compiled with -Dqwen3_kernels=ab_<name> so that all link
# together; the prefill kernels decode.cu calls into are stubbed out (sm90_available() is false,
# so the deterministic mode's short rows stay in decode.cu too). Needs nvcc only (no torch, no
# GPU); ~15 s a variant, in parallel.
#
#   git show main:csrc/kernels/attention/decode.cu > /tmp/main.cu
#   bash benchmarks/decode_ab/build.sh main:/tmp/main.cu tree:csrc/kernels/attention/decode.cu
#   benchmarks/decode_ab/build/ab [rounds]  # on the GPU: carry benchmarks/decode_ab/build
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="$here/build"
mkdir -p "$out"
flags=(-std=c++17 -O3 --expt-relaxed-constexpr -DNDEBUG --use_fast_math
       -gencode=arch=compute_90a,code=sm_90a -I"$root/csrc/include"
       -I"$root/csrc/kernels/attention" -I"$out")
decls="" calls="" names="" objs=() pids=()
for spec in "$@"; do
  name=${spec%%:*} file=${spec#*:}
  [[ "$file" = /* ]] || file="$root/$file"
  cat > "$out/w_$name.cu" <<WRAP
#include "$file"
namespace qwen3_kernels::prefill {
bool sm90_available() { return false; }
cudaError_t launch_decode_prefill_order(const PrefillParams&, int, int, DType, cudaStream_t) {
  return cudaErrorNotSupported;
}
}  // namespace qwen3_kernels::prefill
WRAP
  decls+=" DECL(ab_$name)" calls+=" CALL(ab_$name)," names+=" \"$name\","
  nvcc -c "${flags[@]}" -Dqwen3_kernels="ab_$name" "$out/w_$name.cu" -o "$out/v_$name.o" &
  pids+=($!)
  objs+=("$out/v_$name.o")
done
printf '%s\n#define VARIANT_CALLS_LIST %s\n#define VARIANT_NAMES_LIST %s\n' \
  "$decls" "$calls" "$names" > "$out/variants.h"
nvcc -c "${flags[@]}" "$here/main.cu" -o "$out/main.o" & pids+=($!)
for p in "${pids[@]}"; do wait "$p"; done
nvcc "${flags[@]}" "$out/main.o" "${objs[@]}" -o "$out/ab"
echo "built $out/ab"
