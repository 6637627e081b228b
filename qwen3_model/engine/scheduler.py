"""Continuous batching with chunked prefill, under a per-step token budget.

Each step the scheduler walks the running sequences oldest first: a decoding sequence gets its one
token, a prefilling one its next chunk (as much as the budget still allows). What budget is left
then admits waiting sequences, oldest first (under ``policy="longest_first"``: the one that may
still produce the most output tokens first, below). So decodes and prefill chunks share one step,
a long prompt never stalls the decodes, and no step exceeds ``max_num_batched_tokens``.

A sequence is admitted only when blocks for all its tokens can be had (after prefix-cache hits).
When a running sequence needs one more block and none is free, the newest running sequence is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed
later (its full blocks usually survive in the prefix cache, so that is often cheap).

Longest first: an offline batch (``LLM.generate`` with every request known at once) ends when its
longest request ends, so starting the requests with the most output tokens to go first shortens
it (the LPT rule of makespan scheduling). It also makes a small token budget pay: with
``max_num_batched_tokens`` near the size where a step's GEMMs stop being bound by reading the
weights (a few hundred tokens at Qwen3-8B on an H200), the short requests' prompts are computed in
chunks alongside the long requests' decodes, in steps that read every weight anyway, instead of
in large prefill steps of their own; and they still finish before the longest ones. A cap on the
running sequences below the batch's size (``max_num_seqs``) spreads the admissions further: the
shortest requests wait for a slot, and their prompts fill the batch's last steps, which would
otherwise decode a few sequences each (Qwen3-8B on an H200: 384 tokens and 176 sequences for 256
requests, benchmarks/RESULTS.md). It orders by
``max_tokens`` (a bound when EOS can end a request early) and may keep a short request waiting
behind longer ones, so it is a throughput setting for offline batches only. ``policy="auto"``
(the default) is fcfs, and the engine switches a large offline batch on a large model to longest
first with smaller budgets for the length of that batch (``throughput_schedule``,
``Scheduler.offline_batch``).
"""

from __future__ import annotations

import contextlib
from collections import deque
from itertools import chain, repeat
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from qwen3_model.config import (
    SCHEDULING_POLICIES,
    THROUGHPUT_MAX_NUM_BATCHED_TOKENS,
    THROUGHPUT_MAX_NUM_SEQS,
    THROUGHPUT_MIN_WEIGHT_BYTES,
)
from qwen3_model.engine.block_manager import BlockManager
from qwen3_model.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step's work. The flat token batch is the prefill chunks (in order), then the decodes.

    A sequence with exactly one token to compute this step goes in ``decodes`` whether or not it
    is past its prompt: attention is the same (one query over the whole cached context).
    """

    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, chunk length)
    decodes: list[Sequence] = field(default_factory=list)
    # the block manager's table mirror (row ``seq.table_row`` = ``seq.block_table``, 0-padded);
    # None: the runner builds the tables from the lists
    block_tables: np.ndarray | None = None
    # decodes whose one token is not their last (a prompt chunk cut to one token by the budget):
    # their row is not sampled. None: not counted (the runner checks every decode)
    num_partial_decodes: int | None = None

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefills)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + len(self.decodes)

    def items(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens computed this step), in batch order."""
        return self.prefills + [(s, 1) for s in self.decodes]

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


_context_len = attrgetter("num_computed_tokens")  # a decode's cached keys (its one query sees them)


def _output_left(seq: Sequence) -> int:
    """Tokens ``seq`` may still append (its length limit less what it holds)."""
    return seq.max_num_tokens - len(seq.token_ids)


def throughput_schedule(policy: str, weight_bytes: int, num_requests: int, max_num_seqs: int,
                        max_num_batched_tokens: int, mixed_step_graphs: bool
                        ) -> tuple[int, int] | None:
    """``policy="auto"`` for an offline batch of ``num_requests`` on a model with ``weight_bytes``
    of weights per GPU: (max_num_seqs, max_num_batched_tokens) to run it longest first under,
    or None to run it as configured (config.py, THROUGHPUT_*). ``mixed_step_graphs``: steps of
    THROUGHPUT_MAX_NUM_BATCHED_TOKENS prompt and decode tokens replay CUDA graphs (one GPU,
    piecewise graphs that large); run eagerly, their launches would set the pace instead.
    The deterministic mode too: Qwen3-8B on an H200, 9,207 output tok/s under this schedule
    against 8,976 fcfs (one call)."""
    if (policy != "auto" or not mixed_step_graphs
            or weight_bytes < THROUGHPUT_MIN_WEIGHT_BYTES
            or num_requests <= THROUGHPUT_MAX_NUM_SEQS):
        return None
    # (max_num_seqs <= max_num_batched_tokens holds for the pair as for the configured one)
    return (min(max_num_seqs, THROUGHPUT_MAX_NUM_SEQS),
            min(max_num_batched_tokens, THROUGHPUT_MAX_NUM_BATCHED_TOKENS))


