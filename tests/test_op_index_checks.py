"""CPU: the index values inside the ops' index tensors are checked (issue #42).

Every bad value is a ValueError naming the op, the argument and its first bad entry, through
the checked wrapper (``qwen3_kernels.<op>``), the raw op (``torch.ops.qwen3_kernels.<op>``, the
reference on CPU) and the reference itself, and nothing is written into the KV cache first.
``trusted_inputs()`` is the calling thread's own.

The case builders and BAD_* tables are shared with tests/test_op_index_checks_cuda.py, which
runs the same bad values through the CUDA kernels' wrappers.
"""

from __future__ import annotations

import threading

import pytest
import torch

import qwen3_kernels
from qwen3_kernels import ops, reference as ref
from tests.helpers import one_thread  # noqa: F401  (autouse)

D, HQ, HKV, BS = 128, 4, 2, 16


def rope_case(device="cpu", dtype=torch.bfloat16, max_position=64, num_blocks=3):
    """qk_norm_rope's arguments: 4 tokens at positions 0..3 written to slots 0..3."""
    g = torch.Generator().manual_seed(0)
    t = 4
    return dict(
        qkv=torch.randn(t, (HQ + 2 * HKV) * D, generator=g).to(dtype).to(device),
        q_norm_weight=torch.ones(D, dtype=dtype, device=device),
        k_norm_weight=torch.ones(D, dtype=dtype, device=device),
        cos_sin_cache=ref.rope_cos_sin_cache(D, max_position, 1e6, device=device),
        positions=torch.arange(t, device=device),
        k_cache=torch.zeros(num_blocks, BS, HKV, D, dtype=dtype, device=device),
        v_cache=torch.zeros(num_blocks, BS, HKV, D, dtype=dtype, device=device),
        slot_mapping=torch.arange(t, dtype=torch.int32, device=device),
        num_q_heads=HQ, num_kv_heads=HKV, eps=1e-6,
    )


def _paged(device, dtype):
    """2 sequences of 5 and 20 keys over a 4-block cache; tables 4 columns wide (capacity 64),
    padded with 0 as the engine pads them."""
    g = torch.Generator().manual_seed(1)
    k = torch.randn(4, BS, HKV, D, generator=g).to(dtype).to(device)
    return dict(k_cache=k, v_cache=k.clone(),
                block_tables=torch.tensor([[1, 0, 0, 0], [2, 3, 0, 0]], dtype=torch.int32,
                                          device=device))


