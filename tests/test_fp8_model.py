"""The FP8 model on CPU (the linear_fp8 reference): its logits against the same checkpoint
dequantized to bf16, tensor parallel 2 over gloo against world size 1, and LLM.generate end to end.

The FP8 model and the dequantized one hold the same weight values; they differ only in the FP8
model quantizing each projection's input per token per 128-wide group to e4m3 (3 mantissa bits)
at run time, which is what the tolerances below measure.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qwen3_model import LLM, SamplingParams
from qwen3_model.random_checkpoint import dequantize_checkpoint, quantize_checkpoint
from tests.helpers import load_checkpoint
from tests.helpers import one_thread, rel_err  # noqa: F401  (autouse: one intra-op thread)
from tests.qwen3_tiny import make_tiny_qwen3
from tests.test_fp8_checkpoint import FP8_TINY
from tests.test_tp import free_port, run_steps

# intermediate 512: 256 rows per rank at TP 2, block-aligned (384 is not: test_fp8_checkpoint)
SHAPE = dict(FP8_TINY, intermediate_size=512)
# The activation rounding's cost on the logits: e4m3 moves each input of a projection by up to
# 2^-4 of its group's amax (rel err ~2% per projection at random values), over 2 layers x 4
# projections, damped by the norms; measured 0.009 here (CPU, fp32). 0.03 is ~3x that; a scale
# applied to the wrong block, a missing scale or a bf16 / fp8 mix-up gives O(1).
LOGITS_REL_ERR = 0.03
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(fp8, the same dequantized to bf16), from a fp32 model with spread-out weights."""
    root = tmp_path_factory.mktemp("fp8_model")
    src, fp8, bf16 = root / "src", root / "fp8", root / "bf16"
    make_tiny_qwen3(src, SHAPE, seed=3, with_tokenizer=True, gain=0.5, embed_std=1.0)
    quantize_checkpoint(src, fp8)
    dequantize_checkpoint(fp8, bf16)
    return str(fp8), str(bf16)


def test_fp8_logits_match_the_dequantized_model(ckpts):
    fp8, bf16 = ckpts
    m8, m16 = load_checkpoint(fp8), load_checkpoint(bf16)
    assert m8.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    got, _ = run_steps(m8, SHAPE["vocab_size"])
    want, _ = run_steps(m16, SHAPE["vocab_size"])
    err = rel_err(got, want)
    print(f"\nFP8 vs dequantized bf16 logits (CPU, fp32 activations): rel err {err:.4f}")
    assert got.isfinite().all() and err <= LOGITS_REL_ERR, err
    # and not ~1e-7: the activations were quantized (linear_fp8 ran, not F.linear on the
    # dequantized weights)
    assert err > 1e-3, "no activation quantization seen: is linear_fp8 running?"


