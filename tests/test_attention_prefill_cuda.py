"""CUDA tests of paged_attention_prefill (csrc/kernels/attention/prefill.cu) against the fp32
reference.

Tolerance (the FlashAttention-3 rule, TARGETS.md): per sequence, our error against the fp32
reference must be at most twice the error of PyTorch doing the same attention in the low precision
(SDPA on the dense gathered K/V, the end-aligned causal mask given as an explicit boolean mask),
plus a tiny epsilon for the cases where both are exact.

Every cache slot the sequences do not own is NaN, and block-table entries past a sequence's last
block point at a NaN block, so a kernel that reads a key it must not see fails loudly. Outputs are
NaN-poisoned before the call, so every element must be written.

On Hopper the op runs the warp-specialised wgmma kernel (prefill_sm90_ws.cu): persistent (one CTA
per SM walks the work tiles) up to 8192 queries a sequence, one CTA per work tile above; elsewhere
the portable mma.sync kernel (prefill.cu). The `grid` fixture runs each test on both grids: the
one-tile grid by passing a max_seqlen_q above 8192, which only sizes the grid (the extra M blocks
are empty). The wgmma kernel loads Q with TMA where the GQA group is a power of two and with
cp.async otherwise: GQA below has both (group 5 for the second).
"""
from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F

import qwen3_kernels.ops as ops
import qwen3_kernels.reference as ref
from tests.helpers import misaligned, rel_err, requires_cuda

D = 128
EPS = 1e-5


