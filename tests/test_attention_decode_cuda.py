"""CUDA tests of paged_attention_decode (csrc/kernels/attention/decode.cu) against the fp32
reference.

Tolerance (the FlashAttention-3 rule, TARGETS.md): our max abs error against the fp32 reference must
be at most twice the max abs error of PyTorch SDPA in the same low precision on the same dense
(gathered) K/V, plus a tiny epsilon for the cases where both are exact; the same for the relative
Frobenius error.

Inputs come from ``tests.test_attention_reference.make_paged_kv``: shuffled block tables, every
unowned cache slot (the tail of a sequence's last block, spare blocks, unused table entries) NaN.
Outputs are NaN-poisoned before each call, so every element must be written.

Every launch the kernel picks from the shape (decode.cu's choose_launch) is covered: the batch
shape (B * Hkv fills the SMs: w4s3) with one split (out written directly) and with contiguous splits
and the looping combine (B * Hkv just above the SM count), and the split shape (small batches:
w8s3c1, interleaved splits, the one-round-trip combine, PDL), each against the same reference, with
a NaN-poisoned workspace, and under CUDA graph replay after the lengths and tables change.
"""
from __future__ import annotations

import functools
import math
import random

import pytest
import torch

import qwen3_kernels
import qwen3_kernels.reference as ref
from qwen3_kernels.ops import MAX_DECODE_SPLITS, decode_workspace
from tests.helpers import misaligned, rel_err, requires_cuda
from tests.test_attention_reference import GQA, make_paged_kv, sdpa_decode

pytestmark = requires_cuda

D = 128
EPS = 1e-5


def _run_case(lens, hq, hkv, block_size, dtype=torch.bfloat16, seed=0, q_std=2.0):
    """Builds a case on the GPU, runs the op into a NaN-poisoned out; (out, case, q, scale)."""
    case = make_paged_kv(lens, hkv, block_size, dtype=dtype, device="cuda", seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = (torch.randn(len(lens), hq, D, generator=g) * q_std).to("cuda", dtype)
    scale = 1 / math.sqrt(D)
    out = torch.full_like(q, float("nan"))
    qwen3_kernels.paged_attention_decode(q, case["k_cache"], case["v_cache"], case["block_tables"],
                                         case["seq_lens"], scale, out=out)
    return out, case, q, scale


def _check(out, case, q, scale, rows=None):
    """FA3 rule on the rows `rows` of the batch (all by default)."""
    rows = list(range(q.shape[0])) if rows is None else rows
    assert torch.isfinite(out[rows]).all(), "an output was not written (NaN poison) or read poison"
    idx = torch.tensor(rows, device=q.device)
    want = ref.paged_attention_decode(q[idx].float(), case["k_cache"].float(),
                                      case["v_cache"].float(), case["block_tables"][idx],
                                      case["seq_lens"][idx], scale)
    base = sdpa_decode(q[idx], [case["k"][r] for r in rows], [case["v"][r] for r in rows], scale,
                       dtype=q.dtype).float()
    ours = out[idx].float()
    ours_max, base_max = (ours - want).abs().max().item(), (base - want).abs().max().item()
    assert ours_max <= 2 * base_max + EPS, f"max abs err {ours_max:.3e} vs torch {base_max:.3e}"
    ours_rel, base_rel = rel_err(ours, want), rel_err(base, want)
    assert ours_rel <= 2 * base_rel + EPS, f"rel err {ours_rel:.3e} vs torch {base_rel:.3e}"


@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_decode_matches_reference_block_boundaries(hq, hkv, block_size):
    bs = block_size
    # context lengths at every block-boundary case, plus a few blocks' worth, mixed in one batch
    lens = [1, bs - 1, bs, bs + 1, 2 * bs + 7, 1000]
    _check(*_run_case(lens, hq, hkv, bs, seed=hq + hkv + bs))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 256])
def test_decode_32k_context_split_kv(dtype, block_size):
    # batch 1 and a long/short mix: few CTAs, so the launcher splits the context
    _check(*_run_case([32768], 32, 8, block_size, dtype=dtype, seed=7))
    _check(*_run_case([32768, 1, 5000, 17], 16, 8, block_size, dtype=dtype, seed=8))