def _worker(rank, world, port, path, out_dir):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = load_checkpoint(path)
        logits, hidden = run_steps(model, model.config.vocab_size)
        layer = model.model.layers[0]
        shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()
                  if n.endswith("weight_scale_inv")}
        torch.save({"logits": logits, "hidden": hidden, "scales": shapes},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_tp2_fp8_logits_match_world_size_1(ckpts, tmp_path):
    fp8, _ = ckpts
    mp.spawn(_worker, args=(2, free_port(), fp8, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    want_logits, want_hidden = run_steps(load_checkpoint(fp8), SHAPE["vocab_size"])
    # every activation group lies within one rank's slice (K per rank a multiple of 128), so
    # each rank quantizes exactly what world size 1 does: only fp32 summation order differs. How
    # much that moves the result depends on the CPU's GEMM kernels (1.6e-5 on one CI machine,
    # under 1e-5 on another); a block with a wrong scale would be off by a whole factor.
    assert rel_err(ranks[0]["logits"], want_logits) <= 1e-4
    assert ranks[1]["logits"] is None
    for r in range(2):
        assert rel_err(ranks[r]["hidden"], want_hidden) <= 1e-4
        # the scales really were split: q | k | v of 2 + 1 + 1 heads of 128 rows, 256 of gate
        # and of up, down's 512 input columns in halves; hidden 272 -> 3 blocks
        assert ranks[r]["scales"] == {"self_attn.qkv_proj.weight_scale_inv": (4, 3),
                                      "self_attn.o_proj.weight_scale_inv": (3, 2),
                                      "mlp.gate_up_proj.weight_scale_inv": (4, 3),
                                      "mlp.down_proj.weight_scale_inv": (3, 2)}


def _prompts(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, int, int]:
    """(tokens before the first difference summed over sequences, all tokens, sequences equal)."""
    same = 0
    for x, y in zip(a, b):
        same += next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
    return same, sum(map(len, a)), sum(x == y for x, y in zip(a, b))


def test_llm_generates_from_an_fp8_checkpoint(ckpts):
    fp8, bf16 = ckpts
    prompts = _prompts(8, SHAPE["vocab_size"])
    llm = LLM(fp8, kvcache_block_size=16, max_num_seqs=8, max_num_batched_tokens=512)
    assert llm.model_runner.model.quantization == "fp8"
    outs = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert all(len(o) == GREEDY.max_tokens for o in outs)
    # chunked prefill and prefix-cache hits give the same tokens (per-token quantization: a
    # token's activations quantize the same whatever else is in its step)
    chunked = LLM(fp8, kvcache_block_size=16, max_num_seqs=4, max_num_batched_tokens=24)
    again = [o.token_ids for o in chunked.generate(prompts + prompts[:2], GREEDY, use_tqdm=False)]
    assert chunked.scheduler.num_partial_prefills > 0
    assert again == outs + outs[:2]
    ref = LLM(bf16, kvcache_block_size=16, max_num_seqs=8, max_num_batched_tokens=512)
    ref_outs = [o.token_ids for o in ref.generate(prompts, GREEDY, use_tqdm=False)]
    same, total, equal = greedy_agreement(outs, ref_outs)
    print(f"\nFP8 vs dequantized bf16 greedy agreement (CPU): {same}/{total} tokens before the "
          f"first difference, {equal}/{len(prompts)} sequences identical")
    # the first token comes from the prompt's logits, within LOGITS_REL_ERR of each other
    assert sum(o[0] == r[0] for o, r in zip(outs, ref_outs)) >= len(prompts) // 2


def test_dummy_weights_for_an_fp8_config(tmp_path):
    """load_format="dummy" (the benchmarks at real shapes) fills e4m3 weights and their scales."""
    from qwen3_model.random_checkpoint import write_random_checkpoint

    write_random_checkpoint(tmp_path, SHAPE, quantization="fp8", weights=False, tokenizer=False)
    llm = LLM(str(tmp_path), load_format="dummy", kvcache_block_size=16, max_num_seqs=2,
              max_num_batched_tokens=64)
    qkv = llm.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and (qkv.weight_scale_inv == 0.02).all()
    assert qkv.weight.float().std() > 0.5  # N(0, 1) in e4m3, not zeros
    outs = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                        use_tqdm=False)
    assert len(outs[0].token_ids) == 4


def test_the_decoder_quantizes_in_its_norms_and_silu_above_one_token(ckpts, monkeypatch):
    """Above one token the FP8 projections get their input from rms_norm_fp8 /
    fused_add_rms_norm_fp8 / silu_and_mul_fp8 (Fp8Activation), each of which linear_fp8's own
    quantize_fp8 would otherwise repeat; at one token the 16-bit path (the GEMV quantizes), with
    gate_up and its activation in one op (linear_fp8_silu_and_mul)."""
    import qwen3_kernels
    from tests.paged_runner import PagedRunner

    m8 = load_checkpoint(ckpts[0])
    calls = {}
    for name in ("rms_norm_fp8", "fused_add_rms_norm_fp8", "silu_and_mul_fp8",
                 "linear_fp8_silu_and_mul"):
        def counted(*args, _f=getattr(qwen3_kernels, name), _n=name, **kwargs):
            calls[_n] = calls.get(_n, 0) + 1
            return _f(*args, **kwargs)
        monkeypatch.setattr(qwen3_kernels, name, counted)
    layers = SHAPE["num_hidden_layers"]
    runner = PagedRunner(m8, num_blocks=16, block_size=16, seed=1)
    runner.step(prefills=[(0, list(range(1, 14)))])  # 13 tokens
    assert calls == {"rms_norm_fp8": 1, "fused_add_rms_norm_fp8": 2 * layers - 1,
                     "silu_and_mul_fp8": layers}, calls
    calls.clear()
    runner.step(decodes=[(0, 5)])  # one token
    assert calls == {"linear_fp8_silu_and_mul": layers}, calls