def _cdiv(a, b):
    return -(-a // b)


class Case:
    """Packed queries of several sequences plus their keys/values in a shuffled paged cache.

    seqs: list of (Lq, Lk) with Lk >= Lq; query i of a sequence sits at position Lk - Lq + i.
    """

    def __init__(self, seqs, hq, hkv, block_size, dtype, seed=0, poison=True, extra_blocks=3):
        gen = torch.Generator().manual_seed(seed)
        self.seqs, self.hq, self.hkv, self.bs, self.dtype = seqs, hq, hkv, block_size, dtype
        nblk = [_cdiv(lk, block_size) for _, lk in seqs]
        num_blocks = sum(nblk) + extra_blocks
        max_blocks = max(nblk + [0]) + 1  # at least one unused entry per row
        perm = torch.randperm(num_blocks, generator=gen)
        unused = perm[-1].item()  # never assigned: stays NaN (or random without poison)
        fill = float("nan") if poison else None
        shape = (num_blocks, block_size, hkv, D)
        if poison:
            self.k_cache = torch.full(shape, fill, dtype=dtype)
            self.v_cache = torch.full(shape, fill, dtype=dtype)
        else:
            self.k_cache = torch.randn(shape, generator=gen).to(dtype)
            self.v_cache = torch.randn(shape, generator=gen).to(dtype)
        self.block_tables = torch.full((len(seqs), max_blocks), unused, dtype=torch.int32)
        self.keys, self.values = [], []
        nxt = 0
        for b, (lq, lk) in enumerate(seqs):
            assert lk >= lq
            self.block_tables[b, : nblk[b]] = perm[nxt : nxt + nblk[b]].to(torch.int32)
            nxt += nblk[b]
            k = torch.randn(lk, hkv, D, generator=gen).to(dtype)
            v = torch.randn(lk, hkv, D, generator=gen).to(dtype)
            self.keys.append(k)
            self.values.append(v)
            self.write_kv(b, 0, lk)
        tq = sum(lq for lq, _ in seqs)
        self.q = torch.randn(tq, hq, D, generator=gen).to(dtype)
        cu = [0]
        for lq, _ in seqs:
            cu.append(cu[-1] + lq)
        self.cu_seqlens_q = torch.tensor(cu, dtype=torch.int32)
        self.seq_lens_k = torch.tensor([lk for _, lk in seqs], dtype=torch.int32)
        self.max_seqlen_q = max([lq for lq, _ in seqs] + [0])
        self.scale = 1.0 / math.sqrt(D)

    def write_kv(self, b, start, end):
        """Write keys/values [start, end) of sequence b into its cache slots."""
        j = torch.arange(start, end, device=self.block_tables.device)
        slots = self.block_tables[b].long()[j // self.bs] * self.bs + j % self.bs
        self.k_cache.view(-1, self.hkv, D)[slots] = self.keys[b][start:end].to(self.k_cache.device)
        self.v_cache.view(-1, self.hkv, D)[slots] = self.values[b][start:end].to(
            self.v_cache.device)

    def chunk(self, start, n):
        """This single-sequence case's call: queries [start, start + n), keys [0, start + n)."""
        step = Case.__new__(Case)
        step.__dict__.update(self.__dict__)
        dev = self.q.device
        step.q = self.q[start : start + n].contiguous()
        step.seqs = [(n, start + n)]
        step.cu_seqlens_q = torch.tensor([0, n], dtype=torch.int32, device=dev)
        step.seq_lens_k = torch.tensor([start + n], dtype=torch.int32, device=dev)
        step.max_seqlen_q = n
        return step

    def cuda(self):
        for name in ("k_cache", "v_cache", "block_tables", "q", "cu_seqlens_q", "seq_lens_k"):
            setattr(self, name, getattr(self, name).cuda())
        return self

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.cu_seqlens_q, self.seq_lens_k,
                self.block_tables)


def run_ours(case, max_seqlen_q=None):
    out = torch.full_like(case.q, float("nan"))  # poisoned: every element must be written
    max_seqlen_q = case.max_seqlen_q if max_seqlen_q is None else max_seqlen_q
    res = ops.paged_attention_prefill(*case.args(), max(max_seqlen_q, _min_seqlen_q), case.scale,
                                      out=out)
    assert res is out
    return out


def _ref_fp32(case):
    """The reference's math kept in fp32 (reference.paged_attention_prefill rounds its result to
    the input dtype, which would blur the error measure); run on the GPU for speed."""
    out = torch.empty(case.q.shape, dtype=torch.float32, device=case.q.device)
    cu = case.cu_seqlens_q.tolist()
    for b, lk in enumerate(case.seq_lens_k.tolist()):
        s, e = cu[b], cu[b + 1]
        if e == s:
            continue
        k = ref._gather_kv(case.k_cache, case.block_tables[b], lk)
        v = ref._gather_kv(case.v_cache, case.block_tables[b], lk)
        out[s:e] = ref._attention_one(case.q[s:e], k, v, case.scale)
    return out


def run_torch_lowp(case):
    """PyTorch in the input dtype: SDPA on the dense gathered K/V with an explicit causal mask."""
    out = torch.empty_like(case.q)
    cu = case.cu_seqlens_q.tolist()
    group = case.hq // case.hkv
    for b, lk in enumerate(case.seq_lens_k.tolist()):
        s, e = cu[b], cu[b + 1]
        lq = e - s
        if lq == 0:
            continue
        k = ref._gather_kv(case.k_cache, case.block_tables[b], lk)
        v = ref._gather_kv(case.v_cache, case.block_tables[b], lk)
        qb = case.q[s:e].transpose(0, 1)[None]  # [1, Hq, Lq, D]
        kb = k.transpose(0, 1).repeat_interleave(group, dim=0)[None]  # [1, Hq, Lk, D]
        vb = v.transpose(0, 1).repeat_interleave(group, dim=0)[None]
        qpos = torch.arange(lq, device=qb.device)[:, None] + (lk - lq)
        kpos = torch.arange(lk, device=qb.device)[None, :]
        mask = kpos <= qpos  # [Lq, Lk], True = attend
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=case.scale)
        out[s:e] = o[0].transpose(0, 1)
    return out


def check_against_reference(case, ours):
    assert torch.isfinite(ours).all(), "output has NaN/Inf: an element was not written or a " \
        "masked / out-of-sequence key leaked in"
    want = _ref_fp32(case)
    lowp = run_torch_lowp(case)
    cu = case.cu_seqlens_q.tolist()
    for b, (lq, lk) in enumerate(case.seqs):
        s, e = cu[b], cu[b + 1]
        if lq == 0:
            continue
        ours_err = rel_err(ours[s:e], want[s:e])
        torch_err = rel_err(lowp[s:e], want[s:e])
        assert ours_err <= 2 * torch_err + EPS, (
            f"sequence {b} (Lq={lq}, Lk={lk}): error {ours_err:.3e} > 2 x torch's {torch_err:.3e}")


