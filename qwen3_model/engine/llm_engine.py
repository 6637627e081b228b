"""The offline engine: validate requests, then schedule -> run -> postprocess until all are done.

    engine = LLMEngine("/path/to/Qwen3-0.6B", max_model_len=2048)
    outs = engine.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0))
    for delta in engine.stream(prompts, params):   # tokens as they are produced
        print(delta.index, delta.token_ids, delta.text, delta.finished)
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Iterator, Sequence as Seq

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qwen3_model.config import Config
from qwen3_model.distributed import (abort_custom_all_reduce, close_collectives, open_collectives,
                                     release_all_reduce)
from qwen3_model.engine.model_runner import ModelRunner
from qwen3_model.engine.scheduler import Scheduler
from qwen3_model.engine.sequence import Sequence, SequenceStatus
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


@dataclass
class StreamDelta:
    """What one step added to one request."""

    index: int
    token_ids: list[int]  # new ids this step
    text: str  # new text this step (held back while it could still be part of a stop string)
    finished: bool
    finish_reason: str | None = None


@dataclass
class _Detok:
    """Incremental detokenization of one request's output, and stop-string matching."""

    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""  # all text so far, cut before a stop string once one matched
    emitted: int = 0  # chars already streamed
    ids: list[int] = field(default_factory=list)  # ids fed to the detokenizer


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        known = set(Config.field_names()) - {"model"}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"LLM: unknown argument(s) {unknown}; expected some of: {sorted(known)}")
        config = Config(model, **kwargs)
        self.config = config
        self._workers: list = []
        world = config.tensor_parallel_size
        if world > 1:
            if config.device == "cuda" and torch.cuda.device_count() < world:
                raise ValueError(f"LLM: tensor_parallel_size={world} needs {world} GPUs, "
                                 f"torch sees {torch.cuda.device_count()}")
            if dist.is_initialized():
                raise RuntimeError("LLM: a torch.distributed process group already exists in "
                                   "this process; tensor_parallel_size > 1 makes its own")
            self._workers = _start_workers(model, kwargs, config, world)
        self._stopped: str | None = None  # why the tensor-parallel workers are gone, once they are
        try:
            self.model_runner = ModelRunner(config, rank=0)
            if self._workers:
                self.model_runner.worker_conns = [conn for _, conn in self._workers]
                if config.device == "cuda":
                    self.model_runner.tp_watch = self._check_workers
                for rank, (proc, conn) in enumerate(self._workers, start=1):
                    msg = _recv_while_alive(self._workers, rank)
                    if msg[0] != "ready":
                        raise RuntimeError(f"LLM: tensor-parallel rank {rank} failed: {msg[1]}")
        except BaseException:
            _stop_workers(self._workers, world > 1, graceful=False)
            raise
        # rank 0 on CUDA: a thread that aborts NCCL the moment a worker dies (see _NcclWatch)
        self._watch = (_NcclWatch(self._workers) if self._workers and config.device == "cuda"
                       else None)
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers, world > 1,
                                           graphs=self.model_runner.graphs, watch=self._watch)
        self.tokenizer = self._load_tokenizer(config.model)
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

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (also done at exit / garbage collection);
        with tensor_parallel_size > 1 the engine cannot run steps afterwards."""
        self._finalizer()
        if self.config.tensor_parallel_size > 1 and self._stopped is None:
            self._stopped = "close() stopped the tensor-parallel workers"

    def _check_workers(self) -> None:
        """Raise if a worker has died. On CUDA, first abort this rank's NCCL communicator: its
        in-flight collective waits for the dead peer forever and would hold the stream."""
        dead = _dead_worker(self._workers)
        if dead is None:
            return
        # the graphs first: NCCL's abort waits for the graphs that hold its collectives to go
        self.model_runner.graphs.clear()
        _abort_nccl()  # (the watch thread has normally started it already)
        raise RuntimeError(f"LLM: {dead}")

    def _fail_tp(self, error: BaseException) -> None:
        """A step failed with workers running: some rank is mid-step, so the ranks can no longer
        agree on what runs next. Find the worker that died (if one did), stop them all, and raise
        an error naming it; the engine refuses further steps."""
        dead = None
        if not isinstance(error, KeyboardInterrupt):
            # a worker's crash reaches rank 0 as a broken pipe / gloo "connection closed";
            # give the worker a moment to finish exiting so the error can name it
            deadline = time.monotonic() + _FAIL_GRACE_S
            while (dead := _dead_worker(self._workers)) is None and time.monotonic() < deadline:
                time.sleep(0.05)
        _stop_workers(self._workers, True, graceful=False, graphs=self.model_runner.graphs,
                      watch=self._watch)
        self._finalizer.detach()  # done here; a later LLM's process group is not ours to destroy
        self._stopped = (f"a failed step stopped the tensor-parallel workers "
                         f"({dead or f'rank 0 raised {type(error).__name__}: {error}'})")
        if dead is not None:
            raise RuntimeError(f"LLM: {dead}; the tensor-parallel workers were stopped") from error

    @staticmethod
    def _load_tokenizer(path: str):
        files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
        if not any(os.path.isfile(os.path.join(path, f)) for f in files):
            return None  # (and no attempt to reach the Hub from an offline machine)
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, KeyError, TypeError):
            return None  # no tokenizer files: token-id prompts only, text outputs are ""

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

    def validate_requests(self, prompts, sampling_params) -> list[tuple[list[int], SamplingParams]]:
        """Check every request before any work; a ValueError names the first bad one by index."""
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
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    bad(f"a text prompt needs a tokenizer, and {self.config.model!r} has none; "
                        "pass token ids instead")
                ids = list(self.tokenizer(prompt)["input_ids"])
            elif isinstance(prompt, (list, tuple)):
                ids = list(prompt)
                for j, t in enumerate(ids):
                    if not isinstance(t, int) or isinstance(t, bool):
                        bad(f"token {j} is {t!r}; a prompt is a string or a list of int token ids")
                    if not 0 <= t < vocab:
                        bad(f"token id {t} at position {j} is outside the vocabulary [0, {vocab})")
            else:
                bad(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
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

    def _steps(self) -> Iterator[tuple[list[Sequence], list[Sequence], int, int]]:
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
        """
        sched, runner = self.scheduler, self.model_runner
        overlap = self.config.overlap_steps
        self._check_running()
        inflight = None  # (batch, pending tokens, sequences with placeholders, finished) of step k
        try:
            while True:
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

    def _detok_step(self, seq: Sequence, state: _Detok, want_text: bool) -> None:
        """Feed ``seq``'s new tokens to its detokenizer; apply stop strings."""
        p = seq.params
        new_ids = seq.token_ids[seq.num_prompt_tokens + len(state.ids):]  # O(new), not O(output)
        if isinstance(seq.stop_reason, int) or (
            seq.finish_reason == "stop" and seq.stop_reason is None and new_ids
            and new_ids[-1] in self.config.eos_token_ids
        ):
            new_ids = new_ids[:-1]  # the stop id / EOS that ended it is not part of the text
        state.ids.extend(new_ids)
        if self.tokenizer is None or not (want_text or p.stop):
            return
        before = len(state.text)
        state.text += self._decode_new(state)
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
                    self.scheduler.finish(seq, "stop", s)

    def _decode_new(self, state: _Detok) -> str:
        """Text added by the ids past read_offset; empty while a multi-byte char is incomplete."""
        tok = self.tokenizer
        ids = state.ids
        prefix = tok.decode(ids[state.prefix_offset : state.read_offset], skip_special_tokens=True)
        full = tok.decode(ids[state.prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            state.prefix_offset, state.read_offset = state.read_offset, len(ids)
            return full[len(prefix) :]
        return ""

    def _stream(self, prompts, sampling_params, use_tqdm: bool, want_text: bool):
        """Validate all, then run; yields per step the [(sequence, detok state)] that got a token
        (with ``want_text=False``: only those that finished, the rest is skipped for speed).
        The engine is left clean even if the caller stops early."""
        requests = self.validate_requests(prompts, sampling_params)
        if not self.is_finished():
            raise RuntimeError("the engine is already running requests (one generate at a time)")
        seqs = [self.add_request(ids, sp, i) for i, (ids, sp) in enumerate(requests)]
        states = {s.seq_id: _Detok() for s in seqs}
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True)
        last_shown, pre_tps, dec_tps = 0.0, 0.0, 0.0
        # Without streamed text, only stop strings need the text before the end; without them
        # too, a step's work here is its finished sequences, not every one that got a token.
        every_seq = want_text or any(sp.stop for _, sp in requests)
        try:
            t0 = time.perf_counter()
            for got, finished, n_prefill, n_decode in self._steps():
                t1 = time.perf_counter()
                dt, t0 = t1 - t0, t1
                out = []
                for seq in (got if every_seq else finished):
                    if want_text or seq.params.stop or seq.is_finished:
                        state = states[seq.seq_id]
                        self._detok_step(seq, state, want_text)
                        if want_text or seq.is_finished:
                            out.append((seq, state))
                if out:
                    yield out
                if pbar is not None:
                    # exponential moving averages of this step's prefill and decode rates
                    if n_prefill:
                        pre_tps = 0.7 * pre_tps + 0.3 * n_prefill / dt if pre_tps else n_prefill / dt
                    if n_decode:
                        dec_tps = 0.7 * dec_tps + 0.3 * n_decode / dt if dec_tps else n_decode / dt
                    pbar.update(sum(1 for s in got if s.is_finished) if every_seq
                                else len(finished))
                    if t1 - last_shown > 0.2:
                        pbar.set_postfix_str(f"prefill {pre_tps:,.0f} tok/s, decode {dec_tps:,.0f} tok/s")
                        last_shown = t1
        finally:
            self.scheduler.abort_all()  # no-op when everything finished
            if pbar is not None:
                pbar.close()

    def stream(self, prompts, sampling_params=None, use_tqdm: bool = False) -> Iterator[StreamDelta]:
        """Yield a StreamDelta per request per step that produced tokens, as they come."""
        sent: dict[int, int] = {}
        for seq, state in (x for step in self._stream(prompts, sampling_params, use_tqdm, True)
                           for x in step):
            done = seq.is_finished
            k = sent.get(seq.seq_id, 0)
            new_ids = seq.token_ids[seq.num_prompt_tokens + k:]
            sent[seq.seq_id] = k + len(new_ids)
            end = len(state.text)
            if not done:
                if seq.params.stop:  # could be the start of a stop string
                    end -= max(len(s) for s in seq.params.stop) - 1
                end = max(end, state.emitted)
            text = state.text[state.emitted : end]
            state.emitted = end
            yield StreamDelta(seq.index, new_ids, text, done, seq.finish_reason if done else None)

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
            )
        return [finished[i] for i in sorted(finished)]