@pytest.mark.parametrize("hq,hkv", [(32, 8), (16, 8), (64, 8)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_large_batch_one_split(hq, hkv, block_size):
    # B * Hkv fills the GPU: no split, the main kernel writes out directly
    rnd = random.Random(hq + block_size)
    lens = [rnd.randint(1, 2500) for _ in range(64)] + [1, block_size, 4096]
    _check(*_run_case(lens, hq, hkv, block_size, seed=11))


def test_decode_fp16():
    rnd = random.Random(3)
    _check(*_run_case([rnd.randint(1, 3000) for _ in range(9)], 32, 8, 16, dtype=torch.float16))


def test_decode_group_larger_than_16():
    # 20 q heads per kv head: two CTAs per kv head (16 + 4 rows)
    _check(*_run_case([1, 300, 2049], 40, 2, 16, seed=5))


def test_decode_peaked_softmax():
    # large logits: the running max changes often and most weights underflow
    _check(*_run_case([3000, 77, 12000], 32, 8, 16, seed=6, q_std=12.0))


def _direct(case, q, scale, max_splits):
    """torch.ops call with a workspace of any split capacity (the wrapper always uses 64)."""
    out = torch.full_like(q, float("nan"))
    ws = torch.full((q.shape[0], q.shape[1], max_splits, D + 1), float("nan"), device="cuda")
    torch.ops.qwen3_kernels.paged_attention_decode(out, q, case["k_cache"], case["v_cache"],
                                                   case["block_tables"], case["seq_lens"], scale,
                                                   ws)
    return out


@pytest.mark.parametrize("max_splits", [1, 3, 64])
def test_decode_small_workspace_caps_the_splits(max_splits):
    _, case, q, scale = _run_case([20000, 3], 8, 2, 16, seed=9)
    _check(_direct(case, q, scale, max_splits), case, q, scale)


@pytest.mark.parametrize("lens", [[0, 0], [0, 1500], [5000, 0, 3]])
def test_decode_zero_length_sequences_give_zeros(lens):
    # padded graph slots carry seq_len 0: a zero output, no NaN, the other rows unaffected
    fixed = [max(n, 1) for n in lens]
    _, case, q, scale = _run_case(fixed, 32, 8, 16, seed=12)
    case["seq_lens"] = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = _direct(case, q, scale, MAX_DECODE_SPLITS)
    zero = [i for i, n in enumerate(lens) if n == 0]
    live = [i for i, n in enumerate(lens) if n > 0]
    assert (out[zero] == 0).all()
    if live:
        _check(out, case, q, scale, rows=live)


def _batch_just_over_the_sms(hkv):
    """A batch whose B * Hkv CTAs just exceed the SM count: the batch shape (w4s3) with more than
    one split (contiguous ranges, the looping combine) at long contexts."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return sms // hkv + 1


@pytest.mark.parametrize("batch", [1, 4, "over_sms", 48])
def test_decode_cuda_graph_replay_after_lens_and_tables_change(batch):
    # One cache holds two sets of sequences; the graph is captured on the first set's block tables
    # and lengths, then the static buffers get the second set's values and the graph is replayed.
    hq, hkv, bs = 32, 8, 16
    if batch == "over_sms":
        batch = _batch_just_over_the_sms(hkv)
    rnd = random.Random(batch)
    lens_a = [rnd.randint(1, 1200) for _ in range(batch)]
    lens_b = [rnd.randint(1, 2500) for _ in range(batch)]
    lens_b[0], lens_a[-1] = 5000, 1  # the new lengths reach past every old one
    case = make_paged_kv(lens_a + lens_b, hkv, bs, device="cuda", dtype=torch.bfloat16, seed=13)
    q_all = (torch.randn(2 * batch, hq, D) * 2).to("cuda", torch.bfloat16)
    scale = 1 / math.sqrt(D)
    kc, vc = case["k_cache"], case["v_cache"]
    q = q_all[:batch].clone()
    tables = case["block_tables"][:batch].clone()
    lens = case["seq_lens"][:batch].clone()
    out = torch.full_like(q, float("nan"))
    ws = decode_workspace(batch, hq, D, "cuda")

    def step():
        qwen3_kernels.paged_attention_decode(q, kc, vc, tables, lens, scale, out=out, workspace=ws)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()

    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    full = torch.full_like(q_all, float("nan"))
    full[:batch] = out
    _check(full, case, q_all, scale, rows=list(range(batch)))

    q.copy_(q_all[batch:])
    tables.copy_(case["block_tables"][batch:])
    lens.copy_(case["seq_lens"][batch:])
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    full = torch.full_like(q_all, float("nan"))
    full[batch:] = out
    _check(full, case, q_all, scale, rows=list(range(batch, 2 * batch)))


@pytest.mark.parametrize("name", ["q", "k_cache", "v_cache", "out", "workspace"])
def test_decode_refuses_misaligned_tensors(name):
    """As prefill's: a view at an odd offset is refused before the launch (the launcher refuses the
    ones its kernels need aligned), nothing is written, and the next call still runs."""
    case = make_paged_kv([40, 300], 8, 16, dtype=torch.bfloat16, device="cuda", seed=3)
    q = torch.randn(2, 32, D, device="cuda").to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    ws = decode_workspace(2, 32, D, q.device)
    args = dict(q=q, k_cache=case["k_cache"], v_cache=case["v_cache"], out=out, workspace=ws)
    args[name] = misaligned(args[name])
    with pytest.raises(ValueError, match=f"{name} is a view at an odd offset"):
        qwen3_kernels.paged_attention_decode(
            args["q"], args["k_cache"], args["v_cache"], case["block_tables"], case["seq_lens"],
            1 / math.sqrt(D), out=args["out"], workspace=args["workspace"])
    if name in ("k_cache", "v_cache", "workspace"):  # what the launcher needs aligned too
        with pytest.raises(RuntimeError, match="paged_attention_decode: CUDA launch failed"):
            torch.ops.qwen3_kernels.paged_attention_decode(
                args["out"], args["q"], args["k_cache"], args["v_cache"], case["block_tables"],
                case["seq_lens"], 0.1, args["workspace"])
    assert args["out"].isnan().all()  # nothing written
    _check(*_run_case([40, 300], 32, 8, 16, seed=4))


def test_decode_opcheck():
    _, case, q, scale = _run_case([40, 700], 8, 2, 16, seed=14)
    out = torch.zeros_like(q)
    ws = torch.zeros(q.shape[0], q.shape[1], MAX_DECODE_SPLITS, D + 1, device="cuda")
    torch.library.opcheck(torch.ops.qwen3_kernels.paged_attention_decode.default,
                          (out, q, case["k_cache"], case["v_cache"], case["block_tables"],
                           case["seq_lens"], scale, ws))


def test_decode_torch_compile_fullgraph():
    out, case, q, scale = _run_case([40, 700, 3], 16, 8, 32, seed=15)

    @torch.compile(fullgraph=True)
    def f(q, kc, vc, bt, lens, out, ws):
        qwen3_kernels.paged_attention_decode(q, kc, vc, bt, lens, scale, out=out, workspace=ws)
        return out.float() * 1.0

    got = f(q, case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"],
            torch.empty_like(q), decode_workspace(3, 16, D, "cuda"))
    assert torch.equal(got, out.float())


@pytest.mark.parametrize("d,block_size", [(64, 16), (128, 8), (128, 24)])
def test_decode_raw_op_rejects_what_the_kernel_cannot_do(d, block_size):
    # torch.ops calls are unchecked launches that bypass the wrapper's reference fallback: the
    # launcher refuses a head_dim or block size it cannot run, and the op raises its launch error
    q = torch.randn(2, 4, d, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(4, block_size, 2, d, device="cuda", dtype=torch.bfloat16)
    bt = torch.zeros(2, 2, dtype=torch.int32, device="cuda")
    lens = torch.ones(2, dtype=torch.int32, device="cuda")
    ws = torch.empty(2, 4, 8, d + 1, device="cuda")
    with pytest.raises(RuntimeError, match="paged_attention_decode: CUDA launch failed"):
        torch.ops.qwen3_kernels.paged_attention_decode(torch.empty_like(q), q, kc, kc.clone(), bt,
                                                       lens, 0.1, ws)


# ---- every launch the shape picks, at block boundaries, 32k, each GQA ratio ---------------------


@functools.lru_cache(maxsize=None)
def _boundary_case(hq, hkv, bs):
    """Contexts 1, bs - 1, bs, bs + 1 and 32768 in one batch; the reference computed once."""
    lens = [1, bs - 1, bs, bs + 1, 32768]
    case = make_paged_kv(lens, hkv, bs, dtype=torch.bfloat16, device="cuda", seed=hq + hkv + bs)
    g = torch.Generator().manual_seed(hq * 31 + bs)
    q = (torch.randn(len(lens), hq, D, generator=g) * 2.0).to("cuda", torch.bfloat16)
    scale = 1 / math.sqrt(D)
    want = ref.paged_attention_decode(q.float(), case["k_cache"].float(), case["v_cache"].float(),
                                      case["block_tables"], case["seq_lens"], scale)
    base = sdpa_decode(q, case["k"], case["v"], scale, dtype=q.dtype).float()
    limits = ((base - want).abs().max().item(), rel_err(base, want))
    return case, q, scale, want, limits


def _run_boundary(hq, hkv, bs):
    case, q, scale, want, (base_max, base_rel) = _boundary_case(hq, hkv, bs)
    out = torch.full_like(q, float("nan"))
    # stale workspace rows (splits that saw no key) must never be read into the output
    ws = decode_workspace(q.shape[0], hq, D, "cuda").fill_(float("nan"))
    qwen3_kernels.paged_attention_decode(q, case["k_cache"], case["v_cache"], case["block_tables"],
                                         case["seq_lens"], scale, out=out, workspace=ws)
    assert torch.isfinite(out).all(), "an output was not written (NaN poison) or read poison"
    ours_max, ours_rel = (out.float() - want).abs().max().item(), rel_err(out.float(), want)
    assert ours_max <= 2 * base_max + EPS, f"max abs err {ours_max:.3e} vs torch {base_max:.3e}"
    assert ours_rel <= 2 * base_rel + EPS, f"rel err {ours_rel:.3e} vs torch {base_rel:.3e}"


@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 256])
def test_decode_split_shape_at_block_boundaries_and_32k(block_size):
    # 5 sequences x 8 kv heads: the split shape, a short sequence written by split 0 alone
    _run_boundary(32, 8, block_size)


@pytest.mark.parametrize("hq,hkv", GQA)
def test_decode_split_shape_with_each_gqa_ratio(hq, hkv):
    _run_boundary(hq, hkv, 16)


@pytest.mark.parametrize("block_size", [16, 256])
def test_decode_batch_shape_with_splits(block_size):
    # B * Hkv just over the SM count: w4s3, contiguous splits and the looping combine; a NaN
    # workspace, short sequences (one chunk: written by split 0) among long ones
    hkv = 8
    batch = _batch_just_over_the_sms(hkv)
    rnd = random.Random(block_size)
    lens = [rnd.randint(1, 6000) for _ in range(batch - 3)] + [1, block_size + 1, 8192]
    case = make_paged_kv(lens, hkv, block_size, dtype=torch.bfloat16, device="cuda", seed=31)
    q = (torch.randn(batch, 32, D, generator=torch.Generator().manual_seed(32)) * 2).to(
        "cuda", torch.bfloat16)
    scale = 1 / math.sqrt(D)
    out = torch.full_like(q, float("nan"))
    ws = decode_workspace(batch, 32, D, "cuda").fill_(float("nan"))
    qwen3_kernels.paged_attention_decode(q, case["k_cache"], case["v_cache"], case["block_tables"],
                                         case["seq_lens"], scale, out=out, workspace=ws)
    _check(out, case, q, scale)


def test_decode_large_batch_and_group_of_20():
    # one split (B * Hkv fills the GPU) and two CTAs per kv head (20 q heads per kv head)
    rnd = random.Random(21)
    lens = [rnd.randint(1, 2500) for _ in range(64)] + [1, 16, 4096]
    _check(*_run_case(lens, 32, 8, 16, seed=22))
    _check(*_run_case([1, 300, 2049], 40, 2, 16, seed=23))
