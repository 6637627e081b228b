#!/usr/bin/env bash
# Builds qwen3_kernels._C on a machine without a GPU for one that has it, so that a GPU round
# spends its time on tests and benchmarks instead of nvcc (a full build is ~2 min on 16 cores,
# ~7 min on 2).
#
#   PY=/path/to/python3.12 bash scripts/prebuild.sh NAME [SOURCE_TREE]
#
# writes .prebuilt/NAME.so.xz (the extension, host debug info stripped: ~1.5 MB),
# .prebuilt/NAME.sources (what it was built from: a hash of SOURCE_TREE's csrc/ and setup.py, the
# torch version, the target) and .prebuilt/NAME.py.tar.xz (SOURCE_TREE's Python packages and
# tests/).
# SOURCE_TREE defaults to this checkout; any worktree works (another branch's kernels for an A/B).
# .prebuilt/ is git-ignored: name it in the device call's `carry`. scripts/gpu_round.sh then takes
# a prebuilt extension whose hash and torch version match the tree it runs in, instead of building
# (and builds as before when none matches or it does not load); an ENGINE run written "@NAME ..."
# runs NAME's packages and extension (an A/B of two branches in one call), and a TESTS entry
# "@NAME:FILE" NAME's own tests on them.
#
# PY must match the GPU machine's Python and torch exactly (there: Python 3.12, torch
# 2.11.0+cu130): a venv with that torch wheel and its CUDA libraries (torch imports them), the
# cuBLAS headers (nvidia-cublas) and nvidia-cutlass, e.g.
#   python3.12 -m venv /tmp/pb && /tmp/pb/bin/pip install torch==2.11.0 nvidia-cutlass==4.2.0.0 \
#     ninja pybind11 "setuptools<82"
# (torch's CUDA wheels bring nvidia-cublas, whose include/ holds cublas_v2.h), and nvcc 13.0.
set -euo pipefail
name=${1:?usage: PY=python3.12 bash scripts/prebuild.sh NAME [SOURCE_TREE]}
root="$(cd "$(dirname "$0")/.." && pwd)"
src="$(cd "${2:-$root}" && pwd)"
py=${PY:?PY: the python (3.12, torch as on the GPU machine) to build with}
arch=${TORCH_CUDA_ARCH_LIST:-9.0a}
out="$root/.prebuilt"
work="${TMPDIR:-/tmp}/qwen3_prebuild_$name"
mkdir -p "$out"
# The toolkit nvcc belongs to (torch would take the parent of whichever nvcc is on PATH, a
# wrapper's folder for one).
export CUDA_HOME="${CUDA_HOME:-$(cd "$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 \
  | sed -n 's/^#\$ TOP=//p' | head -1)" && pwd)}"
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cublas_inc="$(ls -d "$site"/nvidia/cu*/include 2>/dev/null | head -1 || true)"
rm -rf "$work"
start=$(date +%s)
(cd "$src" && CPATH="${cublas_inc}${CPATH:+:$CPATH}" TORCH_CUDA_ARCH_LIST="$arch" \
  MAX_JOBS=${MAX_JOBS:-$(nproc)} "$py" setup.py build_ext --build-temp "$work/tmp" \
  --build-lib "$work/lib" > "$work.log" 2>&1) || { tail -30 "$work.log"; exit 1; }
so="$(ls "$work"/lib/qwen3_kernels/_C*.so)"
strip --strip-debug "$so"
"$py" - "$so" "$out/$name.so.xz" <<'EOF'
import lzma, shutil, sys
with open(sys.argv[1], "rb") as f, lzma.open(sys.argv[2], "wb", preset=6) as g:
    shutil.copyfileobj(f, g)
EOF
tar -C "$src" -cJf "$out/$name.py.tar.xz" --exclude=__pycache__ --exclude='*.so' \
  qwen3_kernels qwen3_model tests
torch_version="$("$py" -c 'import torch; print(torch.__version__)')"
echo "$(bash "$root/scripts/sources_hash.sh" "$src") $torch_version $(echo $arch | tr ' ' ',')" \
  "$(basename "$so")" \
  > "$out/$name.sources"
echo "prebuilt $out/$name.so.xz ($(du -h "$out/$name.so.xz" | cut -f1)) from $src" \
  "in $(( $(date +%s) - start )) s: $(cat "$out/$name.sources")"
