"""CPU: the reference of the fused tensor-parallel all-reduce + residual add + RMSNorm
(qwen3_kernels.tp_all_reduce_add_rms_norm) vs a straightforward composition, and the wrappers'
input checks. The kernel itself needs 2 GPUs: tests/test_custom_allreduce_cuda.py."""

import pytest
import torch

import qwen3_kernels
from qwen3_kernels import ops, reference as ref


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_is_sum_then_fused_add_rms_norm(world, dtype):
    g = torch.Generator().manual_seed(world)
    t, h, eps = 5, 256, 1e-6
    parts = torch.randn(world, t, h, generator=g).to(dtype)
    residual = torch.randn(t, h, generator=g).to(dtype)
    weight = torch.randn(h, generator=g).to(dtype)

    # straightforward: add the ranks in order in fp32, round (the all-reduce's output), then
    # residual += s (rounded as stored), normalise in fp32
    acc = torch.zeros(t, h)
    for r in range(world):
        acc = acc + parts[r].float()
    s = acc.to(dtype)
    new_res = (s.float() + residual.float()).to(dtype)
    f = new_res.float()
    want = (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(dtype)

    assert torch.equal(ref.tp_all_reduce(parts), s)
    got, got_res = ref.tp_all_reduce_add_rms_norm(parts, residual, weight, eps)
    assert torch.equal(got_res, new_res)
    assert torch.equal(got, want)


def test_reference_adds_in_rank_order():
    # fp16 rounding of 2048 + 1 + 1: (2048 + 1) + 1 in fp32 = 2050, but the order matters only
    # through the single final rounding; a permutation must not change the fp32 sum here
    parts = torch.tensor([[[2048.0]], [[1.0]], [[1.0]]], dtype=torch.float16)
    assert ref.tp_all_reduce(parts).item() == 2050.0


def _args(t=3, h=64, world=2, dtype=torch.bfloat16, device="cpu"):
    return dict(
        x=torch.zeros(t, h, dtype=dtype, device=device),
        buffer=torch.zeros(ops.tp_all_reduce_buffer_bytes(t, h, world), dtype=torch.uint8, device=device),
        peer_ptrs=torch.zeros(world, dtype=torch.int64, device=device),
        counters=torch.zeros(2, dtype=torch.int32, device=device),
        # pinned where CUDA exists (what the op needs); a plain CPU tensor otherwise
        abort_flag=torch.zeros(1, dtype=torch.int32, pin_memory=torch.cuda.is_available()),
        rank=0,
    )


def test_buffer_bytes():
    # 2 halves x world slots x rows x H x 4 bytes (2 elements per 8-byte packet)
    assert ops.tp_all_reduce_buffer_bytes(512, 4096, 2) == 2 * 2 * 512 * 4096 * 4


def test_wrappers_refuse_cpu_with_a_clear_error():
    a = _args()
    with pytest.raises(ValueError, match="qwen3_kernels.tp_all_reduce: runs only as the CUDA kernel"):
        qwen3_kernels.tp_all_reduce(**a)
    with pytest.raises(ValueError, match="tp_all_reduce_add_rms_norm: runs only as the CUDA kernel"):
        qwen3_kernels.tp_all_reduce_add_rms_norm(a["x"], torch.zeros(3, 64, dtype=torch.bfloat16),
                                                 torch.ones(64, dtype=torch.bfloat16), 1e-6,
                                                 a["buffer"], a["peer_ptrs"], a["counters"],
                                                 a["abort_flag"], 0)


def test_gemv_push_refuses_cpu_and_more_than_one_token():
    a = _args(t=1)
    x, w = torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16)
    bufs = (a["buffer"], a["peer_ptrs"], a["counters"], 0)
    with pytest.raises(ValueError, match="qwen3_kernels.tp_gemv_push: runs only as the CUDA kernel"):
        qwen3_kernels.tp_gemv_push(x, w, *bufs)
    with pytest.raises(ValueError, match="tp_gemv_push: x must be one token"):
        qwen3_kernels.tp_gemv_push(torch.zeros(2, 64, dtype=torch.bfloat16), w, *bufs)
    with pytest.raises(ValueError, match="pushed=True needs the one row"):
        qwen3_kernels.tp_all_reduce(**{**_args(t=2), "pushed": True})
    with pytest.raises(RuntimeError, match="needs the CUDA extension and CUDA peers"):
        torch.ops.qwen3_kernels.tp_gemv_push(torch.zeros(1, 64, dtype=torch.bfloat16), x, w, *bufs)


def test_raw_op_on_cpu_says_it_needs_peers():
    a = _args()
    with pytest.raises(RuntimeError, match="needs the CUDA extension and CUDA peers"):
        torch.ops.qwen3_kernels.tp_all_reduce(a["x"], a["buffer"], a["peer_ptrs"], a["counters"],
                                              a["abort_flag"], 0)


needs_cuda_kernels = pytest.mark.skipif(
    not (torch.cuda.is_available() and qwen3_kernels.has_cuda_kernels()), reason="needs the CUDA extension"
)


@needs_cuda_kernels
@pytest.mark.parametrize(
    "change,match",
    [
        (dict(x=lambda a: torch.zeros(3, 60, dtype=torch.bfloat16, device="cuda")), "multiple of 8"),
        (dict(peer_ptrs=lambda a: torch.zeros(1, dtype=torch.int64, device="cuda")), "2..8 ranks"),
        (dict(peer_ptrs=lambda a: torch.zeros(9, dtype=torch.int64, device="cuda")), "2..8 ranks"),
        (dict(rank=lambda a: 2), r"rank must be an int in \[0, 2\)"),
        (dict(counters=lambda a: torch.zeros(3, dtype=torch.int32, device="cuda")), "counters"),
        (dict(counters=lambda a: torch.zeros(2, dtype=torch.int64, device="cuda")), "counters"),
        (dict(buffer=lambda a: a["buffer"][:-32]), "needs a receive buffer of"),
        (dict(abort_flag=lambda a: torch.zeros(1, dtype=torch.int32, device="cuda")), "abort_flag"),
        (dict(abort_flag=lambda a: torch.zeros(1, dtype=torch.int32)), "pinned memory"),
        (dict(abort_flag=lambda a: torch.zeros(2, dtype=torch.int32, pin_memory=True)), "abort_flag"),
        (dict(abort_flag=lambda a: torch.zeros(1, dtype=torch.int64, pin_memory=True)), "abort_flag"),
        (dict(x=lambda a: torch.zeros(3, 64, dtype=torch.float32, device="cuda")), "float16 / bfloat16"),
    ],
)
def test_wrapper_checks_on_cuda(change, match):
    # every check fires before any launch, so one GPU is enough (nothing is communicated)
    a = _args(device="cuda")
    for k, f in change.items():
        a[k] = f(a)
    with pytest.raises(ValueError, match=match):
        qwen3_kernels.tp_all_reduce(**a)
