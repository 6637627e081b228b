"""silu_and_mul, rms_norm, fused_add_rms_norm vs torch eager and torch.compile of the reference.

    cd benchmarks && pytest -q -s bench_elementwise.py

Bytes that must move: each input read once, each output written once. Inputs rotate through enough
sets to exceed the L2 (60 MB); small-T cases replay a CUDA graph of many calls.
Goals (TARGETS.md): >= 4.0 TB/s and >= 1.0x torch.compile at T = 16384; <= 4 us at T <= 256.
"""

import pytest
import torch
import torch.nn.functional as F

import qwen3_kernels
from qwen3_kernels import reference as ref
from common import sets_for, time_gpu

DT = torch.bfloat16
EPS = 1e-6
TOKENS = [16384, 256, 64, 16, 1]


def _compiled(fn):
    return torch.compile(fn, dynamic=False)


@pytest.mark.parametrize("t", TOKENS)
def test_silu_and_mul(t, report):
    inter = 12288  # Qwen3-8B
    nbytes = t * 2 * inter * 2 + t * inter * 2
    n = sets_for(nbytes)
    xs = [torch.randn(t, 2 * inter, dtype=DT, device="cuda") for _ in range(n)]
    outs = [torch.empty(t, inter, dtype=DT, device="cuda") for _ in range(n)]
    comp = _compiled(ref.silu_and_mul)
    ours = time_gpu([lambda x=x, o=o: qwen3_kernels.silu_and_mul(x, out=o) for x, o in zip(xs, outs)],
                    calls_per_replay=64)
    eager = time_gpu([lambda x=x: F.silu(x[:, :inter]) * x[:, inter:] for x in xs], calls_per_replay=64)
    compiled = time_gpu([lambda x=x: comp(x) for x in xs], calls_per_replay=64)
    report("silu_and_mul", f"T={t} I={inter}", ours, {"eager": eager, "compile": compiled}, nbytes=nbytes)


@pytest.mark.parametrize("t", TOKENS)
def test_rms_norm(t, report):
    h = 4096
    nbytes = 2 * t * h * 2
    n = sets_for(nbytes)
    xs = [torch.randn(t, h, dtype=DT, device="cuda") for _ in range(n)]
    outs = [torch.empty_like(x) for x in xs]
    w = torch.randn(h, dtype=DT, device="cuda")
    comp = _compiled(ref.rms_norm)
    ours = time_gpu([lambda x=x, o=o: qwen3_kernels.rms_norm(x, w, EPS, out=o) for x, o in zip(xs, outs)],
                    calls_per_replay=64)
    eager = time_gpu([lambda x=x: F.rms_norm(x, (h,), w, EPS) for x in xs], calls_per_replay=64)
    compiled = time_gpu([lambda x=x: comp(x, w, EPS) for x in xs], calls_per_replay=64)
    report("rms_norm", f"T={t} H={h}", ours, {"eager F.rms_norm": eager, "compile": compiled}, nbytes=nbytes)


@pytest.mark.parametrize("t", TOKENS)
def test_fused_add_rms_norm(t, report):
    h = 4096
    nbytes = 4 * t * h * 2  # read x, residual; write residual, x
    n = sets_for(nbytes)
    xs = [torch.randn(t, h, dtype=DT, device="cuda") for _ in range(n)]
    rs = [torch.randn(t, h, dtype=DT, device="cuda") for _ in range(n)]
    w = torch.randn(h, dtype=DT, device="cuda")

    def eager_fn(x, r):
        r.add_(x)
        x.copy_(F.rms_norm(r, (h,), w, EPS))

    def ref_inplace(x, r, w):
        normed, new_r = ref.fused_add_rms_norm(x, r, w, EPS)
        r.copy_(new_r)
        x.copy_(normed)

    comp = _compiled(ref_inplace)
    ours = time_gpu([lambda x=x, r=r: qwen3_kernels.fused_add_rms_norm(x, r, w, EPS) for x, r in zip(xs, rs)],
                    calls_per_replay=64)
    eager = time_gpu([lambda x=x, r=r: eager_fn(x, r) for x, r in zip(xs, rs)], calls_per_replay=64)
    compiled = time_gpu([lambda x=x, r=r: comp(x, r, w) for x, r in zip(xs, rs)], calls_per_replay=64)
    report("fused_add_rms_norm", f"T={t} H={h}", ours, {"eager": eager, "compile": compiled}, nbytes=nbytes)
