"""CUDA: the qk_norm_rope kernel vs the fp32 reference.

Tolerance. The kernel does the reference's math in fp32 and rounds once to the storage dtype, so
its output must be the fp32 reference (computed from the same bf16/fp16 inputs, never rounded)
rounded to nearest: at most half an ulp away, i.e. |ours - ref32| <= 2^-8 |ref32| for bf16 and
2^-11 |ref32| for fp16. Summation order and rsqrt differ from PyTorch's by ~1e-6 relative, which
can push a value sitting on a rounding midpoint to the other neighbour: we allow one full ulp
(rtol 2^-7 / 2^-10, twice the bound) plus atol 1e-5 for the fp32 cancellation in the rotation of
near-zero outputs. That is 1 bf16 ulp, tighter than the usual atol = rtol = 2e-2, and still far
looser than any real bug (a wrong pair, weight, position or head moves outputs by O(1)).
V is a copy: bit-exact. Untouched cache slots must keep their NaN poison bit for bit.

The kernel is picked from the shape (csrc/kernels/qk_norm_rope.cu: the item kernel below 2^16
(token, head) items, the token kernel with PDL above, the item kernel past 128 heads): the token
counts and head counts below reach each of them.
"""

from __future__ import annotations

import pytest
import torch

import qwen3_kernels
from qwen3_kernels import reference as ref
from tests.helpers import requires_cuda
from tests.test_qk_norm_rope import (
    MAX_POSITION, ROPE_THETA, call, make_case, reference_fp32, untouched_slots,
)

pytestmark = requires_cuda

RTOL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
ATOL = 1e-5
HEADS = [(16, 8), (32, 8), (40, 8), (64, 8)]


@pytest.fixture(scope="module")
def cos_sin():
    return ref.rope_cos_sin_cache(128, MAX_POSITION, ROPE_THETA, device="cuda")


def assert_close_ulp(got, want32, dtype, what):
    err = (got.float() - want32).abs()
    tol = ATOL + RTOL[dtype] * want32.abs()
    bad = ~(err <= tol)  # NaN (an unwritten poisoned output) counts as bad
    if bad.any():
        i = bad.nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements off by more than 1 ulp; "
            f"first at {i}: got {got[tuple(i)].item()}, want {want32[tuple(i)].item()}, "
            f"max err {err.nan_to_num(float('inf')).max().item():.3g}"
        )


def check_case(case, q):
    """q and both caches vs the fp32 reference; untouched slots keep the poison exactly."""
    dtype = case["qkv"].dtype
    hkv = case["num_kv_heads"]
    q32, k32, v32 = reference_fp32(case)
    assert_close_ulp(q, q32, dtype, "q")
    s = case["slot_mapping"]
    written = s[s >= 0].long()
    kc = case["k_cache"].view(-1, hkv, 128)
    vc = case["v_cache"].view(-1, hkv, 128)
    assert_close_ulp(kc[written], k32.view(-1, hkv, 128)[written], dtype, "k_cache")
    # v is copied through: compare the raw bits with the input's v heads.
    hq = case["num_q_heads"]
    v_in = case["qkv"][:, (hq + hkv) * 128:].reshape(-1, hkv, 128)[s >= 0]
    assert torch.equal(vc[written].view(torch.int16), v_in.view(torch.int16)), "v_cache bits"
    free = untouched_slots(case)
    poison = torch.full((), float("nan"), dtype=dtype, device="cuda").view(torch.int16)
    for name, c in (("k_cache", kc), ("v_cache", vc)):
        assert (c[free].view(torch.int16) == poison).all(), f"{name}: a slot not in slot_mapping was written"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("hq,hkv", HEADS, ids=[f"{a}x{b}" for a, b in HEADS])
@pytest.mark.parametrize("t", [1, 7, 83, 4096, 16384])
def test_matches_reference(t, hq, hkv, block_size, dtype, cos_sin):
    # Strided qkv rows (a view of a wider buffer) on half of the cases.
    pad = 64 if block_size == 16 else 0
    case = make_case(t, hq, hkv, block_size=block_size, dtype=dtype, device="cuda",
                     qkv_row_pad=pad, seed=t * 7 + hq + block_size, cos_sin=cos_sin)
    assert case["qkv"].is_contiguous() == (pad == 0 or t == 1)  # one row is always contiguous
    q_out = torch.full((t, hq, 128), float("nan"), dtype=dtype, device="cuda")
    q = call(case, q_out=q_out)
    assert q.data_ptr() == q_out.data_ptr()
    check_case(case, q)


