"""Incremental detokenization of the requests' outputs, and stop strings.

A model may have more vocabulary rows than its tokenizer has entries (Qwen3: 151,936 rows for
151,669 tokens), and a random or fine-tuned model can sample the extra ids. An id the tokenizer
has no entry for (>= ``len(tokenizer)``) decodes to "" (nothing), on every path (tokenizers'
DecodeStream, the window decode, ``Detokenizer.decode``), whatever the tokenizer itself would do
with it (tokenizers skips it; a slow tokenizer may raise). The id stays in the token ids.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

from qwen3_model.engine.sequence import Sequence, SequenceStatus


def load_tokenizer(path: str):
    """The checkpoint's tokenizer, or None (token-id prompts only, text outputs are "")."""
    files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any(os.path.isfile(os.path.join(path, f)) for f in files):
        return None  # (and no attempt to reach the Hub from an offline machine)
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass
class DetokState:
    """Where one request's incremental detokenization stands."""

    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""  # all text so far, cut before a stop string once one matched
    emitted: int = 0  # chars already streamed
    sent: int = 0  # output ids already streamed
    ids: list[int] = field(default_factory=list)  # ids fed to the detokenizer (decodable ones)
    num_fed: int = 0  # output ids taken in (the undecodable ones too)
    stream: object = None  # tokenizers' DecodeStream, where the tokenizer has one


class Detokenizer:
    """Feeds each request's new tokens to the tokenizer and matches its stop strings; a match
    ends the request through ``finish(seq, "stop", stop_string)`` (``Scheduler.finish``)."""

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...],
                 finish: Callable[[Sequence, str, str], None]):
        self.tokenizer = tokenizer  # None: ids only
        self.eos_token_ids = eos_token_ids
        self.finish = finish
        # ids at or past this have no entry in the tokenizer: they decode to ""
        self.num_entries = len(tokenizer) if tokenizer is not None else 0
        # A fast tokenizer decodes incrementally in Rust (tokenizers' DecodeStream: ~2 us a token
        # where two full decodes of a window cost ~15 us, which a server streaming every token
        # of hundreds of requests pays on the step loop's thread); the window decode below
        # stays for the rest, and where spaces are cleaned up after decoding.
        self._backend = None
        if tokenizer is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
            try:
                from tokenizers.decoders import DecodeStream  # noqa: F401

                self._backend = tokenizer.backend_tokenizer
            except (ImportError, AttributeError):
                pass

    def step(self, seq: Sequence, state: DetokState, want_text: bool) -> None:
        """Feed ``seq``'s new tokens to its detokenizer; apply stop strings."""
        p = seq.params
        new_ids = seq.token_ids[seq.num_prompt_tokens + state.num_fed:]  # O(new), not O(output)
        if isinstance(seq.stop_reason, int) or (
            seq.finish_reason == "stop" and seq.stop_reason is None and new_ids
            and new_ids[-1] in self.eos_token_ids
        ):
            new_ids = new_ids[:-1]  # the stop id / EOS that ended it is not part of the text
        state.num_fed += len(new_ids)
        if new_ids and max(new_ids) >= self.num_entries and self.tokenizer is not None:
            new_ids = [t for t in new_ids if t < self.num_entries]  # no entry: decodes to ""
        state.ids.extend(new_ids)
        if self.tokenizer is None or not (want_text or p.stop):
            return
        before = len(state.text)
        state.text += self._decode_stream(state, new_ids) if self._backend else \
            self._decode_new(state)
        if p.stop and seq.num_completion_tokens > p.min_tokens:
            longest = max(len(s) for s in p.stop)
            start = max(0, before - longest + 1)
            hits = [(state.text.find(s, start), s) for s in p.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                cut, s = min(hits)
                state.text = state.text[:cut]
                if seq.status == SequenceStatus.FINISHED:  # it also hit a length limit this step
                    seq.finish_reason, seq.stop_reason = "stop", s
                else:
                    self.finish(seq, "stop", s)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` (special tokens skipped; ids without a tokenizer entry: "")."""
        if self.tokenizer is None:
            return ""
        if ids and max(ids) >= self.num_entries:
            ids = [t for t in ids if t < self.num_entries]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _decode_stream(self, state: DetokState, new_ids: list[int]) -> str:
        """Text added by ``new_ids`` (an incomplete multi-byte char waits for its next id)."""
        stream = state.stream
        if stream is None:
            from tokenizers.decoders import DecodeStream

            stream = state.stream = DecodeStream(skip_special_tokens=True)
        backend = self._backend
        return "".join(filter(None, [stream.step(backend, t) for t in new_ids]))

    def _decode_new(self, state: DetokState) -> str:
        """Text added by the ids past read_offset; empty while a multi-byte char is incomplete."""
        tok = self.tokenizer
        ids = state.ids
        prefix = tok.decode(ids[state.prefix_offset : state.read_offset], skip_special_tokens=True)
        full = tok.decode(ids[state.prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            state.prefix_offset, state.read_offset = state.read_offset, len(ids)
            return full[len(prefix) :]
        return ""
