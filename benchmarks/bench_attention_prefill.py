"""Prefill attention: ours (paged, varlen) vs torch SDPA (cuDNN, flash) and flex_attention on the
same problem laid out dense, bf16, head_dim 128, causal, no cached prefix.

FLOPs are counted exactly: 4 * D * Hq * (sum over queries of the keys each one sees), i.e. the
causal half including the diagonal. Baselines get q [B, Hq, L, D] and k/v [B, Hkv, L, D]
(enable_gqa, or K/V repeated to Hq heads where a backend refuses GQA, outside the timed region);
ours reads K/V through a shuffled block table. A baseline that fails records "unavailable".
"ours" is the kernel the op picks for the device and shape; the row's ratio is against
sdpa_cudnn (sdpa_masked for a prefix chunk). The variants that lost are kept on branch
experiment/prefill-sm90-variants.

    cd benchmarks && pytest -q -s bench_attention_prefill.py  # -> results/<this file>.json
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from common import rematch, sets_for, time_gpu

import qwen3_kernels.ops as ops

D = 128
DTYPE = torch.bfloat16

# (batch, tokens per sequence, q heads, kv heads, block size)
CASES = [
    (1, 4096, 32, 8, 256),
    (1, 4096, 16, 8, 256),
    (8, 2048, 32, 8, 256),
    (16, 1024, 32, 8, 256),
    (64, 256, 32, 8, 256),
    (1, 16384, 32, 8, 256),
    (1, 4096, 32, 8, 16),
]


def causal_flops(batch, seqlen, hq):
    keys_seen = seqlen * (seqlen + 1) // 2  # query i sees i + 1 keys
    return 4 * D * hq * keys_seen * batch


def make_inputs(batch, seqlen, hq, hkv, block_size, gen):
    """One input set: dense q/k/v for the baselines and the same K/V in a shuffled paged cache."""
    dev = "cuda"
    q = torch.randn(batch, hq, seqlen, D, device=dev, dtype=DTYPE, generator=gen)
    k = torch.randn(batch, hkv, seqlen, D, device=dev, dtype=DTYPE, generator=gen)
    v = torch.randn(batch, hkv, seqlen, D, device=dev, dtype=DTYPE, generator=gen)
    nblk = -(-seqlen // block_size)
    perm = torch.randperm(batch * nblk, device=dev, generator=gen).to(torch.int32)
    block_tables = perm.view(batch, nblk).contiguous()
    k_cache = torch.empty(batch * nblk, block_size, hkv, D, device=dev, dtype=DTYPE)
    v_cache = torch.empty_like(k_cache)
    # slot of key j of sequence b: block_tables[b, j // bs] * bs + j % bs
    j = torch.arange(seqlen, device=dev)
    slots = (block_tables.long()[:, j // block_size] * block_size + j % block_size).view(-1)
    k_cache.view(-1, hkv, D)[slots] = k.transpose(1, 2).reshape(-1, hkv, D)
    v_cache.view(-1, hkv, D)[slots] = v.transpose(1, 2).reshape(-1, hkv, D)
    q_packed = q.transpose(1, 2).reshape(batch * seqlen, hq, D).contiguous()  # [Tq, Hq, D]
    cu = torch.arange(0, (batch + 1) * seqlen, seqlen, device=dev, dtype=torch.int32)
    lens = torch.full((batch,), seqlen, device=dev, dtype=torch.int32)
    return dict(q=q, k=k, v=v, q_packed=q_packed, k_cache=k_cache, v_cache=v_cache, cu=cu,
                lens=lens, block_tables=block_tables, out=torch.empty_like(q_packed))


def _sdpa_fn(backend, s, scale):
    from torch.nn.attention import sdpa_kernel

    group = s["q"].shape[1] // s["k"].shape[1]

    def gqa():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(s["q"], s["k"], s["v"], is_causal=True,
                                                  scale=scale, enable_gqa=True)

    try:
        gqa()
        return gqa
    except Exception:  # noqa: BLE001 - this backend refuses GQA: give it repeated K/V
        k = s["k"].repeat_interleave(group, dim=1)
        v = s["v"].repeat_interleave(group, dim=1)

        def mha():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(s["q"], k, v, is_causal=True, scale=scale)

        mha()
        return mha


_FLEX = None


def _flex_fn(s, scale):
    global _FLEX
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _FLEX is None:
        _FLEX = torch.compile(flex_attention)
    b, _, seqlen, _ = s["q"].shape
    mask = create_block_mask(lambda b_, h_, qi, ki: ki <= qi, b, None, seqlen, seqlen,
                             device="cuda")

    def run():
        return _FLEX(s["q"], s["k"], s["v"], block_mask=mask, scale=scale, enable_gqa=True)

    run()
    return run


def _check(out_packed, want):
    """A fast wrong kernel must not produce a row: compare with SDPA's output (bf16 level)."""
    b, h, lq, _ = want.shape
    got = out_packed.view(b, lq, h, D).transpose(1, 2)
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < 2e-2, f"prefill output differs from SDPA (rel err {err:.3e})"


