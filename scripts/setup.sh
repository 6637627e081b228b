#!/usr/bin/env bash
# Set up a virtual environment (.venv) with everything the package, its tests and benchmarks need,
# and install the package editable. With a CUDA build of torch and nvcc on PATH this builds the
# kernels; otherwise the ops run their PyTorch reference (qwen3_kernels.has_cuda_kernels() says so).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first (2.13.0: the CPU build on CI machines; use your CUDA build of torch on a GPU box by
# installing it into .venv before running this script).
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q "transformers==5.17.0" safetensors tqdm pytest pytest-benchmark \
  ninja pybind11 "nvidia-cutlass==4.2.0.0" fastapi uvicorn openai
MAX_JOBS=${MAX_JOBS:-4} python -m pip install -q --no-build-isolation --no-deps -e .
python -c "import qwen3_kernels as q; print('qwen3_kernels', q.__version__, '| CUDA kernels:', q.has_cuda_kernels())"
