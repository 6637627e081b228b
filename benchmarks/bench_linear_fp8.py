"""linear_fp8 (the FP8 block-scaled projection of Qwen3-*-FP8 checkpoints) vs cuBLAS and torch.

    cd benchmarks && pytest -q -s bench_linear_fp8.py          # -> results/bench_linear_fp8.json
    cd benchmarks && pytest -q -s bench_linear_fp8.py -k gemm       # (a) prefill M, TFLOP/s
    cd benchmarks && pytest -q -s bench_linear_fp8.py -k decode     # (b) decode T, TB/s
    cd benchmarks && pytest -q -s bench_linear_fp8.py -k "gemm and 8B"   # a quarter of (a)

(a) M = 2048, 4096, 8192 tokens on the Qwen3-8B and 32B projection shapes, TFLOP/s (2 M N K).
"ours" is the op on bf16 activations: quantize_fp8 into the op's workspace, then the CUTLASS
block-scaled GEMM (csrc/kernels/gemm/linear_fp8_sm90.cu). Each row also records quantize_fp8
alone on the same x (quantize_us) and the op on x quantized already (gemm_us, gemm_rate, and
gemm_vs: each FP8 baseline's time over it), which is how the model runs it above one token (the
norms and silu_and_mul hand it quantized x) and the same work as torch's FP8 GEMMs. Baselines,
same process, same shapes:
  - cublas_bf16: torch.matmul on the bf16 dequantized weight (the row's ratio; goal >= 1.6x);
  - scaled_mm_blockwise: torch's own FP8 GEMM with the same scaling (1 x 128 activation groups,
    128 x 128 weight blocks) on pre-quantized input, so without the quantization ours pays
    (goal >= 1.0x); "unavailable" with torch's reason where this torch / GPU does not run it;
  - scaled_mm_tensorwise: torch._scaled_mm with one scale per tensor: the FP8 GEMM with no
    block scales to apply, the ceiling for FP8 on this GPU.
Compute-bound and long (up to 6 ms a call): timed eagerly, 3 calls a path, then once more
alternating (common.rematch). Part (a) in full is about 10 minutes of H200 time.
(b) T = 1, 16, 64 on the 8B shapes: ours vs cuBLAS bf16, TB/s of the bytes ours must move (the
e4m3 weight, its scales, x and out); baseline_tbs is cuBLAS's own (its bf16 weight is twice the
bytes). T = 1 measures the FP8 GEMV (linear_fp8_gemv.cu) through the same op, T = 16 its pass
over a few tokens (qkv, o, down; gate_up's N >= 16384 takes the GEMM there), T = 64 the CUTLASS
GEMM (csrc/kernels/gemm/linear_fp8.cu picks). Input sets rotate
past the L2 and calls are replayed from a CUDA graph, as in bench_linear.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import qwen3_kernels  # noqa: E402 - registers torch.ops.qwen3_kernels
from common import rematch, sets_for, time_gpu  # noqa: E402
from qwen3_kernels import reference as ref  # noqa: E402

BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn
G = ref.FP8_GROUP

# (N, K) of each projection: rows of the weight, its input width (Qwen3 head_dim 128).
SHAPES = {
    "8B": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
           "down": (4096, 12288)},
    "32B": {"qkv": (10240, 5120), "o": (5120, 8192), "gate_up": (51200, 5120),
            "down": (5120, 25600)},
}
GEMM_M = (2048, 4096, 8192)
GEMM_CASES = [(model, proj, m) for model in SHAPES for proj in SHAPES[model] for m in GEMM_M]
DECODE_T = (1, 16, 64)
DECODE_CASES = [("8B", proj, t) for proj in SHAPES["8B"] for t in DECODE_T]
# Guards, relative Frobenius error: ours and torch's block-scaled GEMM compute the same quantized
# product (differences: summation order, bf16 rounding); cuBLAS bf16 skips the activation
# quantization (e4m3 rounding of x: a few % of the product).
SAME_MATH = 1e-2
VS_BF16 = 5e-2


def _weight(n, k, gen):
    """e4m3 [n, k] and weight_scale_inv [ceil(n/128), ceil(k/128)], as a checkpoint holds."""
    w = (torch.randn(n, k, device="cuda", generator=gen) * 100).clamp(-448, 448).to(E4M3)
    s = torch.rand(-(-n // G), -(-k // G), device="cuda", generator=gen) * 1e-3 + 1e-4
    return w, s


def _bf16_weight(w, s):
    return ref.dequantize_fp8(w, s, G).to(BF16)


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _blockwise(xq, x_scales, w, s):
    """torch's FP8 GEMM with our scaling, or (None, why not). x_scales [M, K/128] token-contiguous
    (strides (1, M), torch's "outer-dim-major" 1 x 128 layout), s [N/128, K/128] row-major,
    passed transposed to match mat_b = w^T [K, N]."""
    import torch.nn.functional as F

    tries = []
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        st = F.ScalingType
        tries.append(("F.scaled_mm BlockWise1x128 x BlockWise128x128", lambda: F.scaled_mm(
            xq, w.t(), x_scales, st.BlockWise1x128, s.t(), st.BlockWise128x128,
            output_dtype=BF16)))
    tries.append(("torch._scaled_mm with block scales", lambda: torch._scaled_mm(
        xq, w.t(), scale_a=x_scales, scale_b=s.t(), out_dtype=BF16)))
    why = []
    for name, fn in tries:
        try:
            fn()
            torch.cuda.synchronize()
            return name, fn
        except Exception as e:  # noqa: BLE001 - any refusal means "unavailable", with its reason
            torch.cuda.synchronize()
            why.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    return None, "; ".join(why)


def _tensorwise(xq, w):
    one = torch.ones((), device="cuda")
    return lambda: torch._scaled_mm(xq, w.t(), scale_a=one, scale_b=one, out_dtype=BF16)


@pytest.mark.parametrize("model,proj,m", GEMM_CASES,
                         ids=[f"gemm-{a}-{p}-M{m}" for a, p, m in GEMM_CASES])
def test_linear_fp8_gemm(model, proj, m, report):
    n, k = SHAPES[model][proj]
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", generator=gen).to(BF16)
    w, s = _weight(n, k, gen)
    w16 = _bf16_weight(w, s)
    out = torch.empty(m, n, device="cuda", dtype=BF16)
    out16 = torch.empty(m, n, device="cuda", dtype=BF16)
    outq = torch.empty(m, n, device="cuda", dtype=BF16)
    xq, x_scales = qwen3_kernels.quantize_fp8(x)  # the op's own quantization, pre-computed

    paths = {
        "ours": [lambda: torch.ops.qwen3_kernels.linear_fp8(out, x, w, s)],
        "ours_quantized": [lambda: torch.ops.qwen3_kernels.linear_fp8(outq, xq, w, s, x_scales)],
        "cublas_bf16": [lambda: torch.matmul(x, w16.t(), out=out16)],
        "scaled_mm_tensorwise": [_tensorwise(xq, w)],
    }
    for p in ("ours", "ours_quantized", "cublas_bf16"):
        paths[p][0]()
    err16 = _rel(out, out16)
    assert err16 < VS_BF16, f"ours vs cuBLAS bf16: relative error {err16:.3g}"
    errq = _rel(outq, out)
    assert errq < SAME_MATH, f"linear_fp8 on quantize_fp8(x) vs on x: relative error {errq:.3g}"
    unavailable = {}
    name, fn = _blockwise(xq, x_scales, w, s)
    if name is None:
        unavailable["scaled_mm_blockwise"] = fn
    else:
        err = _rel(out, fn())
        if err < SAME_MATH:
            paths["scaled_mm_blockwise"] = [fn]
        else:  # torch read the scales another way: not the same product, not a baseline
            unavailable["scaled_mm_blockwise"] = f"{name} differs from ours by {err:.3g}"

    kw = dict(graph=False, reps=3)
    best = {p: time_gpu(fns, **kw) for p, fns in paths.items()}
    best = rematch(paths, best, rounds=1, **kw)
    quant = time_gpu([lambda: torch.ops.qwen3_kernels.quantize_fp8(xq, x_scales, x)], reps=10,
                     calls_per_replay=8)
    ours, gemm = best.pop("ours"), best.pop("ours_quantized")
    row = report("linear_fp8", f"{model} {proj} N={n} K={k} M={m}", ours, best,
                 baseline="cublas_bf16", flops=2 * m * n * k, size=m, size_name="M",
                 note=f"{model} {proj}" + (f"; blockwise via {name}" if name else ""),
                 headline=model == "8B" and proj == "gate_up" and m == 4096)
    row["quantize_us"] = quant * 1e6
    row["gemm_us"] = gemm * 1e6
    row["gemm_rate"] = 2 * m * n * k / gemm / 1e12
    row["gemm_vs"] = {p: t / gemm for p, t in best.items() if p.startswith("scaled_mm")}
    row["unavailable"] = unavailable
    print(f"[bench] quantize_fp8 {quant * 1e6:.1f} us; on quantized x {row['gemm_rate']:.0f} "
          f"TFLOP/s, vs {', '.join(f'{p} {r:.2f}x' for p, r in row['gemm_vs'].items())}; "
          f"unavailable: {unavailable or 'none'}")


def _decode_sets(t, n, k):
    gen = torch.Generator(device="cuda").manual_seed(t * 7 + n)
    fp8_bytes = n * k + 4 * (-(-n // G)) * (-(-k // G)) + t * k * 2 + t * n * 2
    sets = []
    for _ in range(sets_for(fp8_bytes)):
        x = torch.randn(t, k, device="cuda", generator=gen).to(BF16)
        w, s = _weight(n, k, gen)
        sets.append(dict(x=x, w=w, s=s, w16=_bf16_weight(w, s),
                         out=torch.empty(t, n, device="cuda", dtype=BF16),
                         out16=torch.empty(t, n, device="cuda", dtype=BF16)))
    return sets, fp8_bytes


@pytest.mark.parametrize("model,proj,t", DECODE_CASES,
                         ids=[f"decode-{a}-{p}-T{t}" for a, p, t in DECODE_CASES])
def test_linear_fp8_decode(model, proj, t, report):
    n, k = SHAPES[model][proj]
    sets, fp8_bytes = _decode_sets(t, n, k)
    ours = [lambda d=d: torch.ops.qwen3_kernels.linear_fp8(d["out"], d["x"], d["w"], d["s"])
            for d in sets]
    cublas = [lambda d=d: torch.matmul(d["x"], d["w16"].t(), out=d["out16"]) for d in sets]
    calls = max(len(sets), 8)
    t_ours = time_gpu(ours, calls_per_replay=calls)
    d = sets[0]
    err = _rel(d["out"], torch.matmul(d["x"], d["w16"].t()))
    assert err < VS_BF16, f"ours vs cuBLAS bf16: relative error {err:.3g}"
    t_base = time_gpu(cublas, calls_per_replay=calls)
    best = rematch({"ours": ours, "cublas_bf16": cublas}, {"ours": t_ours, "cublas_bf16": t_base},
                   calls_per_replay=calls)
    row = report("linear_fp8", f"{model} {proj} N={n} K={k} T={t}", best["ours"],
                 {"cublas_bf16": best["cublas_bf16"]}, nbytes=fp8_bytes, size=t,
                 size_name="M", note=f"{model} {proj} decode",
                 headline=model == "8B" and proj == "qkv" and t == 16)
    bf16_bytes = 2 * n * k + t * k * 2 + t * n * 2
    row["baseline_tbs"] = bf16_bytes / best["cublas_bf16"] / 1e12
    print(f"[bench] cuBLAS bf16 moves {bf16_bytes / 1e6:.1f} MB: {row['baseline_tbs']:.2f} TB/s")