# max_seqlen_q above which prefill.cu launches the one-tile grid instead of the persistent one
PERSISTENT_MAX_SEQLEN_Q = 8192
_min_seqlen_q = 0  # run_ours passes at least this max_seqlen_q (set by the `grid` fixture)


@pytest.fixture(params=["persistent", "one_tile"])
def grid(request, monkeypatch):
    if request.param == "one_tile":
        monkeypatch.setattr(sys.modules[__name__], "_min_seqlen_q", PERSISTENT_MAX_SEQLEN_Q + 1)
    return request.param


GQA = [(8, 8), (16, 8), (32, 8), (40, 8), (64, 8), (4, 1)]  # group sizes 1, 2, 4, 5, 8, 4


def _mixed_seqs(bs):
    """Lengths around the block size, with and without a cached prefix, plus an empty query."""
    return [
        (1, 1),
        (bs - 1, bs - 1),
        (bs, bs),
        (bs + 1, bs + 1),
        (1, 3 * bs + 7),          # one new token over a cached prefix
        (37, 37 + 2 * bs + 5),    # a short chunk over a prefix, not block aligned
        (0, 50),                  # a sequence with nothing to compute this step
        (200, 777),
        (130, 130),               # just past one 128-row M tile
    ]


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("hq,hkv", GQA)
def test_prefill_mixed_batch(dtype, block_size, hq, hkv, grid):
    case = Case(_mixed_seqs(block_size), hq, hkv, block_size, dtype,
                seed=block_size * 100 + hq).cuda()
    check_against_reference(case, run_ours(case))


@requires_cuda
@pytest.mark.parametrize("block_size", [32, 128])
def test_prefill_other_block_sizes(block_size, grid):
    case = Case(_mixed_seqs(block_size), 32, 8, block_size, torch.bfloat16, seed=block_size).cuda()
    check_against_reference(case, run_ours(case))


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 256])
def test_prefill_long_and_short_together(dtype, block_size, grid):
    seqs = [(4096, 4096), (3, 3), (1000, 3000), (1, 1), (513, 513)]
    case = Case(seqs, 32, 8, block_size, dtype, seed=7).cuda()
    check_against_reference(case, run_ours(case))


@requires_cuda
@pytest.mark.parametrize("block_size", [16, 128])
def test_prefill_many_work_tiles(block_size, grid):
    """More work tiles than SMs several times over, of every length, with empty M blocks between
    them: the persistent grid walks many per CTA, its K/V ring and Q barrier running on
    across tiles of different sequences and lengths."""
    gen = torch.Generator().manual_seed(block_size)
    seqs = []
    for _ in range(40):
        lq = int(torch.randint(1, 700, (1,), generator=gen))
        prefix = int(torch.randint(0, 3, (1,), generator=gen)) * int(
            torch.randint(0, 900, (1,), generator=gen))
        seqs.append((lq, lq + prefix))
    case = Case(seqs, 40, 8, block_size, torch.bfloat16, seed=block_size + 1).cuda()
    first = run_ours(case)
    check_against_reference(case, first)
    torch.testing.assert_close(run_ours(case), first, rtol=0, atol=0)  # and again, the same


@requires_cuda
@pytest.mark.parametrize("block_size", [16, 128, 256])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (16, 1), (32, 1)])  # group sizes 4, 16, 32
def test_prefill_output_rows(hq, hkv, block_size, grid):
    """The epilogue finds each output row's token and head by stepping from the lane's first row
    (one division a lane); on the persistent grid over pages of 128 or 256 a warp whose 16 rows
    lie in the sequence stores them with TMA (groups up to 16). Groups from 4 to 32, lengths
    across every 16-row boundary of a warp, with and without a prefix, many tiles a CTA; 2265
    query tokens, past the 2048 from which the TMA stores run."""
    seqs = ([(n, n + (7 * n) % 50) for n in range(1, 41)]
            + [(300, 300), (129, 600), (16, 16), (1000, 1000)])
    case = Case(seqs, hq, hkv, block_size, torch.bfloat16, seed=hq * 10 + hkv).cuda()
    check_against_reference(case, run_ours(case))


