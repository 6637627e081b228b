"""The engine end to end on CPU (fp32, tiny random checkpoints): greedy output equals transformers'
greedy generate prompt by prompt, with and without prefix-cache hits, preemption and chunked
prefill (and the tests check those actually happened); sampling, stops, streaming, input errors.
"""

from __future__ import annotations

import pytest
import torch

from qwen3_model import LLM, SamplingParams
from qwen3_model.random_checkpoint import char_tokenizer
from tests.helpers import one_thread  # noqa: F401  (autouse: one intra-op thread)
from tests.qwen3_tiny import make_tiny_qwen3


BS = 16  # the smallest block size the kernels take; prompts of 16 / 32 tokens fill 1 / 2 blocks
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module", params=["tied_gqa2", "untied_gqa4_sharded"])
def ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    cfg, hf = make_tiny_qwen3(path, request.param, return_model=True)
    char_tokenizer(cfg.vocab_size).save_pretrained(path)
    return str(path), cfg, hf


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    path = tmp_path_factory.mktemp("tied")
    cfg, hf = make_tiny_qwen3(path, "tied_gqa2", return_model=True)
    char_tokenizer(cfg.vocab_size).save_pretrained(path)
    return str(path), cfg, hf


@pytest.fixture(scope="module")
def llm(tied):
    return LLM(tied[0], kvcache_block_size=BS, max_num_seqs=8, max_num_batched_tokens=256)


def random_prompts(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


_HF_CACHE: dict = {}


def hf_greedy(hf, prompt, n):
    key = (id(hf), tuple(prompt), n)
    if key not in _HF_CACHE:
        with torch.no_grad():
            ids = torch.tensor([prompt])
            # an explicit mask: HF would otherwise mask out prompt tokens equal to pad_token_id
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=0)
        _HF_CACHE[key] = out[0, len(prompt):].tolist()
    return _HF_CACHE[key]


def assert_matches_hf(hf, prompts, outs, n=GREEDY.max_tokens):
    assert len(outs) == len(prompts)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert o.index == i and o.prompt_token_ids == p
        assert o.token_ids == hf_greedy(hf, p, n), f"prompt {i} ({len(p)} tokens)"
        assert o.finish_reason == "length"


MIXED = [1, BS, 2 * BS, 7, BS + 1, 45]


def test_greedy_matches_transformers(ckpt):
    path, cfg, hf = ckpt
    llm = LLM(path, kvcache_block_size=BS, max_num_seqs=8, max_num_batched_tokens=512)
    prompts = random_prompts(MIXED, cfg.vocab_size)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(hf, prompts, outs)
    # one step prefilled the whole batch: no chunking, no preemption in this configuration
    assert llm.scheduler.num_partial_prefills == 0 and llm.scheduler.num_preemptions == 0


def test_prefix_cache_hits_give_the_same_tokens(tied):
    path, cfg, hf = tied
    llm = LLM(path, kvcache_block_size=BS, max_num_seqs=8, max_num_batched_tokens=512)
    base = random_prompts([3 * BS + 5], cfg.vocab_size, seed=1)[0]  # 53 tokens: 3 full blocks
    first = [base, base[: 2 * BS]]
    assert_matches_hf(hf, first, llm.generate(first, GREEDY, use_tqdm=False))
    assert llm.scheduler.num_prefix_hit_tokens == 0
    second = [
        base,  # full-prompt hit: 3 blocks cached, the last 5 tokens computed
        base[: 2 * BS],  # block-aligned full hit: 1 block reused, the block with the last token redone
        base[: 2 * BS + 3] + [1, 2, 3],  # shares two blocks, then diverges
        base[:BS] + random_prompts([20], cfg.vocab_size, seed=2)[0],  # shares one block
    ]
    outs = llm.generate(second, GREEDY, use_tqdm=False)
    assert_matches_hf(hf, second, outs)
    assert [o.num_cached_tokens for o in outs] == [3 * BS, BS, 2 * BS, BS]
    assert llm.scheduler.num_prefix_hit_tokens == 7 * BS


