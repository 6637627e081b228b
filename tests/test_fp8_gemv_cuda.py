"""CUDA: the FP8 activation quantizer (quantize_fp8) and the one-token FP8 GEMV (linear_fp8 at
T = 1) against qwen3_kernels.reference.

quantize_fp8 must give the reference's values: scales within one fp32 ulp (both divide exactly)
and e4m3 values equal but for a measured, tiny share of rounding ties, on random, strided,
poisoned and hostile inputs, in the token-contiguous scale layout the FP8 GEMM reads and a plain
[T, G] one. The GEMV is held to the exact product of the quantized operands (fp64) with a bound
derived from bf16 rounding and fp32 accumulation, on every Qwen3 projection shape (0.6B..32B) and
odd ones (K not a multiple of 128, N not a multiple of 16), eagerly and in CUDA-graph replays.
The M > 1 GEMM has its own file (tests/test_linear_fp8_cuda.py); the CPU spec is
tests/test_fp8_reference.py.
"""

from __future__ import annotations

import pytest
import torch

import qwen3_kernels
from qwen3_kernels import reference as ref
from tests.helpers import rel_err, requires_cuda
from tests.test_linear import HEAD_DIM, QWEN3_ATTENTION

pytestmark = requires_cuda

E4M3 = torch.float8_e4m3fn
GROUP = ref.FP8_GROUP

# The e4m3 values of quantize_fp8 may differ from the reference's (torch's float -> e4m3 cast)
# by one e4m3 step: up to 2.3e-3 of the values on the H200 (21 of 17,408 at T = 17, K = 1024),
# with scales within one fp32 ulp of the reference's. Which conversion rounds which boundary
# differently is not pinned down; the bound keeps a wrong rounding mode or scale (most
# values off) failing.
MAX_E4M3_MISMATCH_RATE = 5e-3

# GEMV tolerance, per output element: |out - exact| <= BF16_HALF_ULP * |exact| + ACCUM_TOL * mag,
# exact = the fp64 product of the dequantized operands (what reference.linear_fp8 specifies
# before its final rounding), mag = sum_k |xd_k * wd_k|.
#   - BF16_HALF_ULP: the output is rounded to bf16 (8 significant bits), off by at most half an
#     ulp, 2^-8 relative.
#   - ACCUM_TOL: the kernel sums the exact e4m3 products in fp32: 8 chained mma of 16 products a
#     group on the tensor cores, then one fp32 FMA a group with the combined scale (28 groups a
#     warp at K = 25600), then 8 warp partials. Each rounding errs by at most 2^-23 of a partial
#     sum bounded by mag, about 50 of them on the longest path: under 2^-16 * mag. 2^-15 leaves
#     room for the tensor cores' truncating adds and still fails a wrong scale, group or row
#     (errors of order mag).
BF16_HALF_ULP = 2.0 ** -8
ACCUM_TOL = 2.0 ** -15
# and the whole output: bf16 rounding alone gives a relative Frobenius error near 2^-9.5
MAX_REL_ERR = 2.0 ** -8

requires_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the FP8 linear kernels run on Hopper (sm_90); elsewhere linear_fp8 is the reference",
)

# Qwen3 MLP widths (TARGETS.md); with QWEN3_ATTENTION they give every projection's (N, K).
QWEN3_INTERMEDIATE = {"0.6B": 3072, "1.7B": 6144, "4B": 9728, "8B": 12288, "14B": 17408,
                      "32B": 25600}


def _projections(model):
    hidden, hq, hkv = QWEN3_ATTENTION[model]
    inter = QWEN3_INTERMEDIATE[model]
    return {
        "qkv": ((hq + 2 * hkv) * HEAD_DIM, hidden),
        "o": (hidden, hq * HEAD_DIM),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }


GEMV_SHAPES = [
    pytest.param(n, k, id=f"{model}-{proj}-{n}x{k}")
    for model in QWEN3_ATTENTION for proj, (n, k) in _projections(model).items()
] + [
    pytest.param(n, k, id=f"odd-{n}x{k}")
    for n, k in [
        (8, 16),        # one half-filled CTA, one 16-column group
        (136, 1040),    # N % 16 == 8, K % 128 == 16
        (200, 4112),    # N not a multiple of 128, K % 256 == 16
        (2560, 1216),   # 4B down under TP 8: K % 128 == 64
        (4096, 6144),   # 8B down under TP 2
        (24, 8208),     # K > 4096: a ring of 256-column units, the last one 16 columns wide
        (40, 12560),    # warps with different unit counts, a partial last 128-group
    ]
]


