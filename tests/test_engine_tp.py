"""The engine at tensor_parallel_size=2 on CPU (gloo, one spawned worker process): greedy output
equals transformers' greedy generate, through chunked prefill and prefix-cache hits."""

from __future__ import annotations

import pytest
import torch

from qwen3_model import LLM, SamplingParams
from tests.qwen3_tiny import make_tiny_qwen3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_tied_gqa2")
    cfg, hf = make_tiny_qwen3(path, "tied_gqa2", return_model=True)
    return str(path), cfg, hf


def hf_greedy(hf, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_tp2_greedy_matches_transformers(ckpt):
    path, cfg, hf = ckpt
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(path, tensor_parallel_size=2, kvcache_block_size=16, max_num_seqs=4,
              max_num_batched_tokens=24)
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
                   for n in (1, 16, 40, 7)]
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        for _ in range(2):  # the second pass hits the prefix cache
            outs = llm.generate(prompts, sp, use_tqdm=False)
            for p, o in zip(prompts, outs):
                assert o.token_ids == hf_greedy(hf, p, 8)
        assert llm.scheduler.num_partial_prefills > 0 and llm.scheduler.num_prefix_hit_tokens > 0
        attn = llm.model_runner.model.model.layers[0].self_attn.attn
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)  # half the heads on this rank
    finally:
        llm.close()
        torch.set_num_threads(threads)
    assert not torch.distributed.is_initialized()


def test_tp_that_does_not_divide_the_heads_fails_clearly(ckpt):
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size"):
        LLM(ckpt[0], tensor_parallel_size=3, kvcache_block_size=16, max_num_seqs=4,
            max_num_batched_tokens=24)
    assert not torch.distributed.is_initialized()