class Scheduler:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        eos_token_ids: tuple[int, ...] | list[int] = (),
        policy: str = "fcfs",
    ):
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"Scheduler: policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {policy!r}")
        self.longest_first = policy == "longest_first"  # ("auto": fcfs; see offline_batch)
        self._waiting_sorted = True  # longest_first: whether ``waiting`` is in admission order
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching,
                                          max_blocks_per_seq=-(-max_model_len // block_size),
                                          max_seqs=max_num_seqs)
        # Admission keeps ~1% of the pool free so that running decodes can grow a block without
        # immediately preempting the sequence just admitted (vLLM's watermark).
        self.reserve_blocks = num_blocks // 100
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # counters, for tests and logs
        self.num_preemptions = 0
        self.num_partial_prefills = 0  # chunks that stopped short of the end of the prompt
        self.num_prefix_hit_tokens = 0
        self.num_steps = 0
        # the sequences the last postprocess finished, in batch order (the engine reads them
        # instead of scanning every sequence that got a token)
        self.last_finished: list[Sequence] = []

    @contextlib.contextmanager
    def offline_batch(self, max_num_seqs: int, max_num_batched_tokens: int):
        """Longest first under these budgets until the block ends (``throughput_schedule``'s),
        then the configured policy and budgets again."""
        saved = self.longest_first, self.max_num_seqs, self.max_num_batched_tokens
        self.longest_first, self._waiting_sorted = True, False
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        try:
            yield
        finally:
            self.longest_first, self.max_num_seqs, self.max_num_batched_tokens = saved

    # ---- queue ---------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        p = seq.params
        seq.max_num_tokens = min(seq.num_prompt_tokens + p.max_tokens, self.max_model_len)
        seq.stop_ids = frozenset(p.stop_token_ids).union(() if p.ignore_eos else self.eos_token_ids)
        # stop strings: the engine ends it; penalties (a history on the sequence): the next
        # sampling counts the token
        seq.needs_tokens = bool(seq.stop_ids or p.stop or seq.penalty_state is not None)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._waiting_sorted = False

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def abort_all(self) -> list[Sequence]:
        """Drop every unfinished sequence and free its blocks (after an error or an interrupt)."""
        dropped = list(self.running) + list(self.waiting)
        for seq in self.running:
            self.block_manager.free_seq(seq)
        for seq in dropped:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = seq.finish_reason or "abort"
        self.running.clear()
        self.waiting.clear()
        return dropped

    def abort(self, seq: Sequence) -> None:
        """End ``seq`` now, wherever it is (waiting or running), and free its blocks. Called
        between steps (an in-flight step that still computes it writes only blocks it held when
        launched, ahead of any later step that reuses them on the same stream)."""
        if seq.status == SequenceStatus.FINISHED:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._end(seq, "abort", None)

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch()
        prefills, decodes = batch.prefills, batch.decodes
        preempted = False

        slots_per_block = bm.block_size
        running = self.running
        partial_decodes = 0

        def take(seq: Sequence, n: int, left: int) -> None:
            # n of seq's ``left`` uncomputed tokens into this step: a decode (one token; a partial
            # one when more were left) or a prefill chunk
            nonlocal partial_decodes
            if n == 1:
                decodes.append(seq)
                partial_decodes += left > 1
            else:
                prefills.append((seq, n))
            if n < left:
                self.num_partial_prefills += 1

        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            computed = seq.num_computed_tokens
            left = len(seq.token_ids) - computed
            n = left if left <= budget else budget
            if len(seq.block_table) * slots_per_block < computed + n:  # (rare: a block boundary)
                # Victims come from the back, which this loop has not reached yet (or is ``seq``).
                while not bm.can_grow(seq, computed + n):
                    victim = running[-1]
                    self._preempt(victim)
                    preempted = True
                    if victim is seq:
                        break
                if seq.status != SequenceStatus.RUNNING:
                    break
                bm.grow(seq, computed + n)
            take(seq, n, left)
            budget -= n
            i += 1

        if self.longest_first and not self._waiting_sorted:
            # (a stable sort: arrival order among equals; once per batch of adds, not per step)
            self.waiting = deque(sorted(self.waiting, key=_output_left, reverse=True))
            self._waiting_sorted = True
        # Admitting right after a preemption would just take back the blocks we freed.
        while not preempted and self.waiting and budget > 0 and len(running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit_ids, hit_hashes = bm.match_prefix(seq)
            reserve = self.reserve_blocks if running else 0
            if not bm.can_admit(seq, hit_ids, reserve):
                break
            self.waiting.popleft()
            bm.admit(seq, hit_ids, hit_hashes)
            self.num_prefix_hit_tokens += seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            running.append(seq)
            left = seq.num_uncomputed_tokens
            n = min(left, budget)
            take(seq, n, left)
            budget -= n

        # Longest context first: decode attention runs one CTA per (sequence, kv head) in batch
        # order once the batch fills the GPU, and the GPU starts them in that order, so the
        # longest ones start first instead of ending the kernel alone (a longest-first greedy
        # schedule). Nothing else depends on the order of the decodes.
        decodes.sort(key=_context_len, reverse=True)
        batch.block_tables = bm.tables
        batch.num_partial_decodes = partial_decodes
        if batch:
            self.num_steps += 1
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        self._waiting_sorted = False  # (longest_first: it goes where its output left puts it)

    # ---- after the forward ---------------------------------------------------------------------

    def postprocess(self, batch: ScheduledBatch, sampled: list[int]) -> list[Sequence]:
        """Advance the computed counts, append the sampled tokens, finish what must finish.

        ``sampled`` holds one token per sequence whose chunk reached its last token, in batch
        order (exactly the rows the runner sampled). Returns the sequences that got a token;
        ``last_finished`` the ones of them that finished.
        """
        return self._postprocess(batch, sampled)

    @staticmethod
    def needs_tokens(seqs: list[Sequence]) -> bool:
        """Whether the value of a token sampled for one of ``seqs`` can end it (a stop id, EOS,
        a stop string), so that what runs next depends on it (see ``advance``)."""
        return any([s.needs_tokens for s in seqs])  # (a list: faster than a generator)

    def advance(self, batch: ScheduledBatch) -> list[Sequence]:
        """``postprocess`` before the step's tokens are read back: valid when none of the
        sampled sequences ``needs_tokens``, since then only token counts decide what happens
        next (finishing at a length, blocks, the next schedule), never token values.

        Each sampled sequence gets a placeholder ``-1 - k`` (k: its row among the step's
        sampled tokens), which the model runner turns into that token on the device when the
        next step takes it as input; ``fill`` writes the values once they are read back.
        """
        return self._postprocess(batch, None)

    @staticmethod
    def fill(got: list[Sequence], sampled: list[int]) -> None:
        """The read-back tokens of a step run through ``advance`` (``got``: what it returned).

        Each placeholder is still its sequence's last token: the next ``advance`` (the only
        thing that appends) runs after this.
        """
        assert len(got) == len(sampled), "one token per sequence that got a placeholder"
        for seq, token in zip(got, sampled):
            seq.token_ids[-1] = token

    def _postprocess(self, batch: ScheduledBatch, sampled: list[int] | None) -> list[Sequence]:
        bm = self.block_manager
        caching, bs = bm.enable_prefix_caching, bm.block_size
        got_token = []
        finished = self.last_finished = []
        it = iter(sampled) if sampled is not None else None
        # (the loop runs once per sequence per step: plain locals, the rare cases in calls)
        for seq, n in chain(batch.prefills, zip(batch.decodes, repeat(1))):
            computed = seq.num_computed_tokens + n
            seq.num_computed_tokens = computed
            if caching and computed >= (len(seq.block_hashes) + 1) * bs:
                bm.cache_full_blocks(seq)  # a block just became full
            tokens = seq.token_ids
            if computed < len(tokens):
                continue  # a chunk short of the end: nothing to sample yet
            token = next(it) if it is not None else -1 - len(got_token)
            tokens.append(token)
            got_token.append(seq)
            # the full check only when it can end: at its length limit or on a stop / EOS id
            # (a placeholder is never one: advance is only used when no token can end it)
            if len(tokens) >= seq.max_num_tokens or token in seq.stop_ids:
                reason, stop_reason = self._finish_reason(seq, token)
                if reason is not None:
                    self._end(seq, reason, stop_reason)
                    finished.append(seq)
        if it is not None:
            assert next(it, None) is None, "more sampled tokens than sequences that needed one"
        if finished:  # one pass, not a list.remove per finished sequence
            self.running[:] = [s for s in self.running if s.status is SequenceStatus.RUNNING]
        return got_token

    def _finish_reason(self, seq: Sequence, token: int):
        p = seq.params
        num_tokens = len(seq.token_ids)
        num_out = num_tokens - seq.num_prompt_tokens
        # the token just appended was sampled with num_out - 1 tokens before it; EOS and stop
        # ids count only once min_tokens tokens came before
        past_min = num_out > p.min_tokens
        if past_min and token in p.stop_token_ids:
            return "stop", token
        if past_min and not p.ignore_eos and token in self.eos_token_ids:
            return "stop", None
        if num_out >= p.max_tokens or num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        """End ``seq`` (also used by the engine when a stop string appears)."""
        if seq.status == SequenceStatus.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        self._end(seq, reason, stop_reason)

    def _end(self, seq: Sequence, reason: str, stop_reason) -> None:
        """Mark ``seq`` finished and free its blocks (the caller takes it out of ``running``)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.block_manager.free_seq(seq)