def time_ours(ours, sets, want):
    """Seconds of our op on the rotated sets, after checking set 0's output against `want`."""
    sets[0]["out"].fill_(float("nan"))
    ours(sets[0])()
    _check(sets[0]["out"], want)
    return time_gpu([ours(s) for s in sets], reps=20)


@pytest.mark.parametrize("batch,seqlen,hq,hkv,block_size", CASES)
def test_prefill(report, batch, seqlen, hq, hkv, block_size):
    from torch.nn.attention import SDPBackend

    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = 1.0 / math.sqrt(D)
    set_bytes = 2 * batch * seqlen * D * (2 * hq + 2 * hkv)  # q, out, k, v
    sets = [make_inputs(batch, seqlen, hq, hkv, block_size, gen)
            for _ in range(min(4, sets_for(set_bytes)))]

    def ours(s):
        return lambda: ops.paged_attention_prefill(
            s["q_packed"], s["k_cache"], s["v_cache"], s["cu"], s["lens"], s["block_tables"],
            seqlen, scale, out=s["out"])

    want = F.scaled_dot_product_attention(sets[0]["q"], sets[0]["k"], sets[0]["v"],
                                          is_causal=True, scale=scale, enable_gqa=True)
    t_ours, notes, baselines = time_ours(ours, sets, want), [], {}
    for name, make in (
        ("sdpa_cudnn", lambda s: _sdpa_fn(SDPBackend.CUDNN_ATTENTION, s, scale)),
        ("sdpa_flash", lambda s: _sdpa_fn(SDPBackend.FLASH_ATTENTION, s, scale)),
        ("flex_attention", lambda s: _flex_fn(s, scale)),
    ):
        try:
            baselines[name] = time_gpu([make(s) for s in sets], reps=20)
        except Exception as e:  # noqa: BLE001 - record and keep the row
            notes.append(f"{name} unavailable ({type(e).__name__})")
    # ours was timed first, cuDNN after it: time the two again, alternating (rematch).
    if "sdpa_cudnn" in baselines:
        cudnn = [_sdpa_fn(SDPBackend.CUDNN_ATTENTION, s, scale) for s in sets]
        best = rematch({"ours": [ours(s) for s in sets], "sdpa_cudnn": cudnn},
                       {"ours": t_ours, "sdpa_cudnn": baselines["sdpa_cudnn"]}, reps=20)
        t_ours, baselines["sdpa_cudnn"] = best["ours"], best["sdpa_cudnn"]
        notes.append("ours, sdpa_cudnn: best of 4 timings, the last 3 alternating")
    flops = causal_flops(batch, seqlen, hq)
    notes = [f"{k} {flops / t / 1e12:.0f} TFLOP/s" for k, t in baselines.items()] + notes
    report("paged_attention_prefill",
           f"causal B={batch} L={seqlen} Hq/Hkv={hq}/{hkv} bs={block_size}",
           t_ours, baselines, flops=flops, baseline="sdpa_cudnn", note="; ".join(notes),
           headline=(batch, seqlen, hq, block_size) in ((1, 4096, 32, 256), (8, 2048, 32, 256)))


