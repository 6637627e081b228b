"""CPU: the FP8 activation producers (rms_norm_fp8, fused_add_rms_norm_fp8, silu_and_mul_fp8)
and linear_fp8 on their output: their references are the unfused ops followed by quantize_fp8,
and linear_fp8 on (values, x_scales) gives what linear_fp8 gives on the 16-bit activation;
the input checks name the op and the argument."""

import pytest
import torch

import qwen3_kernels
from qwen3_kernels import reference as ref

BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn


def _bits(t):
    return t.view(torch.uint8) if t.dtype == E4M3 else t


@pytest.mark.parametrize("t,h", [(1, 128), (7, 256), (33, 1024), (5, 4112)])
def test_rms_norm_fp8_is_the_norm_then_quantize_fp8(t, h):
    x, w = torch.randn(t, h, dtype=BF16) * 3, torch.randn(h, dtype=BF16)
    q, s = qwen3_kernels.rms_norm_fp8(x, w, 1e-6)
    q_ref, s_ref = qwen3_kernels.quantize_fp8(qwen3_kernels.rms_norm(x, w, 1e-6))
    assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(s, s_ref)
    assert s.stride(0) == 1  # the GEMM's token-contiguous layout


@pytest.mark.parametrize("t,h", [(1, 128), (9, 512), (4, 4096)])
def test_fused_add_rms_norm_fp8_updates_the_residual_and_leaves_x(t, h):
    x, r = torch.randn(t, h, dtype=BF16), torch.randn(t, h, dtype=BF16)
    w = torch.randn(h, dtype=BF16)
    x0, r0 = x.clone(), r.clone()
    q, s = qwen3_kernels.fused_add_rms_norm_fp8(x, r, w, 1e-6)
    normed, r_ref = qwen3_kernels.fused_add_rms_norm(x0.clone(), r0.clone(), w, 1e-6)
    q_ref, s_ref = qwen3_kernels.quantize_fp8(normed)
    assert torch.equal(x, x0), "x must be left as it was"
    assert torch.equal(r, r_ref)
    assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(s, s_ref)


@pytest.mark.parametrize("t,i", [(1, 128), (6, 384), (17, 3072)])
def test_silu_and_mul_fp8_is_silu_and_mul_then_quantize_fp8(t, i):
    x = torch.randn(t, 2 * i, dtype=BF16) * 4
    q, s = qwen3_kernels.silu_and_mul_fp8(x)
    q_ref, s_ref = qwen3_kernels.quantize_fp8(qwen3_kernels.silu_and_mul(x))
    assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(s, s_ref)


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_linear_fp8_on_a_quantized_activation_is_linear_fp8(dtype):
    x = torch.randn(11, 256, dtype=dtype)
    w = (torch.randn(64, 256) * 64).to(E4M3)
    ws = torch.rand(1, 2) / 64 + 1e-3
    q, s = qwen3_kernels.quantize_fp8(x)
    out = torch.empty(11, 64, dtype=dtype)
    qwen3_kernels.linear_fp8(q, w, ws, out=out, x_scales=s)
    assert torch.equal(out, qwen3_kernels.linear_fp8(x, w, ws))
    assert qwen3_kernels.linear_fp8(q, w, ws, x_scales=s).dtype == BF16  # the kernel's output


def test_opcheck_and_compile():
    x, w = torch.randn(3, 256, dtype=BF16), torch.randn(256, dtype=BF16)
    q = torch.empty(3, 256, dtype=E4M3)
    s = qwen3_kernels.fp8_scales_buffer(3, 256, "cpu")
    utils = ("test_faketensor", "test_autograd_registration")  # test_schema cannot compare fp8
    ops = torch.ops.qwen3_kernels
    torch.library.opcheck(ops.rms_norm_fp8, (q, s, x, w, 1e-6), test_utils=utils)
    torch.library.opcheck(ops.fused_add_rms_norm_fp8, (q, s, x, x.clone(), w, 1e-6),
                          test_utils=utils)
    torch.library.opcheck(ops.silu_and_mul_fp8, (q[:, :128], s[:, :1], x), test_utils=utils)
    wq, ws = _w()
    out = torch.empty(3, 64, dtype=BF16)
    torch.library.opcheck(ops.linear_fp8, (out, q, wq, ws, s), test_utils=utils)

    @torch.compile(fullgraph=True, backend="eager")
    def f(x):
        return qwen3_kernels.linear_fp8(*qwen3_kernels.rms_norm_fp8(x, w, 1e-6)[:1], wq, ws,
                                        x_scales=qwen3_kernels.rms_norm_fp8(x, w, 1e-6)[1])

    assert torch.equal(f(x), qwen3_kernels.linear_fp8(qwen3_kernels.rms_norm(x, w, 1e-6), wq, ws))


def _w():
    return (torch.randn(64, 256) * 64).to(E4M3), torch.ones(1, 2)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: qwen3_kernels.rms_norm_fp8(torch.randn(3, 256), torch.randn(128), 1e-6),
         "rms_norm_fp8: weight must have shape"),
        (lambda: qwen3_kernels.rms_norm_fp8(torch.randn(3, 256), torch.randn(256), 1e-6,
                                            out=torch.empty(3, 256)),
         "rms_norm_fp8: out must be torch.float8_e4m3fn"),
        (lambda: qwen3_kernels.rms_norm_fp8(torch.randn(3, 256), torch.randn(256), 1e-6,
                                            x_scales=torch.empty(3, 3)),
         r"rms_norm_fp8: x_scales must have shape \(3, 2\)"),
        (lambda: qwen3_kernels.fused_add_rms_norm_fp8(torch.randn(3, 256), torch.randn(2, 256),
                                                      torch.randn(256), 1e-6),
         "fused_add_rms_norm_fp8: residual must have shape"),
        (lambda: qwen3_kernels.silu_and_mul_fp8(torch.randn(3, 255)),
         "silu_and_mul_fp8: x's last dim must be even"),
        (lambda: qwen3_kernels.linear_fp8(torch.randn(3, 256).to(E4M3), *_w(),
                                          x_scales=torch.ones(3, 1)),
         r"linear_fp8: x_scales must have shape \(3, 2\)"),
        (lambda: qwen3_kernels.linear_fp8(torch.randn(3, 256).to(E4M3), *_w(),
                                          x_scales=torch.ones(3, 2)),
         "linear_fp8: x_scales must be token-contiguous"),
        (lambda: qwen3_kernels.linear_fp8(torch.randn(3, 256), *_w(),
                                          x_scales=qwen3_kernels.fp8_scales_buffer(3, 256, "cpu")),
         "linear_fp8: x must be torch.float8_e4m3fn"),
    ],
)
def test_input_checks_name_the_op_and_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
