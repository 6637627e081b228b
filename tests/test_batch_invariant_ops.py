"""Batch invariance of the ops (``batch_invariant=True``, ops.py "Batch invariance"): each output
row is a function of its own inputs alone, bit for bit (torch.equal), whatever else shares the call.

What holds, and what is checked here:
  - linear: row i of a call on x [M, K] equals that row computed in any other call holding it, at
    any position, for any M (CPU: the reference, one row at a time; CUDA: data-parallel
    CUTLASS tiles picked by M and N, at Qwen3's projection shapes, M up to 4096).
  - rms_norm / fused_add_rms_norm: the rows of a call on the first T rows equal those of the call
    on all 4096 (CUDA: one launch configuration for every T; CPU: the reference, per row already).
  - paged_attention_decode: a sequence's row equals its batch-of-one result whatever the other
    sequences are, their number and order, and the block table's width (CUDA: splits of a fixed
    2048 keys from key 0, ops.BATCH_INVARIANT_SPLIT_KEYS), bf16 / fp16 / fp8 caches.
  - paged_attention_prefill: each query token's row equals paged_attention_decode's for that token
    (its q row, seq_len = its position + 1, its sequence's block-table row); so it depends neither
    on the batch, nor on how the prompt is chunked, nor on the cached prefix.
  - a context past ops.BATCH_INVARIANT_MAX_CONTEXT (40960 keys) is a ValueError naming
    batch_invariant, raised before anything is written.
The CUDA outputs are also held to the accuracy rules of the ops' own tests (test_linear_cuda.py,
test_attention_decode_cuda.py, test_kv_fp8_cuda.py, test_elementwise_cuda.py).

Inputs are random with fixed seeds; unowned KV-cache slots and block-table padding point at NaN
(``make_paged_kv``) and outputs are NaN-poisoned, so a stray read or an unwritten row fails.
The CPU part always runs; the CUDA part needs the extension on a compute capability 9.0 GPU.
"""

from __future__ import annotations

import contextlib
import math
import random

import pytest
import torch

import qwen3_kernels
import qwen3_kernels.ops as ops
from qwen3_kernels import reference as ref
from qwen3_kernels.ops import BATCH_INVARIANT_MAX_CONTEXT, decode_workspace
from tests.helpers import HAS_CUDA, one_thread, rel_err, requires_cuda  # noqa: F401 (one_thread)
from tests.test_attention_decode_cuda import _check as decode_fa3_check
from tests.test_attention_reference import make_paged_kv, sdpa_decode
from tests.test_elementwise_cuda import TOL as NORM_TOL
from tests.test_kv_fp8_cuda import fa3_check, fp8_cache, sdpa_fp16
from tests.test_linear_cuda import _check as linear_fa3_check
from tests.test_linear_cuda import _inputs as linear_inputs

D = 128
SCALE = 1 / math.sqrt(D)
NAN = float("nan")
HALF = [torch.bfloat16, torch.float16]

SM90 = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)
requires_sm90 = pytest.mark.skipif(
    not SM90, reason="needs the CUDA extension on a compute capability 9.0 GPU "
                     "(the batch-invariant kernels are sm_90 only)")


def _ids(dtypes):
    return [str(d).removeprefix("torch.") for d in dtypes]


# ----------------------------------------------------------------------------------------------
# helpers (CPU and CUDA alike)
# ----------------------------------------------------------------------------------------------


def rand(shape, dtype, gen, device="cpu", std=1.0):
    """Normal values (never zeros) drawn on the CPU from ``gen``, then moved and rounded."""
    return (torch.randn(shape, generator=gen) * std).to(device, dtype)


def widen(tables: torch.Tensor, extra: int) -> torch.Tensor:
    """Block tables with ``extra`` more columns of padding (copies of the last column, which
    make_paged_kv points at a NaN spare block): a wider table, the same blocks read."""
    if extra == 0:
        return tables.contiguous()
    return torch.cat([tables, tables[:, -1:].expand(-1, extra)], dim=1).contiguous()


def decode_rows(case, q, rows, *, extra_cols=0, **kw):
    """paged_attention_decode(batch_invariant=True) of the sequences ``rows`` of ``case`` (in that
    order, repeats allowed) as one batch, into a NaN-poisoned out. kw: k_scale / v_scale."""
    idx = torch.tensor(rows, dtype=torch.long, device=q.device)
    qb = q[idx].contiguous()
    out = torch.full_like(qb, NAN)
    res = qwen3_kernels.paged_attention_decode(
        qb, case["k_cache"], case["v_cache"], widen(case["block_tables"][idx], extra_cols),
        case["seq_lens"][idx].contiguous(), SCALE, out=out, batch_invariant=True, **kw)
    assert res is out
    return out


