"""CUDA: linear vs the fp32 reference, held to the FlashAttention-3 rule.

Our error (vs x.float() @ w.float().T) must be at most twice cuBLAS's error doing the same GEMM
in the same 16-bit dtype (torch.matmul), plus a tiny epsilon; measured as the max abs error and as
the relative Frobenius error. Outputs are poisoned with NaN first so an unwritten element fails.
The kernel is picked from the shape (csrc/kernels/gemm/linear.cu): the GEMV at T = 1 on any
shape, the table's cell on the six Qwen3 QKV shapes, cuBLAS elsewhere. The cases below reach every
configuration a cell names (split-K, both CUTLASS tiles) and the GEMV at odd sizes.
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


# Cells of the table that name our kernels (linear.cu), and cuBLAS cells on either side.
CELLS = [
    ("14B", t) for t in (2, 3, 5, 8)          # split-K, 4 splits
] + [
    ("14B", 9), ("14B", 600), ("14B", 1024),  # cuBLAS, the 128x128 tile
    ("32B", 513), ("32B", 1000),              # the 128x128 tile
    ("4B", 1025), ("8B", 2048), ("8B", 1500),  # the 128x128 tile
    ("0.6B", 4097), ("0.6B", 9000), ("8B", 5000),  # the 128x256 tile (dp / stream-K)
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model,t", CASES + CELLS, ids=[f"{m}-T{t}" for m, t in CASES + CELLS])
def test_linear_qwen3_shapes(model, t, dtype):
    n, k = QKV_SHAPES[model]
    x, w = _inputs(t, n, k, dtype)
    out = torch.full((t, n), float("nan"), device="cuda", dtype=dtype)
    qwen3_kernels.linear(x, w, out=out)
    _check(x, w, out)


# The GEMV (every shape at T = 1) at odd sizes: N not a multiple of 4 warps x R rows (idle warps
# in the last CTA), K = 8 (one lane busy), K not a multiple of the 256..1024-column stage (partial
# last stage), K far past any shared-memory staging limit, and N = 12288 (4 rows a warp).
GEMV_ODD = [(8, 8), (72, 1032), (4104, 200), (24, 2056), (1032, 264), (40, 776), (72, 25600),
            (12288, 4096), (4096, 12288)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", GEMV_ODD, ids=[f"N{n}-K{k}" for n, k in GEMV_ODD])
def test_linear_gemv_odd_sizes(n, k, dtype):
    x, w = _inputs(1, n, k, dtype, seed=n + k)
    out = torch.full((1, n), float("nan"), device="cuda", dtype=dtype)
    torch.ops.qwen3_kernels.linear(out, x, w)
    _check(x, w, out)


def test_linear_gemv_writes_only_its_output():
    # The output is a row of a larger poisoned buffer: nothing around it may change (idle warps
    # must not store).
    for n, k in ((72, 1032), (4104, 200)):
        x, w = _inputs(1, n, k, torch.bfloat16, seed=n)
        buf = torch.full((3, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        out = buf[1:2]
        torch.ops.qwen3_kernels.linear(out, x, w)
        _check(x, w, out)
        assert buf[0].isnan().all() and buf[2].isnan().all()


def test_linear_in_a_cuda_graph():
    # Decode runs from captured graphs: the stream-K workspace comes from the caching allocator,
    # so replays must stay correct with fresh inputs. The GEMV, split-K, a CUTLASS tile, cuBLAS.
    for model, t in (("8B", 1), ("14B", 5), ("8B", 2048), ("8B", 16)):
        n, k = QKV_SHAPES[model]
        x, w = _inputs(t, n, k, torch.bfloat16)
        out = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
        qwen3_kernels.linear(x, w, out=out)  # warm-up outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            torch.ops.qwen3_kernels.linear(out, x, w)
        for seed in (1, 2):
            x2, w2 = _inputs(t, n, k, torch.bfloat16, seed=seed)
            x.copy_(x2)
            w.copy_(w2)
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            _check(x, w, out)


def test_linear_runs_cublas_where_the_rule_says_so():
    # T = 16 on the 8B shape is a cuBLAS cell of the table, and a shape off the table (N = 4104)
    # above one token runs cuBLAS: the op's output must then be cuBLAS's own, bit for bit.
    for (n, k), t in ((QKV_SHAPES["8B"], 16), ((4104, 1032), 2), ((4104, 1032), 300)):
        x, w = _inputs(t, n, k, torch.bfloat16, seed=t)
        out = torch.full((t, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        torch.ops.qwen3_kernels.linear(out, x, w)
        assert torch.equal(out, torch.matmul(x, w.t())), (n, k, t)


def test_linear_opcheck():
    n, k = 4104, 1032
    for t in (1, 300):
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


# The checked API's errors (qwen3_kernels/ops.py); the raw torch.ops calls are unchecked.
BAD_OPERANDS = [
    # (case, x [T, K], weight [N, K], out [T, N / div] unless given, match)
    ("inner dims", dict(x=(4, 64), w=(16, 32)), "inner dims differ"),
    ("K not a multiple of 8", dict(x=(4, 60), w=(16, 60)), "multiples of 8"),
    ("N not a multiple of 8", dict(x=(4, 64), w=(20, 64)), "multiples of 8"),
    ("out shape", dict(x=(4, 64), w=(16, 64), out=(4, 4)), "out must have shape"),
    ("weight dtype", dict(x=(4, 64), w=(16, 64), w_dtype=torch.float16), "weight must be"),
    ("out dtype", dict(x=(4, 64), w=(16, 64), out_dtype=torch.float16), "out must be"),
    ("x on the CPU", dict(x=(4, 64), w=(16, 64), x_cpu=True), "is on"),
    ("strided x", dict(x=(4, 128), w=(16, 64), x_cols=64), "x must be contiguous"),
    ("x 3-d", dict(x=(4, 64, 1), w=(16, 64)), "x must have 2 dims"),
    ("misaligned x", dict(x=(8, 64), w=(16, 64), x_offset=4), "16-byte aligned"),
]


@pytest.mark.parametrize("op,div", [("linear", 1), ("linear_silu_and_mul", 2)])
@pytest.mark.parametrize("case,spec,match", BAD_OPERANDS, ids=[c[0] for c in BAD_OPERANDS])
def test_ops_reject_bad_operands(op, div, case, spec, match):
    bf16 = torch.bfloat16
    dev = "cpu" if spec.get("x_cpu") else "cuda"
    if "x_offset" in spec:
        rows, cols = spec["x"]
        off = spec["x_offset"]
        x = torch.randn(rows * cols + off, device=dev).to(bf16)[off:].view(rows, cols)
    else:
        x = torch.randn(*spec["x"], device=dev).to(bf16)
    if "x_cols" in spec:
        x = x[:, : spec["x_cols"]]  # a strided view
    w = torch.randn(*spec["w"], device="cuda").to(spec.get("w_dtype", bf16))
    rows = spec["x"][0]
    out = torch.full(spec.get("out", (rows, spec["w"][0] // div)), float("nan"), device="cuda",
                     dtype=spec.get("out_dtype", bf16))
    before = out.clone()
    with pytest.raises(ValueError, match=match):
        getattr(qwen3_kernels, op)(x, w, out=out)
    assert torch.equal(out.isnan(), before.isnan())  # nothing written



# (T, 2I, K): the gate_up shapes of 0.6B, 8B and one rank of 8B under TP 2 (4 rows a warp), then
# odd ones: I not a multiple of the CTA's columns (idle warps), K of one lane, K past any staging
# limit, partial last stages (at T = 1 the CTA-rows kernel: a row shorter than one stage, rows of
# several stages with a partial last one); T > 1 takes the cuBLAS + silu_and_mul path.
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


def test_gemv_pdl_orders_after_the_previous_kernel():
    # The GEMVs (PDL on sm_90) start while the kernel before them runs: they must still read the
    # x that kernel writes, and the GEMV after them (started early by their launch_dependents)
    # their finished output. Eager and in a graph.
    two_i, k = 24576, 4096
    x_new, w1_new = _inputs(1, two_i, k, torch.bfloat16, seed=7)
    _, w2 = _inputs(1, 1032, two_i // 2, torch.bfloat16, seed=8)
    x = torch.zeros_like(x_new)
    w1 = torch.zeros_like(w1_new)
    mid = torch.full((1, two_i // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = torch.full((1, 1032), float("nan"), device="cuda", dtype=torch.bfloat16)

    def step():
        # kernels (not memcpys) writing both operands; the GEMV loads its first weight bytes
        # before it waits, so its contract is a weight not written by the kernel right before it
        # (a model's weights are not written during a step): x last
        torch.mul(w1_new, 1.0, out=w1)
        torch.mul(x_new, 1.0, out=x)
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
