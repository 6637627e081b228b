#!/usr/bin/env bash
# Prints one hash of what the extension is built from (csrc/ and setup.py of TREE, default this
# checkout): scripts/prebuild.sh records it, scripts/gpu_round.sh compares it.
set -euo pipefail
cd "${1:-$(dirname "$0")/..}"
find csrc setup.py -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
