"""CPU: the paged attention references (decode and prefill) vs dense torch SDPA, and the wrappers'
input checks.

The paged inputs are built from dense per-sequence K/V that are scattered into a NaN-poisoned cache
through shuffled, non-contiguous block tables; the expected outputs come from
``F.scaled_dot_product_attention`` on the dense K/V, never from the reference's own gather. Any read
of a slot past a sequence's end, of a spare block or of an unused block-table entry shows up as NaN.

``make_paged_kv`` / ``sdpa_decode`` / ``sdpa_prefill`` are shared with the CUDA tests and
benchmarks.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import qwen3_kernels
from qwen3_kernels import reference as ref
from tests.helpers import rel_err

D = 128
GQA = [(8, 8), (8, 4), (8, 2), (10, 2), (16, 2)]  # (Hq, Hkv): ratios 1, 2, 4, 5, 8


def make_paged_kv(lens, hkv, block_size, dtype=torch.float32, device="cpu", d=D, seed=0,
                  spare_blocks=2, extra_table_cols=2, kv_std=1.0):
    """Random dense K/V per sequence, scattered into a paged cache.

    lens             key count of each sequence
    returns dict:
      k_cache, v_cache  [num_blocks, block_size, hkv, d]: every slot no sequence owns is NaN
      block_tables      [B, max_blocks] int32: each sequence's blocks, a random permutation of the
                        cache; entries past a sequence's blocks point at a NaN spare block
      seq_lens          [B] int32
      k, v              lists of dense [L, hkv, d] tensors (what the cache holds, in `dtype`)
    """
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-n // block_size) for n in lens]
    num_blocks = sum(nblk) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g)
    spare = perm[sum(nblk):]
    max_blocks = max(nblk + [1]) + extra_table_cols
    tables = torch.empty(len(lens), max_blocks, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    ks, vs = [], []
    start = 0
    for b, n in enumerate(lens):
        blocks = perm[start:start + nblk[b]]
        start += nblk[b]
        tables[b] = spare[0] if len(spare) else 0
        tables[b, :nblk[b]] = blocks.to(torch.int32)
        k = (torch.randn(n, hkv, d, generator=g) * kv_std).to(dtype)
        v = (torch.randn(n, hkv, d, generator=g) * kv_std).to(dtype)
        pad = nblk[b] * block_size - n
        k_pad = torch.cat([k, torch.full((pad, hkv, d), float("nan"), dtype=dtype)])
        v_pad = torch.cat([v, torch.full((pad, hkv, d), float("nan"), dtype=dtype)])
        k_cache[blocks] = k_pad.view(nblk[b], block_size, hkv, d)
        v_cache[blocks] = v_pad.view(nblk[b], block_size, hkv, d)
        ks.append(k)
        vs.append(v)
    return dict(k_cache=k_cache.to(device), v_cache=v_cache.to(device),
                block_tables=tables.to(device),
                seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), k=ks, v=vs)


def sdpa_decode(q, ks, vs, scale, dtype=torch.float32):
    """q [B, Hq, D], ks/vs lists of dense [L, Hkv, D] -> [B, Hq, D] by torch SDPA in `dtype`."""
    outs = []
    for b in range(q.shape[0]):
        qb = q[b].to(dtype)[None, :, None, :]             # [1, Hq, 1, D]
        kb = ks[b].to(q.device, dtype).transpose(0, 1)[None]  # [1, Hkv, L, D]
        vb = vs[b].to(q.device, dtype).transpose(0, 1)[None]
        out_b = F.scaled_dot_product_attention(qb, kb, vb, scale=scale, enable_gqa=True)
        outs.append(out_b[0, :, 0])
    return torch.stack(outs)


def sdpa_prefill(q, cu_seqlens_q, ks, vs, scale, dtype=torch.float32):
    """Varlen causal attention, queries aligned to the end of the keys, by torch SDPA with an
    explicit mask (SDPA's is_causal aligns to the start). q [Tq, Hq, D] -> [Tq, Hq, D]."""
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    cu = cu_seqlens_q.tolist()
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        if e == s:
            continue
        lq, lk = e - s, ks[b].shape[0]
        qpos = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        mask = torch.arange(lk, device=q.device)[None, :] <= qpos  # [Lq, Lk], True = attend
        qb = q[s:e].to(dtype).transpose(0, 1)[None]               # [1, Hq, Lq, D]
        kb = ks[b].to(q.device, dtype).transpose(0, 1)[None]
        vb = vs[b].to(q.device, dtype).transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=True)
        out[s:e] = o[0].transpose(0, 1)
    return out


