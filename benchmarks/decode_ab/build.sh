#!/usr/bin/env bash
# Builds build/ab from main.cu and the variants of decode.cu given as name:file (see main.cu's
# header and ../ab_variants.sh), each with stubs.inc for the prefill kernels it calls into.
#   git show main:csrc/kernels/attention/decode.cu > /tmp/main.cu
#   bash benchmarks/decode_ab/build.sh main:/tmp/main.cu tree:csrc/kernels/attention/decode.cu
#   benchmarks/decode_ab/build/ab [rounds]  # on the GPU: carry benchmarks/decode_ab/build
here="$(cd "$(dirname "$0")" && pwd)"
STUBS="$here/stubs.inc" exec bash "$here/../ab_variants.sh" "$here" "$@"
