"""CUDA: silu_and_mul, rms_norm, fused_add_rms_norm vs the fp32 reference (skips without a GPU).

Tolerance: both sides start from the same bf16/fp16 inputs and compute in fp32, so they differ
only by the final rounding (and __expf / summation order): at most ~1 ulp of the output dtype.
The token counts cover both launches each kernel picks from the shape (below and above 1024
tokens) and the vector / scalar paths.
"""

import pytest
import torch

import qwen3_kernels
from qwen3_kernels import reference as ref
from tests.helpers import requires_cuda

pytestmark = requires_cuda

TOKENS = [1, 7, 83, 4096, 16384]
DTYPES = [torch.bfloat16, torch.float16]
TOL = {torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def poisoned(*shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("inter", [3072, 12288, 25600, 83, 1032])
def test_silu_and_mul(t, inter, dtype):
    if t * inter > 16384 * 12288:
        pytest.skip("keeps the test fast")
    x = torch.randn(t, 2 * inter, dtype=dtype, device="cuda") * 3
    out = poisoned(t, inter, dtype=dtype)
    qwen3_kernels.silu_and_mul(x, out=out)
    torch.testing.assert_close(out, ref.silu_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_strided_rows(dtype):
    base = torch.randn(37, 2 * 3072 + 64, dtype=dtype, device="cuda")
    x = base[:, 32:32 + 2 * 3072]  # 16-byte aligned strided rows: vector path
    out_base = poisoned(37, 3072 + 8, dtype=dtype)
    out = out_base[:, :3072]
    qwen3_kernels.silu_and_mul(x, out=out)
    torch.testing.assert_close(out, ref.silu_and_mul(x), **TOL[dtype])
    assert out_base[:, 3072:].isnan().all(), "wrote outside out"
    x_odd = base[:, 3:3 + 2 * 3072]  # misaligned rows: scalar path
    torch.testing.assert_close(qwen3_kernels.silu_and_mul(x_odd), ref.silu_and_mul(x_odd), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("hidden", [1024, 2048, 2560, 4096, 5120, 769, 64, 10240])
def test_rms_norm(t, hidden, dtype):
    x = torch.randn(t, hidden, dtype=dtype, device="cuda")
    w = torch.randn(hidden, dtype=dtype, device="cuda")
    out = poisoned(t, hidden, dtype=dtype)
    qwen3_kernels.rms_norm(x, w, 1e-6, out=out)
    torch.testing.assert_close(out, ref.rms_norm(x, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("hidden", [1024, 4096, 5120, 769, 10240])
def test_fused_add_rms_norm(t, hidden, dtype):
    x = torch.randn(t, hidden, dtype=dtype, device="cuda")
    res = torch.randn(t, hidden, dtype=dtype, device="cuda") * 4
    w = torch.randn(hidden, dtype=dtype, device="cuda")
    want_x, want_res = ref.fused_add_rms_norm(x, res, w, 1e-6)
    qwen3_kernels.fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(res, want_res, atol=0, rtol=0)  # the same rounding of the same sum
    torch.testing.assert_close(x, want_x, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_strided_rows(dtype):
    base = torch.randn(19, 4096 + 64, dtype=dtype, device="cuda")
    x = base[:, 64:]
    w = torch.randn(4096, dtype=dtype, device="cuda")
    torch.testing.assert_close(qwen3_kernels.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), **TOL[dtype])
    rbase = torch.randn(19, 4096 + 8, dtype=dtype, device="cuda")
    res = rbase[:, 8:]
    xs = x.clone()
    want_x, want_res = ref.fused_add_rms_norm(xs, res, w, 1e-6)
    qwen3_kernels.fused_add_rms_norm(xs, res, w, 1e-6)
    torch.testing.assert_close(res, want_res, atol=0, rtol=0)
    torch.testing.assert_close(xs, want_x, **TOL[dtype])


def test_cuda_errors_are_clear():
    x = torch.randn(4, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="weight"):
        qwen3_kernels.rms_norm(x, torch.randn(64, dtype=torch.bfloat16), 1e-6)  # weight on CPU
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        torch.ops.qwen3_kernels.silu_and_mul(torch.empty(4, 32, device="cuda", dtype=torch.int32),
                                             torch.empty(4, 64, device="cuda", dtype=torch.int32))


def test_fp32_on_cuda_runs_the_reference():
    x = torch.randn(5, 64, device="cuda")
    torch.testing.assert_close(qwen3_kernels.silu_and_mul(x), ref.silu_and_mul(x))


def test_opcheck():
    x = torch.randn(9, 256, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(256, dtype=torch.bfloat16, device="cuda")
    torch.library.opcheck(torch.ops.qwen3_kernels.silu_and_mul.default,
                          (torch.empty(9, 128, dtype=torch.bfloat16, device="cuda"), x))
    torch.library.opcheck(torch.ops.qwen3_kernels.rms_norm.default, (torch.empty_like(x), x, w, 1e-6))
    torch.library.opcheck(torch.ops.qwen3_kernels.fused_add_rms_norm.default,
                          (x.clone(), torch.randn_like(x), w, 1e-6))


def test_torch_compile_fullgraph():
    @torch.compile(fullgraph=True)
    def mlp_tail(h, res, w, gate_up):
        qwen3_kernels.fused_add_rms_norm(h, res, w, 1e-6)
        return qwen3_kernels.silu_and_mul(gate_up), qwen3_kernels.rms_norm(res, w, 1e-6)

    h = torch.randn(33, 1024, dtype=torch.bfloat16, device="cuda")
    res = torch.randn_like(h)
    w = torch.randn(1024, dtype=torch.bfloat16, device="cuda")
    gu = torch.randn(33, 2 * 3072, dtype=torch.bfloat16, device="cuda")
    want_h, want_res = ref.fused_add_rms_norm(h, res, w, 1e-6)
    act, normed = mlp_tail(h, res, w, gu)
    torch.testing.assert_close(act, ref.silu_and_mul(gu), **TOL[torch.bfloat16])
    torch.testing.assert_close(res, want_res, atol=0, rtol=0)
    torch.testing.assert_close(h, want_h, **TOL[torch.bfloat16])
    torch.testing.assert_close(normed, ref.rms_norm(want_res, w, 1e-6), **TOL[torch.bfloat16])


def test_graph_capture_small_batch():
    x = torch.randn(16, 2 * 3072, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(16, 3072, dtype=torch.bfloat16, device="cuda")
    qwen3_kernels.silu_and_mul(x, out=out)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        qwen3_kernels.silu_and_mul(x, out=out)
    x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    g.replay()
    torch.testing.assert_close(out, ref.silu_and_mul(x), **TOL[torch.bfloat16])


@pytest.mark.parametrize("t", [1, 16, 300])
def test_silu_dependent_calls_in_graph(t):
    # The second call reads what the first wrote: with programmatic dependent launch it must wait
    # for it (a missing wait reads the NaN poison).
    inter = 3072
    a = torch.randn(t, 2 * inter, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(t, 2 * inter, dtype=torch.bfloat16, device="cuda")
    c = torch.empty(t, inter, dtype=torch.bfloat16, device="cuda")
    qwen3_kernels.silu_and_mul(a, out=b[:, :inter])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        qwen3_kernels.silu_and_mul(a, out=b[:, :inter])
        qwen3_kernels.silu_and_mul(b, out=c)
    b[:, :inter] = float("nan")
    c.fill_(float("nan"))
    g.replay()
    want_b = b.clone()
    want_b[:, :inter] = ref.silu_and_mul(a)
    torch.testing.assert_close(b[:, :inter], want_b[:, :inter], **TOL[torch.bfloat16])
    torch.testing.assert_close(c, ref.silu_and_mul(b), **TOL[torch.bfloat16])


@pytest.mark.parametrize("t", [1, 16, 300])
def test_norm_dependent_calls_in_graph(t):
    # Each call reads the x and residual the previous one wrote (see the silu test above).
    h = 4096
    x0 = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")
    r0 = torch.randn(t, h, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(h, dtype=torch.bfloat16, device="cuda") * 0.1 + 1
    x, r, out = x0.clone(), r0.clone(), torch.empty_like(x0)

    def chain():
        for _ in range(3):
            qwen3_kernels.fused_add_rms_norm(x, r, w, 1e-6)
        qwen3_kernels.rms_norm(r, w, 1e-6, out=out)

    chain()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain()
    x.copy_(x0)
    r.copy_(r0)
    out.fill_(float("nan"))
    g.replay()
    want_x, want_r = x0, r0
    for _ in range(3):
        want_x, want_r = ref.fused_add_rms_norm(want_x, want_r, w, 1e-6)
    # Three rounded steps: allow each step's rounding (the sums are exact in the reference).
    torch.testing.assert_close(r, want_r, atol=6e-2, rtol=3e-2)
    torch.testing.assert_close(x, want_x, atol=6e-2, rtol=3e-2)
    torch.testing.assert_close(out, ref.rms_norm(r, w, 1e-6), **TOL[torch.bfloat16])
