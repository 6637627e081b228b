"""CPU: the FP8 block-scaled projection's spec (reference.quantize_fp8 / linear_fp8) and its
checked wrappers (qwen3_kernels.quantize_fp8 / linear_fp8), which run the reference here.

The CUDA kernels are compared with these in tests/test_fp8_gemv_cuda.py and
tests/test_linear_fp8_cuda.py."""

from __future__ import annotations

import pytest
import torch

import qwen3_kernels
from qwen3_kernels import reference as ref
from tests.helpers import one_thread, rel_err  # noqa: F401  (autouse)

E4M3 = torch.float8_e4m3fn


def _weight(n, k, seed=0):
    """A [n, k] e4m3 weight and its [ceil(n/128), ceil(k/128)] scales, as a checkpoint holds."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    blocks = (-(-n // 128), -(-k // 128))
    scales = torch.rand(blocks, generator=g) * 1e-3 + 1e-4
    wd = w / scales.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return wd.clamp(-448, 448).to(E4M3), scales


@pytest.mark.parametrize("t,k", [(1, 128), (3, 256), (5, 272), (17, 1040)])
def test_quantize_fp8_round_trip_is_within_half_an_e4m3_step(t, k):
    x = torch.randn(t, k, dtype=torch.bfloat16) * torch.logspace(-3, 3, t).unsqueeze(1).to(
        torch.bfloat16)
    q, s = ref.quantize_fp8(x)
    assert q.dtype == E4M3 and q.shape == (t, k) and s.shape == (t, -(-k // 128))
    xd = ref.dequantize_fp8(q, s, 1)
    # e4m3 steps are at most 32 (between 416 and 448) on the 448-wide scaled range, so rounding
    # moves a value by at most 16 / 448 of its group's amax < amax * 2^-4.
    amax = x.float().abs().reshape(t, -1).amax(dim=1, keepdim=True)
    assert ((xd - x.float()).abs() <= amax * 2.0 ** -4 + 1e-30).all()
    # every group's amax lands on +-448
    full = k // 128
    g = q.float()[:, : full * 128].reshape(t, full, 128).abs().amax(-1)
    assert (g == 448).all()


def test_quantize_fp8_zero_group_and_partial_group():
    x = torch.zeros(2, 144, dtype=torch.bfloat16)
    x[1, 130] = -3.0
    q, s = ref.quantize_fp8(x)
    assert s[0, 0] == pytest.approx(ref.FP8_SCALE_FLOOR / 448)  # no 0 / 0
    assert (q.float()[0] == 0).all()
    assert s[1, 1] == pytest.approx(3.0 / 448)  # the 16-wide last group alone
    assert q.float()[1, 130] == -448


def test_linear_fp8_equals_the_dequantized_product():
    x = torch.randn(7, 384, dtype=torch.bfloat16)
    w, ws = _weight(264, 384)
    out = ref.linear_fp8(x, w, ws)
    q, s = ref.quantize_fp8(x)
    expect = ref.dequantize_fp8(q, s, 1) @ ref.dequantize_fp8(w, ws, 128).t()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expect, rtol=8e-3, atol=1e-5)
    # and close to the unquantized activations' product (the activation rounding's cost)
    assert rel_err(out, x.float() @ ref.dequantize_fp8(w, ws, 128).t()) < 0.05


def test_wrappers_run_the_reference_on_cpu():
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    w, ws = _weight(128, 256, seed=1)
    out = torch.full((3, 128), float("nan"), dtype=torch.bfloat16)
    qwen3_kernels.linear_fp8(x, w, ws, out=out)
    assert torch.equal(out, ref.linear_fp8(x, w, ws))
    q, s = qwen3_kernels.quantize_fp8(x)
    rq, rs = ref.quantize_fp8(x)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    assert s.stride() == (1, 4)  # token-contiguous, the GEMM's layout


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(weight=a["weight"].to(torch.bfloat16)), "weight must be"),
    (lambda a: a.update(weight_scale_inv=a["weight_scale_inv"][:, :1].contiguous()), "weight_scale_inv must have shape"),
    (lambda a: a.update(weight_scale_inv=a["weight_scale_inv"].double()), "weight_scale_inv must be"),
    (lambda a: a.update(x=a["x"][:, :128].contiguous()), "inner dims differ"),
    (lambda a: a.update(x=a["x"].t().contiguous().t()), "x must be contiguous"),
    (lambda a: a.update(out=torch.empty(3, 128, dtype=torch.float16)), "out must be"),
    (lambda a: a.update(out=torch.empty(3, 136, dtype=torch.bfloat16)), "out must have shape"),
])
def test_linear_fp8_refuses_bad_arguments(change, match):
    w, ws = _weight(128, 256, seed=2)
    args = dict(x=torch.randn(3, 256, dtype=torch.bfloat16), weight=w, weight_scale_inv=ws)
    change(args)
    with pytest.raises(ValueError, match=r"qwen3_kernels.linear_fp8: .*" + match):
        qwen3_kernels.linear_fp8(**args)


def test_linear_fp8_refuses_k_not_a_multiple_of_16():
    w = torch.zeros(128, 136, dtype=E4M3)
    with pytest.raises(ValueError, match="multiple of 16"):
        qwen3_kernels.linear_fp8(torch.randn(2, 136), w, torch.ones(1, 2))


def test_quantize_fp8_refuses_bad_arguments():
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x_scales must have shape"):
        qwen3_kernels.quantize_fp8(x, x_scales=torch.empty(3, 3))
    with pytest.raises(ValueError, match="out must be"):
        qwen3_kernels.quantize_fp8(x, out=torch.empty(3, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 16"):
        qwen3_kernels.quantize_fp8(torch.randn(3, 136))


def test_opcheck_and_compile():
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    w, ws = _weight(128, 256, seed=3)
    out = torch.empty(3, 128, dtype=torch.bfloat16)
    utils = ("test_faketensor", "test_autograd_registration")  # test_schema cannot compare fp8
    torch.library.opcheck(torch.ops.qwen3_kernels.linear_fp8, (out, x, w, ws), test_utils=utils)
    q = torch.empty(3, 256, dtype=E4M3)
    s = qwen3_kernels.fp8_scales_buffer(3, 256, "cpu")
    torch.library.opcheck(torch.ops.qwen3_kernels.quantize_fp8, (q, s, x), test_utils=utils)

    @torch.compile(fullgraph=True, backend="eager")
    def f(x):
        return qwen3_kernels.linear_fp8(x, w, ws)

    assert torch.equal(f(x), ref.linear_fp8(x, w, ws))


def test_linear_fp8_silu_and_mul_is_linear_fp8_then_silu_and_mul():
    x = torch.randn(3, 384, dtype=torch.bfloat16)
    w, ws = _weight(2 * 144, 384, seed=4)  # I = 144: the up rows start inside a 128 block
    expect = ref.silu_and_mul(ref.linear_fp8(x, w, ws))
    assert torch.equal(ref.linear_fp8_silu_and_mul(x, w, ws), expect)
    out = torch.full((3, 144), float("nan"), dtype=torch.bfloat16)
    assert qwen3_kernels.linear_fp8_silu_and_mul(x, w, ws, out=out) is out
    assert torch.equal(out, expect)


@pytest.mark.parametrize("change,match", [
    (lambda a: a.update(weight=a["weight"].to(torch.bfloat16)), "weight must be"),
    (lambda a: a.update(weight_scale_inv=a["weight_scale_inv"][:1].contiguous()),
     "weight_scale_inv must have shape"),
    (lambda a: a.update(x=a["x"][:, :128].contiguous()), "inner dims differ"),
    (lambda a: a.update(x=a["x"].t().contiguous().t()), "x must be contiguous"),
    (lambda a: a.update(weight=a["weight"][:248], weight_scale_inv=a["weight_scale_inv"][:2]),
     r"2I \(248\) of 16"),
    (lambda a: a.update(out=torch.empty(3, 128, dtype=torch.float16)), "out must be"),
    (lambda a: a.update(out=torch.empty(3, 256, dtype=torch.bfloat16)), "out must have shape"),
])
def test_linear_fp8_silu_and_mul_refuses_bad_arguments(change, match):
    w, ws = _weight(256, 256, seed=5)
    args = dict(x=torch.randn(3, 256, dtype=torch.bfloat16), weight=w, weight_scale_inv=ws)
    change(args)
    with pytest.raises(ValueError, match=r"qwen3_kernels.linear_fp8_silu_and_mul: .*" + match):
        qwen3_kernels.linear_fp8_silu_and_mul(**args)


def test_linear_fp8_silu_and_mul_opcheck():
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    w, ws = _weight(256, 256, seed=6)
    out = torch.empty(3, 128, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.qwen3_kernels.linear_fp8_silu_and_mul, (out, x, w, ws),
                          test_utils=("test_faketensor", "test_autograd_registration"))