def decode_alone(case, q, b, **kw):
    """Sequence b alone, its block table cut to exactly the blocks it owns: [1, Hq, D]."""
    n = int(case["seq_lens"][b])
    bs = case["k_cache"].shape[1]
    tables = case["block_tables"][b:b + 1, :-(-n // bs)].contiguous()
    out = torch.full_like(q[b:b + 1], NAN)
    qwen3_kernels.paged_attention_decode(q[b:b + 1].contiguous(), case["k_cache"], case["v_cache"],
                                         tables, case["seq_lens"][b:b + 1].contiguous(), SCALE,
                                         out=out, batch_invariant=True, **kw)
    return out


class Prompts:
    """Sequences whose keys / values (all positions) are in a paged cache, and the queries of the
    positions ``specs`` name: spec (p, c) = a cached prefix of p tokens and a chunk of c new ones,
    queries at positions p .. p + c - 1 (the sequence holds p + c keys)."""

    def __init__(self, specs, hq, hkv, block_size, dtype, device, seed, kv=None):
        self.specs = specs
        self.case = make_paged_kv([p + c for p, c in specs], hkv, block_size, dtype=dtype,
                                  device=device, seed=seed)
        g = torch.Generator().manual_seed(seed + 1)
        self.q = [rand((c, hq, D), dtype, g, device, std=2.0) for _, c in specs]
        self.kw = {}
        if kv is not None:  # an fp8 cache: (k_scale, v_scale)
            k8, v8, kd, vd = fp8_cache(self.case["k_cache"], self.case["v_cache"], *kv)
            self.case = dict(self.case, k_cache=k8, v_cache=v8, k_deq=kd, v_deq=vd)
            self.kw = dict(k_scale=kv[0], v_scale=kv[1])

    def queries(self, b, start, end):
        """Sequence b's queries at positions [start, end)."""
        p = self.specs[b][0]
        assert p <= start <= end <= p + self.specs[b][1]
        return self.q[b][start - p:end - p]

    def prefill(self, parts):
        """One paged_attention_prefill(batch_invariant=True) call; parts = [(b, start, end)]:
        sequence b's queries at positions [start, end) over its keys 0 .. end - 1. Returns the
        rows of each part."""
        dev = self.case["k_cache"].device
        q = torch.cat([self.queries(b, s, e) for b, s, e in parts]).contiguous()
        cu = [0]
        for _, s, e in parts:
            cu.append(cu[-1] + e - s)
        idx = torch.tensor([b for b, _, _ in parts], dtype=torch.long, device=dev)
        out = torch.full_like(q, NAN)
        qwen3_kernels.paged_attention_prefill(
            q, self.case["k_cache"], self.case["v_cache"],
            torch.tensor(cu, dtype=torch.int32, device=dev),
            torch.tensor([e for _, _, e in parts], dtype=torch.int32, device=dev),
            self.case["block_tables"][idx].contiguous(), max(e - s for _, s, e in parts), SCALE,
            out=out, batch_invariant=True, **self.kw)
        return [out[cu[i]:cu[i + 1]] for i in range(len(parts))]

    def decode(self, b, start, end):
        """paged_attention_decode(batch_invariant=True) of sequence b's queries at positions
        [start, end), one row each: seq_len = position + 1, the sequence's block-table row."""
        dev = self.case["k_cache"].device
        q = self.queries(b, start, end).contiguous()
        out = torch.full_like(q, NAN)
        tables = self.case["block_tables"][b:b + 1].expand(end - start, -1).contiguous()
        lens = torch.arange(start + 1, end + 1, dtype=torch.int32, device=dev)
        qwen3_kernels.paged_attention_decode(q, self.case["k_cache"], self.case["v_cache"], tables,
                                             lens, SCALE, out=out, batch_invariant=True, **self.kw)
        return out


def check_prefill_equals_decode(pr: Prompts, single_positions=None):
    """Every spec's chunk by prefill alone == decode of each of its positions (batched), == decode
    of single positions; all chunks in one prefill (and in reverse order) == each alone."""
    alone = []
    for b, (p, c) in enumerate(pr.specs):
        got = pr.prefill([(b, p, p + c)])[0]
        want = pr.decode(b, p, p + c)
        assert torch.isfinite(got).all(), f"spec {b} {(p, c)}: an unwritten or poisoned row"
        bad = [p + i for i in range(c) if not torch.equal(got[i], want[i])]
        assert not bad, (
            f"spec {b} (prefix {p}, chunk {c}): prefill != decode at positions {bad[:10]}")
        picks = single_positions(p, c) if single_positions else {p, p + c // 2, p + c - 1}
        for pos in sorted(picks):
            one = pr.decode(b, pos, pos + 1)
            assert torch.equal(one[0], want[pos - p]), (
                f"spec {b}: decode of position {pos} alone != its row among the chunk's positions")
        alone.append(got)
    everything = [(b, p, p + c) for b, (p, c) in enumerate(pr.specs)]
    for order in (everything, everything[::-1]):
        together = pr.prefill(order)
        for (b, _, _), rows in zip(order, together):
            assert torch.equal(rows, alone[b]), f"spec {b}: its rows differ among the other prompts"
    return alone


def check_chunkings(pr: Prompts, b, chunkings):
    """The same positions of sequence b, chunked differently (each chunk one prefill call, as an
    engine runs them; and all chunks in one call), give identical rows."""
    p, c = pr.specs[b]
    whole = pr.prefill([(b, p, p + c)])[0]
    for cuts in chunkings:
        bounds = [p] + list(cuts) + [p + c]
        parts = [(b, s, e) for s, e in zip(bounds, bounds[1:])]
        per_call = torch.cat([pr.prefill([part])[0] for part in parts])
        one_call = torch.cat(pr.prefill(parts))
        assert torch.equal(per_call, whole), f"chunks at {cuts} (one call each) != the whole chunk"
        assert torch.equal(one_call, whole), f"chunks at {cuts} (in one call) != the whole chunk"


# ==============================================================================================
# CPU: the references through the public ops (always run)
# ==============================================================================================

CPU_DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=_ids(CPU_DTYPES))
@pytest.mark.parametrize("n,k", [(72, 136), (136, 72), (136, 136)])
@pytest.mark.parametrize("t", [1, 3, 17, 64])
def test_cpu_linear_row_equals_row_alone_and_anywhere(t, n, k, dtype):
    g = torch.Generator().manual_seed(t * 1000 + n + k)
    x = rand((t, k), dtype, g)
    w = rand((n, k), dtype, g, std=k ** -0.5)
    full = qwen3_kernels.linear(x, w, batch_invariant=True)
    for i in range(t):
        alone = qwen3_kernels.linear(x[i:i + 1], w, batch_invariant=True)
        assert torch.equal(full[i:i + 1], alone), f"row {i} of T={t} != the row alone"
    # the same rows at another position of a bigger random batch
    big = rand((t + 40, k), dtype, g)
    big[13:13 + t] = x
    assert torch.equal(qwen3_kernels.linear(big, w, batch_invariant=True)[13:13 + t], full)
    torch.testing.assert_close(full.float(), x.float() @ w.float().t(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=_ids(CPU_DTYPES))
@pytest.mark.parametrize("hidden", [1024, 5120])
def test_cpu_norms_rows_equal_rows_alone(hidden, dtype):
    g = torch.Generator().manual_seed(hidden)
    x = rand((100, hidden), dtype, g, std=3.0)
    res = rand((100, hidden), dtype, g, std=4.0)
    w = rand((hidden,), dtype, g)
    full = qwen3_kernels.rms_norm(x, w, 1e-6, batch_invariant=True)
    fx, fr = qwen3_kernels.fused_add_rms_norm(x.clone(), res.clone(), w, 1e-6, batch_invariant=True)
    for t0, t1 in ((0, 1), (7, 12), (99, 100), (0, 37)):
        assert torch.equal(qwen3_kernels.rms_norm(x[t0:t1], w, 1e-6, batch_invariant=True),
                           full[t0:t1])
        sx, sr = qwen3_kernels.fused_add_rms_norm(x[t0:t1].clone(), res[t0:t1].clone(), w, 1e-6,
                                                  batch_invariant=True)
        assert torch.equal(sx, fx[t0:t1]) and torch.equal(sr, fr[t0:t1])


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=_ids(CPU_DTYPES))
def test_cpu_decode_row_equals_sequence_alone(dtype):
    rnd = random.Random(5)
    lens = [rnd.randint(1, 300) for _ in range(9)] + [16, 17]
    case = make_paged_kv(lens, 2, 16, dtype=dtype, seed=3)  # GQA 8 / 2, shuffled blocks, NaN poison
    q = rand((len(lens), 8, D), dtype, torch.Generator().manual_seed(4), std=2.0)
    alone = torch.cat([decode_alone(case, q, b) for b in range(len(lens))])
    assert torch.isfinite(alone).all(), "read a poisoned (unowned) cache slot"
    rows = list(range(len(lens)))
    batches = [rows, rows[::-1], [3, 3, 0, 10, 3]]  # all, reversed, with repeats
    for order in batches:
        for extra in (0, 5):
            out = decode_rows(case, q, order, extra_cols=extra)
            for i, b in enumerate(order):
                assert torch.equal(out[i], alone[b]), (
                    f"sequence {b} (len {lens[b]}) at row {i} of {order} (+{extra} table cols)")
    want = sdpa_decode(q.float(), [k.float() for k in case["k"]], [v.float() for v in case["v"]],
                       SCALE)
    assert rel_err(alone.float(), want) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=_ids(CPU_DTYPES))
def test_cpu_prefill_equals_decode_whatever_the_chunks(dtype):
    # one prompt of 37 tokens (queries at every position), and a batch of three: a fresh prompt,
    # a chunk of 20 after a cached prefix of 50, one token after a prefix of 129 (block size 16)
    pr = Prompts([(0, 37), (50, 20), (129, 1)], 8, 2, 16, dtype, "cpu", seed=11)
    check_prefill_equals_decode(pr, single_positions=lambda p, c: range(p, p + c))
    check_chunkings(pr, 0, [(10,), (1, 9, 10, 36), tuple(range(1, 37))])
    check_chunkings(pr, 1, [(51, 60, 69)])


def _long_cache(n_keys, hq=2, hkv=1, block_size=256, device="cpu", dtype=torch.float32):
    """One sequence of n_keys keys over a shuffled table: (q [1, hq, D], k, v, table [1, cols])."""
    g = torch.Generator().manual_seed(n_keys)
    nblk = -(-n_keys // block_size)
    k = rand((nblk + 1, block_size, hkv, D), dtype, g, device)
    v = rand((nblk + 1, block_size, hkv, D), dtype, g, device)
    table = torch.randperm(nblk + 1, generator=g)[None, :].to(device, torch.int32)
    q = rand((1, hq, D), dtype, g, device, std=2.0)
    return q, k, v, table


def test_one_context_limit_everywhere():
    """The limit is spelled out three times: the ops', the engine config's (which must not load
    the kernels) and launchers.h's split constants; they agree."""
    import re
    from pathlib import Path

    from qwen3_model import config

    assert config.BATCH_INVARIANT_MAX_CONTEXT == BATCH_INVARIANT_MAX_CONTEXT
    header = (Path(__file__).parents[1] / "csrc/include/qwen3_kernels/launchers.h").read_text()
    split = int(re.search(r"kDecodeInvariantSplitKeys = (\d+);", header).group(1))
    assert split == ops.BATCH_INVARIANT_SPLIT_KEYS
    limit = int(re.search(r"kDecodeInvariantMaxKeys = (\d+);", header).group(1))
    assert limit == BATCH_INVARIANT_MAX_CONTEXT <= split * ops.MAX_DECODE_SPLITS


def _rejection_checks(device, dtype):
    """batch_invariant refuses a context past 40960 keys (decode and prefill) with a ValueError,
    before anything is written; 40960 keys run, and prefill == decode there; without
    batch_invariant 40961 keys run."""
    limit = BATCH_INVARIANT_MAX_CONTEXT
    assert limit == 40960 <= ops.BATCH_INVARIANT_SPLIT_KEYS * ops.MAX_DECODE_SPLITS
    q, k, v, table = _long_cache(limit + 1, device=device, dtype=dtype)

    def lens(n):
        return torch.tensor([n], dtype=torch.int32, device=device)

    cu = torch.tensor([0, 1], dtype=torch.int32, device=device)

    out = torch.full_like(q, NAN)
    with pytest.raises(ValueError, match="batch_invariant.*40960.*40961"):
        qwen3_kernels.paged_attention_decode(q, k, v, table, lens(limit + 1), SCALE, out=out,
                                             batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant.*40960.*40961"):
        qwen3_kernels.paged_attention_prefill(q, k, v, cu, lens(limit + 1), table, 1, SCALE,
                                              out=out, batch_invariant=True)
    assert out.isnan().all(), "a refused call wrote its output"
    # a batch whose longest row is past the bound is refused too (the others are fine)
    q3 = q.expand(3, -1, -1).contiguous()
    with pytest.raises(ValueError, match="batch_invariant"):
        qwen3_kernels.paged_attention_decode(
            q3, k, v, table.expand(3, -1).contiguous(),
            torch.tensor([5, limit + 1, 1], dtype=torch.int32, device=device), SCALE,
            batch_invariant=True)

    at_limit = qwen3_kernels.paged_attention_decode(q, k, v, table, lens(limit), SCALE,
                                                    batch_invariant=True)
    assert torch.isfinite(at_limit).all()
    pre = qwen3_kernels.paged_attention_prefill(q, k, v, cu, lens(limit), table, 1, SCALE,
                                                batch_invariant=True)
    assert torch.equal(pre, at_limit), "prefill != decode at the longest context"
    default = qwen3_kernels.paged_attention_decode(q, k, v, table, lens(limit + 1), SCALE)
    assert torch.isfinite(default).all()
    return at_limit, (q, k, v, table)


def test_cpu_rejects_contexts_past_the_bound():
    import time

    start = time.perf_counter()
    _rejection_checks("cpu", torch.float32)
    assert time.perf_counter() - start < 20, "the bound's check should not wait for attention"


def test_cpu_rejection_comes_before_the_reference_runs(monkeypatch):
    # The ValueError comes from the wrapper's check, not from the reference reading 40961 keys:
    # the reference is never reached.
    def boom(*args, **kwargs):
        raise AssertionError("the reference ran")

    monkeypatch.setattr(ref, "paged_attention_decode", boom)
    monkeypatch.setattr(ref, "paged_attention_prefill", boom)
    q, k, v, table = _long_cache(300)
    big = torch.tensor([BATCH_INVARIANT_MAX_CONTEXT + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="batch_invariant"):
        qwen3_kernels.paged_attention_decode(q, k, v, table, big, SCALE, batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant"):
        qwen3_kernels.paged_attention_prefill(q, k, v, torch.tensor([0, 1], dtype=torch.int32),
                                              big, table, 1, SCALE, batch_invariant=True)


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_cpu_batch_invariant_attention_traces_under_torch_compile_fullgraph(op):
    """ops.py promises torch.compile(fullgraph=True) traces every op (fake impls; the index checks
    skip while compiling, index_checks.skipped). The batch_invariant context bound must skip then
    too: ``int(lens.max())`` on a traced tensor is a data-dependent guard (and on CUDA a host sync,
    which also breaks CUDA-graph capture)."""
    case = make_paged_kv([5, 40], 2, 16, dtype=torch.bfloat16, seed=2)
    q = rand((2, 8, D), torch.bfloat16, torch.Generator().manual_seed(2))
    if op == "decode":
        def f(q, kc, vc, bt, lens):
            return qwen3_kernels.paged_attention_decode(q, kc, vc, bt, lens, SCALE,
                                                        batch_invariant=True)
        args = (q, case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"])
    else:
        cu = torch.tensor([0, 1, 2], dtype=torch.int32)

        def f(q, kc, vc, bt, lens):
            return qwen3_kernels.paged_attention_prefill(q, kc, vc, cu, lens, bt, 1, SCALE,
                                                         batch_invariant=True)
        args = (q, case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"])
    torch._dynamo.reset()
    try:
        got = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, f(*args))


# ==============================================================================================
# CUDA (sm_90): the kernels
# ==============================================================================================

# (N, K): Qwen3-8B QKV / o_proj / the 8B gate_up pair (2 x 12288), down_proj, 0.6B QKV, the 0.6B
# lm_head (vocab 151936), and an odd small one
LINEAR_SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (4096, 1024),
                 (151936, 1024), (136, 72)]
LINEAR_M = [1, 2, 3, 7, 8, 16, 17, 31, 32, 33, 64, 65, 100, 128, 129, 192, 193, 200, 256]


def _linear_rows_mismatch(x, w, full, ms, offset):
    """[(offset, M)] where linear(x[offset:offset + M], batch_invariant) != full's rows."""
    bad = []
    for m in ms:
        if offset + m > x.shape[0]:
            continue
        out = torch.full((m, w.shape[0]), NAN, device="cuda", dtype=x.dtype)
        qwen3_kernels.linear(x[offset:offset + m], w, out=out, batch_invariant=True)
        if not torch.equal(out, full[offset:offset + m]):
            bad.append((offset, m))
    return bad


@requires_sm90
@pytest.mark.parametrize("dtype", HALF, ids=_ids(HALF))
@pytest.mark.parametrize("n,k", LINEAR_SHAPES, ids=[f"N{n}-K{k}" for n, k in LINEAR_SHAPES])
def test_cuda_linear_rows_do_not_depend_on_m(n, k, dtype):
    """linear(x[:M]) and linear(x[5:5 + M]) equal the matching rows of linear(x) (x [256, K])
    bit for bit for every M; the full result meets test_linear_cuda's accuracy rule."""
    x, w = linear_inputs(256, n, k, dtype, seed=n + k)
    full = torch.full((256, n), NAN, device="cuda", dtype=dtype)
    qwen3_kernels.linear(x, w, out=full, batch_invariant=True)
    linear_fa3_check(x, w, full)
    bad = _linear_rows_mismatch(x, w, full, LINEAR_M, 0) + _linear_rows_mismatch(x, w, full,
                                                                                 LINEAR_M, 5)
    assert not bad, f"(first row, M) whose rows differ from the M = 256 run: {bad}"


@requires_sm90
@pytest.mark.parametrize("dtype", HALF, ids=_ids(HALF))
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 12288), (136, 72)],
                         ids=["N6144-K4096", "N4096-K12288", "N136-K72"])
def test_cuda_linear_large_m(n, k, dtype):
    """Prefill sizes: M up to 4096 rows equal the rows of the M = 4096 run."""
    x, w = linear_inputs(4096, n, k, dtype, seed=n * 3 + k)
    full = qwen3_kernels.linear(x, w, batch_invariant=True)
    linear_fa3_check(x, w, full)
    bad = (_linear_rows_mismatch(x, w, full, [1, 255, 300, 384, 385, 512, 513, 1000, 2048, 3001,
                                              4095, 4096], 0)
           + _linear_rows_mismatch(x, w, full, [1000, 2048, 4000], 64))
    assert not bad, f"(first row, M) whose rows differ from the M = 4096 run: {bad}"


@requires_sm90
def test_default_linear_is_not_batch_invariant():
    """The point of the mode: on the 8B QKV shape (6144, 4096) the default choice (GEMV at M = 1,
    split-K / CUTLASS tiles / cuBLAS by M) rounds some row differently at some M. A pass means a
    difference was found; a failure records that the default mode matched at every M."""
    x, w = linear_inputs(256, 6144, 4096, torch.bfloat16, seed=1)
    full = qwen3_kernels.linear(x, w)
    differ = [m for m in LINEAR_M if not torch.equal(qwen3_kernels.linear(x[:m], w), full[:m])]
    assert differ, ("finding: the default linear gave every M in "
                    f"{LINEAR_M} the rows of the M = 256 run bit for bit on (6144, 4096)")


NORM_T = [1, 5, 100, 1023, 1024, 1500, 4096]


@requires_sm90
@pytest.mark.parametrize("dtype", HALF, ids=_ids(HALF))
@pytest.mark.parametrize("hidden", [1024, 4096, 5120])
def test_cuda_rms_norm_rows_do_not_depend_on_t(hidden, dtype):
    g = torch.Generator(device="cuda").manual_seed(hidden)
    x = (torch.randn(4096, hidden, device="cuda", generator=g) * 3).to(dtype)
    w = torch.randn(hidden, device="cuda", generator=g).to(dtype)
    full = torch.full_like(x, NAN)
    qwen3_kernels.rms_norm(x, w, 1e-6, out=full, batch_invariant=True)
    torch.testing.assert_close(full, ref.rms_norm(x, w, 1e-6), **NORM_TOL[dtype])
    bad = []
    for t in NORM_T:
        for off in (0, 7):
            if off + t > 4096:
                continue
            out = torch.full((t, hidden), NAN, device="cuda", dtype=dtype)
            qwen3_kernels.rms_norm(x[off:off + t], w, 1e-6, out=out, batch_invariant=True)
            if not torch.equal(out, full[off:off + t]):
                bad.append((off, t))
    assert not bad, f"(first row, T) whose rows differ from the T = 4096 run: {bad}"


@requires_sm90
@pytest.mark.parametrize("dtype", HALF, ids=_ids(HALF))
@pytest.mark.parametrize("hidden", [1024, 4096, 5120])
def test_cuda_fused_add_rms_norm_rows_do_not_depend_on_t(hidden, dtype):
    """Both outputs (the normalised x and the new residual; in place, so every call on clones)."""
    g = torch.Generator(device="cuda").manual_seed(hidden + 1)
    x = torch.randn(4096, hidden, device="cuda", generator=g).to(dtype)
    res = (torch.randn(4096, hidden, device="cuda", generator=g) * 4).to(dtype)
    w = torch.randn(hidden, device="cuda", generator=g).to(dtype)
    fx, fr = qwen3_kernels.fused_add_rms_norm(x.clone(), res.clone(), w, 1e-6,
                                              batch_invariant=True)
    want_x, want_res = ref.fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(fr, want_res, atol=0, rtol=0)
    torch.testing.assert_close(fx, want_x, **NORM_TOL[dtype])
    bad = []
    for t in NORM_T:
        for off in (0, 7):
            if off + t > 4096:
                continue
            sx, sr = qwen3_kernels.fused_add_rms_norm(x[off:off + t].clone(),
                                                      res[off:off + t].clone(), w, 1e-6,
                                                      batch_invariant=True)
            if not (torch.equal(sx, fx[off:off + t]) and torch.equal(sr, fr[off:off + t])):
                bad.append((off, t))
    assert not bad, f"(first row, T) whose rows differ from the T = 4096 run: {bad}"


# ---- decode ------------------------------------------------------------------------------------

# around the block sizes and the 2048-key splits, up to 5 splits
TARGET_LENS = [1, 15, 16, 17, 639, 640, 2047, 2048, 2049, 4097, 9000]
POOL = 64  # other sequences to share a batch with


def _decode_case(hq, hkv, block_size, dtype, seed):
    """The targets, then POOL other sequences (1..5000 keys), in one NaN-poisoned cache."""
    rnd = random.Random(seed)
    lens = TARGET_LENS + [rnd.randint(1, 5000) for _ in range(POOL)]
    case = make_paged_kv(lens, hkv, block_size, dtype=dtype, device="cuda", seed=seed)
    q = rand((len(lens), hq, D), dtype, torch.Generator().manual_seed(seed + 1), "cuda", std=2.0)
    return case, q


def _check_decode_invariance(case, q, **kw):
    """Each target's row, in every batch below, == its batch-of-one result (exact table);
    returns the batch-of-one rows [targets, Hq, D]."""
    block_size = case["k_cache"].shape[1]
    targets = list(range(len(TARGET_LENS)))
    others = list(range(len(TARGET_LENS), len(TARGET_LENS) + POOL))
    alone = torch.cat([decode_alone(case, q, b, **kw) for b in targets])
    assert torch.isfinite(alone).all(), "an unwritten row, or a poisoned (unowned) slot read"
    failures = []

    def compare(rows, what, extra_cols=0):
        out = decode_rows(case, q, rows, extra_cols=extra_cols, **kw)
        for i, b in enumerate(rows):
            if b in targets and not torch.equal(out[i], alone[b]):
                failures.append(f"len {TARGET_LENS[b]} at row {i}: {what}")

    # wider tables: a few more columns, and past the 40960-key bound (the context cap clamps)
    wide = [0, 3, BATCH_INVARIANT_MAX_CONTEXT // block_size + 7]
    for b in targets:
        for extra in wide:
            compare([b], f"alone, table +{extra} columns", extra)
    compare(targets, "all targets")
    compare(targets[::-1], "all targets reversed")
    rnd = random.Random(block_size)
    for n_others in (1, 2, 7, 31, 64):
        for extra in (0, wide[-1]):
            rows = targets + rnd.sample(others, n_others)
            rnd.shuffle(rows)
            compare(rows, f"among {n_others} others, table +{extra} columns", extra)
    for b in targets:  # one target among a few random others
        rows = rnd.sample(others, rnd.randint(1, 64))
        rows.insert(rnd.randint(0, len(rows)), b)
        compare(rows, f"alone among {len(rows) - 1} others")
    assert not failures, f"{len(failures)} rows differ from the batch of one:\n" + "\n".join(
        failures[:30])
    return alone


@requires_sm90
@pytest.mark.parametrize("dtype", HALF, ids=_ids(HALF))
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (16, 8)])
def test_cuda_decode_row_equals_sequence_alone(hq, hkv, block_size, dtype):
    case, q = _decode_case(hq, hkv, block_size, dtype, seed=hq + block_size)
    _check_decode_invariance(case, q)
    everything = list(range(q.shape[0]))
    decode_fa3_check(decode_rows(case, q, everything), case, q, SCALE)


@requires_sm90
@pytest.mark.parametrize("block_size", [16, 256])
def test_cuda_decode_fp8_cache_row_equals_sequence_alone(block_size):
    """An fp8 (e4m3) cache with k_scale / v_scale != 1; accuracy by test_kv_fp8_cuda's rule (SDPA
    in fp16 on the dequantized K/V)."""
    k_scale, v_scale = 0.5, 0.25
    case, q = _decode_case(32, 8, block_size, torch.bfloat16, seed=7 + block_size)
    k8, v8, kd, vd = fp8_cache(case["k_cache"], case["v_cache"], k_scale, v_scale)
    case8 = dict(case, k_cache=k8, v_cache=v8)
    _check_decode_invariance(case8, q, k_scale=k_scale, v_scale=v_scale)
    rows = list(range(q.shape[0]))
    out = decode_rows(case8, q, rows, k_scale=k_scale, v_scale=v_scale)
    want = ref.paged_attention_decode(q.float(), kd, vd, case["block_tables"], case["seq_lens"],
                                      SCALE)
    lens = case["seq_lens"].tolist()
    lowp = torch.stack([
        sdpa_fp16(q[b:b + 1], ref._gather_kv(kd, case["block_tables"][b], n),
                  ref._gather_kv(vd, case["block_tables"][b], n), SCALE, n - 1)[0]
        for b, n in enumerate(lens)])
    fa3_check(out, want, lowp, "decode batch_invariant, fp8 cache")


# ---- prefill == decode -------------------------------------------------------------------------

# (cached prefix, chunk): a fresh prompt, a chunk after a prefix crossing the first 2048-key
# split's end, 3 tokens across the second split's end, one token, a chunk past 9000 keys, and
# the last 60 positions below the 40960-key bound (20 splits)
PREFILL_SPECS = [(0, 700), (2000, 100), (4095, 3), (0, 1), (8990, 20), (40900, 60)]
KV_KINDS = {"bf16": (torch.bfloat16, None), "fp16": (torch.float16, None),
            "fp8": (torch.bfloat16, (0.5, 0.25))}


@requires_sm90
@pytest.mark.parametrize("kv", list(KV_KINDS))
@pytest.mark.parametrize("block_size", [16, 256])
def test_cuda_prefill_equals_decode(block_size, kv):
    """Each chunk's query rows == paged_attention_decode of each token (batch_invariant both);
    the chunks together == each alone; the 700-token prompt chunked differently == whole."""
    dtype, scales = KV_KINDS[kv]
    pr = Prompts(PREFILL_SPECS, 32, 8, block_size, dtype, "cuda", seed=block_size, kv=scales)

    def boundaries(p, c):  # the first, middle and last query, and those at a split's edge
        return {p, p + c // 2, p + c - 1} | {
            x for x in (2047, 2048, 2049, 4095, 4096, 4097, 40959) if p <= x < p + c}

    check_prefill_equals_decode(pr, single_positions=boundaries)
    check_chunkings(pr, 0, [(333,), (1, 640, 641), (16, 17, 256, 257, 639)])
    check_chunkings(pr, 5, [(40901, 40930)])
    if scales is not None:
        return  # the fp8 decode's accuracy: test_cuda_decode_fp8_cache_row_equals_sequence_alone
    for b, (p, c) in enumerate(PREFILL_SPECS):  # accuracy of the rows (== decode's) vs fp32
        rows = pr.decode(b, p, p + c)
        k, v = pr.case["k"][b].cuda(), pr.case["v"][b].cuda()  # dense, moved once
        like = dict(k_cache=pr.case["k_cache"], v_cache=pr.case["v_cache"],
                    block_tables=pr.case["block_tables"][b:b + 1].expand(c, -1).contiguous(),
                    seq_lens=torch.arange(p + 1, p + c + 1, dtype=torch.int32, device="cuda"),
                    k=[k[:n] for n in range(p + 1, p + c + 1)],
                    v=[v[:n] for n in range(p + 1, p + c + 1)])
        decode_fa3_check(rows, like, pr.queries(b, p, p + c).contiguous(), SCALE)


@requires_sm90
@pytest.mark.parametrize("hq,hkv", [(8, 8), (16, 8), (40, 8), (64, 4), (64, 2)])
def test_cuda_prefill_equals_decode_any_group(hq, hkv):
    """A decode CTA of the prefill holds 16 / group consecutive tokens of one sequence (16, 8, 3,
    1 here; 1 where a group spans two 16-head chunks): rows of every group size, chunks that start
    and end inside a CTA's tokens and prompts shorter than one CTA's tokens == decode, bit for
    bit."""
    specs = [(0, 300), (37, 45), (0, 1), (0, 2), (2040, 17), (5, 19)]
    pr = Prompts(specs, hq, hkv, 16, torch.bfloat16, "cuda", seed=hq + hkv)
    check_prefill_equals_decode(pr)
    check_chunkings(pr, 0, [(3,), (1, 2, 17, 18, 19, 299)])


# ---- CUDA graphs -------------------------------------------------------------------------------


def _graph_vs_eager(checked: bool):
    """Decode (batch_invariant) captured for a batch padded to 8 (engine style: the padding rows
    have seq_len 0 at replay), replayed on two sets of 5 sequences: the real rows == the eager
    batch of 5, bit for bit; padding rows are zeros. checked: capture with the ops' checks on
    (as the engine captures its decode graphs), else inside trusted_inputs()."""
    hq, hkv, bs, pad_to = 32, 8, 16, 8
    lens = [1, 640, 641, 3000, 9000] + [17, 1281, 639, 2000, 4000]
    case = make_paged_kv(lens, hkv, bs, dtype=torch.bfloat16, device="cuda", seed=31)
    q_all = rand((len(lens), hq, D), torch.bfloat16, torch.Generator().manual_seed(32), "cuda",
                 std=2.0)
    sets = [list(range(5)), list(range(5, 10))]
    eager = [decode_rows(case, q_all, rows) for rows in sets]

    width = case["block_tables"].shape[1]
    q = torch.empty(pad_to, hq, D, device="cuda", dtype=torch.bfloat16)
    tables = torch.empty(pad_to, width, device="cuda", dtype=torch.int32)
    seq_lens = torch.empty(pad_to, device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    ws = decode_workspace(pad_to, hq, D, "cuda")

    def load(rows, pad_len):
        idx = torch.tensor(rows + [rows[0]] * (pad_to - len(rows)), device="cuda")
        q.copy_(q_all[idx])
        tables.copy_(case["block_tables"][idx])
        seq_lens.copy_(case["seq_lens"][idx])
        seq_lens[len(rows):] = pad_len

    def step():
        qwen3_kernels.paged_attention_decode(q, case["k_cache"], case["v_cache"], tables, seq_lens,
                                             SCALE, out=out, workspace=ws, batch_invariant=True)

    load(sets[0], 1)  # valid padding for the eager warm-up (its checks refuse seq_len 0)
    ctx = contextlib.nullcontext if checked else qwen3_kernels.trusted_inputs
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), ctx():
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    try:
        with ctx(), torch.cuda.graph(graph):
            step()
    except RuntimeError as e:  # e.g. a host sync inside the capture
        pytest.fail(f"capturing decode (batch_invariant, checks {'on' if checked else 'off'}) "
                    f"failed: {e}")
    for rows, want in zip(sets, eager):
        load(rows, 0)
        out.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[:len(rows)], want), "a replayed row != the eager batch's"
        assert (out[len(rows):] == 0).all(), "a padding row (seq_len 0) is not zero"