@requires_cuda
def test_prefill_many_one_key_tile_work_tiles(grid):
    """Hundreds of short sequences: every work tile has one or two key tiles, so the producer
    publishes tiles into the two Q buffers faster than the consumers finish them, and each
    buffer's barrier phases turn many times within one CTA."""
    gen = torch.Generator().manual_seed(11)
    seqs = [(n, n) for n in torch.randint(1, 180, (300,), generator=gen).tolist()]
    case = Case(seqs, 32, 8, 16, torch.bfloat16, seed=12).cuda()
    first = run_ours(case)
    check_against_reference(case, first)
    torch.testing.assert_close(run_ours(case), first, rtol=0, atol=0)


def _widened(case, keys):
    """case with its block table widened to `keys` keys a row (the extra entries on the NaN
    block): the same attention, but the persistent grid sizes its sections of (sequence, kv head)
    pairs by the table's width (prefill_sm90_ws.cu, list_tile)."""
    wide = Case.__new__(Case)
    wide.__dict__.update(case.__dict__)
    cols = _cdiv(keys, case.bs) - case.block_tables.shape[1]
    unused = case.block_tables[:, -1:]  # every row ends on an unused (NaN) block
    wide.block_tables = torch.cat([case.block_tables, unused.expand(-1, cols)], 1).contiguous()
    return wide


@requires_cuda
@pytest.mark.parametrize("num_seqs", [3, 5, 40])
def test_prefill_sections_of_pairs(num_seqs):
    """The persistent grid's list in sections of (sequence, kv head) pairs: a table 2048 keys wide
    bounds a pair's K and V at 1 MiB (bf16), so a section holds 16 pairs, and 3 / 5 / 40
    sequences of 8 kv heads make 2 sections, 3 (the last one partial, the middle one's M blocks
    first to last) and 20. Each work tile's arithmetic does not depend on where the list puts
    it: the same bits as one section (the table as narrow as the sequences need)."""
    gen = torch.Generator().manual_seed(num_seqs)
    seqs = []
    for _ in range(num_seqs):
        lq = int(torch.randint(1, 400, (1,), generator=gen))
        seqs.append((lq, lq + int(torch.randint(0, 2, (1,), generator=gen)) * 300))
    case = Case(seqs, 32, 8, 16, torch.bfloat16, seed=num_seqs).cuda()
    narrow = run_ours(case)
    wide = run_ours(_widened(case, 2048))
    check_against_reference(case, wide)
    torch.testing.assert_close(wide, narrow, rtol=0, atol=0)


@requires_cuda
def test_prefill_concurrent_streams():
    """Two calls in flight at once on two streams, each with more work tiles than SMs: the
    persistent grid's work counter is each call's own, so neither takes the other's tiles."""
    gen = torch.Generator().manual_seed(21)
    cases = []
    for seed in (22, 23):
        seqs = [(n, n) for n in torch.randint(100, 900, (48,), generator=gen).tolist()]
        cases.append(Case(seqs, 32, 8, 64, torch.bfloat16, seed=seed).cuda())
    alone = [run_ours(c) for c in cases]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in cases]
    outs = []
    for _ in range(3):
        for st in streams:
            st.wait_stream(torch.cuda.current_stream())
        for c, st in zip(cases, streams):
            with torch.cuda.stream(st):
                outs.append(run_ours(c))
        for st in streams:
            torch.cuda.current_stream().wait_stream(st)
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        torch.testing.assert_close(out, alone[i % 2], rtol=0, atol=0)
    check_against_reference(cases[0], alone[0])