# ---- tensor parallelism: one process per rank, rank 0 (this process) drives ---------------------
#
# Lifecycle: close(), garbage collection and interpreter exit (weakref.finalize) send every worker
# "exit" and kill any that has not gone within _JOIN_TIMEOUT_S. A failed step on any rank (a worker
# that raised or was killed, an exception or KeyboardInterrupt on rank 0) kills the workers at once:
# some rank is then mid-step and the ranks cannot agree on what runs next. A worker that loses
# rank 0 (its pipe closes, or a collective finds the peer gone) exits by itself. Every wait of rank 0
# on a worker checks the worker is alive; a worker's death reaches a blocked gloo collective as a
# "connection closed" error at once.

_TP_TIMEOUT = timedelta(minutes=10)  # a rank that hangs (alive) shows up as a collective timing out
_JOIN_TIMEOUT_S = 10.0  # close(): how long a worker gets to leave cleanly before it is killed
_FAIL_GRACE_S = 5.0  # a failed step: how long a crashing worker gets to exit, so we can name it
_POLL_S = 0.1


def _init_tp_group(config: Config, rank: int, world: int, port: int) -> None:
    # init_method rather than MASTER_ADDR / MASTER_PORT: the user's environment is left as it was
    backend = "nccl" if config.device == "cuda" else "gloo"
    if config.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=_TP_TIMEOUT)
    open_collectives()  # (closed by an earlier engine's abort in this process)