@requires_sm90
def test_cuda_decode_graph_replay_equals_eager():
    _graph_vs_eager(checked=False)


@requires_sm90
def test_cuda_decode_graph_capture_with_checks_on():
    """The engine captures its decode graphs with the ops' checks on (cuda_graphs.py
    capture_cudagraph, no trusted_inputs): the index checks skip while capturing
    (index_checks.skipped); the batch_invariant context bound must as well (no host sync)."""
    _graph_vs_eager(checked=True)


# ---- rejections ------------------------------------------------------------------------------


@requires_sm90
def test_cuda_rejects_contexts_past_the_bound():
    at_limit, (q, k, v, table) = _rejection_checks("cuda", torch.bfloat16)
    want = ref.paged_attention_decode(q.float(), k.float(), v.float(), table,
                                      torch.tensor([BATCH_INVARIANT_MAX_CONTEXT], dtype=torch.int32,
                                                   device="cuda"), SCALE)
    assert rel_err(at_limit, want) < 1e-2


@requires_cuda
@pytest.mark.skipif(SM90, reason="a compute capability 9.0 GPU has the batch-invariant kernels")
def test_cuda_batch_invariant_needs_sm90():
    x, w = linear_inputs(4, 136, 72, torch.bfloat16)
    with pytest.raises(ValueError, match="compute capability 9.0"):
        qwen3_kernels.linear(x, w, batch_invariant=True)
    case = make_paged_kv([5, 40], 2, 16, dtype=torch.bfloat16, device="cuda")
    qb = torch.randn(2, 8, D, device="cuda").to(torch.bfloat16)
    with pytest.raises(ValueError, match="compute capability 9.0"):
        qwen3_kernels.paged_attention_decode(qb, case["k_cache"], case["v_cache"],
                                             case["block_tables"], case["seq_lens"], SCALE,
                                             batch_invariant=True)
