"""linear (x @ W^T, the op the model runs for every projection and the LM head) vs cuBLAS.

    cd benchmarks && pytest -q -s bench_linear.py                  # -> results/bench_linear.json
    cd benchmarks && pytest -q -s bench_linear.py -k vs_cublas     # the fused-QKV shapes by T
    cd benchmarks && pytest -q -s bench_linear.py -k shapes        # every projection at decode T
    cd benchmarks && pytest -q -s bench_linear.py -k invariant     # the deterministic mode's cost

out[T, N] = x[T, K] @ w[N, K]^T in bf16, the kernel the op picks for the shape (GEMV, CUTLASS or
cuBLAS: the choice table in csrc/kernels/gemm/linear.cu) against torch.matmul (cuBLAS). Each case
rotates (x, w, out) sets that together exceed the 60 MB L2 several times, so the weight streams
from HBM as it does in a real forward pass, and cuBLAS runs on the same sets in the same process;
the two are then timed again alternating (common.rematch). Small T report TB/s of the bytes that
must move (the weight, plus x and out); large T report TFLOP/s (2 * T * N * K).
Goals (TARGETS.md): >= 1.3x cuBLAS and >= 3.4 TB/s for T <= 64; >= 1.0x for T >= 1024.
The configurations that no shape picks (and the sweeps that chose the table) are kept on branches
experiment/qkv-gemm-stream and experiment/kernel-launch-variants.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shape list lives with the tests

import qwen3_kernels  # noqa: E402,F401 - registers torch.ops.qwen3_kernels
from common import rematch, sets_for, time_gpu  # noqa: E402
from tests.test_linear import QKV_SHAPES  # noqa: E402

DT = torch.bfloat16
TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 16384]
SMALL_T = 256  # up to here the GEMM is weight streaming: report TB/s
CASES = [(model, t) for model in QKV_SHAPES for t in TOKENS]
IDS = [f"{m}-T{t}" for m, t in CASES]


def _sets(t, n, k):
    set_bytes = (n * k + t * k + t * n) * 2
    gen = torch.Generator(device="cuda").manual_seed(t * 7 + n)
    out = []
    for _ in range(sets_for(set_bytes)):
        x = torch.randn(t, k, device="cuda", generator=gen).to(DT)
        w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(DT)
        out.append((x, w, torch.empty(t, n, device="cuda", dtype=DT)))
    return out


def _ours(sets):
    return [lambda s=s: torch.ops.qwen3_kernels.linear(s[2], s[0], s[1]) for s in sets]


def _cublas(sets):
    return [lambda s=s: torch.matmul(s[0], s[1].t(), out=s[2]) for s in sets]


def _guard(sets):
    x, w, out = sets[0]
    want = torch.matmul(x, w.t())
    err = ((out.float() - want.float()).norm() / want.float().norm()).item()
    assert err < 1e-2, f"our output differs from cuBLAS: relative error {err:.3g}"


def _time_both(t, n, k):
    """(ours, cuBLAS) seconds per call on the same rotated sets, our output checked first."""
    sets = _sets(t, n, k)
    calls = max(len(sets), 8)
    ours = time_gpu(_ours(sets), calls_per_replay=calls)
    _guard(sets)
    base = time_gpu(_cublas(sets), calls_per_replay=calls)
    best = rematch({"ours": _ours(sets), "cublas": _cublas(sets)}, {"ours": ours, "cublas": base},
                   calls_per_replay=calls)
    return best["ours"], best["cublas"]


@pytest.mark.parametrize("model,t", CASES, ids=IDS)
def test_linear_vs_cublas(model, t, report):
    n, k = QKV_SHAPES[model]
    ours, base = _time_both(t, n, k)
    nbytes = (n * k + t * k + t * n) * 2
    report("linear", f"{model} qkv N={n} K={k} T={t}", ours, {"cublas": base},
           nbytes=nbytes if t <= SMALL_T else None, flops=2 * t * n * k if t > SMALL_T else None,
           size=t, size_name="M", note=f"{model} qkv",
           headline=model == "8B" and t in (1, 64, 4096))


# Every projection of the model at decode sizes, per shape, so a shape where cuBLAS wins is
# visible. Shapes from qwen3_model.random_checkpoint.QWEN3_SIZES (head_dim 128, vocab 151936);
# "tp2" is one rank's slice under tensor parallel 2 (column-parallel: N / 2; row-parallel: K / 2;
# the LM head is vocab-parallel).
def _linear_shapes(size, tp):
    from qwen3_model.random_checkpoint import QWEN3_SIZES

    hidden, _, heads, kv, inter, _ = QWEN3_SIZES[size]
    return {
        "qkv": ((heads + 2 * kv) * 128 // tp, hidden),
        "o": (hidden, heads * 128 // tp),
        "gate_up": (2 * inter // tp, hidden),
        "down": (hidden, inter // tp),
        "lm_head": (151936 // tp, hidden),
    }


LINEAR_CASES = [(size, tp, proj, t) for size, tp in (("0.6B", 1), ("8B", 1), ("8B", 2))
                for proj in ("qkv", "o", "gate_up", "down", "lm_head") for t in (1, 2)]


@pytest.mark.parametrize("size,tp,proj,t", LINEAR_CASES,
                         ids=[f"{s}-tp{p}-{j}-T{t}" for s, p, j, t in LINEAR_CASES])
def test_linear_shapes_vs_cublas(size, tp, proj, t, report):
    n, k = _linear_shapes(size, tp)[proj]
    ours, base = _time_both(t, n, k)
    report("linear", f"{size} tp{tp} {proj} N={n} K={k} T={t}", ours, {"cublas": base},
           nbytes=(n * k + t * k + t * n) * 2, size=t, size_name="M")


# The deterministic mode's linear (batch_invariant=True: one data-parallel CUTLASS tile per
# (M, N), linear.cu's choose_invariant) against the default choice (GEMV, CUTLASS or cuBLAS) on
# Qwen3-8B's projections, at the token counts of its engine steps: batch 1, decode batches, and
# the 384-token mixed steps of the throughput schedule. ours / default < 1 is what the mode costs.
INVARIANT_CASES = [(proj, t) for proj in ("qkv", "o", "gate_up", "down", "lm_head")
                   for t in (1, 16, 64, 128, 176, 256, 384, 512, 2048)]


@pytest.mark.parametrize("proj,t", INVARIANT_CASES,
                         ids=[f"8B-{j}-T{t}" for j, t in INVARIANT_CASES])
def test_linear_batch_invariant_vs_default(proj, t, report):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the batch-invariant linear runs on compute capability 9.0 only")
    n, k = _linear_shapes("8B", 1)[proj]
    sets = _sets(t, n, k)
    calls = max(len(sets), 8)
    mode = [lambda s=s: torch.ops.qwen3_kernels.linear(s[2], s[0], s[1], True) for s in sets]
    ours = time_gpu(mode, calls_per_replay=calls)
    _guard(sets)
    default = time_gpu(_ours(sets), calls_per_replay=calls)
    best = rematch({"ours": mode, "default": _ours(sets)}, {"ours": ours, "default": default},
                   calls_per_replay=calls)
    report("linear_batch_invariant", f"8B {proj} N={n} K={k} T={t}", best["ours"],
           {"default": best["default"]}, nbytes=(n * k + t * k + t * n) * 2 if t <= SMALL_T
           else None, flops=2 * t * n * k if t > SMALL_T else None, size=t, size_name="M")

