"""SamplingParams.logprobs / prompt_logprobs on CPU (fp32, tiny random checkpoints), against
transformers' own fp32 forward: each generated token's logprob, rank and top-N, and each prompt
token's, equal log_softmax of HF's logits at that position (tol 1e-4); they come from the raw
logits whatever the sampling settings; and they do not depend on the batch, chunked prefill,
preemption, overlapped steps, tensor parallelism or the prefix cache.
"""

from __future__ import annotations

import pytest
import torch

from qwen3_model import LLM, SamplingParams
from tests.helpers import one_thread  # noqa: F401  (autouse: one intra-op thread)
from tests.qwen3_tiny import make_tiny_qwen3

BS = 16
TOL = 1e-4


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    path = tmp_path_factory.mktemp("logprobs_tied")
    cfg, hf = make_tiny_qwen3(path, "tied_gqa2", return_model=True)
    return str(path), cfg, hf


@pytest.fixture(scope="module")
def llm(tied):
    return LLM(tied[0], kvcache_block_size=BS, max_num_seqs=8, max_num_batched_tokens=256,
               device="cpu")


def random_prompts(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] fp32: row i is log_softmax of HF's logits after ids[: i + 1]."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids))).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_entry(entry, lp_row: torch.Tensor, token: int, n: int):
    """One TokenLogprobs against the reference log-probabilities lp_row [V] of its position."""
    assert entry.token_id == token
    assert abs(entry.logprob - lp_row[token].item()) < TOL
    ref_rank = int((lp_row > lp_row[token]).sum()) + 1
    assert entry.rank == ref_rank
    assert len(entry.top) == n
    values = [v for _, v in entry.top]
    assert values == sorted(values, reverse=True)
    if n:
        ref = lp_row.topk(n)
        assert [t for t, _ in entry.top] == ref.indices.tolist()
        assert torch.allclose(torch.tensor(values), ref.values, atol=TOL, rtol=0)


def assert_output_logprobs(hf, out, n: int):
    """out.logprobs: one entry per generated token, each equal to HF's at its position."""
    prompt, tokens = out.prompt_token_ids, out.token_ids
    assert out.logprobs is not None and len(out.logprobs) == len(tokens)
    lp = hf_logprobs(hf, prompt + tokens[:-1])
    for j, (entry, token) in enumerate(zip(out.logprobs, tokens)):
        assert_entry(entry, lp[len(prompt) - 1 + j], token, n)


def assert_prompt_logprobs(hf, out, n: int):
    prompt = out.prompt_token_ids
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    lp = hf_logprobs(hf, prompt)
    for p in range(1, len(prompt)):
        assert_entry(out.prompt_logprobs[p], lp[p - 1], prompt[p], n)


def flat(out) -> list[tuple]:
    """An output's logprobs as comparable tuples (token, logprob, rank, top ids)."""
    rows = list(out.logprobs or []) + [e for e in (out.prompt_logprobs or []) if e is not None]
    return [(e.token_id, e.logprob, e.rank, [t for t, _ in e.top]) for e in rows]


def assert_same_logprobs(a, b):
    assert a.token_ids == b.token_ids
    fa, fb = flat(a), flat(b)
    assert len(fa) == len(fb)
    for x, y in zip(fa, fb):
        assert x[0] == y[0] and x[2] == y[2] and x[3] == y[3]
        assert abs(x[1] - y[1]) < 1e-5


# ---- generated tokens ---------------------------------------------------------------------------

def test_greedy_logprobs_match_transformers_per_row_n(llm, tied):
    _, cfg, hf = tied
    prompts = random_prompts([1, BS, 2 * BS + 3, 7], cfg.vocab_size)
    ns = [5, 0, None, 20]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=n)
              for n in ns]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, n in zip(outs, ns):
        assert out.prompt_logprobs is None
        if n is None:
            assert out.logprobs is None
            continue
        assert_output_logprobs(hf, out, n)
        for entry, token in zip(out.logprobs, out.token_ids):  # greedy: the most likely
            assert entry.rank == 1
            assert n == 0 and entry.top == [] or entry.top[0] == (token, entry.logprob)


