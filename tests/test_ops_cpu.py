"""CPU: the references of the elementwise ops vs naive formulas, input checks, dispatch, schemas."""

import math
import re
from pathlib import Path

import pytest
import torch

import qwen3_kernels
from qwen3_kernels import ops, reference as ref
from tests.helpers import rel_err

ROOT = Path(__file__).resolve().parents[1]


def test_the_extension_implements_every_schema():
    # ops.SCHEMAS is the only schema text; csrc/torch_bindings.cpp registers a CUDA impl per name.
    text = (ROOT / "csrc" / "torch_bindings.cpp").read_text()
    assert "TORCH_LIBRARY(" not in text and ".def(" not in text
    impls = re.findall(r'm\.impl\("(\w+)"', text)
    assert sorted(impls) == sorted(ops.SCHEMAS)


def test_every_op_resolves_and_has_a_reference():
    for name in ops.SCHEMAS:
        assert hasattr(torch.ops.qwen3_kernels, name)
        assert callable(getattr(ref, name))
        assert callable(getattr(qwen3_kernels, name))


@pytest.mark.parametrize("t,i", [(1, 8), (7, 83), (33, 3072)])
def test_silu_and_mul_reference_vs_formula(t, i):
    x = torch.randn(t, 2 * i)  # the reference computes in fp32
    naive = torch.empty(t, i)
    for r in range(t):
        for c in range(0, i, max(1, i // 7)):
            g, u = x[r, c].item(), x[r, i + c].item()
            naive[r, c] = g / (1 + math.exp(-g)) * u
    got = ref.silu_and_mul(x)
    cols = list(range(0, i, max(1, i // 7)))
    assert torch.allclose(got[:, cols], naive[:, cols], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t,h", [(1, 8), (7, 769), (4, 1024)])
def test_rms_norm_reference_vs_formula(t, h):
    x = torch.randn(t, h)
    w = torch.randn(h)
    eps = 1e-6
    naive = torch.stack([x[r] / math.sqrt(sum(v * v for v in x[r].tolist()) / h + eps) * w for r in range(t)])
    assert torch.allclose(ref.rms_norm(x, w, eps), naive, rtol=1e-5, atol=1e-6)


def test_fused_add_rms_norm_reference_rounds_the_sum_like_the_store():
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    res = torch.randn(5, 64, dtype=torch.bfloat16)
    w = torch.randn(64, dtype=torch.bfloat16)
    out, new_res = ref.fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(new_res, (x.float() + res.float()).bfloat16())
    assert torch.equal(out, ref.rms_norm(new_res, w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wrappers_on_cpu_match_reference_and_write_out(dtype):
    x = torch.randn(9, 2 * 40, dtype=dtype)
    out = torch.full((9, 40), float("nan"), dtype=dtype)
    qwen3_kernels.silu_and_mul(x, out=out)
    assert torch.equal(out, ref.silu_and_mul(x))

    h = torch.randn(9, 48, dtype=dtype)
    w = torch.randn(48, dtype=dtype)
    assert torch.equal(qwen3_kernels.rms_norm(h, w, 1e-6), ref.rms_norm(h, w, 1e-6))

    res = torch.randn(9, 48, dtype=dtype)
    want_out, want_res = ref.fused_add_rms_norm(h, res, w, 1e-6)
    hh, rr = h.clone(), res.clone()
    qwen3_kernels.fused_add_rms_norm(hh, rr, w, 1e-6)
    assert torch.equal(hh, want_out) and torch.equal(rr, want_res)


def test_strided_rows_on_cpu():
    base = torch.randn(6, 200)
    x = base[:, 10:10 + 2 * 64]  # rows strided: a view of a wider buffer
    assert rel_err(qwen3_kernels.silu_and_mul(x), ref.silu_and_mul(x.contiguous())) == 0


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: qwen3_kernels.silu_and_mul(torch.randn(3, 7)), "even"),
        (lambda: qwen3_kernels.silu_and_mul(torch.randn(3, 8, 2)), "2 dims"),
        (lambda: qwen3_kernels.silu_and_mul(torch.randint(0, 3, (3, 8))), "must be one of"),
        (lambda: qwen3_kernels.silu_and_mul(torch.randn(3, 8), out=torch.empty(3, 5)), "shape"),
        (lambda: qwen3_kernels.silu_and_mul(torch.randn(3, 8), out=torch.empty(3, 4, dtype=torch.float16)), "float16|dtype|must be"),
        (lambda: qwen3_kernels.silu_and_mul(torch.randn(8, 3).t()), "contiguous in its last dim"),
        (lambda: qwen3_kernels.rms_norm(torch.randn(3, 8), torch.randn(7), 1e-6), "weight"),
        (lambda: qwen3_kernels.rms_norm(torch.randn(3, 8), torch.randn(8), -1.0), "eps"),
        (lambda: qwen3_kernels.rms_norm(torch.randn(3, 8), torch.randn(8, dtype=torch.float16), 1e-6), "weight"),
        (lambda: qwen3_kernels.fused_add_rms_norm(torch.randn(3, 8), torch.randn(4, 8), torch.randn(8), 1e-6), "residual"),
    ],
)
def test_input_checks_raise_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_opcheck_reference_ops_on_cpu():
    x = torch.randn(5, 32)
    torch.library.opcheck(torch.ops.qwen3_kernels.silu_and_mul.default, (torch.empty(5, 16), x))
    w = torch.randn(32)
    torch.library.opcheck(torch.ops.qwen3_kernels.rms_norm.default, (torch.empty(5, 32), x, w, 1e-6))
    torch.library.opcheck(
        torch.ops.qwen3_kernels.fused_add_rms_norm.default, (x.clone(), torch.randn(5, 32), w, 1e-6)
    )


def test_has_cuda_kernels_is_a_bool():
    assert isinstance(qwen3_kernels.has_cuda_kernels(), bool)
    if not qwen3_kernels.has_cuda_kernels():
        assert qwen3_kernels.cuda_kernels_import_error() is not None


def test_trusted_inputs_skips_the_tensor_checks_only_inside_the_block():
    x, w = torch.randn(3, 8), torch.randn(8)
    bad_w = w.double()  # a dtype the checks reject
    with pytest.raises(ValueError, match="weight must be torch.float32, got torch.float64"):
        qwen3_kernels.rms_norm(x, bad_w, 1e-6)
    with qwen3_kernels.trusted_inputs():
        out = qwen3_kernels.rms_norm(x, w, 1e-6)  # a good call still computes the same
        qwen3_kernels.rms_norm(x, bad_w, 1e-6)  # unchecked: it reaches the reference
        with qwen3_kernels.trusted_inputs():  # nested: still off after the inner block
            pass
        qwen3_kernels.rms_norm(x, bad_w, 1e-6)
    torch.testing.assert_close(out, ref.rms_norm(x, w, 1e-6))
    with pytest.raises(ValueError, match="weight must be torch.float32"):
        qwen3_kernels.rms_norm(x, bad_w, 1e-6)
    with pytest.raises(RuntimeError, match="boom"), qwen3_kernels.trusted_inputs():
        raise RuntimeError("boom")
    assert ops.checks_enabled()  # restored after an exception too
