"""Scheduler: continuous batching, chunked prefill under the token budget, preemption, finishing.

The model is replaced by a deterministic function of each sequence's tokens, so whatever the
schedule (chunks, preemptions, batch mix), every request must end with the same tokens.
"""

from __future__ import annotations

import itertools
import random

import pytest

from qwen3_model.engine.scheduler import ScheduledBatch, Scheduler
from qwen3_model.engine.sequence import Sequence, SequenceStatus
from qwen3_model.sampling_params import SamplingParams

BS = 4


def fake_token(seq: Sequence) -> int:
    return (sum(seq.token_ids) * 31 + 7 * len(seq.token_ids)) % 50 + 10


def make(num_blocks=64, budget=32, max_seqs=8, max_len=256, eos=(), prefix=True, policy="fcfs"):
    return Scheduler(num_blocks=num_blocks, block_size=BS, max_num_seqs=max_seqs,
                     max_num_batched_tokens=budget, max_model_len=max_len,
                     enable_prefix_caching=prefix, eos_token_ids=eos, policy=policy)


def fake_step(sched: Scheduler, log: list | None = None) -> ScheduledBatch:
    batch = sched.schedule()
    assert batch, "empty step with work pending"
    assert batch.num_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    for seq, n in batch.items():
        assert n >= 1 and seq.num_computed_tokens + n <= seq.num_tokens
        # the chunk's slots are all covered by the block table
        assert len(seq.block_table) * BS >= seq.num_computed_tokens + n
    tokens = [fake_token(s) for s, n in batch.items() if s.num_computed_tokens + n == s.num_tokens]
    if log is not None:
        log.append([(s.seq_id, n) for s, n in batch.items()])
    sched.postprocess(batch, tokens)
    sched.block_manager.check_invariants()
    return batch


def run_all(sched, seqs, log=None, max_steps=10_000):
    for s in seqs:
        sched.add(s)
    steps = 0
    while not sched.is_finished():
        fake_step(sched, log)
        steps += 1
        assert steps < max_steps, "no progress"
    return steps


def reference_output(prompt, max_tokens):
    s = Sequence(prompt, SamplingParams(max_tokens=max_tokens))
    while s.num_completion_tokens < max_tokens:
        s.append_token(fake_token(s))
    return s.completion_token_ids


def random_requests(n, seed=0, max_prompt=40, max_out=20):
    rng = random.Random(seed)
    return [([rng.randrange(100) for _ in range(rng.randint(1, max_prompt))], rng.randint(1, max_out))
            for _ in range(n)]


def test_long_prompt_is_chunked_under_the_budget():
    sched = make(budget=8)
    s = Sequence(list(range(20)), SamplingParams(max_tokens=3))
    log = []
    run_all(sched, [s], log)
    assert [step[0][1] for step in log[:3]] == [8, 8, 4]  # then one token per decode step
    assert sched.num_partial_prefills == 2
    assert s.completion_token_ids == reference_output(list(range(20)), 3)


def test_prefill_chunks_and_decodes_share_a_step():
    sched = make(budget=10)
    a = Sequence([1, 2, 3], SamplingParams(max_tokens=10))
    sched.add(a)
    fake_step(sched)  # a prefilled, decoding from now on
    b = Sequence(list(range(30)), SamplingParams(max_tokens=2))
    sched.add(b)
    batch = fake_step(sched)
    assert batch.decodes == [a]
    assert batch.prefills == [(b, 9)]  # the budget left after a's decode
    assert batch.num_tokens == 10


