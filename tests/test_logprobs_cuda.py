"""Logprobs on the GPU (bf16, head_dim 128, the CUDA kernels): generated and prompt logprobs with
decode and piecewise CUDA graphs equal those of eager steps and of each request alone, within bf16
tolerance, and transformers' fp32 forward of the same (bf16-rounded) weights; a greedy token is
the most likely one; prompt logprobs of a long prompt on a KV cache sized from free memory.

    pytest -q tests/test_logprobs_cuda.py
"""

from __future__ import annotations

import gc

import pytest
import torch

from qwen3_model import LLM, SamplingParams
from tests.helpers import requires_cuda

pytestmark = requires_cuda

SHAPE = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=128,
             tie_word_embeddings=False, max_position_embeddings=4096)
# bf16 logits of O(10): one logit is off by up to ~0.04 (2^-8 relative); a logprob carries that
# plus the log-sum-exp's error
TOL = 0.08


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The stable init (tests/qwen3_tiny.py): bf16 rounding rarely flips a greedy token, so
    tokens (and their logprobs) can be compared across setups; and transformers' fp32 model with
    the same bf16-rounded weights, on the GPU."""
    from tests.qwen3_tiny import make_tiny_qwen3

    path = tmp_path_factory.mktemp("logprobs_bf16_hd128")
    _, hf = make_tiny_qwen3(path, SHAPE, dtype=torch.bfloat16, gain=0.5, embed_std=1.0,
                            return_model=True)
    hf = hf.to(torch.bfloat16).float().cuda()
    return str(path), hf


def free_cuda():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, SHAPE["vocab_size"], (n,), generator=g).tolist() for n in lengths]


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] fp32 on the host: row i is log_softmax of the logits after ids[: i + 1]."""
    with torch.no_grad():
        x = torch.tensor([ids], device="cuda")
        logits = hf(x, attention_mask=torch.ones_like(x)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def close_to_hf(hf, out):
    """Every entry's logprob within TOL of transformers' fp32 value of its token, and its top-N
    logprobs of the reference's top-N values."""
    prompt, tokens = out.prompt_token_ids, out.token_ids
    lp = hf_logprobs(hf, prompt + tokens[:-1])
    rows = [(e, lp[len(prompt) - 1 + j]) for j, e in enumerate(out.logprobs or [])]
    rows += [(e, lp[p - 1]) for p, e in enumerate(out.prompt_logprobs or []) if e is not None]
    assert rows
    worst = 0.0
    for e, ref in rows:
        worst = max(worst, abs(e.logprob - ref[e.token_id].item()))
        if e.top:
            top = torch.tensor([v for _, v in e.top])
            worst = max(worst, (top - ref.topk(len(e.top)).values).abs().max().item())
    assert worst < TOL, worst


def assert_close(a, b, greedy: bool):
    """Two runs of the same request: each entry's logprob and top-N logprobs within TOL. Greedy:
    the same tokens; sampled: the generated entries up to the first token that differs (a bf16
    difference may flip a close draw)."""
    n = len(a.token_ids)
    if greedy:
        assert a.token_ids == b.token_ids
    else:
        n = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), n)
    ea = list(a.logprobs or [])[:n] + [e for e in a.prompt_logprobs or [] if e is not None]
    eb = list(b.logprobs or [])[:n] + [e for e in b.prompt_logprobs or [] if e is not None]
    assert len(ea) == len(eb) and ea
    for x, y in zip(ea, eb):
        assert x.token_id == y.token_id
        assert abs(x.logprob - y.logprob) < TOL
        assert len(x.top) == len(y.top)
        for (_, vx), (_, vy) in zip(x.top, y.top):
            assert abs(vx - vy) < TOL


PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5, prompt_logprobs=3),
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=0),
    SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True, logprobs=4),
    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=8, seed=4, max_tokens=28, ignore_eos=True, logprobs=20,
                   prompt_logprobs=0),
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=20),
]
LENGTHS = [1, 16, 45, 7, 100, 33]
KW = dict(kvcache_block_size=16, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024,
          num_kvcache_blocks=512)


def test_graphs_eager_and_alone_agree(ckpt):
    path, hf = ckpt
    prompts = prompts_of(LENGTHS)
    runs = {}
    for name, kw in (("graphs", {}), ("eager", dict(enforce_eager=True))):
        llm = LLM(path, **KW, **kw)
        runs[name] = llm.generate(prompts, PARAMS, use_tqdm=False)
        runner = llm.model_runner
        if name == "graphs":  # decode steps replayed, mixed steps from the piecewise graphs
            assert runner.num_graph_steps > 0 and runner.piecewise.num_steps > 0
            runs["alone"] = [llm.generate([p], sp, use_tqdm=False)[0]
                             for p, sp in zip(prompts, PARAMS)]
        else:
            assert runner.num_graph_steps == 0
        del llm, runner
        free_cuda()
    for i, sp in enumerate(PARAMS):
        g, e, a = runs["graphs"][i], runs["eager"][i], runs["alone"][i]
        if sp.logprobs is None and sp.prompt_logprobs is None:
            assert g.logprobs is None and g.prompt_logprobs is None
            continue
        assert_close(g, e, sp.greedy)
        assert_close(g, a, sp.greedy)
        close_to_hf(hf, g)
        if sp.logprobs is not None:
            assert len(g.logprobs) == len(g.token_ids)
            assert all(len(x.top) == sp.logprobs for x in g.logprobs)
        if sp.greedy and sp.logprobs:  # the most likely token (top[0]: itself or a tie)
            for x in g.logprobs:
                assert x.rank == 1 and x.top[0][1] == x.logprob
        if sp.prompt_logprobs is not None:
            assert g.prompt_logprobs[0] is None
            assert len(g.prompt_logprobs) == len(g.prompt_token_ids)


def test_long_prompt_logprobs_on_a_cache_sized_from_free_memory(ckpt):
    """A 900-token prompt in one step: its prompt logprobs' LM head runs in pieces of
    max_num_seqs rows, within the memory the warm-up measured."""
    path, hf = ckpt
    llm = LLM(path, kvcache_block_size=16, max_num_seqs=4, max_num_batched_tokens=1024,
              max_model_len=1024, gpu_memory_utilization=0.3)
    prompt = prompts_of([900], seed=1)[0]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=5,
                        logprobs=5)
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == 900
    close_to_hf(hf, out)
    again = llm.generate([prompt], sp, use_tqdm=False)[0]  # no prefix-cache hit
    assert again.num_cached_tokens == 0
    assert_close(again, out, True)
    del llm
    free_cuda()