def test_prefix_hits_within_one_call_across_steps(tied):
    """With a small token budget the shared prefix is computed for the first request in an early
    step and the later requests (admitted later) hit it."""
    path, cfg, hf = tied
    llm = LLM(path, kvcache_block_size=BS, max_num_seqs=4, max_num_batched_tokens=40)
    shared = random_prompts([2 * BS], cfg.vocab_size, seed=3)[0]
    tails = random_prompts([3, 9, 17], cfg.vocab_size, seed=4)
    prompts = [shared + t for t in tails]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(hf, prompts, outs)
    assert llm.scheduler.num_prefix_hit_tokens > 0


def test_preemption_gives_the_same_tokens(tied):
    path, cfg, hf = tied
    # 6 blocks = 96 token slots for 5 requests that need up to 35 + 20 tokens each
    llm = LLM(path, kvcache_block_size=BS, max_num_seqs=5, max_num_batched_tokens=256,
              num_kvcache_blocks=6)
    prompts = random_prompts([20, 35, 9, 17, 30], cfg.vocab_size, seed=5)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_matches_hf(hf, prompts, outs, n=20)
    assert llm.scheduler.num_preemptions > 0
    bm = llm.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # all blocks back


def test_chunked_prefill_gives_the_same_tokens(tied):
    path, cfg, hf = tied
    budget = 8
    llm = LLM(path, kvcache_block_size=BS, max_num_seqs=4, max_num_batched_tokens=budget,
              enable_prefix_caching=False)
    lengths = [9, BS, 2 * BS, 23, 45]  # every prompt is longer than the budget
    prompts = random_prompts(lengths, cfg.vocab_size, seed=6)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(hf, prompts, outs)
    # each prompt needs at least ceil(len / budget) chunks, all but the last one partial
    assert llm.scheduler.num_partial_prefills >= sum(-(-n // budget) - 1 for n in lengths)


def test_longest_first_with_a_small_budget_gives_the_same_tokens(tied):
    """scheduling_policy="longest_first": admitted by max_tokens (most first), prompts chunked
    alongside decodes; every request still gets HF's tokens, returned in request order."""
    path, cfg, hf = tied
    llm = LLM(path, kvcache_block_size=BS, max_num_seqs=3, max_num_batched_tokens=12,
              enable_prefix_caching=False, scheduling_policy="longest_first")
    lengths, max_tokens = [9, 23, 5, 14, 30], [3, 8, 5, 8, 2]
    prompts = random_prompts(lengths, cfg.vocab_size, seed=8)
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens],
                        use_tqdm=False)
    for i, (p, o, m) in enumerate(zip(prompts, outs, max_tokens)):
        assert o.index == i and o.prompt_token_ids == p
        assert o.token_ids == hf_greedy(hf, p, m), f"prompt {i}"
    assert llm.scheduler.num_partial_prefills > 0


def test_auto_policy_runs_a_large_offline_batch_under_the_throughput_schedule(tied, monkeypatch):
    """scheduling_policy="auto": where throughput_schedule says so, generate runs longest first
    under its smaller budgets (HF's tokens still), then the configured schedule is back; the
    rule's inputs are the policy, this GPU's weight bytes, the batch size and the budgets."""
    from qwen3_model.engine import llm_engine

    path, cfg, hf = tied
    llm = LLM(path, kvcache_block_size=BS, max_num_seqs=4, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    assert llm.config.scheduling_policy == "auto"
    seen = {}

    def rule(policy, weight_bytes, num_requests, max_num_seqs, max_num_batched_tokens, graphs):
        seen.update(policy=policy, weight_bytes=weight_bytes, num_requests=num_requests,
                    budgets=(max_num_seqs, max_num_batched_tokens), graphs=graphs)
        return (2, 12)

    monkeypatch.setattr(llm_engine, "throughput_schedule", rule)
    sched = llm.scheduler
    steps = []
    schedule = sched.schedule

    def spy():
        batch = schedule()
        steps.append((batch.num_tokens, len(sched.running), sched.longest_first))
        return batch

    monkeypatch.setattr(sched, "schedule", spy)
    lengths, max_tokens = [9, 23, 5, 14, 30], [3, 8, 5, 8, 2]
    prompts = random_prompts(lengths, cfg.vocab_size, seed=8)
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens],
                        use_tqdm=False)
    for p, o, m in zip(prompts, outs, max_tokens):
        assert o.token_ids == hf_greedy(hf, p, m)
    weights = sum(p.numel() * p.element_size() for p in llm.model_runner.model.parameters())
    assert seen == dict(policy="auto", weight_bytes=weights, num_requests=5, budgets=(4, 64),
                        graphs=False)  # (the CPU has no piecewise graphs)
    assert steps and all(n <= 12 and running <= 2 and lf for n, running, lf in steps)
    assert (sched.longest_first, sched.max_num_seqs, sched.max_num_batched_tokens) == (False, 4, 64)


