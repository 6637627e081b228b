"""One request as the scheduler sees it: its tokens, how many have K/V in the cache, its blocks."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import Enum, auto
from itertools import count

from qwen3_model.sampling_params import SamplingParams


@dataclass(slots=True)
class TokenLogprobs:
    """One token's logprob (SamplingParams.logprobs / prompt_logprobs), from the raw logits:
    fp32 log_softmax of the LM head's output, before any sampling setting."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely (1 + the number of tokens strictly more likely)
    top: list[tuple[int, float]]  # the top-N (token_id, logprob), most likely first; [] for N = 0


class SequenceStatus(Enum):
    WAITING = auto()  # not admitted yet, or preempted (its blocks were freed; it will recompute)
    RUNNING = auto()  # holds blocks; gets a chunk of prefill or one decode token per step
    FINISHED = auto()


class Sequence:
    """token_ids = prompt + output so far.

    ``num_computed_tokens`` tokens have their K/V in the cache; a step computes the next chunk
    ``[num_computed_tokens, num_computed_tokens + n)``. When that chunk reaches the last token the
    step also samples a new token (appended, not yet computed). So a decoding sequence always has
    exactly one uncomputed token, and a prefilling one has more (or, after a prefix-cache hit,
    possibly exactly one: the hit never covers the last prompt token, whose logits we need).
    """

    _ids = count()
    __slots__ = ("seq_id", "index", "status", "token_ids", "num_prompt_tokens",
                 "num_computed_tokens", "num_cached_tokens", "block_table", "block_hashes",
                 "table_row", "params", "max_num_tokens", "stop_ids", "needs_tokens",
                 "finish_reason", "stop_reason", "num_preemptions", "logprobs",
                 "prompt_logprobs", "penalty_state")

    def __init__(self, token_ids: list[int], params: SamplingParams, index: int = 0):
        self.seq_id = next(Sequence._ids)
        self.index = index  # position in the caller's prompt list
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # of the computed ones, how many came from the prefix cache
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full, computed blocks we own
        # the row of BlockManager.tables mirroring block_table (-1: holds no blocks), so that
        # the model runner gathers a step's block tables with one numpy take, not list padding
        self.table_row = -1
        self.params = params
        # set by Scheduler.add: the length at which it ends ("length"), and the token ids that
        # may end it ("stop": stop ids, EOS unless ignore_eos) - so that postprocess checks two
        # cheap conditions per token and calls the full check only when one holds
        self.max_num_tokens = self.num_prompt_tokens + params.max_tokens
        self.stop_ids: frozenset[int] = frozenset(params.stop_token_ids)
        # whether a sampled token's value (not just its count) can end it: then the scheduling
        # after a step that samples it must wait for the token (see Scheduler.advance)
        self.needs_tokens = True
        self.finish_reason: str | None = None  # "stop" or "length"
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.num_preemptions = 0
        # one entry per generated token (the model runner appends them as tokens are read back)
        self.logprobs: list[TokenLogprobs] | None = None if params.logprobs is None else []
        # one entry per prompt token, [0] None (nothing predicts the first); the runner fills
        # entry p + 1 when it computes the prompt token at position p
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            None if params.prompt_logprobs is None else [None] * self.num_prompt_tokens)
        # a penalized request's history (SamplingParams.penalized; the model runner updates it):
        # [count of each output token, output tokens counted so far, the prompt's ids]; else None
        self.penalty_state: list | None = (
            [Counter(), 0, set(self.token_ids)] if params.penalized else None)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, index={self.index}, {self.status.name}, "
            f"tokens={self.num_tokens} (prompt {self.num_prompt_tokens}), "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
