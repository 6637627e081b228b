"""CUDA: the FP8 activation producers (norm.cu's rms_norm_fp8 / fused_add_rms_norm_fp8,
quantize_fp8.cu's silu_and_mul_fp8) against the unfused CUDA ops followed by quantize_fp8, bit
for bit (values and scales: the same math, fused), and linear_fp8 on their output against
linear_fp8 on the 16-bit activation (bit for bit above one token, where both run the same
kernel on the same quantized input; within the FP8 GEMV's tolerance at one token, where the
16-bit path's GEMV quantizes x itself). Odd token counts, Qwen3's hidden and intermediate sizes,
strided rows, outputs poisoned with NaN (0xff in e4m3)."""

import pytest
import torch

import qwen3_kernels
from qwen3_kernels import reference as ref
from tests.helpers import requires_cuda

pytestmark = requires_cuda

BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn
TOKENS = [1, 2, 7, 83, 1024, 1031, 4096]


def _poisoned(t, k):
    q = torch.full((t, k), 0xFF, dtype=torch.uint8, device="cuda").view(E4M3)
    s = qwen3_kernels.fp8_scales_buffer(t, k, "cuda")
    s.fill_(float("nan"))
    return q, s


def _same(a, b):
    qa, sa = a
    qb, sb = b
    assert torch.equal(qa.view(torch.uint8), qb.view(torch.uint8))
    assert torch.equal(sa, sb)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("h", [1024, 2560, 4096, 5120])
def test_rms_norm_fp8_is_rms_norm_then_quantize_fp8(t, h):
    x = torch.randn(t, h, dtype=BF16, device="cuda") * 3
    w = torch.randn(h, dtype=BF16, device="cuda")
    got = qwen3_kernels.rms_norm_fp8(x, w, 1e-6, *_poisoned(t, h))
    _same(got, qwen3_kernels.quantize_fp8(qwen3_kernels.rms_norm(x, w, 1e-6)))


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("h", [1024, 4096, 5120])
def test_fused_add_rms_norm_fp8_is_fused_add_rms_norm_then_quantize_fp8(t, h):
    base = torch.randn(t, h + 64, dtype=BF16, device="cuda")
    x = base[:, 64:]  # strided rows
    r = torch.randn(t, h, dtype=BF16, device="cuda")
    w = torch.randn(h, dtype=BF16, device="cuda")
    x0, r0 = x.clone(), r.clone()
    got = qwen3_kernels.fused_add_rms_norm_fp8(x, r, w, 1e-6, *_poisoned(t, h))
    normed, r_want = qwen3_kernels.fused_add_rms_norm(x0.clone(), r0.clone(), w, 1e-6)
    assert torch.equal(x, x0), "x must be left as it was"
    assert torch.equal(r, r_want)
    _same(got, qwen3_kernels.quantize_fp8(normed))


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("i", [3072, 9728, 12288, 25600])
def test_silu_and_mul_fp8_is_silu_and_mul_then_quantize_fp8(t, i):
    if t * i > 4096 * 12288:
        pytest.skip("keeps the test fast")
    base = torch.randn(t, 2 * i + 32, dtype=BF16, device="cuda") * 4
    x = base[:, 32:]  # strided rows
    got = qwen3_kernels.silu_and_mul_fp8(x, *_poisoned(t, i))
    _same(got, qwen3_kernels.quantize_fp8(qwen3_kernels.silu_and_mul(x)))


def test_producers_keep_nan_and_inf_as_quantize_fp8_does():
    x = torch.randn(5, 1024, dtype=BF16, device="cuda")
    x[1, 7] = float("nan")
    x[3, 300] = float("inf")
    w = torch.ones(1024, dtype=BF16, device="cuda")
    got = qwen3_kernels.silu_and_mul_fp8(torch.cat([x, x], 1))
    want = qwen3_kernels.quantize_fp8(qwen3_kernels.silu_and_mul(torch.cat([x, x], 1)))
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1].isnan(), want[1].isnan())
    got = qwen3_kernels.rms_norm_fp8(x, w, 1e-6)
    want = qwen3_kernels.quantize_fp8(qwen3_kernels.rms_norm(x, w, 1e-6))
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))


@pytest.mark.parametrize("t", [1, 3, 8, 16, 17, 64, 176, 384])
@pytest.mark.parametrize("nk", [(6144, 4096), (4096, 12288), (24576, 4096)])
def test_linear_fp8_on_the_quantized_activation(t, nk):
    n, k = nk
    gen = torch.Generator(device="cuda").manual_seed(t + n)
    x = torch.randn(t, k, dtype=BF16, device="cuda", generator=gen)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 64).to(E4M3)
    ws = torch.rand(-(-n // 128), -(-k // 128), device="cuda", generator=gen) / 256 + 1e-4
    q, s = qwen3_kernels.quantize_fp8(x)
    out = torch.full((t, n), float("nan"), dtype=BF16, device="cuda")
    qwen3_kernels.linear_fp8(q, w, ws, out=out, x_scales=s)
    want = qwen3_kernels.linear_fp8(x, w, ws)
    if t > 1:
        assert torch.equal(out, want)
    else:  # the GEMV (quantizing x in each CTA) and the tokens pass: another summation order
        spec = ref.linear_fp8_quantized(q, s, w, ws)
        rel = (out.float() - spec).norm() / spec.norm()
        assert rel < 8e-3, rel


def test_linear_fp8_quantized_refuses_a_scale_layout_it_cannot_read():
    q = torch.zeros(4, 256, dtype=E4M3, device="cuda")
    w = torch.zeros(64, 256, dtype=E4M3, device="cuda")
    ws = torch.ones(1, 2, device="cuda")
    with pytest.raises(ValueError, match="token-contiguous"):
        qwen3_kernels.linear_fp8(q, w, ws, x_scales=torch.ones(4, 2, device="cuda"))