def test_string_prompts_use_the_checkpoint_tokenizer(llm, tied):
    _, cfg, hf = tied
    tok = llm.tokenizer
    texts = ["Hello, world", "a", "The quick brown fox jumps over the lazy dog"]
    outs = llm.generate(texts, GREEDY, use_tqdm=False)
    ids = [tok(t)["input_ids"] for t in texts]
    assert_matches_hf(hf, ids, outs)
    for o in outs:
        assert o.text == tok.decode(o.token_ids, skip_special_tokens=True)


def test_one_params_per_prompt_and_outputs_in_prompt_order(llm, tied):
    _, cfg, hf = tied
    prompts = random_prompts([30, 2, 12], cfg.vocab_size, seed=7)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [3, 9, 5]
    for p, o, n in zip(prompts, outs, (3, 9, 5)):
        assert o.token_ids == hf_greedy(hf, p, n)


def test_top_k_1_equals_greedy(llm, tied):
    _, cfg, _ = tied
    prompts = random_prompts([5, 17, 33], cfg.vocab_size, seed=8)
    greedy = llm.generate(prompts, GREEDY, use_tqdm=False)
    topk1 = llm.generate(prompts, SamplingParams(temperature=1.0, top_k=1, max_tokens=10,
                                                 ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in topk1] == [o.token_ids for o in greedy]


def test_seeded_sampling_is_reproducible_and_independent_of_batch(llm, tied):
    _, cfg, _ = tied
    p, q, r = random_prompts([12, 30, 5], cfg.vocab_size, seed=9)
    sp = SamplingParams(temperature=1.0, seed=42, max_tokens=12, ignore_eos=True)
    alone = llm.generate([p], sp, use_tqdm=False)[0].token_ids
    assert llm.generate([p], sp, use_tqdm=False)[0].token_ids == alone
    mixed = llm.generate(
        [q, p, r, p],
        [SamplingParams(temperature=1.0, max_tokens=20), sp,
         SamplingParams(temperature=0.5, seed=1, max_tokens=3), sp],
        use_tqdm=False,
    )
    assert mixed[1].token_ids == alone and mixed[3].token_ids == alone
    other = llm.generate([p], SamplingParams(temperature=1.0, seed=43, max_tokens=12,
                                             ignore_eos=True), use_tqdm=False)[0].token_ids
    assert other != alone


def test_stop_strings_and_stop_ids(llm, tied):
    _, cfg, _ = tied
    tok = llm.tokenizer
    prompt = "Once upon a time"
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert free.finish_reason == "length" and free.stop_reason is None
    text = free.text
    assert len(text) >= 8, text

    stop = text[4:6]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, stop=[stop, "\x00"]),
                       use_tqdm=False)[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == text[: text.find(stop)]
    assert out.token_ids == free.token_ids[: len(out.token_ids)]

    stop_id = free.token_ids[5]
    k = free.token_ids.index(stop_id)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert out.token_ids == free.token_ids[: k + 1]  # the stop id is in token_ids ...
    assert out.text == tok.decode(free.token_ids[:k], skip_special_tokens=True)  # ... not in text

    # min_tokens: the stop id cannot end the request before min_tokens tokens
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, min_tokens=k + 1,
                                                stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert len(out.token_ids) > k + 1


def test_eos_ends_the_request_unless_ignored(tied):
    path, cfg, _ = tied
    probe = LLM(path, kvcache_block_size=BS, max_num_seqs=2, max_num_batched_tokens=64)
    prompt = random_prompts([10], cfg.vocab_size, seed=10)[0]
    free = probe.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
    eos = free[3]
    k = free.index(eos)
    llm = LLM(path, kvcache_block_size=BS, max_num_seqs=2, max_num_batched_tokens=64,
              eos_token_ids=(eos,))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    assert (out.finish_reason, out.token_ids) == ("stop", free[: k + 1])
    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]  # ignore_eos
    assert (out.finish_reason, out.token_ids) == ("length", free)
    # min_tokens bans EOS from being sampled at all until then: the output changes from there
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, min_tokens=k + 1),
                       use_tqdm=False)[0]
    assert out.token_ids[:k] == free[:k] and eos not in out.token_ids[: k + 1]