@requires_cuda
def test_prefill_persistent_in_cuda_graph():
    """The persistent grid (on Hopper) captured and replayed after the inputs change, and on a
    second stream."""
    case = Case(_mixed_seqs(64), 32, 8, 64, torch.bfloat16, seed=5).cuda()
    out = torch.full_like(case.q, float("nan"))
    ops.paged_attention_prefill(*case.args(), case.max_seqlen_q, case.scale, out=out)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.paged_attention_prefill(*case.args(), case.max_seqlen_q, case.scale, out=out)
    case.q.copy_(torch.randn_like(case.q))
    out.fill_(float("nan"))
    graph.replay()
    check_against_reference(case, out.clone())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        other = run_ours(case)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(other, out, rtol=0, atol=0)


@requires_cuda
@pytest.mark.parametrize("hq,hkv", [(32, 8), (16, 8)])
def test_prefill_long_prefix_32k(hq, hkv, grid):
    seqs = [(64, 32768), (1, 32768)]  # short chunks over a 32k-key cached context
    case = Case(seqs, hq, hkv, 256, torch.bfloat16, seed=11).cuda()
    check_against_reference(case, run_ours(case))


@requires_cuda
def test_prefill_oversized_max_seqlen_q(grid):
    """max_seqlen_q only sizes the grid: a larger value than the longest sequence is fine."""
    case = Case([(5, 20), (70, 70)], 32, 8, 16, torch.bfloat16, seed=3).cuda()
    check_against_reference(case, run_ours(case, max_seqlen_q=case.max_seqlen_q + 300))


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 64])
def test_prefill_in_chunks_matches_one_shot(dtype, block_size, grid):
    """Chunked prefill: each call sees the keys written so far (keys beyond are still NaN)."""
    total = 1200
    chunks = [300, 1, block_size, 444, total - 745 - block_size]
    hq, hkv = 32, 8
    full = Case([(total, total)], hq, hkv, block_size, dtype, seed=5)
    one_shot = run_ours(full.cuda())
    check_against_reference(full, one_shot)

    # The same sequence, its cache filled chunk by chunk.
    chunked = Case([(total, total)], hq, hkv, block_size, dtype, seed=5)
    chunked.k_cache.fill_(float("nan"))
    chunked.v_cache.fill_(float("nan"))
    chunked.cuda()
    start = 0
    outs = []
    for n in chunks:
        chunked.write_kv(0, start, start + n)
        step = chunked.chunk(start, n)
        out = run_ours(step)
        check_against_reference(step, out)
        outs.append(out)
        start += n
    assert start == total
    # Per row the kernel does the same work either way (a tile the row sees nothing of adds
    # exact zeros and rescales by exactly 1): the same bits.
    assert torch.equal(torch.cat(outs), one_shot)


def _queries(case, picks):
    """A call of (sequence b, first query i, count n) picks of `case` as sequences of their own:
    query i of sequence b sits at its position there, with the keys up to the last pick's."""
    step = Case.__new__(Case)
    step.__dict__.update(case.__dict__)
    starts = case.cu_seqlens_q.tolist()
    rows, seqs, tables = [], [], []
    for b, i, n in picks:
        lq, lk = case.seqs[b]
        rows.append(torch.arange(starts[b] + i, starts[b] + i + n))
        seqs.append((n, lk - lq + i + n))
        tables.append(case.block_tables[b])
    dev = case.q.device
    step.q = case.q[torch.cat(rows).to(dev)].contiguous()
    step.seqs = seqs
    step.block_tables = torch.stack(tables).contiguous()
    step.cu_seqlens_q = torch.tensor([0] + torch.tensor([n for n, _ in seqs]).cumsum(0).tolist(),
                                     dtype=torch.int32, device=dev)
    step.seq_lens_k = torch.tensor([k for _, k in seqs], dtype=torch.int32, device=dev)
    step.max_seqlen_q = max(n for n, _ in seqs)
    return step


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_query_bits_depend_on_its_sequence_only(dtype, grid):
    """A query's output bits are the same alone, in a batch, in any chunk, and as a one-query
    (decode-shaped) sequence at its position: each row's sums run over the same 128-key tiles in
    the same order whatever shares its M block (what a batch-invariant mode can build on)."""
    seqs = [(1000, 1000), (300, 300), (777, 2500)]
    case = Case(seqs, 32, 8, 64, dtype, seed=9, poison=False).cuda()
    batch = run_ours(case)
    check_against_reference(case, batch)
    rows = torch.split(batch, [lq for lq, _ in seqs])
    for b, (lq, _) in enumerate(seqs):
        assert torch.equal(run_ours(_queries(case, [(b, 0, lq)])), rows[b]), f"seq {b} alone"
        # chunks of 97 queries, two sequences' chunks in each call
        for i in range(0, lq, 97):
            n = min(97, lq - i)
            other = (b + 1) % len(seqs)
            got = run_ours(_queries(case, [(other, 0, 50), (b, i, n)]))
            assert torch.equal(got[50:], rows[b][i:i + n]), f"seq {b} chunk at {i}"
        # the last 9 queries as one-query sequences, in one call
        last = list(range(lq - 9, lq))
        got = run_ours(_queries(case, [(b, i, 1) for i in last]))
        assert torch.equal(got, rows[b][last]), f"seq {b} decode-shaped"