def test_sampled_tokens_report_raw_logprobs(llm, tied):
    """Temperature and top-k shape the sampling, not the reported logprobs."""
    _, cfg, hf = tied
    prompts = random_prompts([5, 19, 33], cfg.vocab_size, seed=1)
    sp = SamplingParams(temperature=0.8, top_k=6, max_tokens=12, ignore_eos=True, seed=7,
                        logprobs=3)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    ranks = []
    for out in outs:
        assert_output_logprobs(hf, out, 3)
        ranks += [e.rank for e in out.logprobs]
    assert max(ranks) <= 6 and max(ranks) > 1  # top-k held; not every token was the argmax
    # rows without top-k (the one-kernel sampling path) too
    sp = SamplingParams(temperature=1.3, max_tokens=12, ignore_eos=True, seed=3, logprobs=2)
    for out in llm.generate(prompts, sp, use_tqdm=False):
        assert_output_logprobs(hf, out, 2)


def test_logprobs_are_taken_before_the_min_tokens_bans(llm, tied):
    """A banned token (a stop id before min_tokens) still has its raw logprob and rank 1."""
    _, cfg, hf = tied
    prompt = random_prompts([11], cfg.vocab_size, seed=2)[0]
    greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    first = llm.generate([prompt], greedy, use_tqdm=False)[0].token_ids[0]
    sp = SamplingParams(temperature=0, max_tokens=4, min_tokens=4, ignore_eos=True,
                        stop_token_ids=[first], logprobs=2)
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert_output_logprobs(hf, out, 2)
    entry = out.logprobs[0]
    assert entry.token_id != first and entry.rank == 2 and entry.top[0][0] == first


# ---- prompt tokens ------------------------------------------------------------------------------

def test_prompt_logprobs_match_transformers(llm, tied):
    _, cfg, hf = tied
    prompts = random_prompts([1, 2, BS + 5, 40], cfg.vocab_size, seed=3)
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=4,
                        logprobs=1)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    for out in outs:
        assert_prompt_logprobs(hf, out, 4)
        assert_output_logprobs(hf, out, 1)
    assert outs[0].prompt_logprobs == [None]


def test_prompt_logprobs_skip_the_prefix_cache(tied):
    _, cfg, hf = tied
    llm = LLM(tied[0], kvcache_block_size=BS, max_num_seqs=4, max_num_batched_tokens=256,
              device="cpu")
    prompt = random_prompts([3 * BS + 4], cfg.vocab_size, seed=4)[0]
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    asks = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    llm.generate([prompt], plain, use_tqdm=False)  # caches its 3 full blocks
    outs = llm.generate([prompt, prompt], [asks, plain], use_tqdm=False)
    assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens == 3 * BS
    assert_prompt_logprobs(hf, outs[0], 2)
    # the same request again still gets them in full
    again = llm.generate([prompt], asks, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert_same_logprobs(again, outs[0])


# ---- independent of how the step ran --------------------------------------------------------------

PROMPT_LENGTHS = [9, BS, 2 * BS, 23, 45]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2),
    SamplingParams(temperature=0.9, max_tokens=12, ignore_eos=True, seed=11, logprobs=5),
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.7, top_p=0.8, max_tokens=12, ignore_eos=True, seed=5,
                   logprobs=0, prompt_logprobs=0),
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=1),
]

SETUPS = {
    # prompt chunks of at most 8 tokens, cut to one token at times (a "partial decode" row)
    "chunked": dict(max_num_seqs=5, max_num_batched_tokens=8, enable_prefix_caching=False),
    # 6 blocks for 5 requests of up to 45 + 12 tokens: sequences are preempted and recomputed
    "preempted": dict(max_num_seqs=5, max_num_batched_tokens=256, num_kvcache_blocks=6),
    "no_overlap": dict(max_num_seqs=5, max_num_batched_tokens=256, overlap_steps=False),
}