def test_stream_yields_the_same_tokens_and_text(llm, tied):
    _, cfg, _ = tied
    prompts = ["abc", "Hello there", "x"]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (6, 9, 3)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    got_ids = {i: [] for i in range(3)}
    got_text = {i: "" for i in range(3)}
    finished = []
    for d in llm.stream(prompts, params):
        assert d.index not in finished, "a delta after the request finished"
        got_ids[d.index] += d.token_ids
        got_text[d.index] += d.text
        if d.finished:
            finished.append(d.index)
            assert d.finish_reason == outs[d.index].finish_reason
    assert sorted(finished) == [0, 1, 2]
    for i, o in enumerate(outs):
        assert got_ids[i] == o.token_ids and got_text[i] == o.text


def test_stream_holds_back_a_possible_stop_string(llm):
    free = llm.generate(["zz"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    stop = free.text[6:9]
    deltas = list(llm.stream(["zz"], SamplingParams(temperature=0, max_tokens=12, stop=stop)))
    text = "".join(d.text for d in deltas)
    assert text == free.text[: free.text.find(stop)]
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"


BAD = [
    ([], "empty prompt"),
    ("", "empty prompt"),
    ([1, 2, 10_000], "token id 10000 at position 2 is outside the vocabulary"),
    ([1, -1], "token id -1 at position 1"),
    ([1, 2.0], "token 1 is 2.0"),
    (list(range(64)) * 2, "prompt has 128 tokens; max_model_len=128"),
]


@pytest.mark.parametrize("bad_prompt, message", BAD)
def test_bad_prompt_is_reported_by_index_before_any_work(tied, bad_prompt, message):
    path, cfg, hf = tied
    llm = LLM(path, kvcache_block_size=BS, max_num_seqs=4, max_num_batched_tokens=64,
              max_model_len=128)
    good = random_prompts([5, 6], cfg.vocab_size, seed=11)
    with pytest.raises(ValueError, match=f"request 2: {message}"):
        llm.generate(good + [bad_prompt], GREEDY, use_tqdm=False)
    assert llm.scheduler.num_steps == 0 and llm.scheduler.is_finished()
    # still usable, and correct
    assert_matches_hf(hf, good, llm.generate(good, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", 0),
    ("top_k", -2),
])
def test_bad_sampling_params_are_reported_by_index(llm, field, value):
    sp = SamplingParams(temperature=0, max_tokens=4)
    setattr(sp, field, value)  # bypass the constructor's check: generate checks again
    with pytest.raises(ValueError, match=f"request 1: SamplingParams.{field}"):
        llm.generate([[1, 2], [3, 4]], [GREEDY, sp], use_tqdm=False)
    assert llm.scheduler.is_finished()
    assert len(llm.generate([[1, 2]], GREEDY, use_tqdm=False)[0].token_ids) == 10


def test_logit_bias(llm):
    """-100 bans the greedy token, +100 forces a token; an id outside the vocabulary is refused
    before any work; the logprobs stay the raw model's."""
    prompt = [5, 9, 2, 7]
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=2,
                                                  ignore_eos=True), use_tqdm=False)[0]
    first = plain.token_ids[0]
    second = next(t for t, _ in plain.logprobs[0].top if t != first)
    banned = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=2,
                                                   ignore_eos=True, logit_bias={first: -100}),
                          use_tqdm=False)[0]
    assert banned.token_ids[0] == second
    assert banned.logprobs[0].top == plain.logprobs[0].top  # raw, before the bias
    forced = llm.generate([prompt], SamplingParams(temperature=0.8, seed=3, max_tokens=5,
                                                   ignore_eos=True, logit_bias={77: 100}),
                          use_tqdm=False)[0]
    assert forced.token_ids == [77] * 5
    vocab = llm.config.hf_config.vocab_size
    with pytest.raises(ValueError, match=f"request 1: logit_bias names token id {vocab}"):
        llm.generate([prompt, prompt], [GREEDY, SamplingParams(logit_bias={vocab: 1.0})],
                     use_tqdm=False)
    assert llm.scheduler.is_finished()


