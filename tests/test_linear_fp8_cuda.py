"""CUDA: linear_fp8 above one token (quantize_fp8 into the op's workspace, then the
weight-streaming pass over a few tokens of csrc/kernels/gemm/linear_fp8_gemv.cu up to T = 16
where N < 16384, else the CUTLASS block-scaled GEMM of linear_fp8_sm90.cu) vs the fp32 spec.

The spec is reference.linear_fp8's own steps kept in fp32: want = dequant(quantize_fp8(x)) @
dequant(weight)^T. The kernel quantizes x to the same e4m3 values and scales (quantize_fp8 is
bit-exact with the reference), so only the summation and the final rounding differ:
  - OUT_ROUNDING: the output is rounded once to bf16, at most half an ulp, 2^-8 of the value;
  - ACCUMULATION: Hopper's FP8 tensor cores keep ~14 significant bits while summing inside a
    128-wide group (the few-token pass sums e4m3 products as f16 mma in fp32, tighter still); the kernel adds each group's sum into an fp32 total (CUTLASS's promotion), so
    the error is a few 2^-14 of the group's sum of |products|; bounded here, with a wide margin,
    by 2^-9 of the row's sum of |products| (abs_sum).
Elementwise: |out - want| <= OUT_ROUNDING * |want| + ACCUMULATION * abs_sum. Per output row:
relative Frobenius error <= ROW_REL, which the rounding alone puts near 1.3e-3 and any misplaced
scale, dropped group or wrong tail trips by far (dropping one 128-group of a K = 8192 row: ~0.12;
the last 16 columns of K = 4112: ~0.06; one token's scale on another's row: O(1)).
Weights and activations get per-block / per-group magnitudes spread over 2^12 so that reading
a scale from the wrong block, group or token changes the answer. Outputs are poisoned with NaN.
"""

import pytest
import torch

import qwen3_kernels
from qwen3_kernels import reference as ref
from tests.helpers import requires_cuda

pytestmark = requires_cuda

E4M3 = torch.float8_e4m3fn
G = ref.FP8_GROUP
OUT_ROUNDING = 2.0**-8
ACCUMULATION = 2.0**-9  # one element at 1.02x of 2^-10 (T=17, 1.7B gate_up, H200)
ROW_REL = 8e-3