def _rand_x(t, k, dtype, seed):
    """Rows of very different magnitudes (10^-4..10^4; fp16: 10^-3..10, its range), and an
    outlier group (activation outliers are why the scales are per group)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, k, device="cuda", generator=g)
    lo, hi = (-4, 4) if dtype == torch.bfloat16 else (-3, 1)
    x *= torch.logspace(lo, hi, t, device="cuda").unsqueeze(1)
    if k > GROUP:
        x[:, GROUP:2 * GROUP] *= 300.0
    return x.to(dtype)


def _rand_weight(n, k, seed):
    """An e4m3 weight using the whole range (saturated and subnormal values included) and its
    positive block scales."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, device="cuda", generator=g) * 100).clamp(-448, 448).to(E4M3)
    scales = torch.rand(-(-n // GROUP), -(-k // GROUP), device="cuda", generator=g) * 1e-2 + 1e-4
    return w, scales


def _ulp_distance(a, b):
    """|a - b| in fp32 ulps (both finite and of one sign here)."""
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()


def _check_quantized(q, s, x):
    """q, s from the kernel vs reference.quantize_fp8(x); NaN equals NaN, -0 equals 0."""
    rq, rs = ref.quantize_fp8(x)
    sf, rsf = s.contiguous(), rs.contiguous()
    finite = rsf.isfinite()
    assert torch.equal(sf.isnan(), rsf.isnan()) and torch.equal(sf.isinf(), rsf.isinf())
    if finite.any():
        assert _ulp_distance(sf[finite], rsf[finite]).max().item() <= 1, "scales differ"
    qf, rqf = q.float(), rq.float()
    assert torch.equal(qf.isnan(), rqf.isnan()), "NaN where the reference has none, or missed"
    ok = qf.isnan() | (qf == rqf)
    bad = (~ok).sum().item()
    assert bad <= MAX_E4M3_MISMATCH_RATE * q.numel(), f"{bad} of {q.numel()} e4m3 values differ"
    if bad:
        # one e4m3 step apart: no value lies strictly between them
        lo, hi = torch.minimum(qf, rqf)[~ok], torch.maximum(qf, rqf)[~ok]
        steps = torch.arange(256, dtype=torch.uint8, device=q.device).view(E4M3).float()
        steps = steps[steps.isfinite()]
        between = ((steps.unsqueeze(0) > lo.unsqueeze(1)) & (steps.unsqueeze(0) < hi.unsqueeze(1)))
        assert not between.any(), "an e4m3 value is more than one step from the reference"


# ---- quantize_fp8 --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [128, 1024, 1040, 4096, 4112])
@pytest.mark.parametrize("t", [1, 3, 17, 64, 129, 4096])
@pytest.mark.parametrize("layout", ["token_contiguous", "plain"])
def test_quantize_fp8_matches_reference(t, k, dtype, layout):
    x = _rand_x(t, k, dtype, seed=t * 7 + k)
    out = torch.empty(t, k, dtype=E4M3, device="cuda")
    out.view(torch.uint8).fill_(0x7F)  # NaN
    groups = -(-k // GROUP)
    if layout == "token_contiguous":
        s = qwen3_kernels.fp8_scales_buffer(t, k, "cuda")
        assert s.stride(0) == 1
    else:
        s = torch.empty(t, groups, device="cuda")
    s.fill_(float("nan"))
    q, s2 = qwen3_kernels.quantize_fp8(x, out=out, x_scales=s)
    assert q is out and s2 is s
    _check_quantized(q, s, x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantize_fp8_strided_rows(dtype):
    t, k = 33, 1040
    big = _rand_x(t, k + 48, dtype, seed=3)  # row stride k + 48: a multiple of 8, not of 128
    x = big[:, 16:16 + k]
    assert x.stride(0) == k + 48 and not x.is_contiguous()
    q, s = qwen3_kernels.quantize_fp8(x)
    _check_quantized(q, s, x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quantize_fp8_hostile_values(dtype):
    t, k = 8, 4112  # 33 groups, the last 16 wide
    big = 3e38 if dtype == torch.bfloat16 else 6e4
    tiny = 1e-38 if dtype == torch.bfloat16 else 6e-8  # subnormal (or 0) in both
    x = torch.randn(t, k, device="cuda")
    x[0] = 0.0                                    # all-zero row: the 1e-10 floor, zeros out
    x[1, :GROUP] = 0.0                            # one all-zero group among normal ones
    x[2] *= big / 8                               # near the dtype's max
    x[2, 5] = -big
    x[3] *= tiny                                  # subnormals: bf16's under the 1e-10 floor
    x[4, 7] = 1e4 if dtype == torch.bfloat16 else 1e3  # one outlier: its group's small values
    x[5, GROUP + 3] = float("nan")                # a NaN: its group's scale and values NaN
    x[6, 2 * GROUP + 1] = float("inf")            # an Inf: scale Inf, the Inf itself NaN
    x[7, k - 1] = -5.0                            # the partial last group's own amax
    x = x.to(dtype)
    q, s = qwen3_kernels.quantize_fp8(x)
    _check_quantized(q, s, x)
    assert (q.float()[0] == 0).all() and s[0, 0].item() == pytest.approx(1e-10 / 448)
    assert q.float()[7, k - 1].item() == -448


def test_quantize_fp8_in_a_cuda_graph():
    t, k = 17, 1040
    x = _rand_x(t, k, torch.bfloat16, seed=5)
    out = torch.empty(t, k, dtype=E4M3, device="cuda")
    s = qwen3_kernels.fp8_scales_buffer(t, k, "cuda")
    qwen3_kernels.quantize_fp8(x, out=out, x_scales=s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        qwen3_kernels.quantize_fp8(x, out=out, x_scales=s)
    for seed in (6, 7):
        x.copy_(_rand_x(t, k, torch.bfloat16, seed=seed))
        out.view(torch.uint8).fill_(0x7F)
        s.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        _check_quantized(out, s, x)


def test_quantize_fp8_opcheck():
    x = _rand_x(5, 272, torch.bfloat16, seed=8)
    q = torch.empty(5, 272, dtype=E4M3, device="cuda")
    s = qwen3_kernels.fp8_scales_buffer(5, 272, "cuda")
    utils = ("test_faketensor", "test_autograd_registration")  # test_schema cannot compare fp8
    torch.library.opcheck(torch.ops.qwen3_kernels.quantize_fp8, (q, s, x), test_utils=utils)


# ---- linear_fp8 at one token: the FP8 GEMV ---------------------------------------------------


def _exact(x, w, ws):
    """fp64 product of the dequantized operands [1, N] and mag = |xd| @ |wd|^T. x quantized by
    the quantize_fp8 kernel, which the GEMV's own quantization equals (a value one e4m3 step from
    the reference's, allowed above, would move whole outputs past the accumulation bound)."""
    xq, xs = qwen3_kernels.quantize_fp8(x)
    xd = ref.dequantize_fp8(xq, xs, 1).double()
    wd = ref.dequantize_fp8(w, ws, GROUP).double()
    return xd @ wd.t(), xd.abs() @ wd.abs().t()


def _check_gemv(out, x, w, ws):
    assert out.dtype == torch.bfloat16
    assert not out.isnan().any(), "some outputs were not written (still NaN)"
    exact, mag = _exact(x, w, ws)
    err = (out.double() - exact).abs()
    bound = BF16_HALF_ULP * exact.abs() + ACCUM_TOL * mag
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (
        f"output {worst.item()}: {out.flatten()[worst].item()} vs {exact.flatten()[worst].item()}"
        f" (mag {mag.flatten()[worst].item()})")
    assert rel_err(out, exact) <= MAX_REL_ERR


@requires_sm90
@pytest.mark.parametrize("n,k", GEMV_SHAPES)
def test_linear_fp8_one_token_matches_reference(n, k):
    x = _rand_x(1, k, torch.bfloat16, seed=n + k)
    w, ws = _rand_weight(n, k, seed=n * 3 + k)
    out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert qwen3_kernels.linear_fp8(x, w, ws, out=out) is out
    _check_gemv(out, x, w, ws)


@requires_sm90
def test_linear_fp8_one_token_hostile_inputs():
    n, k = 264, 4112
    w, ws = _rand_weight(n, k, seed=11)
    out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    x = torch.zeros(1, k, dtype=torch.bfloat16, device="cuda")
    qwen3_kernels.linear_fp8(x, w, ws, out=out)
    assert (out == 0).all()  # x = 0: the floor scale, no 0 / 0
    x = _rand_x(1, k, torch.bfloat16, seed=12)
    x[0, :GROUP] = 0.0     # a zero group
    x[0, -16:] *= 1e4      # an outlier in the 16-wide last group
    x[0, 500] = 3e30       # a huge value: its group quantizes to it alone
    qwen3_kernels.linear_fp8(x, w, ws, out=out)
    _check_gemv(out, x, w, ws)
    x[0, 700] = float("nan")
    qwen3_kernels.linear_fp8(x, w, ws, out=out)
    assert out.isnan().all()  # as the reference: a NaN reaches every output


@requires_sm90
@pytest.mark.parametrize("n,k", [(6144, 4096), (5120, 25600), (136, 1040)])
def test_linear_fp8_one_token_in_a_cuda_graph(n, k):
    # Decode replays captured graphs: new x each step, the weight and out buffers fixed.
    w, ws = _rand_weight(n, k, seed=13)
    x = _rand_x(1, k, torch.bfloat16, seed=14)
    out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    qwen3_kernels.linear_fp8(x, w, ws, out=out)
    torch.cuda.synchronize()
    _check_gemv(out, x, w, ws)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        qwen3_kernels.linear_fp8(x, w, ws, out=out)
    for seed in (15, 16):
        x.copy_(_rand_x(1, k, torch.bfloat16, seed=seed))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        _check_gemv(out, x, w, ws)


@requires_sm90
def test_linear_fp8_one_token_opcheck():
    w, ws = _rand_weight(136, 1040, seed=17)
    x = _rand_x(1, 1040, torch.bfloat16, seed=18)
    out = torch.empty(1, 136, dtype=torch.bfloat16, device="cuda")
    utils = ("test_faketensor", "test_autograd_registration")  # test_schema cannot compare fp8
    torch.library.opcheck(torch.ops.qwen3_kernels.linear_fp8, (out, x, w, ws), test_utils=utils)

    # the raw op, as tests/test_linear_cuda.py compiles linear: the checked wrapper's alignment
    # check reads data_ptr(), which dynamo cannot trace on CUDA tensors
    @torch.compile(fullgraph=True)
    def f(x):
        out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
        torch.ops.qwen3_kernels.linear_fp8(out, x, w, ws)
        return out

    _check_gemv(f(x), x, w, ws)


# ---- linear_fp8_silu_and_mul: the FP8 GEMV with silu_and_mul at its end ------------------------

SILU_SHAPES = [
    pytest.param(2 * QWEN3_INTERMEDIATE[model] // tp, QWEN3_ATTENTION[model][0],
                 id=f"{model}-gate_up-tp{tp}")
    for model in QWEN3_ATTENTION for tp in (1, 2)
] + [
    pytest.param(two_i, k, id=f"odd-{two_i}x{k}")
    for two_i, k in [
        (16, 16),       # one CTA, one 16-column group
        (288, 1040),    # I = 144: the up rows start inside a 128 block; K % 128 == 16
        (400, 4112),    # K % 256 == 16
        (48, 12560),    # K > 4096: the ring of 256-column units
    ]
]


@requires_sm90
@pytest.mark.parametrize("two_i,k", SILU_SHAPES)
def test_linear_fp8_silu_and_mul_is_the_unfused_pair(two_i, k):
    """One token: bit for bit silu_and_mul(linear_fp8(x)) (each row's sums are the GEMV's, in
    the same order; gate and up rounded to bf16 before silu_and_mul's math); more tokens run
    that pair."""
    w, ws = _rand_weight(two_i, k, seed=two_i + k)
    for t in (1, 3):
        x = _rand_x(t, k, torch.bfloat16, seed=two_i * 5 + k + t)
        out = torch.full((t, two_i // 2), float("nan"), dtype=torch.bfloat16, device="cuda")
        assert qwen3_kernels.linear_fp8_silu_and_mul(x, w, ws, out=out) is out
        expect = qwen3_kernels.silu_and_mul(qwen3_kernels.linear_fp8(x, w, ws))
        assert torch.equal(out, expect), (t, (out.float() - expect.float()).abs().max().item())
        if t == 1:  # and the unfused pair is the reference's within the GEMV's bound
            _check_gemv(qwen3_kernels.linear_fp8(x, w, ws), x, w, ws)


@requires_sm90
def test_linear_fp8_silu_and_mul_nan_and_graph():
    two_i, k = 24576, 4096  # Qwen3-8B's gate_up
    w, ws = _rand_weight(two_i, k, seed=21)
    x = _rand_x(1, k, torch.bfloat16, seed=22)
    out = torch.full((1, two_i // 2), float("nan"), dtype=torch.bfloat16, device="cuda")
    g = torch.cuda.CUDAGraph()
    qwen3_kernels.linear_fp8_silu_and_mul(x, w, ws, out=out)  # warm-up (opts in to smem)
    with torch.cuda.graph(g):
        qwen3_kernels.linear_fp8_silu_and_mul(x, w, ws, out=out)
    for seed in (23, 24):
        x.copy_(_rand_x(1, k, torch.bfloat16, seed=seed))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        expect = qwen3_kernels.silu_and_mul(qwen3_kernels.linear_fp8(x, w, ws))
        assert torch.equal(out, expect)
    x[0, 700] = float("nan")
    qwen3_kernels.linear_fp8_silu_and_mul(x, w, ws, out=out)
    assert out.isnan().all()  # as the reference: a NaN reaches every output


@requires_sm90
def test_linear_fp8_silu_and_mul_opcheck():
    w, ws = _rand_weight(288, 1040, seed=25)
    x = _rand_x(1, 1040, torch.bfloat16, seed=26)
    out = torch.empty(1, 144, dtype=torch.bfloat16, device="cuda")
    torch.library.opcheck(torch.ops.qwen3_kernels.linear_fp8_silu_and_mul, (out, x, w, ws),
                          test_utils=("test_faketensor", "test_autograd_registration"))
