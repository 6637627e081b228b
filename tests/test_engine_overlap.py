"""Overlapped steps (LLMEngine._steps: step k + 1 is scheduled and launched before step k's tokens
are read back) give exactly the step-by-step loop's schedule and outputs, on CPU.

The mix covers what the overlap must get right: sequences whose tokens can end them (EOS, stop
ids, stop strings: those steps are waited for) next to ignore_eos ones (advanced with
placeholders), seeded sampling (keyed by output position), min_tokens bans, prefix-cache hits,
chunked prefill (one-token chunks included), preemption, and sequences finishing at a length.
"""

from __future__ import annotations

import pytest
import torch

from qwen3_model import LLM, SamplingParams
from qwen3_model.engine import model_runner as mr
from qwen3_model.engine.scheduler import Scheduler
from qwen3_model.random_checkpoint import char_tokenizer
from tests.helpers import one_thread  # noqa: F401  (autouse: one intra-op thread)
from tests.qwen3_tiny import make_tiny_qwen3

BS = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("overlap")
    cfg = make_tiny_qwen3(path, "tied_gqa2")
    char_tokenizer(cfg.vocab_size).save_pretrained(path)
    return str(path), cfg


def workload(vocab, eos_too: bool):
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(4, vocab, (2 * BS,), generator=g).tolist()
    prompts, params = [], []
    for i in range(14):
        n = int(torch.randint(1, 60, (1,), generator=g))
        tail = torch.randint(4, vocab, (n,), generator=g).tolist()
        prompts.append(shared + tail if i % 3 == 0 else tail)
        kw = dict(max_tokens=int(torch.randint(3, 40, (1,), generator=g)), ignore_eos=True)
        if i % 4 == 1:
            kw.update(temperature=0.8, seed=100 + i)
        elif i % 4 == 2:
            kw.update(temperature=0)
        if i % 5 == 3:
            kw.update(min_tokens=2)
        if eos_too and i % 6 == 5:
            kw.update(ignore_eos=False, stop_token_ids=[7, 9])
        if eos_too and i == 4:
            kw.update(stop=["ab"])
        params.append(SamplingParams(**kw))
    return prompts, params


def run(path, monkeypatch, overlap: bool, prompts, params, **kw):
    llm = LLM(path, kvcache_block_size=BS, overlap_steps=overlap, **kw)
    log = []
    schedule = llm.scheduler.schedule

    def logged():
        batch = schedule()
        log.append(([(s.seq_id - first, n) for s, n in batch.prefills],
                    [s.seq_id - first for s in batch.decodes]))
        return batch

    llm.scheduler.schedule = logged
    first = next(mr.Sequence._ids) + 1  # seq ids of this generate start here
    outs = llm.generate(prompts, params, use_tqdm=False)
    sched = llm.scheduler
    stats = (sched.num_steps, sched.num_preemptions, sched.num_partial_prefills,
             sched.num_prefix_hit_tokens)
    result = [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in outs]
    bm = sched.block_manager
    assert sched.is_finished() and bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()  # ref counts, free list, the block-table mirror rows all cleared
    return result, log, stats, llm


@pytest.mark.parametrize("eos_too", [False, True], ids=["ignore_eos", "with_stops"])
@pytest.mark.parametrize("kw", [
    dict(max_num_seqs=8, max_num_batched_tokens=64),  # chunked prefill, prefix hits
    dict(max_num_seqs=8, max_num_batched_tokens=37, num_kvcache_blocks=12),  # + preemption
], ids=["chunked", "preempting"])
def test_overlapped_steps_equal_step_by_step(ckpt, monkeypatch, eos_too, kw):
    path, cfg = ckpt
    prompts, params = workload(cfg.vocab_size, eos_too)
    calls = {"advance": 0, "in_order": 0, "gathered": 0}
    advance, fill_pending = Scheduler.advance, mr.ModelRunner._fill_pending

    def count_advance(self, batch):
        calls["advance"] += 1
        return advance(self, batch)

    def count_fill(self, plan, input_ids, t):
        calls["in_order" if plan.pending_in_order else "gathered"] += 1
        return fill_pending(self, plan, input_ids, t)

    monkeypatch.setattr(Scheduler, "advance", count_advance)
    monkeypatch.setattr(mr.ModelRunner, "_fill_pending", count_fill)
    ref, ref_log, ref_stats, _ = run(path, monkeypatch, False, prompts, params, **kw)
    assert calls["advance"] == 0
    got, log, stats, _ = run(path, monkeypatch, True, prompts, params, **kw)
    assert got == ref
    assert log == ref_log and stats == ref_stats
    # the overlap did happen, through both ways of feeding the device-side tokens
    assert calls["advance"] > 5 and calls["in_order"] > 0 and calls["gathered"] > 0
    if "num_kvcache_blocks" in kw:
        assert stats[1] > 0, "the workload was meant to preempt"
    assert stats[2] > 0 and stats[3] > 0  # chunked prefill and prefix hits happened


def test_stream_stopped_early_leaves_no_placeholder(ckpt, monkeypatch):
    path, cfg = ckpt
    llm = LLM(path, kvcache_block_size=BS, max_num_seqs=4, max_num_batched_tokens=64,
              overlap_steps=True)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    seen = []
    for delta in llm.stream([[5, 6, 7], [8, 9]], sp):
        seen.append(delta)
        if len(seen) == 5:
            break
    assert llm.is_finished()
    # the engine runs the next request normally afterwards
    out = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0]
    assert len(out.token_ids) == 30 and min(out.token_ids) >= 0
    assert [d.token_ids for d in seen if d.index == 0] == [[t] for t in out.token_ids[:len(
        [d for d in seen if d.index == 0])]]
