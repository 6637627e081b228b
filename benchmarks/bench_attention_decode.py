"""paged_attention_decode vs torch SDPA decode (q length 1) on the same K/V laid out dense.

    cd benchmarks && pytest -q -s bench_attention_decode.py   # -> results/<this file>.json

bf16, head_dim 128, GQA 32/8 and 16/8, block sizes 16 and 256. Every sequence of a case has the
same context length so the dense baselines do exactly the same work.
Baselines, each on dense [B, Hkv, L, D] K/V holding the same values as our paged cache:
  cudnn  torch SDPA, cuDNN backend, enable_gqa=True  (the goal's yardstick)
  flash  torch SDPA, flash backend, K/V repeated to Hq heads (flash has no GQA in torch)
  flex   torch.compile(flex_attention), enable_gqa=True, where it compiles for q length 1
A baseline that fails is recorded as unavailable in the row's note; the row still prints. The
baselines are timed once per shape (they do not depend on our block size) and reused for both rows.

Bytes that must move: K and V of every context read once, plus q and out. K/V sets rotate so the
sets together exceed the 60 MB L2.
Goals (TARGETS.md): >= 0.95x cuDNN at batch >= 16, context >= 2k; >= 1.0x cuDNN at batch 1, ctx 32k.

FP8 KV cache rows ("fp8 kv"): the same K/V rounded to e4m3 (scale 1), read by our kernel; the bytes
are the e4m3 bytes it moves, the ratio is against cuDNN on the bf16 K/V (what the cache format buys),
and our bf16-cache kernel on the same problem is the "ours_bf16" baseline.

The row's ratio is against cudnn. The kernel variants and launch flags that lost to the default
are kept on branch experiment/kernel-launch-variants.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import qwen3_kernels
from qwen3_kernels.ops import decode_workspace
from common import rematch, sets_for, time_gpu

DT = torch.bfloat16
D = 128
CASES = [(32, 4096), (16, 2048), (128, 1024), (1, 32768)]  # (batch, context)
HEADS = [(32, 8), (16, 8)]
BLOCK_SIZES = [16, 256]


def _make_set(b, ctx, hq, hkv, bs, gen):
    """Dense K/V [B, Hkv, L, D] and the same values in a paged cache behind shuffled tables."""
    k = torch.randn(b, hkv, ctx, D, dtype=DT, device="cuda", generator=gen)
    v = torch.randn(b, hkv, ctx, D, dtype=DT, device="cuda", generator=gen)
    nb = ctx // bs
    perm = torch.randperm(b * nb, device="cuda", generator=gen)

    def paged(x):  # [B, Hkv, L, D] -> [B * nb, bs, Hkv, D] blocks, stored at shuffled indices
        blocks = x.transpose(1, 2).reshape(b * nb, bs, hkv, D)
        # a contiguous cache whatever layout reshape returned (at B=1 it is a strided view)
        cache = torch.empty(blocks.shape, dtype=blocks.dtype, device=blocks.device)
        cache[perm] = blocks
        return cache

    q = torch.randn(b, hq, D, dtype=DT, device="cuda", generator=gen)
    return dict(q=q, k=k, v=v, k_cache=paged(k), v_cache=paged(v),
                block_tables=perm.view(b, nb).to(torch.int32),
                seq_lens=torch.full((b,), ctx, dtype=torch.int32, device="cuda"),
                out=torch.empty_like(q), ws=decode_workspace(b, hq, D, "cuda"))


def _try_time(fns, calls):
    try:
        return time_gpu(fns, calls_per_replay=calls), None
    except Exception as e:  # noqa: BLE001 - one failing baseline must not kill the row
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"


def _make_sets(b, ctx, hq, hkv, bs):
    kv_bytes = 2 * b * hkv * ctx * D * 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [_make_set(b, ctx, hq, hkv, bs, gen) for _ in range(sets_for(kv_bytes))]


def _guard(s0, scale, what="ours"):
    """The kernel (as now tuned) agrees with fp32 SDPA on set 0."""
    got = qwen3_kernels.paged_attention_decode(s0["q"], s0["k_cache"], s0["v_cache"],
                                               s0["block_tables"], s0["seq_lens"], scale)
    if "want" not in s0:
        s0["want"] = F.scaled_dot_product_attention(
            s0["q"].float()[:, :, None], s0["k"].float(), s0["v"].float(), scale=scale,
            enable_gqa=True)[:, :, 0]
    want = s0["want"]
    err = (got.float() - want).norm().item() / want.norm().item()
    assert err < 2e-2, f"{what}: relative error {err:.3g} against fp32 SDPA"


def _ours_fns(sets, scale):
    return [lambda s=s: qwen3_kernels.paged_attention_decode(
        s["q"], s["k_cache"], s["v_cache"], s["block_tables"], s["seq_lens"], scale,
        out=s["out"], workspace=s["ws"]) for s in sets]


def _time_ours(sets, scale, calls):
    return time_gpu(_ours_fns(sets, scale), calls_per_replay=calls)


def _cudnn_fns(sets, scale):
    def cudnn(s):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(s["q"][:, :, None], s["k"], s["v"], scale=scale,
                                                  enable_gqa=True)

    return [lambda s=s: cudnn(s) for s in sets]


@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("b,ctx", CASES)
def test_paged_attention_decode(b, ctx, hq, hkv, bs, report):
    scale = 1 / math.sqrt(D)
    kv_bytes = 2 * b * hkv * ctx * D * 2
    nbytes = kv_bytes + 2 * b * hq * D * 2
    sets = _make_sets(b, ctx, hq, hkv, bs)
    calls = max(len(sets), 8)
    _guard(sets[0], scale)
    ours = _time_ours(sets, scale, calls)

    # The dense baselines do not depend on the block size: time them once per shape.
    key = (b, ctx, hq, hkv)
    if key not in _BASELINES:
        _BASELINES[key] = _time_baselines(sets, hq, hkv, scale, calls)
    baselines, notes = dict(_BASELINES[key][0]), list(_BASELINES[key][1])
    if "cudnn" in baselines:  # ours was timed before cuDNN: the two again, alternating (rematch)
        best = rematch({"ours": _ours_fns(sets, scale), "cudnn": _cudnn_fns(sets, scale)},
                       {"ours": ours, "cudnn": baselines["cudnn"]}, calls_per_replay=calls)
        ours, baselines["cudnn"] = best["ours"], best["cudnn"]
        notes.append("ours, cudnn: best of 4, the last 3 alternating")
    report("paged_attention_decode", f"B={b} ctx={ctx} Hq/Hkv={hq}/{hkv} bs={bs}", ours,
           baselines, nbytes=nbytes, baseline="cudnn", note="; ".join(notes),
           headline=(hq, hkv, bs) == (32, 8, 16) and (b, ctx) in ((32, 4096), (1, 32768)))


_BASELINES: dict = {}


# Batch 1 at a chat turn's short contexts (the batch-1 engine benchmark decodes at 128..640
# tokens): the kernel is latency here, not bandwidth. The block tables are 4096 tokens wide, as the
# engine's (max_model_len 4096), so the split count the kernel picks is the one its graphs capture.
# Back-to-back calls of one op, so PDL overlaps their launches: a kernel's cost in steady state.
SHORT_CASES = [(1, 128), (1, 384), (1, 640), (1, 1024), (1, 2048)]
SHORT_HEADS = [(32, 8), (16, 4)]  # Qwen3-8B, and one TP-2 rank of it
TABLE_WIDTH = 4096 // 16


@pytest.mark.parametrize("hq,hkv", SHORT_HEADS)
@pytest.mark.parametrize("b,ctx", SHORT_CASES)
def test_decode_batch1_short_contexts(b, ctx, hq, hkv, report):
    scale = 1 / math.sqrt(D)
    nbytes = 2 * b * hkv * ctx * D * 2 + 2 * b * hq * D * 2
    sets = _make_sets(b, ctx, hq, hkv, 16)
    for s in sets:  # pad the tables to the engine's width (entries past seq_len are never read)
        t = s["block_tables"]
        s["block_tables"] = torch.cat([t, t[:, :1].expand(b, TABLE_WIDTH - t.shape[1])], 1)
    calls = max(len(sets), 8)
    _guard(sets[0], scale)
    ours = _time_ours(sets, scale, calls)
    baselines, notes = _time_baselines(sets, hq, hkv, scale, calls, only_cudnn=True)
    if "cudnn" in baselines:
        best = rematch({"ours": _ours_fns(sets, scale), "cudnn": _cudnn_fns(sets, scale)},
                       {"ours": ours, "cudnn": baselines["cudnn"]}, calls_per_replay=calls)
        ours, baselines["cudnn"] = best["ours"], best["cudnn"]
    report("paged_attention_decode", f"B={b} ctx={ctx} Hq/Hkv={hq}/{hkv} bs=16 short", ours,
           baselines, nbytes=nbytes, baseline="cudnn", note="; ".join(notes))


FP8_CASES = [(32, 4096), (128, 1024), (16, 2048), (1, 32768)]


@pytest.mark.parametrize("b,ctx", FP8_CASES)
def test_paged_attention_decode_fp8_kv(b, ctx, report):
    hq, hkv, bs = 32, 8, 16
    scale = 1 / math.sqrt(D)
    nbytes = 2 * b * hkv * ctx * D + 2 * b * hq * D * 2
    sets = _make_sets(b, ctx, hq, hkv, bs)
    for s in sets:
        s["k8"] = s["k_cache"].to(torch.float8_e4m3fn)
        s["v8"] = s["v_cache"].to(torch.float8_e4m3fn)
    calls = max(len(sets), 8)
    s0 = sets[0]
    got = qwen3_kernels.paged_attention_decode(s0["q"], s0["k8"], s0["v8"], s0["block_tables"],
                                               s0["seq_lens"], scale)
    want = F.scaled_dot_product_attention(
        s0["q"].float()[:, :, None], s0["k"].float(), s0["v"].float(), scale=scale,
        enable_gqa=True)[:, :, 0]
    err = (got.float() - want).norm().item() / want.norm().item()
    assert err < 6e-2, f"fp8 kv: relative error {err:.3g} against fp32 SDPA on the bf16 K/V"
    fp8 = [lambda s=s: qwen3_kernels.paged_attention_decode(
        s["q"], s["k8"], s["v8"], s["block_tables"], s["seq_lens"], scale, out=s["out"],
        workspace=s["ws"]) for s in sets]
    best = rematch({"ours": fp8, "cudnn": _cudnn_fns(sets, scale),
                    "ours_bf16": _ours_fns(sets, scale)},
                   {"ours": time_gpu(fp8, calls_per_replay=calls),
                    "cudnn": time_gpu(_cudnn_fns(sets, scale), calls_per_replay=calls),
                    "ours_bf16": _time_ours(sets, scale, calls)}, calls_per_replay=calls)
    report("paged_attention_decode", f"B={b} ctx={ctx} Hq/Hkv={hq}/{hkv} bs={bs} fp8 kv",
           best["ours"], {"cudnn": best["cudnn"], "ours_bf16": best["ours_bf16"]}, nbytes=nbytes,
           baseline="cudnn", note=f"rel err vs fp32 on the bf16 K/V {err:.3f}; best of 4, the "
           "last 3 alternating")


def _time_baselines(sets, hq, hkv, scale, calls, only_cudnn=False):
    baselines, notes = {}, []

    t, err = _try_time(_cudnn_fns(sets, scale), calls)
    if t is None:
        notes.append(f"cudnn unavailable ({err})")
    else:
        baselines["cudnn"] = t
    if only_cudnn:
        return baselines, notes

    rep = hq // hkv
    flash_kv = [(s["k"].repeat_interleave(rep, dim=1), s["v"].repeat_interleave(rep, dim=1))
                for s in sets]

    def flash(s, kv):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(s["q"][:, :, None], kv[0], kv[1], scale=scale)

    t, err = _try_time([lambda s=s, kv=kv: flash(s, kv) for s, kv in zip(sets, flash_kv)], calls)
    if t is None:
        notes.append(f"flash unavailable ({err})")
    else:
        baselines["flash"] = t
    del flash_kv

    try:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        t, err = _try_time([lambda s=s: flex(s["q"][:, :, None], s["k"], s["v"], scale=scale,
                                             enable_gqa=True) for s in sets], calls)
    except Exception as e:  # noqa: BLE001
        t, err = None, f"{type(e).__name__}"
    if t is None:
        notes.append(f"flex unavailable ({err})")
    else:
        baselines["flex"] = t
    return baselines, notes
