"""CUDA: linear vs the fp32 reference, held to the FlashAttention-3 rule.

Our error (vs x.float() @ w.float().T) must be at most twice cuBLAS's error doing the same GEMM
in the same 16-bit dtype (torch.matmul), plus a tiny epsilon; measured as the max abs error and as
the relative Frobenius error. Outputs are poisoned with NaN first so an unwritten element fails.
Every configuration of the dispatcher (QWEN3_LINEAR_FORCE) is tested on its own as well, so
the choice table can change without losing coverage.
"""

import pytest
import torch

import qwen3_kernels
from tests.helpers import rel_err, requires_cuda
from tests.test_linear import QKV_SHAPES, TOKENS

pytestmark = requires_cuda

# Every T on two shapes (the smallest and the most common large one); a spread on the others.
SOME_TOKENS = [1, 16, 33, 64, 256, 1024, 4096]
CASES = [
    (model, t)
    for model in QKV_SHAPES
    for t in (TOKENS if model in ("0.6B", "8B") else SOME_TOKENS)
]
CASES.append(("32B", 16384))


def _inputs(t, n, k, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, k, device="cuda", dtype=torch.float32, generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", dtype=torch.float32, generator=g) * k**-0.5).to(dtype)
    return x, w


def _check(x, w, out):
    """The FA3 rule against cuBLAS in the same dtype, both vs fp32; every element written."""
    assert not out.isnan().any(), "some outputs were not written (still NaN)"
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        want = x.float() @ w.float().t()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    cublas = torch.matmul(x, w.t())
    ours_max = (out.float() - want).abs().max().item()
    base_max = (cublas.float() - want).abs().max().item()
    eps = 1e-5 * want.abs().max().item() + 1e-6
    assert ours_max <= 2 * base_max + eps, (ours_max, base_max)
    ours_rel, base_rel = rel_err(out, want), rel_err(cublas, want)
    assert ours_rel <= 2 * base_rel + 1e-6, (ours_rel, base_rel)


def _eager_then_replayed(step, check, refresh):
    """step() eagerly, then captured in a CUDA graph and replayed twice, each time after
    refresh(seed) put new inputs in place (and poisoned the outputs); check() after each run."""
    step()
    torch.cuda.synchronize()
    check()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for seed in (1, 2):
        refresh(seed)
        g.replay()
        torch.cuda.synchronize()
        check()


@pytest.fixture
def force(monkeypatch):
    """Pin the dispatcher to one configuration for the test (read by the launcher per call)."""
    def set_config(value):
        monkeypatch.setenv("QWEN3_LINEAR_FORCE", value)
    monkeypatch.delenv("QWEN3_LINEAR_FORCE", raising=False)
    return set_config


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model,t", CASES, ids=[f"{m}-T{t}" for m, t in CASES])
def test_linear_qwen3_shapes(model, t, dtype, force):
    n, k = QKV_SHAPES[model]
    x, w = _inputs(t, n, k, dtype)
    out = torch.full((t, n), float("nan"), device="cuda", dtype=dtype)
    qwen3_kernels.linear(x, w, out=out)
    _check(x, w, out)


# (config, T, N, K): each configuration on its own, with odd sizes on purpose: N not a multiple
# of 64 / 128 (partial row blocks and tiles), K not a multiple of 64 / 128 (K tails), T that fill
# no tile exactly.
FORCED = [
    ("splitk", t, n, k)
    for t in (1, 5, 8, 9, 16, 17, 32, 33, 64)
    for n, k in ((6144, 4096), (72, 1032), (4104, 200))
] + [
    (f"splitk:{s}", 13, 1032, 2056) for s in (1, 2, 3, 5, 8)
] + [
    # the L2-prefetch / PDL variants: K tails shorter than the prefetch distance, one-step splits
    (f"{name}{splits}", t, n, k)
    for name in ("splitk_pf", "splitk_pdl")
    for splits in ("", ":1", ":3", ":8")
    for t, n, k in ((1, 6144, 4096), (17, 72, 1032), (64, 4104, 200))
] + [
    (f"swap_128x64:{mode}", t, n, k)
    for mode in ("streamk", "heuristic", "dp", "split3")
    for t, n, k in ((1, 6144, 4096), (33, 4104, 1032), (64, 72, 2056))
] + [
    (f"{cfg}:{mode}", t, n, k)
    for cfg in ("tile_128x128", "tile_128x256")
    for mode in ("heuristic", "dp", "streamk", "split2")
    for t, n, k in ((1, 4096, 1024), (65, 6144, 2560), (777, 4104, 1032), (2048, 10240, 5120))
] + [
    # the wgmma streaming kernel (M <= 128): 64- and 128-token tiles, a partial last row block
    # (N = 4104, 520, 72), K tails (1032, 200, 2056), every split count incl. more splits than K
    # blocks (K = 200 has 4), and Qwen3-8B's o / down shapes
    (f"stream{splits}", t, n, k)
    for splits in ("", ":1", ":3", ":8")
    for t, n, k in ((1, 6144, 4096), (17, 4104, 1032), (64, 72, 2056), (65, 520, 200),
                    (100, 4096, 12288), (128, 4104, 1032))
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config,t,n,k", FORCED, ids=[f"{c}-T{t}-N{n}-K{k}" for c, t, n, k in FORCED])
def test_linear_each_config(config, t, n, k, dtype, force):
    force(config)
    x, w = _inputs(t, n, k, dtype, seed=t + n + k)
    out = torch.full((t, n), float("nan"), device="cuda", dtype=dtype)
    torch.ops.qwen3_kernels.linear(out, x, w)
    _check(x, w, out)


# gemv (M <= 8; the choice table takes it at M = 1): every weight-rows-per-warp variant on every shape
# case above with T <= 8, plus T = 1, 3, 8 on every shape (T = 3 runs as 4 with a masked row).
GEMV_VARIANTS = ["gemv", "gemv:1", "gemv:2", "gemv:4"]
GEMV_SHAPE_CASES = sorted(
    {(m, t) for m, t in CASES if t <= 8} | {(m, t) for m in QKV_SHAPES for t in (1, 3, 8)},
    key=lambda c: (list(QKV_SHAPES).index(c[0]), c[1]),
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", GEMV_VARIANTS)
@pytest.mark.parametrize("model,t", GEMV_SHAPE_CASES, ids=[f"{m}-T{t}" for m, t in GEMV_SHAPE_CASES])
def test_linear_gemv_qwen3_shapes(model, t, config, dtype, force):
    force(config)
    n, k = QKV_SHAPES[model]
    x, w = _inputs(t, n, k, dtype, seed=t + n)
    out = torch.full((t, n), float("nan"), device="cuda", dtype=dtype)
    torch.ops.qwen3_kernels.linear(out, x, w)
    _check(x, w, out)


# gemv at odd sizes: every padded token count (T = 1..8 -> 1, 2, 4, 8), N not a multiple of
# 4 warps x R rows (idle warps in the last CTA), K = 8 (one lane busy), K not a multiple of the
# 256..1024-column stage (partial last stage), and a K far past any shared-memory staging limit.
GEMV_ODD = [
    (config, t, n, k)
    for config in GEMV_VARIANTS
    for t, n, k in ((1, 8, 8), (2, 72, 1032), (3, 4104, 200), (4, 24, 2056), (5, 1032, 264),
                    (6, 40, 776), (7, 4104, 1032), (8, 72, 25600))
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config,t,n,k", GEMV_ODD,
                         ids=[f"{c}-T{t}-N{n}-K{k}" for c, t, n, k in GEMV_ODD])
def test_linear_gemv_odd_sizes(config, t, n, k, dtype, force):
    force(config)
    x, w = _inputs(t, n, k, dtype, seed=t + n + k)
    out = torch.full((t, n), float("nan"), device="cuda", dtype=dtype)
    torch.ops.qwen3_kernels.linear(out, x, w)
    _check(x, w, out)


def test_linear_gemv_writes_only_its_output(force):
    # The output is a row-aligned slice of a larger poisoned buffer: nothing around it may change
    # (masked token rows and idle warps must not store).
    force("gemv")
    for t, n, k in ((3, 72, 1032), (5, 4104, 200)):
        x, w = _inputs(t, n, k, torch.bfloat16, seed=t)
        buf = torch.full((t + 2, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        out = buf[1 : t + 1]
        torch.ops.qwen3_kernels.linear(out, x, w)
        _check(x, w, out)
        assert buf[0].isnan().all() and buf[t + 1].isnan().all()


@pytest.mark.parametrize("t", [9, 64, 65, 128])
def test_linear_stream_writes_only_its_output(t, force):
    # Token rows past M are zero-filled tile padding: none of them may be stored, nor anything
    # past N in the partial last row block.
    force("stream")
    for n, k in ((72, 1032), (4104, 200)):
        x, w = _inputs(t, n, k, torch.bfloat16, seed=t + n)
        buf = torch.full((t + 2, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        out = buf[1 : t + 1]
        torch.ops.qwen3_kernels.linear(out, x, w)
        _check(x, w, out)
        assert buf[0].isnan().all() and buf[t + 1].isnan().all()


@pytest.mark.parametrize("t", [16, 128])
def test_linear_stream_pdl_orders_after_the_previous_kernel(t, force):
    # The stream kernel is launched with PDL and asks for its first weight stages before it waits
    # for the kernel before it: x written by that kernel must still be read new, and a second
    # stream GEMM (started early by the first one's launch_dependents) must read the first one's
    # finished output. The weights are written by an earlier kernel (not the one right before: the
    # contract). Eager and in a graph, with new inputs each replay.
    force("stream")
    n1, k1, n2 = 4104, 4096, 1032
    x_new, w1 = _inputs(t, n1, k1, torch.bfloat16, seed=11)
    _, w2 = _inputs(t, n2, n1, torch.bfloat16, seed=12)
    x = torch.zeros_like(x_new)
    mid = torch.full((t, n1), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = torch.full((t, n2), float("nan"), device="cuda", dtype=torch.bfloat16)

    def step():
        torch.mul(x_new, 1.0, out=x)  # a kernel writing x right before the GEMM
        torch.ops.qwen3_kernels.linear(mid, x, w1)
        torch.ops.qwen3_kernels.linear(out, mid, w2)

    def check():
        _check(x_new, w1, mid)
        _check(mid, w2, out)

    def refresh(seed):
        x_new.copy_(_inputs(t, n1, k1, torch.bfloat16, seed=seed)[0])
        x.zero_()
        mid.fill_(float("nan"))
        out.fill_(float("nan"))

    _eager_then_replayed(step, check, refresh)


def test_linear_in_a_cuda_graph(force):
    # Decode runs from captured graphs: the stream-K workspace comes from the caching allocator
    # and the barrier reset is a memset node, so replays must stay correct with fresh inputs.
    n, k = QKV_SHAPES["8B"]
    for config in ("auto", "splitk", "splitk_pdl", "stream", "swap_128x64:streamk",
                   "tile_128x128:streamk"):
        force(config)
        x, w = _inputs(16, n, k, torch.bfloat16)
        out = torch.empty(16, n, device="cuda", dtype=torch.bfloat16)
        qwen3_kernels.linear(x, w, out=out)  # warm-up outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            torch.ops.qwen3_kernels.linear(out, x, w)
        for seed in (1, 2):
            x2, w2 = _inputs(16, n, k, torch.bfloat16, seed=seed)
            x.copy_(x2)
            w.copy_(w2)
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            _check(x, w, out)


@pytest.mark.parametrize("config", ["splitk_pdl", "splitk_pdl:2", "splitk_pf"])
def test_linear_pdl_orders_after_the_previous_kernel(config, force):
    # splitk_pdl may start while the previous kernel in the stream runs: it must still read the
    # weight and x that kernel writes, and a following splitk_pdl (started early by our
    # launch_dependents) must still read our finished output. Eager and in a graph.
    force(config)
    n1, k = QKV_SHAPES["8B"]
    n2 = 1032
    x_new, w1_new = _inputs(5, n1, k, torch.bfloat16, seed=7)
    _, w2 = _inputs(5, n2, n1, torch.bfloat16, seed=8)
    x = torch.zeros_like(x_new)
    w1 = torch.zeros_like(w1_new)
    mid = torch.full((5, n1), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = torch.full((5, n2), float("nan"), device="cuda", dtype=torch.bfloat16)

    def step():
        # kernels (not memcpys, which never overlap a PDL launch) writing both operands, the
        # 50 MB weight last, right before the GEMM that reads them
        torch.mul(x_new, 1.0, out=x)
        torch.mul(w1_new, 1.0, out=w1)
        torch.ops.qwen3_kernels.linear(mid, x, w1)
        torch.ops.qwen3_kernels.linear(out, mid, w2)  # reads the previous GEMM's output

    step()
    torch.cuda.synchronize()
    _check(x_new, w1_new, mid)
    _check(mid, w2, out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for seed in (1, 2):
        x2, w2_ = _inputs(5, n1, k, torch.bfloat16, seed=seed)
        x_new.copy_(x2)
        w1_new.copy_(w2_)
        w1.zero_()
        mid.fill_(float("nan"))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        _check(x_new, w1_new, mid)
        _check(mid, w2, out)


def test_linear_runs_cublas_where_the_table_says_so(force):
    # T = 16 on the 8B shape is a cuBLAS cell of the table (cuBLAS measured faster): the op's
    # output must then be cuBLAS's own, bit for bit; forcing "cublas" gives the same anywhere.
    n, k = QKV_SHAPES["8B"]
    for config, t in (("auto", 16), ("cublas", 1), ("cublas", 300)):
        force(config)
        x, w = _inputs(t, n, k, torch.bfloat16, seed=t)
        out = torch.full((t, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        torch.ops.qwen3_kernels.linear(out, x, w)
        assert torch.equal(out, torch.matmul(x, w.t())), (config, t)


def test_linear_opcheck():
    n, k = 4104, 1032
    for t in (3, 300):
        x, w = _inputs(t, n, k, torch.bfloat16)
        out = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
        torch.library.opcheck(torch.ops.qwen3_kernels.linear, (out, x, w))


def test_linear_under_torch_compile():
    x, w = _inputs(8, 4096, 1024, torch.bfloat16)

    @torch.compile(fullgraph=True)
    def f(x, w):
        out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
        torch.ops.qwen3_kernels.linear(out, x, w)
        return out

    _check(x, w, f(x, w))


def test_linear_rejects_misaligned_and_refused(force):
    buf = torch.randn(8 * 64 + 4, device="cuda").to(torch.bfloat16)
    x = buf[4:].view(8, 64)  # contiguous, but 8 bytes past an aligned start
    w = torch.randn(64, 64, device="cuda").to(torch.bfloat16)
    out = torch.empty(8, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        torch.ops.qwen3_kernels.linear(out, x, w)
    force("splitk")  # the hand-written kernel covers M <= 64 only
    x, w = _inputs(65, 64, 64, torch.bfloat16)
    out = torch.empty(65, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="cannot run M=65"):
        torch.ops.qwen3_kernels.linear(out, x, w)
    force("stream")  # M <= 128 only
    x, w = _inputs(129, 64, 64, torch.bfloat16)
    out = torch.empty(129, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="cannot run M=129"):
        torch.ops.qwen3_kernels.linear(out, x, w)
    force("gemv")  # M <= 8 only
    x, w = _inputs(9, 64, 64, torch.bfloat16)
    out = torch.empty(9, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="cannot run M=9"):
        torch.ops.qwen3_kernels.linear(out, x, w)


# The op's own checks (torch_bindings.cpp, one helper for both ops), called directly: the Python
# wrappers check first, so only a direct torch.ops call reaches these.
BAD_OPERANDS = [
    # (case, x [T, K], weight [N, K], out [T, N / div] unless given, match)
    ("inner dims", dict(x=(4, 64), w=(16, 32)), "inner dims differ"),
    ("K not a multiple of 8", dict(x=(4, 60), w=(16, 60)), "multiples of 8"),
    ("N not a multiple of 8", dict(x=(4, 64), w=(20, 64)), "multiples of 8"),
    ("out shape", dict(x=(4, 64), w=(16, 64), out=(4, 4)), "out must be"),
    ("weight dtype", dict(x=(4, 64), w=(16, 64), w_dtype=torch.float16), "weight must be BFloat16"),
    ("out dtype", dict(x=(4, 64), w=(16, 64), out_dtype=torch.float16), "out must be BFloat16"),
    ("x on the CPU", dict(x=(4, 64), w=(16, 64), x_cpu=True), "x must be a CUDA tensor"),
    ("strided x", dict(x=(4, 128), w=(16, 64), x_cols=64), "x must be contiguous"),
    ("x 3-d", dict(x=(4, 64, 1), w=(16, 64)), "x must have 2 dims"),
]


@pytest.mark.parametrize("op,div", [("linear", 1), ("linear_silu_and_mul", 2)])
@pytest.mark.parametrize("case,spec,match", BAD_OPERANDS, ids=[c[0] for c in BAD_OPERANDS])
def test_ops_reject_bad_operands_directly(op, div, case, spec, match):
    bf16 = torch.bfloat16
    x = torch.randn(*spec["x"], device="cpu" if spec.get("x_cpu") else "cuda").to(bf16)
    if "x_cols" in spec:
        x = x[:, : spec["x_cols"]]  # a strided view
    w = torch.randn(*spec["w"], device="cuda").to(spec.get("w_dtype", bf16))
    rows = spec["x"][0]
    out = torch.full(spec.get("out", (rows, spec["w"][0] // div)), float("nan"), device="cuda",
                     dtype=spec.get("out_dtype", bf16))
    before = out.clone()
    with pytest.raises(RuntimeError, match=match):
        getattr(torch.ops.qwen3_kernels, op)(out, x, w)
    assert torch.equal(out.isnan(), before.isnan())  # nothing written


# ---- the GEMV's launch variants (plain, PDL) and weight loads (L2 hint) -------------------------

GEMV_LAUNCH_VARIANTS = ["auto", "pdl", "pdl_early", "pdl_late", "pdl_early_late"]
GEMV_LOADS = ["auto", "l2_256b"]


def _knob_fixture(op):
    from qwen3_kernels import elementwise_tuning as et

    before = et.current(op)
    yield lambda name: et.select(op, name)
    et.select(op, before)


@pytest.fixture
def gemv_variant():
    yield from _knob_fixture("gemv")


@pytest.fixture
def gemv_loads():
    yield from _knob_fixture("gemv_loads")


@pytest.fixture
def gemv_silu():
    yield from _knob_fixture("gemv_silu")


@pytest.mark.parametrize("loads", GEMV_LOADS)
@pytest.mark.parametrize("variant", GEMV_LAUNCH_VARIANTS)
@pytest.mark.parametrize("t,n,k", [(1, 6144, 4096), (1, 4096, 12288), (3, 4104, 200), (8, 72, 25600),
                                   (1, 8, 8)])
def test_linear_gemv_launch_variants(variant, loads, t, n, k, force, gemv_variant, gemv_loads):
    force("gemv")
    gemv_variant(variant)
    gemv_loads(loads)
    x, w = _inputs(t, n, k, torch.bfloat16, seed=t + n + k)
    out = torch.full((t, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    torch.ops.qwen3_kernels.linear(out, x, w)
    _check(x, w, out)


# ---- linear_silu_and_mul: the gate_up projection with silu_and_mul fused into the GEMV ------------

# (T, 2I, K): the gate_up shapes of 0.6B, 8B and one rank of 8B under TP 2 (4 rows a warp), then
# odd ones: I not a multiple of the CTA's columns (idle warps), K of one lane, K past any staging
# limit, partial last stages (at T = 1 the CTA-rows kernel: a row shorter than one stage, rows of
# several stages with a partial last one); T = 9 and 33 take the cuBLAS + silu_and_mul path.
GATE_UP_CASES = [
    (t, two_i, k)
    for t in (1, 2, 5, 8)
    for two_i, k in ((6144, 1024), (24576, 4096), (12288, 4096))
] + [
    (1, 8, 8), (3, 72, 1032), (4, 4104, 200), (7, 24, 2056), (2, 16392, 264), (3, 8200, 1032),
    (6, 80, 25600), (1, 72, 1032), (1, 16392, 264), (1, 80, 25600), (1, 24, 2056),
    (9, 6144, 1024), (33, 72, 1032),
]


def _check_silu(x, w, out):
    """FA3 rule: our error vs the fp32 product + activation at most twice that of cuBLAS in the
    same dtype followed by the reference activation; every element written."""
    assert not out.isnan().any(), "some outputs were not written (still NaN)"
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        h = x.float() @ w.float().t()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    i = h.shape[1] // 2
    want = torch.nn.functional.silu(h[:, :i]) * h[:, i:]
    base = qwen3_kernels.reference.silu_and_mul(torch.matmul(x, w.t()))
    ours_max = (out.float() - want).abs().max().item()
    base_max = (base.float() - want).abs().max().item()
    eps = 1e-5 * want.abs().max().item() + 1e-6
    assert ours_max <= 2 * base_max + eps, (ours_max, base_max)
    assert rel_err(out, want) <= 2 * rel_err(base, want) + 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,two_i,k", GATE_UP_CASES, ids=[f"T{t}-2I{n}-K{k}" for t, n, k in GATE_UP_CASES])
def test_linear_silu_and_mul(t, two_i, k, dtype):
    x, w = _inputs(t, two_i, k, dtype, seed=t + two_i + k)
    # out a 16-byte aligned view inside a poisoned buffer: nothing around it may change
    i, pad = two_i // 2, 8
    buf = torch.full((t * i + 2 * pad,), float("nan"), device="cuda", dtype=dtype)
    out = buf[pad : pad + t * i].view(t, i)
    torch.ops.qwen3_kernels.linear_silu_and_mul(out, x, w)
    _check_silu(x, w, out)
    assert buf[:pad].isnan().all() and buf[pad + t * i :].isnan().all()


@pytest.mark.parametrize("silu", ["auto", "warp_rows"])
@pytest.mark.parametrize("loads", GEMV_LOADS)
@pytest.mark.parametrize("variant", GEMV_LAUNCH_VARIANTS)
def test_linear_silu_and_mul_launch_variants(variant, loads, silu, gemv_variant, gemv_loads,
                                             gemv_silu):
    gemv_variant(variant)
    gemv_loads(loads)
    gemv_silu(silu)  # at T = 1: the CTA-rows kernel (auto) or gemv_kernel's warp rows
    for t, two_i, k in ((1, 24576, 4096), (5, 4104, 200), (1, 12288, 4096), (1, 72, 12296)):
        x, w = _inputs(t, two_i, k, torch.bfloat16, seed=t)
        out = torch.full((t, two_i // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
        torch.ops.qwen3_kernels.linear_silu_and_mul(out, x, w)
        _check_silu(x, w, out)


@pytest.mark.parametrize("silu", ["auto", "warp_rows"])
@pytest.mark.parametrize("variant", GEMV_LAUNCH_VARIANTS)
def test_gemv_pdl_orders_after_the_previous_kernel(variant, silu, force, gemv_variant, gemv_silu):
    # The PDL GEMVs start while the kernel before them runs: they must still read the x and the
    # weight that kernel writes, and the GEMV after them (started early by their
    # launch_dependents) their finished output. Eager and in a graph.
    force("gemv")
    gemv_variant(variant)
    gemv_silu(silu)  # the first GEMV: linear_silu_and_mul at one token
    two_i, k = 24576, 4096
    x_new, w1_new = _inputs(1, two_i, k, torch.bfloat16, seed=7)
    _, w2 = _inputs(1, 1032, two_i // 2, torch.bfloat16, seed=8)
    x = torch.zeros_like(x_new)
    w1 = torch.zeros_like(w1_new)
    mid = torch.full((1, two_i // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = torch.full((1, 1032), float("nan"), device="cuda", dtype=torch.bfloat16)

    def step():
        # kernels (not memcpys) writing both operands, the 200 MB weight last; pdl_early loads
        # its first weight bytes before it waits, so its contract is a weight not written by the
        # kernel right before it (a model's weights are not written during a step): x last there
        if variant.startswith("pdl_early"):
            torch.mul(w1_new, 1.0, out=w1)
            torch.mul(x_new, 1.0, out=x)
        else:
            torch.mul(x_new, 1.0, out=x)
            torch.mul(w1_new, 1.0, out=w1)
        torch.ops.qwen3_kernels.linear_silu_and_mul(mid, x, w1)
        torch.ops.qwen3_kernels.linear(out, mid, w2)

    def check():
        _check_silu(x_new, w1_new, mid)
        _check(mid, w2, out)

    def refresh(seed):
        x2, w2_ = _inputs(1, two_i, k, torch.bfloat16, seed=seed)
        x_new.copy_(x2)
        w1_new.copy_(w2_)
        w1.zero_()
        mid.fill_(float("nan"))
        out.fill_(float("nan"))

    _eager_then_replayed(step, check, refresh)


def test_linear_silu_and_mul_opcheck():
    for t in (3, 300):
        x, w = _inputs(t, 4104, 1032, torch.bfloat16)
        out = torch.empty(t, 2052, device="cuda", dtype=torch.bfloat16)
        torch.library.opcheck(torch.ops.qwen3_kernels.linear_silu_and_mul, (out, x, w))


def test_linear_silu_and_mul_under_torch_compile():
    x, w = _inputs(1, 6144, 1024, torch.bfloat16)

    @torch.compile(fullgraph=True)
    def f(x, w):
        out = torch.empty(x.shape[0], w.shape[0] // 2, device=x.device, dtype=x.dtype)
        torch.ops.qwen3_kernels.linear_silu_and_mul(out, x, w)
        return out

    _check_silu(x, w, f(x, w))