def test_outputs_do_not_depend_on_the_schedule():
    reqs = random_requests(12)
    expected = [reference_output(p, m) for p, m in reqs]
    for (budget, num_blocks), policy in itertools.product(
            [(512, 256), (16, 256), (7, 30), (64, 16)], ["fcfs", "longest_first"]):
        sched = make(num_blocks=num_blocks, budget=budget, max_seqs=6, policy=policy)
        seqs = [Sequence(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in reqs]
        run_all(sched, seqs)
        assert [s.completion_token_ids for s in seqs] == expected, (budget, num_blocks, policy)
        assert all(s.finish_reason == "length" for s in seqs)
        assert sched.block_manager.num_free_blocks == num_blocks  # everything given back


def test_preemption_happens_when_blocks_run_out_and_recomputes():
    sched = make(num_blocks=12, budget=64, max_seqs=4)
    reqs = [(list(range(i, i + 10)), 24) for i in range(4)]  # 4 x 34 tokens = 36 blocks needed
    seqs = [Sequence(p, SamplingParams(max_tokens=m)) for p, m in reqs]
    run_all(sched, seqs)
    assert sched.num_preemptions > 0
    assert any(s.num_preemptions > 0 for s in seqs)
    assert [s.completion_token_ids for s in seqs] == [reference_output(p, m) for p, m in reqs]


def test_max_num_seqs_limits_the_running_set():
    sched = make(max_seqs=2, budget=64)
    seqs = [Sequence([i + 1] * 3, SamplingParams(max_tokens=4)) for i in range(5)]
    for s in seqs:
        sched.add(s)
    fake_step(sched)
    assert len(sched.running) == 2 and len(sched.waiting) == 3
    while not sched.is_finished():
        fake_step(sched)
    assert all(s.num_completion_tokens == 4 for s in seqs)


def test_full_prefix_hit_still_computes_the_last_prompt_token():
    sched = make()
    prompt = list(range(9))  # two full blocks + 1 token
    a = Sequence(prompt, SamplingParams(max_tokens=2))
    run_all(sched, [a])
    b = Sequence(prompt, SamplingParams(max_tokens=2))
    sched.add(b)
    batch = fake_step(sched)
    assert b.num_cached_tokens == 8
    assert batch.decodes == [b]  # exactly one token left to compute, and it is sampled
    assert sched.num_prefix_hit_tokens == 8
    while not sched.is_finished():
        fake_step(sched)
    assert b.completion_token_ids == a.completion_token_ids


def finish(sched, prompt, params, tokens):
    """Drive one sequence with the given sampled tokens; returns it."""
    s = Sequence(prompt, params)
    sched.add(s)
    it = iter(tokens)
    while not s.is_finished:
        batch = sched.schedule()
        sched.postprocess(batch, [next(it) for x, n in batch.items()
                                  if x.num_computed_tokens + n == x.num_tokens])
    return s


def test_finish_reasons():
    sched = make(eos=(2,), max_len=64)
    s = finish(sched, [5, 6], SamplingParams(max_tokens=10), [7, 2, 9])
    assert (s.finish_reason, s.stop_reason, s.completion_token_ids) == ("stop", None, [7, 2])
    s = finish(sched, [5, 6], SamplingParams(max_tokens=4, ignore_eos=True), [2, 2, 11, 9])
    assert (s.finish_reason, s.completion_token_ids) == ("length", [2, 2, 11, 9])
    s = finish(sched, [5, 6], SamplingParams(max_tokens=3, ignore_eos=True), [2, 2, 2])
    assert (s.finish_reason, s.completion_token_ids) == ("length", [2, 2, 2])
    s = finish(sched, [5, 6], SamplingParams(max_tokens=10, stop_token_ids=[11]), [7, 11])
    assert (s.finish_reason, s.stop_reason) == ("stop", 11)
    # min_tokens: EOS / stop ids before it do not end the request
    s = finish(sched, [5, 6], SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[11]),
               [11, 2, 11])
    assert (s.finish_reason, s.completion_token_ids) == ("stop", [11, 2, 11])
    # max_model_len ends it even before max_tokens
    s = finish(sched, list(range(60)), SamplingParams(max_tokens=10), [7] * 10)
    assert (s.finish_reason, s.num_tokens) == ("length", 64)
    assert sched.is_finished() and sched.block_manager.num_free_blocks == 64


