"""The FP8 (e4m3) KV cache in the engine on CPU (the attention ops' reference path): the cache
tensors are float8_e4m3fn holding K / V divided by the layer's scale, the same memory holds twice
the blocks of bf16, greedy tokens agree with a cache in the model's dtype for most tokens, prefix
caching and chunked prefill change no token, the checkpoint's per-layer k_scale / v_scale reach
the attention layers (bad ones are refused naming the tensor), tensor parallel 2 gives the tokens
of 1, and kv_cache_dtype / --kv-cache-dtype take "auto" or "fp8" only."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen3_model import LLM, SamplingParams
from qwen3_model.loader import (CheckpointError, config_fields, load_hf_config, load_model,
                                read_config)
from qwen3_model.memory import describe, model_need
from qwen3_model.models.qwen3 import Qwen3ForCausalLM
from qwen3_kernels.reference import quantize_kv
from tests.helpers import one_thread  # noqa: F401  (autouse: one intra-op thread)
from tests.qwen3_tiny import make_tiny_qwen3
from tests.test_fp8_model import greedy_agreement

FP8 = torch.float8_e4m3fn
SPEC = "untied_gqa4_sharded"  # 3 layers, 8 q / 2 kv heads of 16 (split over 2 ranks); one file
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# (k_scale, v_scale) of each layer: a 0-dim tensor, a 1-element one; non-powers of 2 on purpose
SCALES = [(0.5, 1.5), (2.0, 0.75), (1.25, 3.0)]
# Share of greedy tokens (before each sequence's first difference) that an fp8 cache keeps equal
# to a float32 one over 16 prompts x 16 tokens, measured here (CPU): 243 / 256 = 0.95 with scales
# 1.0 (15 of 16 sequences identical), 256 / 256 with SCALES (the e4m3 rounding of K / V, 3
# mantissa bits, moves each attention a little; a bf16 model vs the float32 one: 230 / 256). A
# read that drops SCALES gives 135 / 256 = 0.53.
MIN_AGREEMENT = 0.8


def engine(path, **kw):
    args = dict(kvcache_block_size=16, max_num_seqs=8, max_num_batched_tokens=512,
                max_model_len=512)
    return LLM(path, **{**args, **kw})


def random_prompts(n, vocab, seed=0, lengths=(3, 60)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(k),), generator=g).tolist()
            for k in torch.randint(*lengths, (n,), generator=g)]


def tokens(llm, prompts, params=GREEDY):
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny model in the regime where small perturbations shrink (tests/qwen3_tiny.py), so
    that the greedy agreement measures the cache's rounding rather than chaos."""
    path = tmp_path_factory.mktemp("kv_fp8")
    cfg = make_tiny_qwen3(path, SPEC, seed=1, gain=0.5, embed_std=1.0, max_shard_size="2GB")
    return str(path), cfg


def add_tensors(src, dst, tensors: dict) -> str:
    shutil.copytree(src, dst)
    stored = load_file(f"{dst}/model.safetensors")
    stored.update(tensors)
    save_file(stored, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


@pytest.fixture(scope="module")
def scaled(ckpt, tmp_path_factory):
    """``ckpt`` with per-layer KV scales, as vLLM's FP8-KV checkpoints store them."""
    tensors = {}
    for i, (k, v) in enumerate(SCALES):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)  # 0-dim
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([v])  # [1]
    return add_tensors(ckpt[0], tmp_path_factory.mktemp("kv_fp8_scaled") / "ckpt", tensors)