@requires_cuda
def test_prefill_head_dim_64_uses_reference():
    """head_dim != 128 is not a kernel case: the wrapper runs the reference instead."""
    gen = torch.Generator().manual_seed(0)
    d = 64
    k_cache = torch.randn(4, 16, 2, d, generator=gen).to(torch.bfloat16).cuda()
    v_cache = torch.randn(4, 16, 2, d, generator=gen).to(torch.bfloat16).cuda()
    q = torch.randn(20, 4, d, generator=gen).to(torch.bfloat16).cuda()
    cu = torch.tensor([0, 20], dtype=torch.int32, device="cuda")
    lens = torch.tensor([40], dtype=torch.int32, device="cuda")
    tables = torch.tensor([[3, 1, 0]], dtype=torch.int32, device="cuda")
    out = ops.paged_attention_prefill(q, k_cache, v_cache, cu, lens, tables, 20, 0.125)
    want = ref.paged_attention_prefill(q, k_cache, v_cache, cu, lens, tables, 0.125)
    torch.testing.assert_close(out, want)
    # The raw op (an unchecked launch) gets the launcher's refusal, not garbage.
    with pytest.raises(RuntimeError, match="paged_attention_prefill: CUDA launch failed"):
        torch.ops.qwen3_kernels.paged_attention_prefill(
            torch.empty_like(q), q, k_cache, v_cache, cu, lens, tables, 20, 0.125)


@requires_cuda
@pytest.mark.parametrize("name", ["q", "k_cache", "v_cache", "out"])
def test_prefill_refuses_misaligned_tensors(name):
    """A contiguous view at an odd offset would reach 16-byte cp.async / TMA accesses (a fault:
    a sticky error for the whole process): refused by the op and by the launcher, nothing
    written, and the next call still runs."""
    case = Case([(17, 40), (64, 64)], 16, 8, 16, torch.bfloat16, seed=1, poison=False).cuda()
    out = torch.full_like(case.q, float("nan"))
    if name == "out":
        out = misaligned(out)
    else:
        setattr(case, name, misaligned(getattr(case, name)))
    with pytest.raises(ValueError, match=f"{name} is a view at an odd offset"):
        ops.paged_attention_prefill(*case.args(), case.max_seqlen_q, case.scale, out=out)
    # the raw op (unchecked, and what a torch.compile'd caller reaches) gets the launcher's refusal
    with pytest.raises(RuntimeError, match="paged_attention_prefill: CUDA launch failed"):
        torch.ops.qwen3_kernels.paged_attention_prefill(out, *case.args(), case.max_seqlen_q,
                                                        case.scale)
    assert out.isnan().all()  # nothing written
    good = Case([(17, 40), (64, 64)], 16, 8, 16, torch.bfloat16, seed=2).cuda()
    check_against_reference(good, run_ours(good))


@requires_cuda
def test_prefill_opcheck():
    case = Case([(17, 40), (64, 64)], 16, 8, 16, torch.bfloat16, seed=1, poison=False).cuda()
    out = torch.empty_like(case.q)
    torch.library.opcheck(
        torch.ops.qwen3_kernels.paged_attention_prefill.default,
        (out, *case.args(), case.max_seqlen_q, case.scale))
