"""CUDA: the bad index values of tests/test_op_index_checks.py through the CUDA kernels' checked
wrappers (bf16, head_dim 128: the kernel path): a ValueError before the launch, nothing written
into the cache, and the device still healthy afterwards (no device-side assert, no fault).

Under ``compute-sanitizer --tool memcheck python -m pytest tests/test_op_index_checks_cuda.py``
no error may be reported: every bad call raises before a kernel reads or writes anything."""

import pytest
import torch

import qwen3_kernels
from tests.helpers import requires_cuda
from tests.test_op_index_checks import (
    BAD_DECODE, BAD_PREFILL, BAD_ROPE, BAD_TEMPERATURES, decode_case, prefill_case, rope_case,
    sample_case, with_value,
)

pytestmark = [pytest.mark.cuda, requires_cuda]


def _healthy():
    torch.cuda.synchronize()  # an earlier fault or device assert would surface here
    x = torch.arange(4, device="cuda")
    assert (x * 2).tolist() == [0, 2, 4, 6]


@pytest.mark.parametrize("name,index,value,match", BAD_ROPE)
def test_qk_norm_rope_refuses_before_the_launch(name, index, value, match):
    case = with_value(rope_case("cuda"), name, index, value)
    with pytest.raises(ValueError, match="qwen3_kernels.qk_norm_rope: " + match):
        qwen3_kernels.qk_norm_rope(**case)
    _healthy()
    assert not case["k_cache"].any() and not case["v_cache"].any()


@pytest.mark.parametrize("name,index,value,match", BAD_DECODE)
def test_paged_attention_decode_refuses_before_the_launch(name, index, value, match):
    case = with_value(decode_case("cuda"), name, index, value)
    with pytest.raises(ValueError, match="qwen3_kernels.paged_attention_decode: " + match):
        qwen3_kernels.paged_attention_decode(**case)
    _healthy()


@pytest.mark.parametrize("name,index,value,match", BAD_PREFILL)
def test_paged_attention_prefill_refuses_before_the_launch(name, index, value, match):
    case = with_value(prefill_case("cuda"), name, index, value)
    with pytest.raises(ValueError, match="qwen3_kernels.paged_attention_prefill: " + match):
        qwen3_kernels.paged_attention_prefill(**case)
    _healthy()


@pytest.mark.parametrize("bad", BAD_TEMPERATURES)
def test_sample_tokens_refuses_non_finite_temperatures(bad):
    case = with_value(sample_case("cuda"), "temperatures", 2, bad)
    with pytest.raises(ValueError, match=r"qwen3_kernels.sample_tokens: temperatures\[2\]"):
        qwen3_kernels.sample_tokens(**case)
    _healthy()


def test_good_values_match_the_cpu_reference():
    for make, op in ((decode_case, qwen3_kernels.paged_attention_decode),
                     (prefill_case, qwen3_kernels.paged_attention_prefill)):
        got = op(**make("cuda")).float().cpu()
        want = op(**make("cpu")).float()
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    case = rope_case("cuda")
    qwen3_kernels.qk_norm_rope(**case)
    written = case["k_cache"].view(-1, 2, 128).abs().sum(dim=(1, 2)) > 0
    assert written[:4].all() and not written[4:].any()


def test_the_checks_skip_inside_trusted_inputs_and_during_graph_capture():
    # good values only: inside trusted_inputs and in a capture no host sync may happen
    case = decode_case("cuda")
    with qwen3_kernels.trusted_inputs():
        qwen3_kernels.paged_attention_decode(**case)
    out = torch.empty_like(case["q"])
    ws = qwen3_kernels.decode_workspace(2, case["q"].shape[1], 128, "cuda")
    qwen3_kernels.paged_attention_decode(**case, out=out, workspace=ws)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qwen3_kernels.paged_attention_decode(**case, out=out, workspace=ws)
    graph.replay()
    _healthy()


@pytest.mark.parametrize("num_tokens", [4, 8192])  # the item kernel, the token-major kernel
def test_an_unchecked_slot_past_the_cache_is_not_written(num_tokens):
    """Inside trusted_inputs nothing checks slot_mapping: the kernel itself skips a slot past
    the cache (as -1) instead of writing past it. The cache is a view into a larger buffer whose
    tail must stay zero."""
    case = rope_case("cuda")
    g = torch.Generator().manual_seed(5)
    case["qkv"] = torch.randn(num_tokens, case["qkv"].shape[1], generator=g).to(
        case["qkv"].dtype).cuda()
    case["positions"] = torch.zeros(num_tokens, dtype=torch.int64, device="cuda")
    shape = case["k_cache"].shape  # [num_blocks, block_size, Hkv, D]
    num_slots = shape[0] * shape[1]
    k_buf = torch.zeros(shape[0] * 4, *shape[1:], dtype=case["k_cache"].dtype, device="cuda")
    v_buf = torch.zeros_like(k_buf)
    case["k_cache"], case["v_cache"] = k_buf[: shape[0]], v_buf[: shape[0]]
    slots = torch.full((num_tokens,), -1, dtype=torch.int32)
    slots[0] = 1
    slots[1:4] = torch.tensor([num_slots, num_slots + 7, 2 * num_slots])
    case["slot_mapping"] = slots.cuda()
    with qwen3_kernels.trusted_inputs():
        qwen3_kernels.qk_norm_rope(**case)
    _healthy()
    for buf in (k_buf, v_buf):
        assert not buf[shape[0]:].any(), "written past the cache"
        per_slot = buf[: shape[0]].reshape(num_slots, -1).abs().sum(dim=1) > 0
        assert per_slot[1] and per_slot.sum() == 1
