#!/usr/bin/env bash
# The build of the torch-free A / B harnesses (prefill_ab/, decode_ab/, linear_fp8_gemv_ab/):
# HARNESS_DIR/build/ab from HARNESS_DIR/main.cu and the variants given as name:file (paths from the
# repository root or absolute), each compiled with -Dqwen3_kernels=ab_<name> so that all link
# together, and listed in build/variants.h for main.cu's DECL / CALL macros. STUBS=file: each
# variant is compiled as its file followed by this one (definitions the variant calls into but the
# harness leaves out).
# Needs nvcc only (no torch, no GPU); ~15 s a variant, in parallel.
#   bash benchmarks/ab_variants.sh HARNESS_DIR name:file ...
set -euo pipefail
here="$(cd "$1" && pwd)"
shift
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$here/build"
mkdir -p "$out"
flags=(-std=c++17 -O3 --expt-relaxed-constexpr -DNDEBUG --use_fast_math
       -gencode=arch=compute_90a,code=sm_90a -I"$root/csrc/include"
       -I"$root/csrc/kernels/attention" -I"$root/csrc/kernels/gemm" -I"$root/benchmarks"
       -I"$out")
decls="" calls="" names="" objs=() pids=()
for spec in "$@"; do
  name=${spec%%:*} file=${spec#*:}
  [[ "$file" = /* ]] || file="$root/$file"
  src="$file"
  if [ -n "${STUBS:-}" ]; then
    src="$out/w_$name.cu"
    printf '#include "%s"\n#include "%s"\n' "$file" "$STUBS" > "$src"
  fi
  decls+=" DECL(ab_$name)" calls+=" CALL(ab_$name)," names+=" \"$name\","
  nvcc -c "${flags[@]}" -Dqwen3_kernels="ab_$name" "$src" -o "$out/v_$name.o" & pids+=($!)
  objs+=("$out/v_$name.o")
done
printf '%s\n#define VARIANT_CALLS_LIST %s\n#define VARIANT_NAMES_LIST %s\n' \
  "$decls" "$calls" "$names" > "$out/variants.h"
nvcc -c "${flags[@]}" "$here/main.cu" -o "$out/main.o" & pids+=($!)
for p in "${pids[@]}"; do wait "$p"; done
nvcc "${flags[@]}" "$out/main.o" "${objs[@]}" -o "$out/ab"
echo "built $out/ab"