# ----------------------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_reference_vs_dense_sdpa(hq, hkv, block_size):
    bs = block_size
    lens = [1, bs - 1, bs, bs + 1, 3 * bs + 5]
    case = make_paged_kv(lens, hkv, bs, seed=hq * 100 + hkv + bs)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(len(lens), hq, D, generator=g) * 2
    scale = 1 / math.sqrt(D)
    got = ref.paged_attention_decode(q, case["k_cache"], case["v_cache"], case["block_tables"],
                                     case["seq_lens"], scale)
    want = sdpa_decode(q, case["k"], case["v"], scale)
    assert torch.isfinite(got).all(), "the reference read a poisoned (unowned) cache slot"
    assert rel_err(got, want) < 1e-5


def test_decode_wrapper_on_cpu_writes_out_and_accepts_a_workspace():
    case = make_paged_kv([5, 40], 2, 16, dtype=torch.bfloat16)
    q = torch.randn(2, 8, D).to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    ws = qwen3_kernels.ops.decode_workspace(2, 8, D, "cpu")
    res = qwen3_kernels.paged_attention_decode(q, case["k_cache"], case["v_cache"],
                                               case["block_tables"], case["seq_lens"], 0.1,
                                               out=out, workspace=ws)
    assert res is out and torch.isfinite(out).all()
    want = sdpa_decode(q.float(), [k.float() for k in case["k"]], [v.float() for v in case["v"]],
                       0.1)
    assert rel_err(out.float(), want) < 1e-2


# ----------------------------------------------------------------------------------------------
# prefill
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hq,hkv", GQA)
def test_prefill_reference_vs_dense_sdpa_with_cached_prefixes(hq, hkv):
    bs = 16
    # (new query tokens, keys) per sequence: no prefix, prefixes of odd lengths, one query token,
    # a sequence with no query tokens this step, block-boundary lengths.
    pairs = [(7, 7), (5, 21), (1, 1), (0, 9), (bs, bs + 1), (bs + 1, 2 * bs - 1), (3, 3 * bs)]
    case = make_paged_kv([lk for _, lk in pairs], hkv, bs, seed=hq + hkv)
    cu = torch.tensor([0] + list(torch.tensor([lq for lq, _ in pairs]).cumsum(0)),
                      dtype=torch.int32)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(int(cu[-1]), hq, D, generator=g) * 2
    scale = 1 / math.sqrt(D)
    got = ref.paged_attention_prefill(q, case["k_cache"], case["v_cache"], cu, case["seq_lens"],
                                      case["block_tables"], scale)
    want = sdpa_prefill(q, cu, case["k"], case["v"], scale)
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("block_size", [16, 64])
def test_prefill_reference_in_chunks_equals_one_causal_pass(block_size):
    # Chunked prefill: each chunk's queries see the earlier chunks (already in the cache) and
    # themselves causally; the chunks together must give plain causal attention over the sequence.
    n, hq, hkv = 83, 8, 2
    case = make_paged_kv([n], hkv, block_size, seed=3)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(n, hq, D, generator=g)
    scale = 0.09
    full = sdpa_prefill(q, torch.tensor([0, n], dtype=torch.int32), case["k"], case["v"], scale)
    bounds = [0, 17, 32, 33, 70, n]
    parts = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        parts.append(ref.paged_attention_prefill(
            q[s:e], case["k_cache"], case["v_cache"], torch.tensor([0, e - s], dtype=torch.int32),
            torch.tensor([e], dtype=torch.int32), case["block_tables"], scale))
    assert rel_err(torch.cat(parts), full) < 1e-5