# Tails: item counts (T * (Hq + 2Hkv)) that fill no whole block, on both launch shapes (one item
# per thread below 2^16 items, two above), including an odd count so a thread's second item is
# out of range while its first is not.
# (37, 128, 8), (5, 256, 8) and (300, 256, 8): more heads than one token-major CTA holds at 4
# heads per thread; the last has >= 2^16 items, where the launcher falls back to the item kernel.
@pytest.mark.parametrize("t,hq,hkv", [(3, 7, 1), (1171, 40, 8), (7283, 7, 1), (2, 1, 1),
                                      (37, 128, 8), (5, 256, 8), (300, 256, 8)])
def test_tails_and_odd_head_counts(t, hq, hkv, cos_sin):
    case = make_case(t, hq, hkv, block_size=16, dtype=torch.bfloat16, device="cuda",
                     seed=t, cos_sin=cos_sin)
    check_case(case, call(case))


@pytest.mark.parametrize("slot", [-1, 5])
def test_single_decode_token(slot, cos_sin):
    case = make_case(1, 32, 8, block_size=16, device="cuda", pad_frac=0.0, cos_sin=cos_sin)
    case["slot_mapping"].fill_(slot)
    check_case(case, call(case))
    if slot < 0:
        assert torch.isnan(case["k_cache"]).all() and torch.isnan(case["v_cache"]).all()


def test_all_tokens_padded_still_produce_q(cos_sin):
    case = make_case(50, 16, 8, block_size=16, device="cuda", pad_frac=1.1, cos_sin=cos_sin)
    assert (case["slot_mapping"] == -1).all()
    check_case(case, call(case))


def test_one_kernel_launch(cos_sin):
    """As the engine calls it (trusted: no index-value checks, which are kernels of their own)."""
    case = make_case(64, 32, 8, block_size=16, device="cuda", cos_sin=cos_sin)
    q_out = torch.empty(64, 32, 128, dtype=torch.bfloat16, device="cuda")
    call(case, q_out=q_out)  # warm-up
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with qwen3_kernels.trusted_inputs():
            call(case, q_out=q_out)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("cuda", "Activity Buffer"))]  # runtime calls, profiler
    assert len(kernels) == 1 and "qk_norm_rope" in kernels[0], kernels


def test_cuda_graph_replay_with_new_inputs(cos_sin):
    case = make_case(83, 32, 8, block_size=16, device="cuda", cos_sin=cos_sin, seed=11)
    q_out = torch.empty(83, 32, 128, dtype=torch.bfloat16, device="cuda")
    call(case, q_out=q_out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call(case, q_out=q_out)
    # New data in the same buffers (as the engine does between decode steps), then replay.
    fresh = make_case(83, 32, 8, block_size=16, device="cuda", cos_sin=cos_sin, seed=12)
    for k in ("qkv", "q_norm_weight", "k_norm_weight", "positions", "slot_mapping", "k_cache",
              "v_cache"):
        case[k].copy_(fresh[k])
    q_out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    check_case(case, q_out)


def test_misaligned_output_is_refused(cos_sin):
    case = make_case(4, 16, 8, block_size=16, device="cuda", cos_sin=cos_sin)
    # Contiguous but 2 bytes off a 16-byte boundary: the launcher must refuse, not corrupt.
    q_out = torch.empty(4 * 16 * 128 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(4, 16, 128)
    with pytest.raises(RuntimeError, match="misaligned"):
        call(case, q_out=q_out)
        torch.cuda.synchronize()


def test_opcheck(cos_sin):
    case = make_case(37, 32, 8, block_size=16, device="cuda", cos_sin=cos_sin)
    # opcheck compares outputs across runs with ==, which NaN poison would fail on untouched slots.
    case["k_cache"].zero_()
    case["v_cache"].zero_()
    q_out = torch.empty(37, 32, 128, dtype=torch.bfloat16, device="cuda")
    keys = ("qkv", "q_norm_weight", "k_norm_weight", "cos_sin_cache", "positions", "k_cache",
            "v_cache", "slot_mapping", "num_q_heads", "num_kv_heads", "eps")
    torch.library.opcheck(torch.ops.qwen3_kernels.qk_norm_rope.default,
                          (q_out,) + tuple(case[k] for k in keys))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_torch_compile_fullgraph(dtype, cos_sin):
    case = make_case(83, 32, 8, block_size=16, dtype=dtype, device="cuda", cos_sin=cos_sin)
    eager = dict(case, k_cache=case["k_cache"].clone(), v_cache=case["v_cache"].clone())
    q_eager = call(eager)
    compiled = torch.compile(qwen3_kernels.qk_norm_rope, fullgraph=True)
    q = call(case, compiled)
    # The same kernel runs either way: bitwise equal (NaN poison compared through its bits).
    assert torch.equal(q, q_eager)
    for k in ("k_cache", "v_cache"):
        assert torch.equal(case[k].view(torch.int16), eager[k].view(torch.int16)), k
    check_case(case, q)
