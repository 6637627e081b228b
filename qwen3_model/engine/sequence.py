"""One request as the scheduler sees it: its tokens, how many have K/V in the cache, its blocks."""

from __future__ import annotations

from enum import Enum, auto
from itertools import count

from qwen3_model.sampling_params import SamplingParams


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
        self.params = params
        self.finish_reason: str | None = None  # "stop" or "length"
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.num_preemptions = 0

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
