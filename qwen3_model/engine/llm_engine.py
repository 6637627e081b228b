"""The offline engine: validate requests, then the step loop (schedule -> run -> postprocess) until
all are done, detokenizing as tokens come.

    engine = LLMEngine("/path/to/Qwen3-0.6B", max_model_len=2048)
    outs = engine.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0))
    for delta in engine.stream(prompts, params):   # tokens as they are produced
        print(delta.index, delta.token_ids, delta.text, delta.finished)

The engine's parts: scheduler.py (what runs next) over block_manager.py (the KV blocks),
model_runner.py (one step on this rank) with step_inputs.py and cuda_graphs.py, workers.py (the
tensor-parallel ranks), detokenizer.py (text and stop strings).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass
from typing import Iterator, Sequence as Seq

import torch
import torch.distributed as dist

from qwen3_model.config import THROUGHPUT_MAX_NUM_BATCHED_TOKENS, Config
from qwen3_model.engine.detokenizer import Detokenizer, DetokState, load_tokenizer
from qwen3_model.engine.model_runner import ModelRunner
from qwen3_model.engine.scheduler import Scheduler, throughput_schedule
from qwen3_model.engine.sequence import Sequence, TokenLogprobs
from qwen3_model.engine.workers import (FAIL_GRACE_S, abort_nccl, dead_worker,
                                        recv_while_alive, start_workers, stop_workers)
from qwen3_model.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    """The result of one request, in prompt order."""

    index: int  # position in the prompt list
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids (an EOS / stop id that ended the request included)
    text: str  # detokenized output ("" without a tokenizer); stop strings and stop ids excluded
    finish_reason: str | None  # "stop" (EOS, stop id or stop string) or "length"
    stop_reason: int | str | None = None  # the stop id or stop string that matched (None for EOS)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # SamplingParams.logprobs: one entry per generated token (None when not asked)
    logprobs: list[TokenLogprobs] | None = None
    # SamplingParams.prompt_logprobs: one entry per prompt token, the first None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class StreamDelta:
    """What one step added to one request."""

    index: int
    token_ids: list[int]  # new ids this step
    text: str  # new text this step (held back while it could still be part of a stop string)
    finished: bool
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # the new tokens' entries (SamplingParams.logprobs)
    # SamplingParams.prompt_logprobs: the prompt's entries, on a request's first delta
    prompt_logprobs: list[TokenLogprobs | None] | None = None


def stream_delta(seq: Sequence, state: DetokState) -> StreamDelta:
    """What ``seq`` added since its last delta (``state`` after ``Detokenizer.step`` with text);
    advances ``state``. Text that could still be the start of a stop string is held back."""
    done = seq.is_finished
    k = state.sent
    new_ids = seq.token_ids[seq.num_prompt_tokens + k:]
    state.sent = k + len(new_ids)
    end = len(state.text)
    if not done:
        if seq.params.stop:  # could be the start of a stop string
            end -= max(len(s) for s in seq.params.stop) - 1
        end = max(end, state.emitted)
    text = state.text[state.emitted : end]
    state.emitted = end
    lps = seq.logprobs
    return StreamDelta(seq.index, new_ids, text, done, seq.finish_reason if done else None,
                       None if lps is None else lps[k : k + len(new_ids)],
                       seq.prompt_logprobs if k == 0 else None)


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        known = set(Config.field_names()) - {"model"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"LLM: unknown argument(s) {unknown}; expected some of: "
                             f"{sorted(known)}")
        config = Config(model, **kwargs)
        self.config = config
        self._workers: list = []
        self._watch = None  # WorkerWatch: dead and stuck workers (tensor parallel)
        world = config.tensor_parallel_size
        if world > 1:
            if config.device == "cuda" and torch.cuda.device_count() < world:
                raise ValueError(f"LLM: tensor_parallel_size={world} needs {world} GPUs, "
                                 f"torch sees {torch.cuda.device_count()}")
            if dist.is_initialized():
                raise RuntimeError("LLM: a torch.distributed process group already exists in "
                                   "this process; tensor_parallel_size > 1 makes its own")
            self._workers, self._watch = start_workers(kwargs, config, world)
        elif dist.is_initialized() and dist.get_world_size() > 1:
            # the layers would shard over that group and wait for peers that never come
            raise RuntimeError(
                f"LLM: this process is in a torch.distributed group of "
                f"{dist.get_world_size()} (a tensor-parallel LLM still open?); close() it "
                "before making a tensor_parallel_size=1 LLM here")
        self._stopped: str | None = None  # why the tensor-parallel workers are gone, once they are
        try:
            self.model_runner = ModelRunner(config, rank=0)
            if self._workers:
                self.model_runner.worker_conns = [conn for _, conn in self._workers]
                if config.device == "cuda":
                    self.model_runner.tp_watch = self._check_workers
                for rank, (proc, conn) in enumerate(self._workers, start=1):
                    msg = recv_while_alive(self._workers, rank)
                    if msg[0] != "ready":
                        raise RuntimeError(f"LLM: tensor-parallel rank {rank} failed: {msg[1]}")
        except BaseException:
            stop_workers(self._workers, world > 1, graceful=False, watch=self._watch)
            raise
        if self._watch is not None and config.device == "cuda":
            self._watch.abort_nccl_on_death = True  # see WorkerWatch
        self._finalizer = weakref.finalize(self, stop_workers, self._workers, world > 1,
                                           graphs=self.model_runner.graphs, watch=self._watch)
        self.tokenizer = load_tokenizer(config.model)
        self.scheduler = Scheduler(
            num_blocks=self.model_runner.num_blocks,
            block_size=config.kvcache_block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            eos_token_ids=config.eos_token_ids,
            policy=config.scheduling_policy,
        )
        self.detokenizer = Detokenizer(self.tokenizer, config.eos_token_ids, self.scheduler.finish)
        # the last generate / stream's (max_num_seqs, max_num_batched_tokens) under
        # scheduling_policy="auto" (longest first), or None: as configured
        self.offline_schedule = None
        # the weights one GPU holds (this rank's shard): what scheduling_policy="auto" reads
        self.weight_bytes = sum(p.numel() * p.element_size()
                                for p in self.model_runner.model.parameters())

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (also done at exit / garbage collection);
        with tensor_parallel_size > 1 the engine cannot run steps afterwards."""
        self._finalizer()
        if self.config.tensor_parallel_size > 1 and self._stopped is None:
            self._stopped = "close() stopped the tensor-parallel workers"

    def _check_workers(self) -> None:
        """Raise if a worker has died. On CUDA, first abort this rank's NCCL communicator: its
        in-flight collective waits for the dead peer forever and would hold the stream."""
        dead = dead_worker(self._workers)
        if dead is None:
            return
        # the graphs first: NCCL's abort waits for the graphs that hold its collectives to go
        self.model_runner.graphs.clear()
        abort_nccl()  # (the watch thread has normally started it already)
        raise RuntimeError(f"LLM: {dead}")

    def _fail_tp(self, error: BaseException) -> None:
        """A step failed with workers running: some rank is mid-step, so the ranks can no longer
        agree on what runs next. Find the worker that died (if one did), stop them all, and raise
        an error naming it; the engine refuses further steps."""
        dead = None
        if not isinstance(error, KeyboardInterrupt):
            # a worker's crash reaches rank 0 as a broken pipe / gloo "connection closed";
            # give the worker a moment to finish exiting so the error can name it
            deadline = time.monotonic() + FAIL_GRACE_S
            while (dead := dead_worker(self._workers)) is None and time.monotonic() < deadline:
                time.sleep(0.05)
        stop_workers(self._workers, True, graceful=False, graphs=self.model_runner.graphs,
                      watch=self._watch)
        self._finalizer.detach()  # done here; a later LLM's process group is not ours to destroy
        self._stopped = (f"a failed step stopped the tensor-parallel workers "
                         f"({dead or f'rank 0 raised {type(error).__name__}: {error}'})")
        if dead is not None:
            raise RuntimeError(f"LLM: {dead}; the tensor-parallel workers were stopped") from error

    # ---- validation ----------------------------------------------------------------------------

    def _normalise(self, prompts, sampling_params):
        """-> list of (prompt, SamplingParams); a single prompt may be given bare."""
        if isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a list of strings or of token-id lists, got "
                             f"{type(prompts).__name__}")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams: "
                                 "give one for all or one per prompt")
        else:
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got "
                             f"{type(sampling_params).__name__}")
        return list(zip(prompts, params))

    def validate_requests(self, prompts, sampling_params,
                          tokenizer=None) -> list[tuple[list[int], SamplingParams]]:
        """Check every request before any work; a ValueError names the first bad one by index.
        ``tokenizer``: encodes text prompts instead of the engine's own (the online engine encodes
        on its callers' thread, and a fast tokenizer must not be used by two threads at once)."""
        tokenizer = tokenizer or self.tokenizer
        reqs = self._normalise(prompts, sampling_params)
        vocab = self.config.hf_config.vocab_size
        max_len = self.config.max_model_len
        pool_tokens = self.scheduler.block_manager.num_blocks * self.config.kvcache_block_size
        out = []
        for i, (prompt, sp) in enumerate(reqs):
            def bad(msg):
                raise ValueError(f"request {i}: {msg}")

            if not isinstance(sp, SamplingParams):
                bad(f"sampling params must be a SamplingParams, got {type(sp).__name__}")
            try:
                sp.validate()
            except ValueError as e:
                bad(str(e))
            if sp.logit_bias and max(sp.logit_bias) >= vocab:
                bad(f"logit_bias names token id {max(sp.logit_bias)}, outside the vocabulary "
                    f"[0, {vocab})")
            if isinstance(prompt, str):
                if tokenizer is None:
                    bad(f"a text prompt needs a tokenizer, and {self.config.model!r} has none; "
                        "pass token ids instead")
                ids = list(tokenizer(prompt)["input_ids"])
                # a tokenizer may have more entries than the model has embedding rows
                if ids and not (0 <= min(ids) and max(ids) < vocab):
                    j, t = next((j, t) for j, t in enumerate(ids) if not 0 <= t < vocab)
                    bad(f"the text prompt encodes to token id {t} at position {j}, outside the "
                        f"model's vocabulary [0, {vocab}) (the tokenizer has more entries than "
                        "the model's embedding rows)")
            elif isinstance(prompt, (list, tuple)):
                ids = list(prompt)
                for j, t in enumerate(ids):
                    if not isinstance(t, int) or isinstance(t, bool):
                        bad(f"token {j} is {t!r}; a prompt is a string or a list of int token ids")
                    if not 0 <= t < vocab:
                        bad(f"token id {t} at position {j} is outside the vocabulary [0, {vocab})")
            else:
                bad(f"a prompt must be a string or a list of token ids, got "
                    f"{type(prompt).__name__}")
            if not ids:
                bad("empty prompt")
            if len(ids) >= max_len:
                bad(f"prompt has {len(ids)} tokens; max_model_len={max_len} leaves no room to "
                    f"generate (the prompt must be shorter than max_model_len)")
            longest = min(len(ids) + sp.max_tokens, max_len)
            if longest > pool_tokens:
                bad(f"prompt ({len(ids)}) + max_tokens ({sp.max_tokens}) needs up to {longest} "
                    f"tokens of KV cache, but the whole pool holds {pool_tokens}; lower max_tokens "
                    "or give the KV cache more room")
            out.append((ids, sp))
        return out

    # ---- the loop ------------------------------------------------------------------------------

    def add_request(self, token_ids: list[int], params: SamplingParams, index: int = 0) -> Sequence:
        seq = Sequence(token_ids, params, index)
        self.scheduler.add(seq)
        return seq

    def step(self) -> tuple[list[Sequence], int, int]:
        """One scheduled forward, its tokens read. -> (sequences that got a token, prefill
        tokens, decode tokens)."""
        self._check_running()
        batch = self._schedule()
        tokens = self._tp_call(self.model_runner.run, batch, launch=True)
        got = self.scheduler.postprocess(batch, tokens)
        return got, batch.num_prefill_tokens, len(batch.decodes)

    def _check_running(self) -> None:
        if self._stopped is not None:
            raise RuntimeError(f"LLM: {self._stopped}; make a new LLM to generate again")

    def _schedule(self):
        batch = self.scheduler.schedule()
        if not batch:
            raise RuntimeError("the scheduler made an empty step with requests pending")
        return batch

    def _tp_call(self, fn, *args, launch: bool = False):
        """A runner call of a step (launch, wait, run). With tensor-parallel workers a failure
        stops them all (``_fail_tp``); ``launch`` first checks that no worker died since the last
        step."""
        if not self._workers:
            return fn(*args)
        try:
            if launch and any(proc.exitcode is not None for proc, _ in self._workers):
                raise RuntimeError("a worker died between steps")  # _fail_tp names it
            return fn(*args)
        except BaseException as e:
            self._fail_tp(e)
            raise

    def _steps(self, online=None) -> Iterator[tuple[list[Sequence], list[Sequence], int, int]]:
        """The step loop: run steps until every request is done; yields per step, in order, the
        sequences that got a token, those of them that finished, and the prefill and decode
        tokens.

        With ``overlap_steps`` (the default), while the device runs step k the host schedules
        and launches step k + 1, then reads step k's tokens. That is valid when no sequence step
        k samples can be ended by a token's value (a stop id, EOS, a stop string; e.g.
        ignore_eos without stop ids): the scheduler then advances with placeholder tokens
        (``Scheduler.advance``), the runner feeds step k's sampled tokens to step k + 1 on the
        device, and the values are filled in when read. A step whose tokens can end a sequence,
        and every step without ``overlap_steps``, is waited for before anything else is
        scheduled. The schedule, the tokens and the outputs are the same either way.

        ``online`` (the online engine, async_llm.py): ``online.apply()`` runs before each
        schedule, where the scheduler's state is whole (step k + 1 launched and advanced), so it
        may add and abort requests there; when nothing is left to run, ``online.idle()`` blocks
        until there is, and the loop ends when it returns False.
        """
        sched, runner = self.scheduler, self.model_runner
        overlap = self.config.overlap_steps
        self._check_running()
        inflight = None  # (batch, pending tokens, sequences with placeholders, finished) of step k
        try:
            while True:
                if online is not None:
                    online.apply()
                launched = None
                if not sched.is_finished():
                    batch = self._schedule()
                    launched = (batch, self._tp_call(runner.launch, batch, launch=True))
                if inflight is not None:  # step k: read its tokens (k + 1 is queued behind it)
                    batch_k, pending_k, got_k, finished_k = inflight
                    inflight = None
                    sched.fill(got_k, self._tp_call(runner.wait, pending_k))
                    yield got_k, finished_k, batch_k.num_prefill_tokens, len(batch_k.decodes)
                if launched is None:
                    if online is not None and online.idle():
                        continue
                    return
                batch, pending = launched
                if not overlap or sched.needs_tokens(pending.sample_seqs):
                    got = sched.postprocess(batch, self._tp_call(runner.wait, pending))
                    yield got, sched.last_finished, batch.num_prefill_tokens, len(batch.decodes)
                else:
                    got = sched.advance(batch)
                    inflight = (batch, pending, got, sched.last_finished)
        finally:
            if inflight is not None:  # stopped early: still give the sequences their tokens
                try:
                    sched.fill(inflight[2], runner.wait(inflight[1]))
                except Exception:  # noqa: BLE001 - already failing; the first error matters
                    pass

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    def _stream(self, prompts, sampling_params, use_tqdm: bool, want_text: bool):
        """Validate all, then run; yields per step the [(sequence, detok state)] that got a token
        (with ``want_text=False``: only those that finished, the rest is skipped for speed).
        The engine is left clean even if the caller stops early."""
        requests = self.validate_requests(prompts, sampling_params)
        if not self.is_finished():
            raise RuntimeError("the engine is already running requests (one generate at a time)")
        seqs = [self.add_request(ids, sp, i) for i, (ids, sp) in enumerate(requests)]
        states = {s.seq_id: DetokState() for s in seqs}
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True)
        last_shown, pre_tps, dec_tps = 0.0, 0.0, 0.0
        # Without streamed text, only stop strings need the text before the end; without them
        # too, a step's work here is its finished sequences, not every one that got a token.
        every_seq = want_text or any(sp.stop for _, sp in requests)
        cfg, pw = self.config, self.model_runner.piecewise
        caps = throughput_schedule(
            cfg.scheduling_policy, self.weight_bytes, len(seqs), cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            pw is not None and pw.max_tokens >= THROUGHPUT_MAX_NUM_BATCHED_TOKENS)
        self.offline_schedule = caps  # (read by benchmarks: what "auto" chose)
        schedule = contextlib.ExitStack()
        if caps is not None:
            schedule.enter_context(self.scheduler.offline_batch(*caps))
        try:
            t0 = time.perf_counter()
            for got, finished, n_prefill, n_decode in self._steps():
                t1 = time.perf_counter()
                dt, t0 = t1 - t0, t1
                out = []
                for seq in (got if every_seq else finished):
                    if want_text or seq.params.stop or seq.is_finished:
                        state = states[seq.seq_id]
                        self.detokenizer.step(seq, state, want_text)
                        if want_text or seq.is_finished:
                            out.append((seq, state))
                if out:
                    yield out
                if pbar is not None:
                    # exponential moving averages of this step's prefill and decode rates
                    if n_prefill:
                        rate = n_prefill / dt
                        pre_tps = 0.7 * pre_tps + 0.3 * rate if pre_tps else rate
                    if n_decode:
                        dec_tps = 0.7 * dec_tps + 0.3 * n_decode / dt if dec_tps else n_decode / dt
                    pbar.update(sum(1 for s in got if s.is_finished) if every_seq
                                else len(finished))
                    if t1 - last_shown > 0.2:
                        pbar.set_postfix_str(f"prefill {pre_tps:,.0f} tok/s, "
                                             f"decode {dec_tps:,.0f} tok/s")
                        last_shown = t1
        finally:
            schedule.close()  # the configured policy and budgets again
            self.scheduler.abort_all()  # no-op when everything finished
            if pbar is not None:
                pbar.close()

    def stream(self, prompts, sampling_params=None,
               use_tqdm: bool = False) -> Iterator[StreamDelta]:
        """Yield a StreamDelta per request per step that produced tokens, as they come."""
        for step in self._stream(prompts, sampling_params, use_tqdm, True):
            for seq, state in step:
                yield stream_delta(seq, state)

    def generate(
        self,
        prompts: Seq[str] | Seq[list[int]] | str | list[int],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order."""
        finished: dict[int, RequestOutput] = {}
        for seq, state in (x for step in self._stream(prompts, sampling_params, use_tqdm, False)
                           for x in step):
            if self.tokenizer is not None and not seq.params.stop:
                text = self.tokenizer.decode(state.ids, skip_special_tokens=True)
            else:
                text = state.text
            finished[seq.index] = RequestOutput(
                index=seq.index,
                prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
                token_ids=seq.completion_token_ids,
                text=text,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                num_cached_tokens=seq.num_cached_tokens,
                logprobs=seq.logprobs,
                prompt_logprobs=seq.prompt_logprobs,
            )
        return [finished[i] for i in sorted(finished)]
