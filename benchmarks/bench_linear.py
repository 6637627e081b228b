"""linear vs cuBLAS (torch.matmul) on the Qwen3 fused-QKV shapes, and every configuration.

    cd benchmarks && pytest -q -s bench_linear.py                  # both parts
    cd benchmarks && pytest -q -s bench_linear.py -k vs_cublas     # ours (the table's choice) vs cuBLAS
    cd benchmarks && pytest -q -s bench_linear.py -k configs       # every config, best per case
    cd benchmarks && pytest -q -s bench_linear.py -k gemv          # gemv vs cuBLAS, T=1,3,8

out[T, N] = x[T, K] @ w[N, K]^T in bf16. Each case rotates (x, w, out) sets that together exceed
the 60 MB L2 several times, so the weight streams from HBM as it does in a real forward pass, and
cuBLAS runs on the same sets in the same process. Small T report TB/s of the bytes that must move
(the weight, plus x and out); large T report TFLOP/s (2 * T * N * K).
Goals (TARGETS.md / issue 7): >= 1.3x cuBLAS and >= 3.4 TB/s for T <= 64; >= 1.0x for T >= 1024.

The "configs" part times each configuration of the dispatcher (QWEN3_LINEAR_FORCE) on every
case and prints the fastest: the evidence for the choice table in csrc/kernels/gemm/linear.cu.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shape list lives with the tests

import qwen3_kernels  # noqa: E402
from common import sets_for, time_gpu  # noqa: E402
from tests.test_linear import QKV_SHAPES  # noqa: E402

DT = torch.bfloat16
TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 16384]
SMALL_T = 256  # up to here the GEMM is weight streaming: report TB/s
CASES = [(model, t) for model in QKV_SHAPES for t in TOKENS]
IDS = [f"{m}-T{t}" for m, t in CASES]

# Candidates per T range for the configs sweep (config[:mode], see linear.cu). "splitk" is the
# kernel measured on 2026-11-29 (without a count it now takes the 4 / 2 / 1 rule); splitk_pf and
# splitk_pdl are its L2-prefetch and PDL variants, not yet measured; gemv[:R] is the CUDA-core
# weight-streaming GEMV (M <= 8, R weight rows per warp), not yet measured either.
GEMV = ["gemv", "gemv:1", "gemv:2", "gemv:4"]


def _candidates(t):
    if t <= 64:
        return ["splitk", "splitk:2", "splitk:3", "splitk:4", "splitk_pf", "splitk_pf:2",
                "splitk_pdl", "splitk_pdl:2", "swap_128x64:streamk", "swap_128x64:heuristic",
                "tile_128x128:heuristic"] + (GEMV if t <= 8 else [])
    if t <= 512:
        return ["swap_128x64:streamk", "swap_128x64:heuristic", "tile_128x128:heuristic",
                "tile_128x128:streamk", "tile_128x128:dp", "tile_128x256:heuristic"]
    return ["tile_128x128:heuristic", "tile_128x128:dp", "tile_128x256:heuristic",
            "tile_128x256:dp", "tile_128x256:streamk"]


_VS_CUBLAS: dict = {}  # (model, t) -> (ours_s, cublas_s, rate text)
_BEST: dict = {}  # (model, t) -> [(seconds, config)] sorted


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


def _with_force(value, fn):
    old = os.environ.get("QWEN3_LINEAR_FORCE")
    os.environ["QWEN3_LINEAR_FORCE"] = value
    try:
        return fn()
    finally:
        if old is None:
            del os.environ["QWEN3_LINEAR_FORCE"]
        else:
            os.environ["QWEN3_LINEAR_FORCE"] = old


def _guard(sets):
    x, w, out = sets[0]
    want = torch.matmul(x, w.t())
    err = ((out.float() - want.float()).norm() / want.float().norm()).item()
    assert err < 1e-2, f"our output differs from cuBLAS: relative error {err:.3g}"


@pytest.fixture(scope="module")
def summary():
    yield
    if _VS_CUBLAS:
        print("\n\nlinear vs cuBLAS, bf16 (us ours / us cuBLAS, speed-up, rate)")
        models = list(QKV_SHAPES)
        print("| T | " + " | ".join(f"{m} N={QKV_SHAPES[m][0]} K={QKV_SHAPES[m][1]}" for m in models) + " |")
        print("|---" * (len(models) + 1) + "|")
        for t in TOKENS:
            cells = []
            for m in models:
                r = _VS_CUBLAS.get((m, t))
                cells.append("" if r is None else f"{r[0] * 1e6:.1f} / {r[1] * 1e6:.1f}, "
                             f"{r[1] / r[0]:.2f}x, {r[2]}")
            print(f"| {t} | " + " | ".join(cells) + " |")
    if _BEST:
        print("\n\nlinear configurations: fastest per case (us), runner-up in brackets")
        for (m, t), ranked in sorted(_BEST.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            best = ranked[0]
            second = f" [{ranked[1][1]} {ranked[1][0] * 1e6:.1f}]" if len(ranked) > 1 else ""
            print(f"T={t:>5} {m:>5}: {best[1]:<24} {best[0] * 1e6:8.1f}{second}")
        # the same winners laid out like kTable in csrc/kernels/gemm/linear.cu (rows T, columns
        # the shapes), with the runner-up's margin where it is within 2% (a tie, not a choice)
        models = list(QKV_SHAPES)
        print("\nas kTable: T | " + " | ".join(models))
        for t in sorted({t for _, t in _BEST}):
            cells = []
            for m in models:
                ranked = _BEST.get((m, t))
                if not ranked:
                    cells.append("-")
                    continue
                tie = len(ranked) > 1 and ranked[1][0] <= ranked[0][0] * 1.02
                cells.append(ranked[0][1] + (f" (~{ranked[1][1]})" if tie else ""))
            print(f"{t:>5} | " + " | ".join(cells))


@pytest.mark.parametrize("model,t", CASES, ids=IDS)
def test_linear_vs_cublas(model, t, report, summary):
    n, k = QKV_SHAPES[model]
    sets = _sets(t, n, k)
    calls = max(len(sets), 8)
    ours = time_gpu(_ours(sets), calls_per_replay=calls)
    _guard(sets)
    base = time_gpu([lambda s=s: torch.matmul(s[0], s[1].t(), out=s[2]) for s in sets],
                    calls_per_replay=calls)
    nbytes = (n * k + t * k + t * n) * 2
    flops = 2 * t * n * k
    row = report("linear", f"{model} N={n} K={k} T={t}", ours, {"cublas": base},
                 nbytes=nbytes if t <= SMALL_T else None, flops=flops if t > SMALL_T else None)
    rate = f"{row['tbs']:.2f} TB/s" if "tbs" in row else f"{row['tflops']:.0f} TFLOP/s"
    _VS_CUBLAS[(model, t)] = (ours, base, rate)


@pytest.mark.parametrize("model,t", CASES, ids=IDS)
def test_linear_configs(model, t, summary):
    n, k = QKV_SHAPES[model]
    sets = _sets(t, n, k)
    calls = max(len(sets), 8)
    times = []
    for config in _candidates(t):
        def run():
            s = time_gpu(_ours(sets), calls_per_replay=calls)
            _guard(sets)
            return s
        try:
            times.append((_with_force(config, run), config))
        except Exception as e:  # noqa: BLE001 - a config that cannot run this case is skipped
            print(f"\n[configs] {model} T={t} {config}: {type(e).__name__}: {str(e)[:100]}")
    times.sort()
    _BEST[(model, t)] = times
    nbytes = (n * k + t * k + t * n) * 2
    line = ", ".join(f"{c} {s * 1e6:.1f}" for s, c in times)
    print(f"\n[configs] {model} N={n} K={k} T={t}: {line}  -> best {times[0][1]} "
          f"({nbytes / times[0][0] / 1e12:.2f} TB/s, {2 * t * n * k / times[0][0] / 1e12:.0f} TFLOP/s)")


def _cublas_and_ours(sets):
    """cuBLAS's time per call on the rotated sets, and a function timing our op on them under the
    current QWEN3_LINEAR_FORCE (see _with_force), checking its output against cuBLAS."""
    calls = max(len(sets), 8)
    base = time_gpu([lambda s=s: torch.matmul(s[0], s[1].t(), out=s[2]) for s in sets],
                    calls_per_replay=calls)

    def run():
        s = time_gpu(_ours(sets), calls_per_replay=calls)
        _guard(sets)
        return s

    return base, run


GEMV_TOKENS = [1, 3, 8]
GEMV_CASES = [(model, t) for model in QKV_SHAPES for t in GEMV_TOKENS]


@pytest.mark.parametrize("model,t", GEMV_CASES, ids=[f"{m}-T{t}" for m, t in GEMV_CASES])
def test_linear_gemv_vs_cublas(model, t, report):
    """Each gemv variant next to the table's choice (auto) and cuBLAS at decode sizes.

    One report row per variant (baselines: cuBLAS and auto), so the table at the end shows TB/s
    and both speed-ups; the [gemv] line lists all of them for the case.
    """
    n, k = QKV_SHAPES[model]
    base, run = _cublas_and_ours(_sets(t, n, k))
    auto = _with_force("auto", run)
    nbytes = (n * k + t * k + t * n) * 2
    times = {}
    for config in GEMV:
        times[config] = _with_force(config, run)
        report("linear", f"{model} N={n} K={k} T={t} {config}", times[config],
               {"cublas": base, "auto": auto}, nbytes=nbytes)
    line = ", ".join(f"{c} {s * 1e6:.1f} ({nbytes / s / 1e12:.2f} TB/s)" for c, s in times.items())
    print(f"\n[gemv] {model} N={n} K={k} T={t}: cublas {base * 1e6:.1f} "
          f"({nbytes / base / 1e12:.2f} TB/s), auto {auto * 1e6:.1f} "
          f"({nbytes / auto / 1e12:.2f} TB/s), {line}")


# Every projection of the model at decode sizes: what qwen3_model/layers/linear.py's GEMV_MAX_TOKENS
# rule runs (our table's choice at T = 1, the GEMV) next to cuBLAS, per shape, so a shape where
# cuBLAS wins is visible. Shapes from qwen3_model.random_checkpoint.QWEN3_SIZES (head_dim 128,
# vocab 151936); "tp2" is one rank's slice under tensor parallel 2 (column-parallel: N / 2;
# row-parallel: K / 2; the LM head is vocab-parallel).
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
    base, run = _cublas_and_ours(_sets(t, n, k))
    times = {c: _with_force(c, run) for c in ["auto"] + (GEMV if t <= 8 else [])}
    nbytes = (n * k + t * k + t * n) * 2
    report("linear", f"{size} tp{tp} {proj} N={n} K={k} T={t} auto", times["auto"],
           {"cublas": base}, nbytes=nbytes)
    line = ", ".join(f"{c} {s * 1e6:.1f} ({nbytes / s / 1e12:.2f} TB/s)" for c, s in times.items())
    print(f"\n[linear] {size} tp{tp} {proj} N={n} K={k} T={t}: cublas {base * 1e6:.1f} "
          f"({nbytes / base / 1e12:.2f} TB/s), {line}; cublas/auto {base / times['auto']:.2f}x")


# The decode steps of the nano-vllm workload at 8B run every projection at T = 128..256 through
# cuBLAS (the table's CB cells, and linear.py's rule for o / gate_up / down). The step profile
# (RESULTS.md, fifth session) found o_proj at 502 TFLOP/s and down (cuBLAS split-K) at 578 against
# gate_up's 701: this times each CUTLASS configuration of ours on those shapes next to cuBLAS, so a
# cell where one wins can become a table entry.
WORKLOAD_CASES = [(proj, t) for proj in ("o", "down", "qkv", "gate_up") for t in (128, 256)]


@pytest.mark.parametrize("proj,t", WORKLOAD_CASES, ids=[f"8B-{p}-T{t}" for p, t in WORKLOAD_CASES])
def test_workload_shapes_configs(proj, t, report):
    n, k = _linear_shapes("8B", 1)[proj]
    base, run = _cublas_and_ours(_sets(t, n, k))
    candidates = ["swap_128x64:heuristic", "swap_128x64:streamk", "swap_128x64:dp",
                  "tile_128x128:heuristic", "tile_128x128:streamk", "tile_128x128:dp",
                  "tile_128x128:split2", "tile_128x256:heuristic", "tile_128x256:streamk"]
    times = {}
    for config in candidates:
        try:
            times[config] = _with_force(config, run)
        except Exception as e:  # noqa: BLE001 - a config that cannot run this case is skipped
            print(f"\n[workload] 8B {proj} T={t} {config}: {type(e).__name__}: {str(e)[:100]}")
    best = min(times, key=times.get)
    flops = 2 * t * n * k
    report("linear", f"8B {proj} N={n} K={k} T={t} {best}", times[best], {"cublas": base},
           flops=flops)
    line = ", ".join(f"{c} {s * 1e6:.1f}" for c, s in sorted(times.items(), key=lambda i: i[1]))
    print(f"\n[workload] 8B {proj} N={n} K={k} T={t}: cublas {base * 1e6:.1f} us "
          f"({flops / base / 1e12:.0f} TFLOP/s); {line}; best/cublas {base / times[best]:.2f}x")


# o and down of Qwen3-8B, whole and as one TP-2 rank's shard, at the decode graphs' batch sizes
# 96..256 (multiples of 16, the bucket sizes of the captured graphs): cuBLAS against our swapped
# tiles, forced; `auto` is what the op's table runs (cuBLAS on these shapes). Seventh session:
# swap_128x64 won 1.03-1.32x at some T in 160..240, but routing those cells through the op made
# the 8B workload 0.8% slower (branch experiment/projection-cells, RESULTS.md).
SWEEP_CASES = [(tp, proj, t) for tp in (1, 2) for proj in ("o", "down") for t in range(96, 257, 16)]


@pytest.mark.parametrize("tp,proj,t", SWEEP_CASES,
                         ids=[f"8B-tp{tp}-{p}-T{t}" for tp, p, t in SWEEP_CASES])
def test_projection_sweep(tp, proj, t, report):
    n, k = _linear_shapes("8B", tp)[proj]
    base, run = _cublas_and_ours(_sets(t, n, k))
    times = {c: _with_force(c, run) for c in ("auto", "swap_128x64:heuristic", "swap_128x64:dp",
                                              "swap_128x64:streamk", "tile_128x128:split2")}
    best = min(times, key=times.get)
    report("linear", f"8B tp{tp} {proj} N={n} K={k} T={t} auto", times["auto"], {"cublas": base},
           flops=2 * t * n * k)
    line = ", ".join(f"{c} {s * 1e6:.1f}" for c, s in sorted(times.items(), key=lambda i: i[1]))
    print(f"\n[sweep] 8B tp{tp} {proj} N={n} K={k} T={t}: cublas {base * 1e6:.1f} us; {line}; "
          f"best {best} {base / times[best]:.2f}x, auto {base / times['auto']:.2f}x")


# The wgmma streaming kernel (linear_stream.cu, M <= 128: 256 weight rows x all tokens a CTA,
# K split over a cluster) against cuBLAS on Qwen3-8B's projections at the workload's decode batch
# sizes, at its default split count and a few others. cuBLAS is timed again after ours (each its
# best of two, alternating) against the order bias RESULTS.md (ninth session) found.
STREAM_CASES = [(proj, t) for proj in ("qkv", "o", "down", "gate_up") for t in (16, 32, 64, 96, 128)]


@pytest.mark.parametrize("proj,t", STREAM_CASES, ids=[f"8B-{p}-T{t}" for p, t in STREAM_CASES])
def test_stream_vs_cublas(proj, t, report):
    n, k = _linear_shapes("8B", 1)[proj]
    sets = _sets(t, n, k)
    base, run = _cublas_and_ours(sets)
    times = {c: _with_force(c, run) for c in ("stream", "stream:2", "stream:4", "stream:6", "stream:8")}
    calls = max(len(sets), 8)
    base = min(base, time_gpu([lambda s=s: torch.matmul(s[0], s[1].t(), out=s[2]) for s in sets],
                              calls_per_replay=calls))
    times["stream"] = min(times["stream"], _with_force("stream", run))
    best = min(times, key=times.get)
    nbytes = (n * k + t * k + t * n) * 2
    report("linear", f"8B {proj} N={n} K={k} T={t} stream", times["stream"], {"cublas": base},
           nbytes=nbytes)
    line = ", ".join(f"{c} {s * 1e6:.1f}" for c, s in sorted(times.items(), key=lambda i: i[1]))
    print(f"\n[stream] 8B {proj} N={n} K={k} T={t}: cublas {base * 1e6:.1f} us "
          f"({nbytes / base / 1e12:.2f} TB/s); {line}; stream {nbytes / times['stream'] / 1e12:.2f} "
          f"TB/s, {base / times['stream']:.2f}x cublas; best {best} {base / times[best]:.2f}x")
