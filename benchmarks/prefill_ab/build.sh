#!/usr/bin/env bash
# Builds build/ab from main.cu and the variants of prefill_sm90_ws.cu given as name:file (see
# main.cu's header and ../ab_variants.sh).
exec bash "$(dirname "$0")/../ab_variants.sh" "$(dirname "$0")" "$@"