def test_abort_all_frees_everything():
    sched = make()
    seqs = [Sequence(list(range(10)), SamplingParams(max_tokens=50)) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    fake_step(sched)
    dropped = sched.abort_all()
    assert len(dropped) == 3 and sched.is_finished()
    assert all(s.status == SequenceStatus.FINISHED for s in seqs)
    assert sched.block_manager.num_free_blocks == 64


def test_decodes_are_ordered_longest_context_first():
    """Decode attention starts its CTAs in batch order: the longest contexts go first."""
    sched = make(budget=64, max_seqs=8)
    prompts = [[7] * n for n in (3, 11, 5, 17, 2)]
    seqs = [Sequence(p, SamplingParams(max_tokens=6)) for p in prompts]
    for s in seqs:
        sched.add(s)
    fake_step(sched)  # every prompt prefilled in one step
    for _ in range(3):
        batch = fake_step(sched)
        lens = [s.num_computed_tokens for s in batch.decodes]  # (after the step: all + 1)
        assert sorted(batch.decodes, key=lambda s: s.seq_id) == sorted(seqs, key=lambda s: s.seq_id)
        assert lens == sorted(lens, reverse=True) and lens[0] > lens[-1]
    outs = [reference_output(p, 6) for p in prompts]
    while not sched.is_finished():
        fake_step(sched)
    assert [s.completion_token_ids for s in seqs] == outs


def _admission_order(policy, max_tokens, max_seqs=2, add_later=()):
    """seq ids in the order they first get a step, with ``max_seqs`` running at once."""
    sched = make(budget=64, max_seqs=max_seqs, policy=policy)
    seqs = [Sequence([i + 1] * 3, SamplingParams(max_tokens=m, ignore_eos=True))
            for i, m in enumerate(max_tokens)]
    for s in seqs:
        sched.add(s)
    order, steps = [], 0
    while not sched.is_finished():
        if steps == 1:
            for m in add_later:  # arrivals while others run
                s = Sequence([9] * 3, SamplingParams(max_tokens=m, ignore_eos=True))
                seqs.append(s)
                sched.add(s)
        batch = fake_step(sched)
        steps += 1
        order += [seqs.index(s) for s, _ in batch.items() if seqs.index(s) not in order]
    assert all(s.num_completion_tokens == s.params.max_tokens for s in seqs)
    return order


def test_longest_first_admits_the_most_output_left_first():
    max_tokens = [3, 9, 5, 9, 1, 7]
    assert _admission_order("fcfs", max_tokens) == [0, 1, 2, 3, 4, 5]
    # ties keep their arrival order (1 before 3)
    assert _admission_order("longest_first", max_tokens) == [1, 3, 5, 2, 0, 4]
    # a later arrival goes where its max_tokens puts it among those still waiting
    assert _admission_order("longest_first", max_tokens, add_later=[8]) == [1, 3, 6, 5, 2, 0, 4]


def test_longest_first_shortens_an_offline_batch():
    """The LPT rule: with room for two at a time, one long request and many short ones end in
    fewer steps when the long one starts first (fcfs starts it last)."""
    max_tokens = [4] * 6 + [24]
    steps = {}
    for policy in ("fcfs", "longest_first"):
        sched = make(budget=64, max_seqs=2, policy=policy)
        seqs = [Sequence([i + 1] * 3, SamplingParams(max_tokens=m, ignore_eos=True))
                for i, m in enumerate(max_tokens)]
        steps[policy] = run_all(sched, seqs)
        assert [s.completion_token_ids for s in seqs] == [reference_output([i + 1] * 3, m)
                                                          for i, m in enumerate(max_tokens)]
    assert steps["longest_first"] < steps["fcfs"], steps


def test_preempted_sequence_is_readmitted_by_its_output_left():
    sched = make(num_blocks=12, budget=64, max_seqs=4, policy="longest_first")
    reqs = [(list(range(i, i + 10)), 24 - i) for i in range(4)]
    seqs = [Sequence(p, SamplingParams(max_tokens=m)) for p, m in reqs]
    run_all(sched, seqs)
    assert sched.num_preemptions > 0
    assert [s.completion_token_ids for s in seqs] == [reference_output(p, m) for p, m in reqs]


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match=r"policy must be one of \('auto', 'fcfs', 'longest_first'\), "
                                         r"got 'lifo'"):
        make(policy="lifo")


def test_throughput_schedule_rule():
    """policy "auto": a large offline batch on a large model gets the throughput budgets (capped
    by the configured ones); anything else runs as configured."""
    from qwen3_model.config import (THROUGHPUT_MAX_NUM_BATCHED_TOKENS as T,
                                    THROUGHPUT_MAX_NUM_SEQS as S,
                                    THROUGHPUT_MIN_WEIGHT_BYTES as W)
    from qwen3_model.engine.scheduler import throughput_schedule

    assert throughput_schedule("auto", W, S + 1, 512, 16384, True) == (S, T)
    # the configured budgets where smaller
    assert throughput_schedule("auto", W, S + 1, 64, 100, True) == (64, 100)
    assert throughput_schedule("auto", W - 1, 10_000, 512, 16384, True) is None  # small
    # a batch the GPU runs at once
    assert throughput_schedule("auto", W, S, 512, 16384, True) is None
    assert throughput_schedule("auto", W, 10_000, 512, 16384, False) is None  # eager steps
    for policy in ("fcfs", "longest_first"):  # an explicit policy is kept as given
        assert throughput_schedule(policy, W, 10_000, 512, 16384, True) is None


def test_offline_batch_runs_longest_first_under_its_budgets_then_restores():
    sched = make(budget=32, max_seqs=8)
    seqs = [Sequence(list(range(1, 1 + n)), SamplingParams(max_tokens=m, ignore_eos=True))
            for n, m in ((6, 2), (9, 7), (3, 4), (12, 9))]
    for s in seqs:
        sched.add(s)
    with sched.offline_batch(2, 24):
        batch = sched.schedule()
        assert batch.num_tokens <= 24 and len(sched.running) == 2
        # the most output first: max_tokens 9, then 7
        assert [s.params.max_tokens for s in sched.running] == [9, 7]
    assert (sched.longest_first, sched.max_num_seqs, sched.max_num_batched_tokens) == (False, 8, 32)
