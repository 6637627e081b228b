"""Tensor-parallel worker processes: one process per rank, rank 0 (the engine's process) drives.

Start (``start_workers``: spawn ranks 1..world-1, form the process group), the worker loop
(``_tp_worker``: build the same ModelRunner, run every step plan rank 0 sends), watch
(``dead_worker``, ``WorkerWatch``: dead and stuck workers), stop (``stop_workers``), and NCCL's
abort (``abort_nccl``).
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
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qwen3_model.config import Config
from qwen3_model.distributed import (abort_custom_all_reduce, close_collectives, open_collectives,
                                     release_all_reduce)
from qwen3_model.engine.model_runner import ModelRunner

# Lifecycle: close(), garbage collection and interpreter exit (weakref.finalize) send every worker
# "exit" and kill any that has not gone within _JOIN_TIMEOUT_S. A failed step on any rank (a worker
# that raised or was killed, an exception or KeyboardInterrupt on rank 0) kills the workers at once:
# some rank is then mid-step and the ranks cannot agree on what runs next. A worker that loses
# rank 0 (its pipe closes, or a collective finds the peer gone) exits by itself. Every wait of
# rank 0 on a worker checks the worker is alive; a worker's death reaches a blocked gloo
# collective as a "connection closed" error at once. A worker that is alive but stuck (stopped by
# SIGSTOP, or frozen holding its GIL) stops its heartbeat: rank 0's WorkerWatch kills it after
# Config.tp_step_timeout, which turns it into the dead worker above, named as not answering.

# the last resort for a rank that hangs alive without stopping its heartbeat (WorkerWatch)
_TP_TIMEOUT = timedelta(minutes=10)
_JOIN_TIMEOUT_S = 10.0  # close(): how long a worker gets to leave cleanly before it is killed
FAIL_GRACE_S = 5.0  # a failed step: how long a crashing worker gets to exit, so we can name it
_POLL_S = 0.1


def _init_tp_group(config: Config, rank: int, world: int, port: int) -> None:
    # init_method rather than MASTER_ADDR / MASTER_PORT: the user's environment is left as it was
    backend = "nccl" if config.device == "cuda" else "gloo"
    if config.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=_TP_TIMEOUT)
    open_collectives()  # (closed by an earlier engine's abort in this process)


def _tp_worker(model: str, kwargs: dict, rank: int, world: int, port: int, conn, heartbeat,
               beat_s: float) -> None:
    """Ranks 1..world-1: build the same runner, then run every step rank 0 sends. Exits with code 1
    after reporting an exception to rank 0 (which raises it)."""
    # Ctrl-C reaches the whole process group; rank 0 alone decides, and stops the workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_rank0(heartbeat, beat_s)
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


def _watch_rank0(heartbeat, beat_s: float) -> None:
    """A daemon thread of the worker: every ``beat_s`` it bumps ``heartbeat`` (a shared counter
    rank 0's WorkerWatch reads: it stops when this process is stopped or frozen), and it ends the
    process at once when rank 0 is gone. A worker whose rank 0 was killed (SIGKILL: no exit
    message, no closed pipe while the worker sits in an NCCL collective that will never complete)
    must not live on holding its GPU: the thread sees the parent change (re-parented)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            heartbeat.value += 1  # (this thread is its only writer)
            time.sleep(beat_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="qwen3-tp-rank0-watch").start()


def start_workers(kwargs: dict, config: Config, world: int) -> tuple[list, "WorkerWatch"]:
    """Spawn ranks 1..world-1 and form the group with them; -> the workers [(process, pipe)] and
    the watch over them (already running: a worker stuck while loading is found too)."""
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # The workers are spawned with this process's environment as it is, NCCL_* variables included:
    # nothing in qwen3_model sets or changes an NCCL variable (NCCL features are the user's choice).
    ctx = mp.get_context("spawn")
    workers, heartbeats, watch = [], [], None
    timeout_s = config.tp_step_timeout
    try:
        for rank in range(1, world):
            parent, child = ctx.Pipe()
            heartbeat = ctx.RawValue("Q", 0)
            # config.model: the folder rank 0 resolved (a Hub repo id is looked up once, so every
            # rank loads the same snapshot)
            proc = ctx.Process(target=_tp_worker,
                               args=(config.model, kwargs, rank, world, port, child, heartbeat,
                                     min(0.5, timeout_s / 4)), daemon=True)
            proc.start()
            child.close()  # the worker holds the only other end: its exit makes recv() fail
            workers.append((proc, parent))
            heartbeats.append(heartbeat)
        watch = WorkerWatch(workers, heartbeats, timeout_s)
        _run_while_alive(workers, lambda: _init_tp_group(config, 0, world, port))
    except BaseException:
        stop_workers(workers, dist.is_initialized(), graceful=False, watch=watch)
        raise
    return workers, watch


# the workers WorkerWatch killed for not answering -> the timeout they exceeded (s)
_NOT_ANSWERING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _describe_exit(rank: int, proc, conn) -> str:
    who = f"tensor-parallel worker rank {rank} (pid {proc.pid})"
    if (timeout_s := _NOT_ANSWERING.get(proc)) is not None:
        return (f"{who} did not answer for {timeout_s:g} s (alive but stuck, e.g. stopped; "
                f"tp_step_timeout) and was killed")
    code = proc.exitcode
    how = f"exit code {code}"
    if code is not None and code < 0:
        how += f" (signal {signal.Signals(-code).name})"
    msg = f"{who} died with {how}"
    try:
        if conn.poll():
            kind, text = conn.recv()
            if kind == "error":
                msg += f": {text}"
    except (OSError, EOFError):
        pass
    return msg


def dead_worker(workers: list) -> str | None:
    """A description of the first worker that has exited, or None while all are alive."""
    for rank, (proc, conn) in enumerate(workers, start=1):
        if proc.exitcode is not None:
            return _describe_exit(rank, proc, conn)
    return None


def recv_while_alive(workers: list, rank: int):
    """The next message from worker ``rank``; a RuntimeError if any worker dies meanwhile."""
    conn = workers[rank - 1][1]
    while not conn.poll(_POLL_S):
        if (dead := dead_worker(workers)) is not None:
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
        if thread.is_alive() and (dead := dead_worker(workers)) is not None:
            raise RuntimeError(f"LLM: {dead} while the tensor-parallel group was forming")
    if box[0] is not None:
        raise box[0]


def stop_workers(workers: list, owns_group: bool, graceful: bool = True,
                  graphs: dict | None = None, watch: "WorkerWatch | None" = None) -> None:
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
        stuck = not abort_nccl() and _ABORT_THREAD[0] is not None and _ABORT_THREAD[0].is_alive()
        if stuck:
            warnings.warn(f"LLM: NCCL's abort did not finish within {_ABORT_WAIT_S:.0f} s; this "
                          "process's tensor-parallel group is left as it is (a new LLM in this "
                          "process cannot use NCCL)", RuntimeWarning, stacklevel=2)
    if owns_group and dist.is_initialized() and not stuck:
        _release_graphs(graphs)
        dist.destroy_process_group()


_ABORT_LOCK = threading.Lock()
# the abort in flight (or done), shared by the watch and the main thread
_ABORT_THREAD: list = [None]
# How long a failing engine waits for NCCL's abort before it raises anyway. On two H200s with CUDA
# graphs (torch 2.11, NCCL P2P/CUMEM), the abort of a communicator whose captured all-reduce waits
# for a killed peer does not return while those graphs are alive; the engine drops its graphs
# before it waits (LLMEngine._check_workers, stop_workers), and must not hang on it either way.
_ABORT_WAIT_S = 10.0


def abort_nccl(wait_s: float = _ABORT_WAIT_S) -> bool:
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
                    # see qwen3_model.distributed: no eager call meets the abort
                    close_collectives()
                    abort()
                except Exception:  # noqa: BLE001 - the caller's error names the dead worker
                    pass

            thread = threading.Thread(target=run, daemon=True, name="qwen3-nccl-abort")
            _ABORT_THREAD[0] = thread
            thread.start()
    thread.join(wait_s)
    return not thread.is_alive()


class WorkerWatch:
    """Rank 0 with tensor parallelism: a daemon thread over the workers, from their start to
    ``stop``. Each wake-up (every ``min(0.2, timeout_s / 4)`` s) costs the step loop nothing.

    Stuck workers: a worker whose heartbeat (``_watch_rank0``) has not moved for ``timeout_s``
    (Config.tp_step_timeout) is stopped or frozen: the watch records it as not answering and
    SIGKILLs it (the one signal a stopped process cannot hold off). Its death then fails the step
    as any dead worker's does: gloo's collective and the pipes fail at once, NCCL is aborted
    (below), and the engine's error names the worker as not answering (``_describe_exit``).
    Time is counted on this clock only while this thread runs: after rank 0 itself was stopped
    (Ctrl-Z stops the whole process group), every worker gets a fresh ``timeout_s``.

    Dead workers, once ``abort_nccl_on_death`` is set (rank 0 on CUDA, after start-up): a worker
    that dies mid-step leaves this rank's NCCL collective waiting forever, and with it whatever
    host sync is behind it: the step's event (which the runner polls, tp_watch) but also a sync
    inside the forward (a reference op's .item() on the eager path), which no polling in the main
    thread could reach. The watch aborts NCCL at once, which ends the collective; the engine then
    raises the error naming the worker (tp_watch, step, _fail_tp)."""

    def __init__(self, workers: list, heartbeats: list, timeout_s: float):
        self._procs = [proc for proc, _ in workers]
        self._heartbeats = list(heartbeats)
        self._timeout_s = timeout_s
        self._poll_s = min(0.2, timeout_s / 4)
        self.abort_nccl_on_death = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="qwen3-tp-watch")
        self._thread.start()

    def _run(self) -> None:
        from multiprocessing.connection import wait

        sentinels = [proc.sentinel for proc in self._procs]
        last_tick = time.monotonic()
        beats = [hb.value for hb in self._heartbeats]
        moved = [last_tick] * len(beats)  # when each heartbeat last moved, on this clock
        while not self._stopped.is_set():
            died = wait(sentinels, timeout=self._poll_s)
            if self._stopped.is_set():
                return
            if died:
                if self.abort_nccl_on_death:
                    abort_nccl()
                return  # the engine's next look at the workers fails the step
            now = time.monotonic()
            if now - last_tick > self._timeout_s / 2:  # this process was stopped: start afresh
                moved = [now] * len(moved)
            last_tick = now
            for i, (proc, hb) in enumerate(zip(self._procs, self._heartbeats)):
                if hb.value != beats[i]:
                    beats[i], moved[i] = hb.value, now
                elif beats[i] and now - moved[i] > self._timeout_s:  # (0: not started yet)
                    _NOT_ANSWERING[proc] = self._timeout_s  # (before the kill: its death is read)
                    proc.kill()  # its sentinel wakes this loop next; gloo fails at once

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
