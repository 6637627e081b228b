"""The online engine: requests are added and aborted while the step loop runs (continuous batching
across arrivals), on one background thread that owns the device; each request's results reach
its caller as they come.

    engine = AsyncLLM("/path/to/Qwen3-0.6B", max_model_len=4096)
    async for delta in engine.generate_async("Hello", SamplingParams(max_tokens=32)):
        print(delta.text, end="")            # StreamDelta per step; the last has finished=True
    rid = engine.add_request([1, 2, 3], params)         # from any thread; validated at once
    engine.abort_request(rid)                   # its KV blocks are freed before the next step
    engine.shutdown(drain_timeout=10)

The loop thread runs ``LLMEngine._steps`` (the offline engine's step loop, step overlap included)
with this object as its ``online`` hook: ``apply`` takes in the queued adds and aborts between
steps, ``idle`` sleeps while nothing runs. Each step's deltas are handed to the callers' event loop
in one ``call_soon_threadsafe``. Text prompts are encoded on the caller's thread with a tokenizer
of its own (a fast tokenizer must not be used by two threads at once); the loop thread
detokenizes with the engine's.

A failure inside one request (its detokenization, say) fails that request only; a failed step
fails every request in flight and the engine refuses new ones (``error``).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from typing import AsyncIterator, Iterator

from qwen3_model.engine.detokenizer import DetokState, load_tokenizer
from qwen3_model.engine.llm_engine import LLMEngine, StreamDelta, stream_delta
from qwen3_model.engine.metrics import EngineMetrics
from qwen3_model.sampling_params import SamplingParams


class EngineStopped(RuntimeError):
    """The engine no longer takes requests (shutting down, or a step failed)."""


class _Request:
    __slots__ = ("rid", "ids", "params", "seq", "state", "sink", "loop", "arrival", "last_token",
                 "done_at", "unread")

    def __init__(self, rid, ids, params, sink, loop):
        self.rid, self.ids, self.params = rid, ids, params
        self.seq = None  # the engine's Sequence, once the loop thread has taken the request in
        self.state = DetokState()
        self.sink = sink  # asyncio.Queue (on ``loop``) or queue.Queue: deltas, or an exception
        self.loop = loop
        self.arrival = time.monotonic()
        self.last_token: float | None = None
        self.done_at: float | None = None  # when its last delta was handed out
        self.unread = False  # nobody will claim its outputs: forget it once it is done


class AsyncLLM:
    # A finished request whose outputs nobody claimed is kept this long for a late reader (a
    # server's stream starts after the request is queued, and a short request may end first).
    UNCLAIMED_KEEP_S = 300.0

    def __init__(self, model: str, **kwargs):
        self.engine = LLMEngine(model, **kwargs)
        self.config = self.engine.config
        # the callers' tokenizer (encoding, chat templates); the loop thread has the engine's
        self.tokenizer = load_tokenizer(self.config.model)
        self.metrics = EngineMetrics()
        self._lock = threading.Condition()
        self._adds: list[_Request] = []
        self._aborts: list[str] = []
        self._requests: dict[str, _Request] = {}  # every request not yet done, by id
        self._unclaimed: dict[str, _Request] = {}  # requests whose outputs nobody reads yet
        self._by_seq: dict[int, _Request] = {}  # (loop thread) the same, by sequence id
        self._failed: list = []  # (loop thread) sequences of failed requests, ended by apply
        self._ids = itertools.count()
        self._admitting = True
        self._stopping = False
        self.error: BaseException | None = None  # the failure that stopped the loop
        self._thread = threading.Thread(target=self._run, name="qwen3-engine-loop", daemon=True)
        self._thread.start()

    # ---- callers' side (any thread) --------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; -> its id. Raises ValueError for a bad request (nothing queued) and
        EngineStopped once the engine takes no more. Its deltas go to ``outputs(id)`` (in an
        event loop) or ``iter_outputs(id)``."""
        (ids, sp), = self.engine.validate_requests([prompt], params or SamplingParams(),
                                                   tokenizer=self.tokenizer)
        try:
            loop = asyncio.get_running_loop()
            sink = asyncio.Queue()
        except RuntimeError:
            loop, sink = None, queue.SimpleQueue()
        with self._lock:
            if not self._admitting:
                raise EngineStopped(self._why_stopped())
            rid = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
            if rid in self._requests or rid in self._unclaimed:
                raise ValueError(f"request id {rid!r} is already running or its outputs are "
                                 "unread")
            req = _Request(rid, ids, sp, sink, loop)
            self._requests[rid] = req
            self._drop_stale_unclaimed()
            self._unclaimed[rid] = req
            self._adds.append(req)
            self._lock.notify()
        self.metrics.prompt_tokens += len(ids)
        return rid

    def abort_request(self, request_id: str, unread: bool = False) -> None:
        """End a request: its stream gets a last delta with finish_reason "abort", and its KV
        blocks are freed before the next step. Unknown or finished ids are ignored.
        ``unread``: nobody will read its outputs (a client gone before its stream started):
        if nobody has claimed them, they are dropped as it ends instead of being kept
        UNCLAIMED_KEEP_S, and its id is free again."""
        with self._lock:
            req = self._unclaimed.get(request_id) if unread else None
            if req is not None:
                if req.done_at is not None:
                    del self._unclaimed[request_id]
                else:
                    req.unread = True
            if request_id in self._requests:
                self._aborts.append(request_id)
                self._lock.notify()

    def _claim(self, request_id: str, in_loop: bool) -> _Request:
        """The request whose outputs the caller reads from now on (each has one reader); a
        request that has finished meanwhile is still there, its deltas queued."""
        with self._lock:
            req = self._unclaimed.get(request_id)
            if req is None or (req.loop is not None) != in_loop:
                where = "from an event loop" if in_loop else "outside an event loop"
                raise ValueError(f"no request {request_id!r} added {where} whose outputs are "
                                 "unread (unknown id, or another caller reads them)")
            del self._unclaimed[request_id]
        return req

    def _drop_stale_unclaimed(self) -> None:
        """(under the lock) Forget finished requests nobody claimed within UNCLAIMED_KEEP_S."""
        if not self._unclaimed:
            return
        old = time.monotonic() - self.UNCLAIMED_KEEP_S
        for rid in [r for r, q in self._unclaimed.items()
                    if q.done_at is not None and q.done_at < old]:
            del self._unclaimed[rid]

    async def outputs(self, request_id: str) -> AsyncIterator[StreamDelta]:
        """The deltas of a request added from this event loop, from its first one (even if it
        has finished); leaving early aborts it."""
        req = self._claim(request_id, in_loop=True)
        finished = False
        try:
            while True:
                item = await req.sink.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort_request(request_id)

    def iter_outputs(self, request_id: str, timeout: float | None = None) -> Iterator[StreamDelta]:
        """The deltas of a request added outside an event loop (blocking), from its first one."""
        req = self._claim(request_id, in_loop=False)
        finished = False
        try:
            while not finished:
                item = req.sink.get(timeout=timeout)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort_request(request_id)

    async def generate_async(self, prompt: str | list[int], params: SamplingParams | None = None,
                             request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        """``add_request`` then its ``outputs``: one StreamDelta per step that gave it tokens."""
        rid = self.add_request(prompt, params, request_id)
        async for delta in self.outputs(rid):
            yield delta

    def num_waiting(self) -> int:
        """Requests not yet running (queued here or waiting in the scheduler)."""
        return len(self._adds) + len(self.engine.scheduler.waiting)

    def stats(self) -> dict:
        sched = self.engine.scheduler
        bm = sched.block_manager
        return dict(running=len(sched.running), waiting=self.num_waiting(),
                    kv_blocks_used=bm.num_blocks - bm.num_free_blocks,
                    kv_blocks_total=bm.num_blocks, requests=len(self._requests))

    @property
    def is_running(self) -> bool:
        return self._admitting and self.error is None

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop admitting; give the requests in flight up to ``drain_timeout`` s to finish, abort
        the rest; stop the loop thread and the engine (its tensor-parallel workers)."""
        with self._lock:
            self._admitting = False
        deadline = time.monotonic() + drain_timeout
        while self._requests and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._lock:
            self._aborts.extend(self._requests)
            self._stopping = True
            self._lock.notify()
        self._thread.join(timeout=60)
        self.engine.close()

    def _why_stopped(self) -> str:
        if self.error is not None:
            return f"the engine stopped after a failed step ({type(self.error).__name__}: " \
                   f"{self.error})"
        return "the engine is shutting down and takes no new requests"

    # ---- the loop thread -----------------------------------------------------------------------

    def _run(self) -> None:
        runner = self.engine.model_runner
        if runner.use_cuda:
            import torch

            torch.cuda.set_device(runner.device)  # (per thread)
        try:
            for got, _finished, _n_prefill, _n_decode in self.engine._steps(online=self):
                self._emit(got)
        except BaseException as e:  # noqa: BLE001 - every request in flight gets it
            self.error = e
            with self._lock:
                self._admitting = False
                failed = list(self._requests.values())
                self._requests.clear()
                self._adds.clear()
            try:
                self.engine.scheduler.abort_all()
            except Exception:  # noqa: BLE001 - already failing; the first error matters
                pass
            err = EngineStopped(f"the engine failed: {type(e).__name__}: {e}")
            err.__cause__ = e
            self._hand_out([(r, err) for r in failed])

    def apply(self) -> None:
        """(``_steps``, between steps) Take in the queued requests and aborts."""
        if self._failed:
            for seq in self._failed:
                self.engine.scheduler.abort(seq)
            self._failed = []
        with self._lock:
            if not (self._adds or self._aborts):
                return
            adds, self._adds = self._adds, []
            aborts, self._aborts = self._aborts, []
        for req in adds:
            req.seq = self.engine.add_request(req.ids, req.params)
            self._by_seq[req.seq.seq_id] = req
        out = []
        for rid in dict.fromkeys(aborts):  # (a request may be aborted twice before this runs)
            req = self._requests.get(rid)
            if req is None or req.seq is None or req.seq.is_finished:
                continue
            self.engine.scheduler.abort(req.seq)
            out.append((req, StreamDelta(0, [], "", True, "abort")))
        if out:
            self._hand_out(out)

    def idle(self) -> bool:
        """(``_steps``, nothing to run) Sleep until a request or an abort comes; False: stop."""
        with self._lock:
            while not (self._adds or self._aborts or self._stopping):
                self._lock.wait()
            return not self._stopping

    def _emit(self, got) -> None:
        """One step's deltas, one per request that got tokens, handed out together."""
        detok = self.engine.detokenizer
        out = []
        for seq in got:
            req = self._by_seq.get(seq.seq_id)
            if req is None:
                continue  # aborted while the step ran
            try:
                detok.step(seq, req.state, True)
                out.append((req, stream_delta(seq, req.state)))
            except Exception as e:  # noqa: BLE001 - this request fails; the others go on
                out.append((req, e))
                self._failed.append(seq)  # (not here: the next step may be launched already)
        if out:
            self._hand_out(out)

    def _hand_out(self, items: list) -> None:
        """Give each (request, delta or exception) to its caller; a done request is forgotten."""
        by_loop: dict = {}
        for req, item in items:
            if isinstance(item, BaseException) or item.finished:
                self._by_seq.pop(req.seq.seq_id if req.seq is not None else -1, None)
                with self._lock:
                    self._requests.pop(req.rid, None)
                    req.done_at = time.monotonic()
                    if req.unread:
                        self._unclaimed.pop(req.rid, None)
            by_loop.setdefault(req.loop, []).append((req, item))
        for loop, batch in by_loop.items():
            if loop is None:
                self._deliver(batch)
            else:
                try:
                    loop.call_soon_threadsafe(self._deliver, batch)
                except RuntimeError:
                    pass  # the caller's event loop is closed: nobody is listening

    def _deliver(self, items: list) -> None:
        """(the caller's thread) Queue the items; count tokens and latencies."""
        m = self.metrics
        now = time.monotonic()
        for req, item in items:
            if not isinstance(item, BaseException):
                n = len(item.token_ids)
                if n:
                    m.generation_tokens += n
                    if req.last_token is None:
                        m.ttft.observe(now - req.arrival)
                    else:
                        m.itl.observe_many((now - req.last_token) / n, n)
                    req.last_token = now
                if item.finished:
                    m.finished[item.finish_reason or "stop"] += 1
            else:
                m.finished["error"] += 1
            req.sink.put_nowait(item)