def _projection_shapes(size, tp):
    """(N, K) of the four quantized projections of a Qwen3 size, one rank's slice under tensor
    parallel tp (column-parallel qkv / gate_up: N / tp; row-parallel o / down: K / tp)."""
    from qwen3_model.random_checkpoint import QWEN3_SIZES

    hidden, _, heads, kv, inter, _ = QWEN3_SIZES[size]
    return {
        "qkv": ((heads + 2 * kv) * 128 // tp, hidden),
        "o": (hidden, heads * 128 // tp),
        "gate_up": (2 * inter // tp, hidden),
        "down": (hidden, inter // tp),
    }


SIZES = ("0.6B", "1.7B", "4B", "8B", "14B", "32B")
SHAPES = {f"{s}-tp{tp}-{p}": nk for s in SIZES for tp in (1, 2)
          for p, nk in _projection_shapes(s, tp).items()}
SMALL_T = (2, 3, 8, 9, 16, 17, 64, 129)
# Every shape at the small T (the few-token pass where N < 16384: one tile of 8 tokens at T <= 8,
# two at 9..16; the GEMM's swapped 128 x 16 / 32 tiles up to T = 64 and from T = 2 on wider
# weights, then the swapped 128 x 32 / 64 tiles or the 64-row ping-pong tiles by projection, and at
# T = 129 the 64-row ping-pong tiles (N <= 4096) or the swapped 128 x 96 tiles (wider));
# T = 4096 (the 128 x 128 cooperative tiles, data-parallel or stream-K by the wave count) on the
# 8B and 32B shapes, both TP degrees.
CASES = [(name, t) for name in SHAPES for t in SMALL_T]
CASES += [(name, 4096) for name in SHAPES if name.startswith(("8B", "32B"))]
# K not a multiple of 128 (a partial last group: TMA zero-fills it), N not a multiple of 128 (a
# partial weight-scale block, a clipped output tile), tiny (one k-tile of 16 columns), a T that
# picks the ping-pong tiles on a K tail, and 1000 / 2048 tokens on the 8B qkv shape.
ODD = {"N4096-K4112": (4096, 4112), "N1032-K4112": (1032, 4112), "N24-K16": (24, 16),
       "N136-K272": (136, 272), "N6144-K4112": (6144, 4112)}
ODD_CASES = [(name, t) for name in ODD for t in (2, 3, 9, 16, 17, 129, 1000)]
ODD_CASES += [("N4096-K4112", 4096), ("N6144-K4112", 2048)]


def _weight(n, k, seed):
    """A [n, k] e4m3 weight and its [ceil(n/128), ceil(k/128)] weight_scale_inv, the blocks'
    magnitudes 2^-14 .. 2^-2 apart, as a checkpoint holds them."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 120).clamp(-448, 448).to(E4M3)
    blocks = (-(-n // G), -(-k // G))
    scales = torch.exp2(torch.rand(blocks, device="cuda", generator=gen) * 12 - 14)
    return w, scales


def _activations(t, k, seed):
    """bf16 [t, k] whose 128-groups differ in magnitude by up to 2^12 (so each token-group has
    its own scale), with hostile rows when there are enough: all zeros, 1e-20 small, 1e4 large,
    and one outlier per group of row 3."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    groups = -(-k // G)
    mag = torch.exp2(torch.rand(t, groups, device="cuda", generator=gen) * 12 - 6)
    x = torch.randn(t, k, device="cuda", generator=gen) * mag.repeat_interleave(G, 1)[:, :k]
    if t >= 4:
        x[0] = 0
        x[1] *= 1e-20
        x[2] = x[2] / x[2].abs().amax() * 1e4
        x[3, ::G] = 3e3  # one value dominates its group: the rest quantize coarsely
    return x.to(torch.bfloat16)


def _spec(x, w, scales):
    """(want, abs_sum) in fp32: reference.linear_fp8 before its rounding, and the sum of
    |products| that bounds the accumulation error. x is quantized by the quantize_fp8 kernel the
    op runs (tests/test_fp8_gemv_cuda.py holds it to the reference: a rare value one e4m3 step
    apart, which would move a whole row of this product past the accumulation bound), so this
    checks the GEMM alone."""
    q, s = qwen3_kernels.quantize_fp8(x)
    xd = ref.dequantize_fp8(q, s, 1)
    wd = ref.dequantize_fp8(w, scales, G)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return xd @ wd.t(), xd.abs() @ wd.abs().t()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def _check(out, x, w, scales, what=""):
    want, abs_sum = _spec(x, w, scales)
    assert not out.isnan().any(), f"{what}: outputs left unwritten (still NaN)"
    err = (out.float() - want).abs()
    bound = OUT_ROUNDING * want.abs() + ACCUMULATION * abs_sum
    bad = err > bound
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} elements out of bounds, first at "
        f"{tuple(bad.nonzero()[0].tolist())}: worst err / bound "
        f"{(err[bad] / bound[bad].clamp_min(1e-30)).max().item():.3g}")
    num = (out.double() - want.double()).norm(dim=1)
    den = want.double().norm(dim=1)
    zero_rows = den == 0
    assert (num[zero_rows] == 0).all(), f"{what}: a zero row came out non-zero"
    row_rel = (num[~zero_rows] / den[~zero_rows]).max().item() if (~zero_rows).any() else 0.0
    assert row_rel <= ROW_REL, f"{what}: worst row relative error {row_rel:.3g} > {ROW_REL}"


def _run_case(n, k, t, seed):
    w, scales = _weight(n, k, seed)
    x = _activations(t, k, seed + 1)
    out = torch.full((t, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    qwen3_kernels.linear_fp8(x, w, scales, out=out)
    _check(out, x, w, scales, f"T={t} N={n} K={k}")


@pytest.mark.parametrize("name,t", CASES, ids=[f"{s}-T{t}" for s, t in CASES])
def test_linear_fp8_qwen3_shapes(name, t):
    n, k = SHAPES[name]
    _run_case(n, k, t, seed=t + n + k)


@pytest.mark.parametrize("name,t", ODD_CASES, ids=[f"{s}-T{t}" for s, t in ODD_CASES])
def test_linear_fp8_odd_sizes(name, t):
    n, k = ODD[name]
    _run_case(n, k, t, seed=t * 3 + n)


def test_linear_fp8_partial_last_group_counts_its_own_scale():
    # K = 4112: only the last 16 columns are non-zero, in x and in w, so the answer is that
    # group's product alone: a kernel that dropped the tail, read the tail's scale from another
    # group or let stale shared memory past K into the sum would be off by all of it.
    n, k, t = 256, 4112, 129
    w, scales = _weight(n, k, seed=5)
    w = w.view(torch.uint8)
    w[:, : k - 16] = 0
    w = w.view(E4M3)
    x = _activations(t, k, seed=6)
    x[:, : k - 16] = 0
    out = torch.full((t, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    qwen3_kernels.linear_fp8(x, w, scales, out=out)
    _check(out, x, w, scales, "tail only")
    assert out.float().abs().amax() > 0


def test_linear_fp8_writes_only_its_rows():
    # out is rows 1 .. t of a poisoned buffer: the epilogue must clip the last M tile.
    n, k = 4096, 4096
    for t in (3, 11, 129):
        w, scales = _weight(n, k, seed=t)
        x = _activations(t, k, seed=t + 1)
        buf = torch.full((t + 2, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        out = buf[1 : t + 1]
        qwen3_kernels.linear_fp8(x, w, scales, out=out)
        _check(out, x, w, scales, f"T={t} inside a buffer")
        assert buf[0].isnan().all() and buf[t + 1].isnan().all()


def test_linear_fp8_ignores_stale_workspace():
    # The op's workspace (quantized x, x_scales padded to a multiple of 4 tokens, the stream-K
    # partials) comes from the caching allocator uninitialised; NaN left in freed memory must not
    # reach the output (the padding scales multiply only rows past T, which are never stored).
    for t, (n, k) in ((3, (4096, 4096)), (16, (4096, 4112)), (17, (6144, 4112)),
                      (129, (24576, 4096))):
        w, scales = _weight(n, k, seed=t)
        x = _activations(t, k, seed=t + 2)
        junk = torch.full((64 << 20,), float("nan"), device="cuda")
        del junk  # back to the allocator, likely to be split for the workspace
        out = torch.full((t, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        qwen3_kernels.linear_fp8(x, w, scales, out=out)
        _check(out, x, w, scales, f"T={t} after a NaN block was freed")


def test_linear_fp8_under_trusted_inputs():
    # The engine's path: checks off, the same kernels; the result must equal the checked call's.
    for t, (n, k) in ((2, (6144, 4096)), (129, (24576, 4096)), (1000, (4096, 4112))):
        w, scales = _weight(n, k, seed=t)
        x = _activations(t, k, seed=t + 3)
        checked = qwen3_kernels.linear_fp8(x, w, scales)
        out = torch.full((t, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        with qwen3_kernels.trusted_inputs():
            qwen3_kernels.linear_fp8(x, w, scales, out=out)
        _check(out, x, w, scales, f"T={t} trusted")
        assert torch.equal(out, checked)


def test_linear_fp8_in_a_cuda_graph():
    # Prefill and decode run from captured graphs; the op allocates its workspace from the
    # caching allocator and stream-K zeroes its barriers with a memset on the stream, so both
    # must be captured. Replays with new x, w and scales copied in place, out poisoned each time.
    # T = 2 / 12 (the few-token pass, one and two tiles), 17 (stream-K), 129 on gate_up
    # (ping-pong), 2048 (cooperative, data-parallel).
    for t, (n, k) in ((2, (4096, 4096)), (12, (6144, 4112)), (17, (6144, 4112)),
                      (129, (24576, 4096)), (2048, (4096, 4096))):
        w, scales = _weight(n, k, seed=t)
        x = _activations(t, k, seed=t + 4)
        out = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
        qwen3_kernels.linear_fp8(x, w, scales, out=out)  # warm-up outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            torch.ops.qwen3_kernels.linear_fp8(out, x, w, scales)
        for seed in (1, 2):
            w2, scales2 = _weight(n, k, seed=100 * t + seed)
            w.copy_(w2)
            scales.copy_(scales2)
            x.copy_(_activations(t, k, seed=200 * t + seed))
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            _check(out, x, w, scales, f"T={t} replay {seed}")


def test_linear_fp8_opcheck():
    # opcheck's schema test cannot compare fp8 tensors; fake tensors and autograd registration.
    for t in (2, 129):
        w, scales = _weight(1032, 4112, seed=t)
        x = _activations(t, 4112, seed=t)
        out = torch.empty(t, 1032, device="cuda", dtype=torch.bfloat16)
        torch.library.opcheck(torch.ops.qwen3_kernels.linear_fp8, (out, x, w, scales),
                              test_utils=("test_faketensor", "test_autograd_registration"))