def mix_lens(n=24, lo=100, hi=1024, seed=1):
    """The engine's prefill steps hold sequences of mixed length, like the workload's prompts."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


def test_prefill_varlen_mix(report):
    """Sequences of mixed length in one call (an engine prefill step). SDPA has no varlen causal
    form for cuDNN (nested tensors refuse is_causal there), so the baseline is cuDNN's better way
    of the two a dense user has: the batch right-padded to the longest sequence (one launch,
    is_causal: a valid row sees only valid keys; the padding is computed and dropped) or one
    launch per sequence (captured in one CUDA graph with the rest)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hq, hkv, block_size = 32, 8, 256
    lens = mix_lens()
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = 1.0 / math.sqrt(D)
    seqs = [make_inputs(1, n, hq, hkv, block_size, gen) for n in lens]
    # one paged cache for all: sequence b's blocks after the others' (their order is shuffled
    # within each sequence by make_inputs)
    offsets = [0]
    for x in seqs:
        offsets.append(offsets[-1] + x["k_cache"].shape[0])
    k_cache = torch.cat([x["k_cache"] for x in seqs])
    v_cache = torch.cat([x["v_cache"] for x in seqs])
    max_blocks = max(x["block_tables"].shape[1] for x in seqs)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32, device="cuda")
    for b, x in enumerate(seqs):
        tables[b, : x["block_tables"].shape[1]] = x["block_tables"][0] + offsets[b]
    q_packed = torch.cat([x["q_packed"] for x in seqs])
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                      device="cuda")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q_packed)
    lmax = max(lens)
    pad = {}
    for name, width in (("q", hq), ("k", hkv), ("v", hkv)):
        pad[name] = torch.zeros(len(lens), width, lmax, D, device="cuda", dtype=DTYPE)
        for b, x in enumerate(seqs):
            pad[name][b, :, : lens[b]] = x[name][0]

    def ours():
        ops.paged_attention_prefill(q_packed, k_cache, v_cache, cu, seq_lens, tables, lmax, scale,
                                    out=out)

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                  enable_gqa=True)

    def padded():
        return cudnn(pad["q"], pad["k"], pad["v"])

    def per_sequence():
        return [cudnn(x["q"], x["k"], x["v"]) for x in seqs]

    want = per_sequence()
    got_padded = padded()
    out.fill_(float("nan"))
    ours()
    for b, x in enumerate(seqs):
        _check(out[cu[b]:cu[b + 1]].unsqueeze(0), want[b])
        pad_rows = got_padded[b:b + 1, :, : lens[b]].float()  # the padded run's valid rows
        assert (pad_rows - want[b].float()).norm() < 2e-2 * want[b].float().norm()
    best = rematch({"ours": [ours], "sdpa_cudnn_padded": [padded],
                    "sdpa_cudnn_per_seq": [per_sequence]}, {}, reps=20)
    flops = sum(causal_flops(1, n, hq) for n in lens)
    base = min(("sdpa_cudnn_padded", "sdpa_cudnn_per_seq"), key=best.get)
    notes = [f"{k} {flops / best[k] / 1e12:.0f} TFLOP/s"
             for k in ("sdpa_cudnn_padded", "sdpa_cudnn_per_seq")]
    report("paged_attention_prefill",
           f"causal mix B={len(lens)} L={min(lens)}..{lmax} Hq/Hkv={hq}/{hkv} bs={block_size}",
           best["ours"], {k: best[k] for k in ("sdpa_cudnn_padded", "sdpa_cudnn_per_seq")},
           flops=flops, baseline=base,
           note="; ".join(notes + [f"ratio against the faster baseline ({base}); best of 3, "
                                   "alternating"]))