@pytest.fixture(scope="module")
def reference(tied):
    """Each request alone (default engine), checked against transformers once."""
    _, cfg, hf = tied
    prompts = random_prompts(PROMPT_LENGTHS, cfg.vocab_size, seed=5)
    llm = LLM(tied[0], kvcache_block_size=BS, max_num_seqs=5, max_num_batched_tokens=256,
              device="cpu")
    outs = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in zip(prompts, PARAMS)]
    for out, sp in zip(outs, PARAMS):
        if sp.logprobs is not None:
            assert_output_logprobs(hf, out, sp.logprobs)
        else:
            assert out.logprobs is None
        if sp.prompt_logprobs is not None:
            assert_prompt_logprobs(hf, out, sp.prompt_logprobs)
        else:
            assert out.prompt_logprobs is None
    return prompts, outs


def test_batch_equals_alone(tied, reference):
    prompts, alone = reference
    llm = LLM(tied[0], kvcache_block_size=BS, max_num_seqs=5, max_num_batched_tokens=256,
              device="cpu")
    for a, b in zip(llm.generate(prompts, PARAMS, use_tqdm=False), alone):
        assert_same_logprobs(a, b)


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_setup_equals_alone(tied, reference, setup):
    prompts, alone = reference
    llm = LLM(tied[0], kvcache_block_size=BS, device="cpu", **SETUPS[setup])
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    for a, b in zip(outs, alone):
        assert_same_logprobs(a, b)
    sched = llm.scheduler
    if setup == "chunked":
        assert sched.num_partial_prefills >= sum(-(-n // 8) - 1 for n in PROMPT_LENGTHS)
    if setup == "preempted":
        assert sched.num_preemptions > 0


def test_one_token_prompt_chunks(tied):
    """A prompt computed one token a step beside seven decodes: every row of it is a one-token
    "decode" that is not its sequence's last, yet gives a prompt logprob."""
    _, cfg, hf = tied
    llm = LLM(tied[0], kvcache_block_size=BS, max_num_seqs=8, max_num_batched_tokens=8,
              device="cpu", enable_prefix_caching=False)
    short = random_prompts([1] * 7, cfg.vocab_size, seed=6)
    long = random_prompts([12], cfg.vocab_size, seed=7)
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    asks = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=3,
                          logprobs=2)
    outs = llm.generate(short + long, [plain] * 7 + [asks], use_tqdm=False)
    assert llm.scheduler.num_partial_prefills >= 10
    assert_prompt_logprobs(hf, outs[-1], 3)
    assert_output_logprobs(hf, outs[-1], 2)


def test_stream_deltas_carry_the_new_tokens_logprobs(llm, tied):
    _, cfg, _ = tied
    prompts = random_prompts([6, 21], cfg.vocab_size, seed=8)
    sp = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    got: dict[int, list] = {0: [], 1: []}
    for delta in llm.stream(prompts, sp):
        assert delta.logprobs is not None and len(delta.logprobs) == len(delta.token_ids)
        got[delta.index] += delta.logprobs
    for i, out in enumerate(outs):
        assert [(e.token_id, e.rank) for e in got[i]] == [(e.token_id, e.rank)
                                                          for e in out.logprobs]


def test_tensor_parallel_equals_one_rank(tied, reference):
    """Two ranks (gloo): every rank runs the LM head over the prompt-logprob rows."""
    prompts, alone = reference
    llm = LLM(tied[0], tensor_parallel_size=2, kvcache_block_size=BS, max_num_seqs=5,
              max_num_batched_tokens=24, device="cpu")
    try:
        outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    finally:
        llm.close()
    for a, b in zip(outs, alone):
        assert_same_logprobs(a, b)


# ---- validation -----------------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [21, -1, True, "3", 2.0])
def test_bad_values_are_refused(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} must be None or an integer "
                                         r"in \[0, 20\]"):
        SamplingParams(**{field: value})


def test_good_values_and_a_later_change(llm):
    for n in (None, 0, 20):
        sp = SamplingParams(logprobs=n, prompt_logprobs=n)
        assert sp.logprobs == n and sp.prompt_logprobs == n
    assert SamplingParams().logprobs is None and SamplingParams().prompt_logprobs is None
    sp = SamplingParams(max_tokens=2)
    sp.logprobs = 99  # checked again by generate
    with pytest.raises(ValueError, match=r"request 0: SamplingParams.logprobs must be"):
        llm.generate([[1, 2, 3]], sp, use_tqdm=False)