def test_penalties(llm, tied):
    """presence / frequency: each greedy token is the argmax of the raw logprobs minus the
    penalties of the output so far (read from the top-20 raw logprobs); a penalized request
    gives the same tokens alone, in a batch and without overlapped steps; repetition_penalty
    changes the output and is as reproducible."""
    prompt = random_prompts([9], tied[1].vocab_size, seed=5)[0]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=20,
                        presence_penalty=1.5, frequency_penalty=0.8)
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                         use_tqdm=False)[0]
    assert out.token_ids != plain.token_ids
    checked = 0
    for j, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        before = out.token_ids[:j]
        score = {t: v - 0.8 * before.count(t) - 1.5 * (t in before) for t, v in lp.top}
        best = max(score, key=score.get)
        if score[best] >= lp.top[-1][1]:  # nothing outside the top 20 can beat it
            assert tok == best, j
            checked += 1
    assert checked >= 12
    others = random_prompts([5, 17, 3], tied[1].vocab_size, seed=6)
    sp_rep = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.8,
                            frequency_penalty=0.3)
    alone = llm.generate([prompt], sp_rep, use_tqdm=False)[0].token_ids
    mixed = llm.generate(others[:2] + [prompt] + others[2:],
                         [GREEDY, SamplingParams(temperature=0.9, seed=1), sp_rep, GREEDY],
                         use_tqdm=False)[2].token_ids
    assert mixed == alone and alone != plain.token_ids
    serial = LLM(tied[0], kvcache_block_size=BS, max_num_seqs=8, max_num_batched_tokens=256,
                 overlap_steps=False)
    assert serial.generate([prompt], sp_rep, use_tqdm=False)[0].token_ids == alone


def test_other_request_errors(llm, tied):
    path = tied[0]
    with pytest.raises(ValueError, match="2 prompts but 3 SamplingParams"):
        llm.generate([[1], [2]], [GREEDY] * 3, use_tqdm=False)
    with pytest.raises(ValueError, match="request 0: sampling params must be a SamplingParams"):
        llm.generate([[1]], [dict(temperature=0)], use_tqdm=False)
    with pytest.raises(ValueError, match="unknown argument.*'max_token'"):
        SamplingParams(max_token=3)
    with pytest.raises(ValueError, match="LLM: unknown argument.*'max_num_seq'"):
        LLM(path, max_num_seq=3)
    with pytest.raises(ValueError, match="LLM: kvcache_block_size must be one of"):
        LLM(path, kvcache_block_size=8)
    with pytest.raises(ValueError, match=r"LLM: scheduling_policy must be one of \('auto', "
                                         r"'fcfs', 'longest_first'\), got 'lifo'"):
        LLM(path, scheduling_policy="lifo")
    for v in (48, -32, True, 64.0):
        with pytest.raises(ValueError, match="LLM: max_piecewise_graph_tokens must be 0 .off. or "
                                             "a positive multiple of 32, got"):
            LLM(path, max_piecewise_graph_tokens=v)
    with pytest.raises(ValueError, match="LLM: model must be a checkpoint folder"):
        LLM(path + "/nope")
    small = LLM(path, kvcache_block_size=BS, max_num_seqs=2, max_num_batched_tokens=64,
                num_kvcache_blocks=2)
    with pytest.raises(ValueError, match="request 0: .*KV cache.*holds 32"):
        small.generate([[1] * 10], SamplingParams(max_tokens=30), use_tqdm=False)
    # a single prompt may be given bare
    assert len(llm.generate([1, 2, 3], GREEDY, use_tqdm=False)) == 1
    assert len(llm.generate("abc", GREEDY, use_tqdm=False)) == 1