# ----------------------------------------------------------------------------------------------
# input checks (shared by the CPU and CUDA paths: ops.py raises before dispatch)
# ----------------------------------------------------------------------------------------------


def _decode_args(**over):
    case = make_paged_kv([5, 20], 2, 16, dtype=torch.bfloat16)
    args = dict(q=torch.randn(2, 4, D).to(torch.bfloat16), k_cache=case["k_cache"],
                v_cache=case["v_cache"], block_tables=case["block_tables"],
                seq_lens=case["seq_lens"], scale=0.1)
    args.update(over)
    return args


_BT = make_paged_kv([5, 20], 2, 16)["block_tables"]


@pytest.mark.parametrize("over,match", [
    (dict(q=torch.randn(2, 4, D)), "k_cache must be torch.float32"),
    (dict(q=torch.randn(2, 4, D).to(torch.bfloat16)[:, :, :64]), "head_dim"),
    (dict(q=torch.randn(2, 3, D).to(torch.bfloat16)), "multiple of kv heads"),
    (dict(q=torch.randn(4, 2, D).to(torch.bfloat16).transpose(0, 1)), "contiguous"),
    (dict(block_tables=_BT.long()), "block_tables must be torch.int32"),
    (dict(block_tables=_BT[:1]), "block_tables must have 2 rows"),
    (dict(seq_lens=torch.tensor([5, 20])), "seq_lens must be torch.int32"),
    (dict(seq_lens=torch.tensor([5], dtype=torch.int32)), "seq_lens must have shape"),
    (dict(k_cache=torch.zeros(3, 24, 2, D, dtype=torch.bfloat16),
          v_cache=torch.zeros(3, 24, 2, D, dtype=torch.bfloat16)), "block_size"),
    (dict(v_cache=torch.zeros(3, 16, 2, D, dtype=torch.bfloat16)), "v_cache must have shape"),
    (dict(out=torch.empty(2, 4, D)), "out must be torch.bfloat16"),
    (dict(out=torch.empty(2, 4, 64, dtype=torch.bfloat16)), "out must have shape"),
    (dict(workspace=torch.empty(2, 4, 8, D + 1)), "workspace must have shape"),
    (dict(workspace=torch.empty(2, 4, 64, D + 1, dtype=torch.float16)),
     "workspace must be torch.float32"),
])
def test_decode_input_checks_raise_clear_errors(over, match):
    with pytest.raises(ValueError, match=match):
        qwen3_kernels.paged_attention_decode(**_decode_args(**over))


def _prefill_args(**over):
    case = make_paged_kv([5, 20], 2, 16, dtype=torch.bfloat16)
    args = dict(q=torch.randn(9, 4, D).to(torch.bfloat16), k_cache=case["k_cache"],
                v_cache=case["v_cache"], cu_seqlens_q=torch.tensor([0, 4, 9], dtype=torch.int32),
                seq_lens_k=case["seq_lens"], block_tables=case["block_tables"], max_seqlen_q=5,
                scale=0.1)
    args.update(over)
    return args


@pytest.mark.parametrize("over,match", [
    (dict(cu_seqlens_q=torch.tensor([0, 4, 9])), "cu_seqlens_q must be torch.int32"),
    (dict(cu_seqlens_q=torch.tensor([0, 9], dtype=torch.int32)), "block_tables must have 1 rows"),
    (dict(seq_lens_k=torch.tensor([5, 20])), "seq_lens_k must be torch.int32"),
    (dict(max_seqlen_q=-1), "max_seqlen_q"),
    (dict(q=torch.randn(9, 3, D).to(torch.bfloat16)), "multiple of kv heads"),
    (dict(out=torch.empty(9, 4, D, dtype=torch.float16)), "out must be torch.bfloat16"),
])
def test_prefill_input_checks_raise_clear_errors(over, match):
    with pytest.raises(ValueError, match=match):
        qwen3_kernels.paged_attention_prefill(**_prefill_args(**over))