def test_cache_is_e4m3_holding_k_v_over_the_checkpoint_scales(scaled):
    """One prompt's prefill into an fp8 and a float32 cache (same block ids): layer 0's K / V do
    not depend on attention, so the fp8 cache must hold exactly the float32 cache's values
    divided by the layer's scales and rounded to e4m3; the scales reached the layers only for
    the fp8 cache."""
    prompt = random_prompts(1, 256, seed=5, lengths=(40, 41))[0]
    one = SamplingParams(temperature=0, max_tokens=1)
    runners = {}
    for kv in ("auto", "fp8"):
        llm = engine(scaled, kv_cache_dtype=kv)
        tokens(llm, [prompt], one)
        runners[kv] = llm.model_runner
    fp8, ref = runners["fp8"], runners["auto"]
    assert ref.kv_cache.dtype == torch.float32 and fp8.kv_cache.dtype == FP8
    assert all(m.k_cache.dtype == m.v_cache.dtype == FP8 for m in fp8.attn_modules)
    assert [(m.k_scale, m.v_scale) for m in fp8.attn_modules] == SCALES
    assert [(m.k_scale, m.v_scale) for m in ref.attn_modules] == [(1.0, 1.0)] * len(SCALES)
    written = (ref.kv_cache[0, 0] != 0).any(-1).any(-1).sum().item()
    assert written == len(prompt)  # the prompt's slots, nothing else
    for kv, scale in enumerate(SCALES[0]):  # K then V of layer 0
        want = quantize_kv(ref.kv_cache[kv, 0], scale, FP8)
        got = fp8.kv_cache[kv, 0]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), ("KV"[kv], scale)
    # layer 1 (after an attention over the rounded cache): close, not equal
    k1 = fp8.kv_cache[0, 1].float() * SCALES[1][0]
    assert (k1 - ref.kv_cache[0, 1]).norm() <= 0.1 * ref.kv_cache[0, 1].norm()


@pytest.mark.parametrize("scales", ["1.0", "checkpoint"])
def test_fp8_greedy_agrees_with_the_model_dtype_cache(ckpt, scaled, scales):
    path, cfg = ckpt
    prompts = random_prompts(16, cfg.vocab_size)
    got = tokens(engine(scaled if scales == "checkpoint" else path, kv_cache_dtype="fp8"),
                 prompts)
    want = tokens(engine(path), prompts)
    assert all(len(o) == GREEDY.max_tokens for o in got)
    same, total, equal = greedy_agreement(got, want)
    print(f"\nfp8 KV cache (scales {scales}) vs float32 cache, greedy: {same}/{total} tokens "
          f"({same / total:.2f}) before each sequence's first difference, {equal}/{len(prompts)} "
          "sequences identical")
    assert same / total >= MIN_AGREEMENT, (same, total)


def test_the_same_memory_holds_twice_the_bf16_blocks(ckpt):
    path, _ = ckpt
    bf16_block = 2 * 3 * 16 * 2 * 16 * 2  # K and V, 3 layers, 16 tokens, 2 kv heads of 16, 2 bytes
    gib = 64 * bf16_block / 2**30
    blocks = {}
    for dtype, kv in (("bfloat16", "auto"), ("bfloat16", "fp8"), ("float32", "auto")):
        # max_num_seqs x 512 tokens would be 2048 blocks: the budget sets the count
        llm = engine(path, dtype=dtype, kv_cache_dtype=kv, cpu_kvcache_gib=gib, max_num_seqs=64)
        runner = llm.model_runner
        assert runner.kv_cache.dtype == (FP8 if kv == "fp8" else getattr(torch, dtype))
        assert llm.scheduler.block_manager.num_blocks == runner.num_blocks
        blocks[dtype, kv] = runner.num_blocks
    assert blocks == {("bfloat16", "auto"): 64, ("bfloat16", "fp8"): 128,
                      ("float32", "auto"): 32}
    # the start-up check (Config.check_memory) counts the KV cache the same way
    fields = config_fields(read_config(path), "config.json")
    need16 = model_need(fields, torch.bfloat16, 1, kv_tokens=4096)
    need8 = model_need(fields, torch.bfloat16, 1, kv_tokens=4096, kv_dtype=FP8)
    assert need16.kv == 2 * need8.kv == 4096 * bf16_block // 16
    assert need8.weights == need16.weights
    assert "for 4,096 tokens at float8_e4m3fn" in describe(need8, torch.bfloat16, 1)