def test_progress_bar_shows_prefill_and_decode_rates(llm, capsys):
    llm.generate([[1, 2, 3]] * 3, GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "Generating" in err and "3/3" in err


class EagerReplay:
    """Stands in for a captured CUDA graph on CPU: replay() runs the same decode forward over the
    same static buffers, so the replay plumbing (input copies, padding rows, output rows) is
    tested here; tests/test_engine_cuda.py runs the real graphs."""

    def __init__(self, runner, bs, short=False):
        self.runner, self.bs, self.short = runner, bs, short
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.runner.graph_forward(self.bs, self.short)


def test_graph_replay_plumbing_with_padding(tied):
    path, cfg, hf = tied
    llm = LLM(path, kvcache_block_size=BS, max_num_seqs=8, max_num_batched_tokens=256)
    runner = llm.model_runner
    runner.graph_batch_sizes = [1, 2, 4, 8]
    runner.make_graph_buffers(8)
    runner.graph_vars["block_tables"].fill_(3)  # stale rows must not matter
    runner.graphs = {bs: EagerReplay(runner, bs) for bs in runner.graph_batch_sizes}
    # 5 / 3 / 1 decodes as requests finish: buckets 8, 4, 1 with padding rows
    prompts = random_prompts([3, 20, 33, 1, 16], cfg.vocab_size, seed=12)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 12, 8, 12, 6)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, o, sp in zip(prompts, outs, params):
        assert o.token_ids == hf_greedy(hf, p, sp.max_tokens)
    assert runner.num_graph_steps == 11  # every decode-only step went through a "graph"


def test_deterministic_graphs_read_the_narrow_table_while_every_context_fits(tmp_path):
    """The deterministic mode captures its decode graphs over the full block table and over a
    narrow one (short_table_blocks: BATCH_INVARIANT_SPLIT_KEYS keys, so the kernel launches
    nothing for a second split no row has); a step replays the narrow ones while every context
    fits, the full ones after. Tokens and logprobs equal the eager engine's, whose decode tables
    are narrowed by the same rule."""
    from qwen3_kernels.ops import BATCH_INVARIANT_SPLIT_KEYS as SPLIT

    cfg = make_tiny_qwen3(tmp_path, "tied_gqa2", max_position_embeddings=4096)
    char_tokenizer(cfg.vocab_size).save_pretrained(tmp_path)
    kw = dict(kvcache_block_size=BS, max_num_seqs=4, max_num_batched_tokens=SPLIT,
              max_model_len=4096, deterministic=True, enable_prefix_caching=False)
    prompts = random_prompts([SPLIT - 8, 5], cfg.vocab_size, seed=3)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    eager = LLM(str(tmp_path), enforce_eager=True, **kw).generate(prompts, params,
                                                                  use_tqdm=False)
    llm = LLM(str(tmp_path), **kw)
    runner = llm.model_runner
    assert (runner.short_table_blocks, runner.max_blocks_per_seq) == (SPLIT // BS, 4096 // BS)
    runner.graph_batch_sizes = [1, 2, 4]
    runner.make_graph_buffers(4)
    runner.graph_vars["block_tables"].fill_(3)  # stale rows must not matter
    runner.graph_vars["short_block_tables"].fill_(3)
    runner.graphs = {bs: EagerReplay(runner, bs) for bs in runner.graph_batch_sizes}
    runner.short_graphs = {bs: EagerReplay(runner, bs, True) for bs in runner.graph_batch_sizes}
    outs = llm.generate(prompts, params, use_tqdm=False)
    for e, o in zip(eager, outs):
        assert o.token_ids == e.token_ids and o.logprobs == e.logprobs
    # one prefill step, then 15 decode steps at positions SPLIT - 8 ..: 8 with every context
    # within SPLIT keys, 7 past it
    assert sum(g.replays for g in runner.short_graphs.values()) == 8
    assert sum(g.replays for g in runner.graphs.values()) == 7