def _tp_worker(model: str, kwargs: dict, rank: int, world: int, port: int, conn) -> None:
    """Ranks 1..world-1: build the same runner, then run every step rank 0 sends. Exits with code 1
    after reporting an exception to rank 0 (which raises it)."""
    # Ctrl-C reaches the whole process group; rank 0 alone decides, and stops the workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_when_orphaned()
    runner = None
    try:
        config = Config(model, **kwargs)
        if config.device == "cpu":
            torch.set_num_threads(1)  # the ranks share the machine's cores
        _init_tp_group(config, rank, world, port)
        runner = ModelRunner(config, rank=rank)
        conn.send(("ready", runner.num_blocks))
        while True:
            msg, arg = conn.recv()
            if msg == "exit":
                break
            runner.forward_plan(arg)
            runner.receive_sampled(arg)  # rank 0's sampled tokens, for the next step's inputs
    except EOFError:  # rank 0 went away
        pass
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, which raises it
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass  # rank 0 is gone too
        sys.exit(1)
    finally:
        if runner is not None:
            _release_graphs(runner.graphs)
        if dist.is_initialized():
            dist.destroy_process_group()


def _release_graphs(graphs: dict) -> None:
    """Destroy the CUDA graphs before the process group: captured NCCL collectives hold on to the
    communicator, and destroying it under live graphs can block (nano-vllm drops its graphs first
    for the same reason)."""
    if graphs:
        graphs.clear()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    release_all_reduce()  # its symmetric buffer was set up over the group too