def test_prefix_caching_and_chunked_prefill_give_the_same_tokens_on_fp8(ckpt):
    """Every token's attention reads K / V from the cache, rounded once when written, whether
    it was written by this step, an earlier chunk, or another request sharing the prefix."""
    path, cfg = ckpt
    shared = random_prompts(1, cfg.vocab_size, seed=7, lengths=(40, 41))[0]
    prompts = [shared + tail for tail in random_prompts(6, cfg.vocab_size, seed=8,
                                                         lengths=(1, 30))]
    plain = engine(path, kv_cache_dtype="fp8", enable_prefix_caching=False,
                   max_num_batched_tokens=1024)
    want = tokens(plain, prompts)
    assert plain.scheduler.num_partial_prefills == 0
    cached = engine(path, kv_cache_dtype="fp8", max_num_seqs=4, max_num_batched_tokens=24)
    assert tokens(cached, prompts) == want
    assert tokens(cached, prompts[:2]) == want[:2]  # again: the whole prompts' blocks are cached
    sched = cached.scheduler
    assert sched.num_partial_prefills > 0 and sched.num_prefix_hit_tokens >= 2 * 32


@pytest.mark.parametrize("value, said", [
    (torch.tensor(float("nan")), "nan, expected one fp32 value > 0"),
    (torch.tensor([float("inf")]), "inf, expected"),
    (torch.tensor(0.0), "0.0, expected"),
    (torch.tensor(-2.0), "-2.0, expected"),
    (torch.ones(2), r"dtype float32, shape \(2,\); expected one fp32 value > 0"),
    (torch.tensor(1, dtype=torch.int32), "dtype int32, shape"),
])
def test_bad_checkpoint_scales_are_refused_naming_the_tensor(ckpt, tmp_path, value, said):
    path = add_tensors(ckpt[0], tmp_path / "ckpt",
                       {"model.layers.1.self_attn.v_scale": value,
                        "model.layers.0.self_attn.k_scale": torch.tensor(0.5)})
    name = r"tensor 'model\.layers\.1\.self_attn\.v_scale' in \S+model\.safetensors: "
    for apply in (False, True):  # checked whether the cache is fp8 or not
        model = Qwen3ForCausalLM(load_hf_config(path))
        with pytest.raises(CheckpointError, match=name + said):
            load_model(model, path, apply_kv_scales=apply)


def test_a_scale_for_a_layer_the_model_lacks_is_unexpected(ckpt, tmp_path):
    path = add_tensors(ckpt[0], tmp_path / "ckpt",
                       {"model.layers.3.self_attn.k_scale": torch.tensor(1.0)})
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.3\.self_attn"
                                              r"\.k_scale' in model\.safetensors"):
        engine(path, kv_cache_dtype="fp8")


def test_other_kv_cache_dtypes_are_refused(ckpt):
    for bad in ("int8", "float8_e4m3fn", torch.float8_e4m3fn, None):
        with pytest.raises(ValueError, match=r"LLM: kv_cache_dtype must be one of "
                                             r"\('auto', 'fp8'\), got "):
            engine(ckpt[0], kv_cache_dtype=bad)


def test_cli_flag_reaches_the_engine_settings():
    from qwen3_model.__main__ import build_parser
    from qwen3_model.command import engine_kwargs
    from qwen3_model.server.cli import build_parser as build_serve_parser

    for parser in (build_parser(), build_serve_parser()):
        assert engine_kwargs(parser.parse_args(["--model", "m"]))["kv_cache_dtype"] == "auto"
        args = parser.parse_args(["--model", "m", "--kv-cache-dtype", "fp8"])
        assert engine_kwargs(args)["kv_cache_dtype"] == "fp8"
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(["--model", "m", "--kv-cache-dtype", "int8"])
        assert exc.value.code == 2


def test_tp2_fp8_cache_gives_the_tokens_of_tp1(scaled, ckpt):
    """Each rank quantizes its own kv heads with the layer's scale (the same on every rank):
    the tokens of one rank."""
    prompts = random_prompts(4, ckpt[1].vocab_size, seed=3)
    want = tokens(engine(scaled, kv_cache_dtype="fp8"), prompts)
    llm = engine(scaled, kv_cache_dtype="fp8", tensor_parallel_size=2, device="cpu",
                 max_num_seqs=4, max_num_batched_tokens=24)
    try:
        assert llm.model_runner.kv_cache.dtype == FP8
        assert [(m.k_scale, m.v_scale) for m in llm.model_runner.attn_modules] == SCALES
        assert llm.model_runner.num_kv_heads == 1  # 2 kv heads split over the 2 ranks
        assert tokens(llm, prompts) == want
    finally:
        llm.close()