def decode_case(device="cpu", dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(2)
    return dict(q=torch.randn(2, HQ, D, generator=g).to(dtype).to(device),
                **_paged(device, dtype),
                seq_lens=torch.tensor([5, 20], dtype=torch.int32, device=device), scale=0.1)


def prefill_case(device="cpu", dtype=torch.bfloat16):
    """Sequence 0: 4 new queries over 5 keys; sequence 1: 5 over 20 (Tq = 9)."""
    g = torch.Generator().manual_seed(3)
    return dict(q=torch.randn(9, HQ, D, generator=g).to(dtype).to(device),
                **_paged(device, dtype),
                cu_seqlens_q=torch.tensor([0, 4, 9], dtype=torch.int32, device=device),
                seq_lens_k=torch.tensor([5, 20], dtype=torch.int32, device=device),
                max_seqlen_q=5, scale=0.1)


def sample_case(device="cpu"):
    g = torch.Generator().manual_seed(4)
    return dict(logits=torch.randn(3, 50, generator=g).to(device),
                temperatures=torch.tensor([1.0, 0.0, 0.5], device=device),
                seed_keys=torch.zeros(3, 3, dtype=torch.int64, device=device))


def with_value(case: dict, name: str, index, value) -> dict:
    """A copy of ``case`` whose tensor ``name`` holds ``value`` at ``index`` (or, for a scalar
    argument, is ``value``)."""
    case = dict(case)
    if isinstance(case[name], torch.Tensor):
        t = case[name].clone()
        t[index] = value
        case[name] = t
    else:
        case[name] = value
    return case


# (argument, index, bad value, what the error says)
BAD_ROPE = [
    ("positions", 2, 64, r"positions\[2\] = 64 is outside the rope table: must be in \[0, 64\)"),
    ("positions", 1, -1, r"positions\[1\] = -1 is outside the rope table"),
    ("slot_mapping", 3, 48, r"slot_mapping\[3\] = 48 is not a slot of the cache: must be in "
                            r"\[0, 48\) \(num_blocks 3 x block_size 16\), or -1"),
    ("slot_mapping", 0, -2, r"slot_mapping\[0\] = -2 is not a slot"),
]
BAD_DECODE = [
    ("block_tables", (0, 0), 4, r"block_tables\[0, 0\] = 4 is not a block of the cache: must be "
                                r"in \[0, 4\).*row 0 reads its first 1 entries"),
    ("block_tables", (1, 1), -1, r"block_tables\[1, 1\] = -1 is not a block"),
    ("seq_lens", 0, 0, r"seq_lens\[0\] = 0 must be in \[1, 64\]"),
    ("seq_lens", 1, 65, r"seq_lens\[1\] = 65 must be in \[1, 64\]"),
    ("seq_lens", 1, -3, r"seq_lens\[1\] = -3"),
]
BAD_PREFILL = [
    ("cu_seqlens_q", 0, 1, r"cu_seqlens_q\[0\] = 1 must be 0"),
    ("cu_seqlens_q", 1, 10, r"cu_seqlens_q\[2\] = 9 is below cu_seqlens_q\[1\] = 10: offsets "
                            r"must not decrease"),
    ("cu_seqlens_q", 2, 10, r"cu_seqlens_q\[2\] = 10 must equal Tq = 9"),
    ("cu_seqlens_q", 2, 8, r"cu_seqlens_q\[2\] = 8 must equal Tq = 9"),
    ("seq_lens_k", 0, 3, r"seq_lens_k\[0\] = 3 must be in \[4, 64\]: at least sequence 0's "
                         r"query count"),
    ("seq_lens_k", 1, 65, r"seq_lens_k\[1\] = 65 must be in \[5, 64\]"),
    ("max_seqlen_q", None, 4, r"max_seqlen_q = 4 is below sequence 1's query count 5"),
    ("block_tables", (1, 1), 4, r"block_tables\[1, 1\] = 4 is not a block.*seq_lens_k\[1\] = 20"),
    ("block_tables", (0, 0), -1, r"block_tables\[0, 0\] = -1 is not a block"),
]
BAD_TEMPERATURES = [float("nan"), float("inf"), float("-inf")]


def _raw_rope(c):
    q_out = torch.empty(c["qkv"].shape[0], HQ, D, dtype=c["qkv"].dtype)
    torch.ops.qwen3_kernels.qk_norm_rope(
        q_out, c["qkv"], c["q_norm_weight"], c["k_norm_weight"], c["cos_sin_cache"],
        c["positions"], c["k_cache"], c["v_cache"], c["slot_mapping"], HQ, HKV, 1e-6)


@pytest.mark.parametrize("name,index,value,match", BAD_ROPE)
@pytest.mark.parametrize("path", ["wrapper", "raw op", "reference"])
def test_qk_norm_rope_refuses_bad_positions_and_slots_before_writing(path, name, index, value,
                                                                      match):
    case = with_value(rope_case(), name, index, value)
    call = {"wrapper": lambda c: qwen3_kernels.qk_norm_rope(**c), "raw op": _raw_rope,
            "reference": lambda c: ref.qk_norm_rope(**c)}[path]
    with pytest.raises(ValueError, match="qwen3_kernels.qk_norm_rope: " + match):
        call(case)
    assert not case["k_cache"].any() and not case["v_cache"].any()  # nothing written


def test_qk_norm_rope_good_values_still_run():
    case = with_value(rope_case(), "slot_mapping", 1, -1)  # -1: the token is not written
    case = with_value(case, "positions", 3, 63)  # the table's last row
    qwen3_kernels.qk_norm_rope(**case)
    written = case["k_cache"].view(-1, HKV, D).abs().sum(dim=(1, 2)) > 0
    assert written[:4].tolist() == [True, False, True, True] and not written[4:].any()


@pytest.mark.parametrize("name,index,value,match", BAD_DECODE)
@pytest.mark.parametrize("path", ["wrapper", "raw op", "reference"])
def test_paged_attention_decode_refuses_bad_tables_and_lengths(path, name, index, value, match):
    c = with_value(decode_case(), name, index, value)
    if path == "wrapper":
        call = lambda: qwen3_kernels.paged_attention_decode(**c)  # noqa: E731
    elif path == "raw op":
        call = lambda: torch.ops.qwen3_kernels.paged_attention_decode(  # noqa: E731
            torch.empty_like(c["q"]), c["q"], c["k_cache"], c["v_cache"], c["block_tables"],
            c["seq_lens"], 0.1, torch.empty(0))
    else:
        call = lambda: ref.paged_attention_decode(**c)  # noqa: E731
    with pytest.raises(ValueError, match="qwen3_kernels.paged_attention_decode: " + match):
        call()


@pytest.mark.parametrize("name,index,value,match", BAD_PREFILL)
@pytest.mark.parametrize("path", ["wrapper", "raw op", "reference"])
def test_paged_attention_prefill_refuses_bad_offsets_lengths_and_tables(path, name, index, value,
                                                                       match):
    c = with_value(prefill_case(), name, index, value)
    if path == "wrapper":
        call = lambda: qwen3_kernels.paged_attention_prefill(**c)  # noqa: E731
    elif path == "raw op":
        call = lambda: torch.ops.qwen3_kernels.paged_attention_prefill(  # noqa: E731
            torch.empty_like(c["q"]), c["q"], c["k_cache"], c["v_cache"], c["cu_seqlens_q"],
            c["seq_lens_k"], c["block_tables"], c["max_seqlen_q"], 0.1)
    else:
        call = lambda: ref.paged_attention_prefill(**c)  # noqa: E731
    with pytest.raises(ValueError, match="qwen3_kernels.paged_attention_prefill: " + match):
        call()


def test_attention_reads_only_the_table_entries_a_sequence_uses():
    # entries past ceil(seq_len / block_size) are padding (the engine pads with 0): not checked
    c = with_value(decode_case(), "block_tables", (0, 1), 99)
    c = with_value(c, "block_tables", (1, 3), -7)
    want = qwen3_kernels.paged_attention_decode(**decode_case())
    assert torch.equal(qwen3_kernels.paged_attention_decode(**c), want)
    p = with_value(prefill_case(), "block_tables", (0, 2), 1000)
    want = qwen3_kernels.paged_attention_prefill(**prefill_case())
    assert torch.equal(qwen3_kernels.paged_attention_prefill(**p), want)


def test_prefill_allows_empty_sequences_and_a_generous_max_seqlen_q():
    c = dict(prefill_case(), cu_seqlens_q=torch.tensor([0, 0, 9], dtype=torch.int32),
             max_seqlen_q=100)
    out = qwen3_kernels.paged_attention_prefill(**c)
    assert out.shape == c["q"].shape and not out.isnan().any()


@pytest.mark.parametrize("bad", BAD_TEMPERATURES)
@pytest.mark.parametrize("path", ["wrapper", "raw op", "reference"])
def test_sample_tokens_refuses_non_finite_temperatures(path, bad):
    c = with_value(sample_case(), "temperatures", 2, bad)
    if path == "wrapper":
        call = lambda: qwen3_kernels.sample_tokens(**c)  # noqa: E731
    elif path == "raw op":
        call = lambda: torch.ops.qwen3_kernels.sample_tokens(  # noqa: E731
            torch.empty(3, dtype=torch.int64), c["logits"], c["temperatures"], c["seed_keys"])
    else:
        call = lambda: ref.sample_tokens(**c)  # noqa: E731
    with pytest.raises(ValueError, match=rf"qwen3_kernels.sample_tokens: temperatures\[2\] = "
                                         rf"{bad} must be finite"):
        call()


def test_the_cpu_path_checks_index_values_inside_trusted_inputs_too():
    # trusted_inputs skips the wrappers' checks; on CPU the reference runs and keeps its own
    with qwen3_kernels.trusted_inputs():
        with pytest.raises(ValueError, match=r"slot_mapping\[3\] = 48"):
            qwen3_kernels.qk_norm_rope(**with_value(rope_case(), "slot_mapping", 3, 48))
        with pytest.raises(ValueError, match=r"block_tables\[1, 1\] = -1"):
            qwen3_kernels.paged_attention_decode(**with_value(decode_case(), "block_tables",
                                                              (1, 1), -1))


def test_trusted_inputs_is_the_calling_threads_own():
    x, w = torch.randn(3, 8), torch.randn(8)
    inside, leave = threading.Event(), threading.Event()
    seen = {}

    def trusted_caller():
        with qwen3_kernels.trusted_inputs():
            seen["inside"] = ops.checks_enabled()
            inside.set()
            leave.wait(30)

    t = threading.Thread(target=trusted_caller, daemon=True)
    t.start()
    try:
        assert inside.wait(30)
        # another thread's trusted block does not turn this thread's checks off
        assert ops.checks_enabled()
        with pytest.raises(ValueError, match="weight must be torch.float32, got torch.float64"):
            qwen3_kernels.rms_norm(x, w.double(), 1e-6)
    finally:
        leave.set()
        t.join(30)
    assert seen["inside"] is False and not t.is_alive()
    assert ops.checks_enabled()


def test_trusted_inputs_in_a_thread_does_not_leak_into_threads_it_did_not_run():
    with qwen3_kernels.trusted_inputs():
        result = {}
        t = threading.Thread(target=lambda: result.update(on=ops.checks_enabled()))
        t.start()
        t.join(30)
        assert result["on"] is True  # a new thread starts with every check on
        assert not ops.checks_enabled()