def _exit_when_orphaned(poll_s: float = 0.5) -> None:
    """A worker whose rank 0 was killed (SIGKILL: no exit message, no closed pipe while the worker
    sits in an NCCL collective that will never complete) must not live on holding its GPU: a daemon
    thread sees the parent change (re-parented) and ends the process at once."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="qwen3-tp-orphan-watch").start()


def _start_workers(model: str, kwargs: dict, config: Config, world: int) -> list:
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # The workers are spawned with this process's environment as it is, NCCL_* variables included:
    # nothing in qwen3_model sets or changes an NCCL variable (NCCL features are the user's choice).
    ctx = mp.get_context("spawn")
    workers = []
    try:
        for rank in range(1, world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_tp_worker, args=(model, kwargs, rank, world, port, child),
                               daemon=True)
            proc.start()
            child.close()  # the worker holds the only other end: its exit makes recv() fail
            workers.append((proc, parent))
        _run_while_alive(workers, lambda: _init_tp_group(config, 0, world, port))
    except BaseException:
        _stop_workers(workers, dist.is_initialized(), graceful=False)
        raise
    return workers


def _describe_exit(rank: int, proc, conn) -> str:
    code = proc.exitcode
    how = f"exit code {code}"
    if code is not None and code < 0:
        how += f" (signal {signal.Signals(-code).name})"
    msg = f"tensor-parallel worker rank {rank} (pid {proc.pid}) died with {how}"
    try:
        if conn.poll():
            kind, text = conn.recv()
            if kind == "error":
                msg += f": {text}"
    except (OSError, EOFError):
        pass
    return msg


def _dead_worker(workers: list) -> str | None:
    """A description of the first worker that has exited, or None while all are alive."""
    for rank, (proc, conn) in enumerate(workers, start=1):
        if proc.exitcode is not None:
            return _describe_exit(rank, proc, conn)
    return None


def _recv_while_alive(workers: list, rank: int):
    """The next message from worker ``rank``; a RuntimeError if any worker dies meanwhile."""
    conn = workers[rank - 1][1]
    while not conn.poll(_POLL_S):
        if (dead := _dead_worker(workers)) is not None:
            raise RuntimeError(f"LLM: {dead}")
    try:
        return conn.recv()
    except EOFError:
        raise RuntimeError(f"LLM: {_describe_exit(rank, *workers[rank - 1])}") from None


def _run_while_alive(workers: list, fn) -> None:
    """fn() in a helper thread while polling the workers: a rendezvous with a worker that died
    first would otherwise wait for the whole _TP_TIMEOUT."""
    box: list = []

    def target():
        try:
            fn()
            box.append(None)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(_POLL_S)
        if thread.is_alive() and (dead := _dead_worker(workers)) is not None:
            raise RuntimeError(f"LLM: {dead} while the tensor-parallel group was forming")
    if box[0] is not None:
        raise box[0]


def _stop_workers(workers: list, owns_group: bool, graceful: bool = True,
                  graphs: dict | None = None, watch: "_NcclWatch | None" = None) -> None:
    """Stop every worker (bounded: a worker that does not leave in time is killed), then this
    process's side of the group, after its CUDA graphs (``graphs``, cleared: the engine cannot
    replay them without the group anyway). ``graceful=False``: kill at once (they may be
    mid-collective), and abort NCCL rather than destroy the group (a destroy waits for
    collectives that a killed peer will never join)."""
    if watch is not None:
        watch.stop()  # workers leaving on purpose are not a failure
    if graceful:
        for proc, conn in workers:
            try:
                conn.send(("exit", None))
            except OSError:  # BrokenPipeError: it is already gone
                pass
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        for proc, _ in workers:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc, conn in workers:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=_JOIN_TIMEOUT_S)  # SIGKILL cannot be ignored: this returns promptly
        conn.close()
    workers.clear()
    stuck = False
    if owns_group and not graceful:
        if graphs:
            graphs.clear()  # no sync: a replay may be waiting for the dead peer until the abort
        # (a no-op for gloo, whose collectives fail on a closed peer)
        stuck = not _abort_nccl() and _ABORT_THREAD[0] is not None and _ABORT_THREAD[0].is_alive()
        if stuck:
            warnings.warn(f"LLM: NCCL's abort did not finish within {_ABORT_WAIT_S:.0f} s; this "
                          "process's tensor-parallel group is left as it is (a new LLM in this "
                          "process cannot use NCCL)", RuntimeWarning, stacklevel=2)
    if owns_group and dist.is_initialized() and not stuck:
        _release_graphs(graphs)
        dist.destroy_process_group()


_ABORT_LOCK = threading.Lock()
_ABORT_THREAD: list = [None]  # the abort in flight (or done), shared by the watch and the main thread
# How long a failing engine waits for NCCL's abort before it raises anyway. On two H200s with CUDA
# graphs (torch 2.11, NCCL P2P/CUMEM), the abort of a communicator whose captured all-reduce waits
# for a killed peer does not return while those graphs are alive (2026-11-30); the engine drops its
# graphs before it waits (_check_workers, _stop_workers), and must not hang on it either way.
_ABORT_WAIT_S = 10.0


def _abort_nccl(wait_s: float = _ABORT_WAIT_S) -> bool:
    """Abort this process's NCCL communicators: a collective waiting for a dead peer then ends,
    and so does any host sync queued behind it. The group is gone afterwards.

    The abort runs in a daemon thread (one at a time; a second caller joins the one in flight),
    waited for at most ``wait_s``: True when it finished, False when there was nothing to abort
    (no group, or a gloo group) or it is still running (then the group must not be destroyed
    either: that would wait for the same collectives).

    First, our own all-reduce (the TP default) stops waiting for the dead peer: a host
    write that its spinning kernel reads, so a replay stuck on it drains; NCCL's abort cannot end
    a kernel that is not NCCL's."""
    abort_custom_all_reduce()
    with _ABORT_LOCK:
        thread = _ABORT_THREAD[0]
        if thread is None or not thread.is_alive():
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort is None or not dist.is_initialized() or dist.get_backend() != "nccl":
                return False

            def run():
                try:
                    close_collectives()  # see qwen3_model.distributed: no eager call meets the abort
                    abort()
                except Exception:  # noqa: BLE001 - the caller raises the error that names the dead worker
                    pass

            thread = threading.Thread(target=run, daemon=True, name="qwen3-nccl-abort")
            _ABORT_THREAD[0] = thread
            thread.start()
    thread.join(wait_s)
    return not thread.is_alive()


class _NcclWatch:
    """Rank 0 with tensor parallelism on CUDA: a daemon thread that waits on the workers' exit
    sentinels. A worker that dies mid-step leaves this rank's NCCL collective waiting forever, and
    with it whatever host sync is behind it: the step's event (which the runner polls, tp_watch)
    but also a sync inside the forward (a reference op's .item() on the eager path), which no
    polling in this thread could reach. The watch aborts NCCL at once, which ends the collective;
    the engine then raises the error naming the worker (tp_watch, step, _fail_tp)."""

    def __init__(self, workers: list):
        self._sentinels = [proc.sentinel for proc, _ in workers]
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="qwen3-tp-nccl-watch")
        self._thread.start()

    def _run(self) -> None:
        from multiprocessing.connection import wait

        while not self._stopped.is_set():
            if wait(self._sentinels, timeout=0.2) and not self._stopped.is_set():
                _abort_nccl()
                return

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