@pytest.mark.parametrize("lq,lk", [(2048, 8192), (512, 16384)])
def test_prefill_prefix_chunk(report, lq, lk):
    """Chunked prefill / prefix-cache hit: Lq new tokens over Lk keys (query i at Lk - Lq + i).
    Baselines need the end-aligned mask: SDPA with an explicit boolean mask (default backend
    choice) and flex_attention with the offset in its mask_mod; no is_causal backend fits."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _FLEX
    hq, hkv, block_size = 32, 8, 256
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = 1.0 / math.sqrt(D)
    s = make_inputs(1, lk, hq, hkv, block_size, gen)
    # Keep the last lq query tokens: dense q [1, Hq, Lq, D], packed [Lq, Hq, D].
    s["q"] = s["q"][:, :, lk - lq:].contiguous()
    s["q_packed"] = s["q_packed"][lk - lq:].contiguous()
    s["out"] = torch.empty_like(s["q_packed"])
    s["cu"] = torch.tensor([0, lq], device="cuda", dtype=torch.int32)
    sets = [s]
    offset = lk - lq
    mask = (torch.arange(lk, device="cuda")[None, :]
            <= torch.arange(lq, device="cuda")[:, None] + offset)  # [Lq, Lk]

    def ours(s_):
        return lambda: ops.paged_attention_prefill(
            s_["q_packed"], s_["k_cache"], s_["v_cache"], s_["cu"], s_["lens"],
            s_["block_tables"], lq, scale, out=s_["out"])

    def sdpa_masked():
        return F.scaled_dot_product_attention(s["q"], s["k"], s["v"], attn_mask=mask, scale=scale,
                                              enable_gqa=True)

    want = sdpa_masked()
    t_ours, notes, baselines = time_ours(ours, sets, want), [], {}
    try:
        baselines["sdpa_masked"] = time_gpu(sdpa_masked, reps=20)
    except Exception as e:  # noqa: BLE001
        notes.append(f"sdpa_masked unavailable ({type(e).__name__})")
    try:
        if _FLEX is None:
            _FLEX = torch.compile(flex_attention)
        bm = create_block_mask(lambda b_, h_, qi, ki: ki <= qi + offset, 1, None, lq, lk,
                               device="cuda")
        flex = lambda: _FLEX(s["q"], s["k"], s["v"], block_mask=bm, scale=scale,  # noqa: E731
                             enable_gqa=True)
        flex()
        baselines["flex_attention"] = time_gpu(flex, reps=20)
    except Exception as e:  # noqa: BLE001
        notes.append(f"flex_attention unavailable ({type(e).__name__})")
    flops = 4 * D * hq * sum(offset + i + 1 for i in range(lq))
    notes = [f"{k} {flops / t / 1e12:.0f} TFLOP/s" for k, t in baselines.items()] + notes
    report("paged_attention_prefill", f"prefix chunk Lq={lq} Lk={lk} Hq/Hkv={hq}/{hkv}",
           t_ours, baselines, flops=flops, baseline="sdpa_masked", note="; ".join(notes))


@pytest.mark.parametrize("batch,seqlen,block_size", [(8, 2048, 16), (1, 4096, 256)])
def test_prefill_fp8_kv(report, batch, seqlen, block_size):
    """FP8 KV cache: the same K/V rounded to e4m3 (scale 1), read by our prefill (on Hopper the
    wgmma kernel, whose producer widens the e4m3 tiles to fp16); against cuDNN and our bf16-cache
    kernel on the same problem. What reading an fp8 cache costs a prefill."""
    from torch.nn.attention import SDPBackend

    hq, hkv = 32, 8
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = 1.0 / math.sqrt(D)
    s = make_inputs(batch, seqlen, hq, hkv, block_size, gen)
    s["k8"] = s["k_cache"].to(torch.float8_e4m3fn)
    s["v8"] = s["v_cache"].to(torch.float8_e4m3fn)

    def ours(kc, vc):
        return lambda: ops.paged_attention_prefill(
            s["q_packed"], s[kc], s[vc], s["cu"], s["lens"], s["block_tables"], seqlen, scale,
            out=s["out"])

    want = F.scaled_dot_product_attention(s["q"], s["k"], s["v"], is_causal=True, scale=scale,
                                          enable_gqa=True)
    s["out"].fill_(float("nan"))
    ours("k8", "v8")()
    b, h, lq, _ = want.shape
    got = s["out"].view(b, lq, h, D).transpose(1, 2)
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < 6e-2, f"fp8 kv prefill differs from SDPA on the bf16 K/V (rel err {err:.3e})"
    cudnn = _sdpa_fn(SDPBackend.CUDNN_ATTENTION, s, scale)
    best = rematch({"ours": [ours("k8", "v8")], "sdpa_cudnn": [cudnn],
                    "ours_bf16": [ours("k_cache", "v_cache")]}, {}, reps=20)
    flops = causal_flops(batch, seqlen, hq)
    report("paged_attention_prefill",
           f"causal B={batch} L={seqlen} Hq/Hkv={hq}/{hkv} bs={block_size} fp8 kv", best["ours"],
           {"sdpa_cudnn": best["sdpa_cudnn"], "ours_bf16": best["ours_bf16"]}, flops=flops,
           baseline="sdpa_cudnn", note=f"rel err vs SDPA on the bf16 K/V {err:.3f}; best of 3, "
           "alternating")
