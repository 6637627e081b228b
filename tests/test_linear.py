"""CPU: the linear reference vs a naive dot product, input checks, the CPU dispatch path.

The Qwen3 QKV shapes live here and are shared by tests/test_linear_cuda.py and
benchmarks/bench_linear.py.
"""

import pytest
import torch

import qwen3_kernels
from qwen3_kernels import reference as ref

HEAD_DIM = 128
# model: (hidden, q heads, kv heads), from TARGETS.md
QWEN3_ATTENTION = {
    "0.6B": (1024, 16, 8),
    "1.7B": (2048, 16, 8),
    "4B": (2560, 32, 8),
    "8B": (4096, 32, 8),
    "14B": (5120, 40, 8),
    "32B": (5120, 64, 8),
}
# model: (N, K) of the fused QKV projection: w_qkv is [(Hq + 2 * Hkv) * 128, hidden]
QKV_SHAPES = {
    name: ((hq + 2 * hkv) * HEAD_DIM, hidden) for name, (hidden, hq, hkv) in QWEN3_ATTENTION.items()
}
# token counts of the acceptance criteria (issue 7): decode sizes through long prefills
TOKENS = [1, 3, 8, 16, 33, 64, 128, 256, 512, 1024, 4096, 16384]


def test_qkv_shapes_are_the_issue_shapes():
    assert sorted(QKV_SHAPES.values()) == sorted(
        [(4096, 1024), (4096, 2048), (6144, 2560), (6144, 4096), (7168, 5120), (10240, 5120)]
    )


@pytest.mark.parametrize("t,n,k", [(1, 8, 8), (3, 16, 24), (7, 40, 64)])
def test_reference_vs_naive_dot_products(t, n, k):
    x = torch.randn(t, k, dtype=torch.float64)
    w = torch.randn(n, k, dtype=torch.float64)
    naive = torch.tensor([[sum(x[i, c].item() * w[j, c].item() for c in range(k)) for j in range(n)]
                          for i in range(t)], dtype=torch.float64)
    got = ref.linear(x.float(), w.float())
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), naive, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_accumulates_in_fp32_and_rounds_once(dtype):
    # A long K where a 16-bit running sum would drift: the reference must equal the fp32 product
    # rounded once to the storage dtype.
    x = torch.randn(4, 4096).to(dtype)
    w = torch.randn(24, 4096).to(dtype)
    want = (x.double() @ w.double().t()).to(dtype)
    got = ref.linear(x, w)
    assert got.dtype == dtype
    # fp32 accumulation differs from fp64 by far less than one 16-bit ulp: at most one rounding flip
    assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2**-7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_wrapper_on_cpu_runs_the_reference(dtype):
    x = torch.randn(5, 64).to(dtype)
    w = torch.randn(48, 64).to(dtype)
    out = torch.full((5, 48), float("nan"), dtype=dtype)
    got = qwen3_kernels.linear(x, w, out=out)
    assert got is out
    assert torch.equal(out, ref.linear(x, w))
    assert torch.equal(qwen3_kernels.linear(x, w), ref.linear(x, w))


def test_wrapper_handles_zero_tokens():
    out = qwen3_kernels.linear(torch.randn(0, 64), torch.randn(16, 64))
    assert out.shape == (0, 16)


@pytest.mark.parametrize(
    "x_shape,w_shape,kwargs,match",
    [
        ((4, 64), (16, 32), {}, "inner dims differ"),
        ((4, 60), (16, 60), {}, "multiples of 8"),
        ((4, 64), (20, 64), {}, "multiples of 8"),
        ((4, 64, 1), (16, 64), {}, "must have 2 dims"),
        ((4, 64), (16, 64), {"out_shape": (4, 8)}, "must have shape"),
        ((4, 64), (16, 64), {"w_dtype": torch.float16}, "must be torch.bfloat16"),
        ((4, 64), (16, 64), {"out_dtype": torch.float16}, "must be torch.bfloat16"),
    ],
)
def test_input_checks(x_shape, w_shape, kwargs, match):
    x = torch.randn(*x_shape).to(torch.bfloat16)
    w = torch.randn(*w_shape).to(kwargs.get("w_dtype", torch.bfloat16))
    out = None
    if "out_shape" in kwargs or "out_dtype" in kwargs:
        out = torch.empty(*kwargs.get("out_shape", (x_shape[0], w_shape[0])),
                          dtype=kwargs.get("out_dtype", torch.bfloat16))
    with pytest.raises(ValueError, match=match):
        qwen3_kernels.linear(x, w, out=out)


def test_input_checks_reject_strided_operands():
    x = torch.randn(64, 8).to(torch.bfloat16).t()  # [8, 64], column-major
    w = torch.randn(16, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous"):
        qwen3_kernels.linear(x, w)
    with pytest.raises(ValueError, match="contiguous"):
        qwen3_kernels.linear(torch.randn(8, 64).to(torch.bfloat16), torch.randn(64, 32).to(torch.bfloat16).t())


# ---- linear_silu_and_mul: the gate_up projection and its activation in one op -------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_silu_and_mul_reference_is_the_unfused_pair(dtype):
    # the product rounded to the dtype first, then silu(gate) * up: what the model ran before
    x = torch.randn(5, 64).to(dtype)
    w = (torch.randn(48, 64) * 0.125).to(dtype)
    h = ref.linear(x, w)
    want = (torch.nn.functional.silu(h[:, :24].float()) * h[:, 24:].float()).to(dtype)
    assert torch.equal(ref.linear_silu_and_mul(x, w), want)
    out = torch.full((5, 24), float("nan"), dtype=dtype)
    assert qwen3_kernels.linear_silu_and_mul(x, w, out=out) is out
    assert torch.equal(out, want)


@pytest.mark.parametrize(
    "x_shape,w_shape,out_shape,match",
    [
        ((4, 64), (16, 32), None, "inner dims differ"),
        ((4, 64), (20, 64), None, "multiples of 8"),
        ((4, 60), (16, 60), None, "multiples of 8"),
        ((4, 64), (16, 64), (4, 16), "must have shape"),
        ((4, 64, 1), (16, 64), None, "must have 2 dims"),
    ],
)
def test_linear_silu_and_mul_input_checks(x_shape, w_shape, out_shape, match):
    x = torch.randn(*x_shape).to(torch.bfloat16)
    w = torch.randn(*w_shape).to(torch.bfloat16)
    out = None if out_shape is None else torch.empty(*out_shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        qwen3_kernels.linear_silu_and_mul(x, w, out=out)
    with pytest.raises(ValueError, match="must be torch.bfloat16"):
        qwen3_kernels.linear_silu_and_mul(torch.randn(4, 64).to(torch.bfloat16), torch.randn(16, 64))
    with pytest.raises(ValueError, match="contiguous"):
        qwen3_kernels.linear_silu_and_mul(torch.randn(64, 4).to(torch.bfloat16).t(),
                                          torch.randn(16, 64).to(torch.bfloat16))
