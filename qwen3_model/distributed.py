"""Tensor-parallel plumbing: one process per rank, the whole default process group is the TP group.

NCCL on GPUs, gloo on CPU (so CI tests the same split). Without an initialised process group every
helper is the identity: rank 0 of world size 1.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import torch
import torch.distributed as dist


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_tp_rank() -> int:
    return dist.get_rank() if _initialized() else 0


def get_tp_world_size() -> int:
    return dist.get_world_size() if _initialized() else 1


def divide(numerator: int, denominator: int, what: str) -> int:
    """numerator / denominator, or a clear error naming what does not split evenly across ranks."""
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator}); "
            f"choose a tensor_parallel_size that divides it"
        )
    return numerator // denominator


# ---- the engine's eager collectives vs an abort from another thread ----------------------------
# Rank 0 aborts NCCL from a watch thread the moment a worker dies (engine/workers.py). torch's
# abort holds the communicator's lock through ncclCommAbort, and on two H200s that abort did not
# finish while a CUDA graph with a captured NCCL collective was still alive (it finishes once the
# engine drops its graphs). A collective that rank 0's main thread calls meanwhile waits for the
# same lock, so the engine never gets to drop its graphs: the kill test hung in dist.broadcast with
# the abort thread in _abort_process_group (1 of 4 NCCL kills). So every collective the
# engine issues eagerly passes this gate, and the abort closes it first: closing waits for a call in
# flight (a launch: microseconds), and from then on a collective raises at once instead of
# entering NCCL. (The graphs' own collectives need no gate: a replay does not enter NCCL's host
# code.)
_GATE = threading.Lock()
_GATE_CLOSED = [False]


@contextlib.contextmanager
def _collective():
    with _GATE:
        if _GATE_CLOSED[0]:
            raise RuntimeError("tensor-parallel communication was aborted: a rank died")
        yield


def close_collectives(timeout_s: float = 5.0) -> None:
    """Before an abort: wait (bounded) for an eager collective in flight, then refuse new ones."""
    locked = _GATE.acquire(timeout=timeout_s)
    _GATE_CLOSED[0] = True
    if locked:
        _GATE.release()


def open_collectives() -> None:
    """A new process group: collectives may run again."""
    _GATE_CLOSED[0] = False


def _run(collective, x: torch.Tensor, *args, **kwargs) -> None:
    """``collective(x, *args, **kwargs)`` (a torch.distributed call), gated. NCCL's (CUDA) only
    queues on the stream. gloo's (CPU) blocks this thread until every rank joined, inside C++
    where no signal reaches Python: Ctrl-C on rank 0 would wait for a stuck peer (gloo's 10-minute
    timeout). So on CPU the call is asynchronous and its completion polled in Python steps (busy
    for 2 ms, then every 1 ms), where a KeyboardInterrupt can land."""
    with _collective():
        if x.device.type != "cpu":
            collective(x, *args, **kwargs)
            return
        work = collective(x, *args, async_op=True, **kwargs)
        if not work.is_completed():
            spin_until = time.perf_counter() + 2e-3  # most collectives end within it
            while not work.is_completed():
                time.sleep(0 if time.perf_counter() < spin_until else 1e-3)
        work.wait()  # raises the collective's error (a peer gone: "connection closed")


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the ranks, in place; returns x. Identity at world size 1."""
    if get_tp_world_size() > 1:
        if _CUSTOM is not None and _CUSTOM.fits(x):
            return _CUSTOM(x)
        _run(dist.all_reduce, x)
    return x


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            eps: float, batch_invariant: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H]: this rank's partial sum (a row-parallel layer's unreduced output); residual
    [T, H]; weight [H]. In place: residual += sum of x over the ranks; x = rms_norm(residual) *
    weight; returns (x, residual). One kernel where our all-reduce is on (tp_all_reduce
    'custom', what 'auto' picks where it runs) and x fits (up to CUSTOM_MAX_ROWS rows), else
    all_reduce + fused_add_rms_norm. ``batch_invariant``: the norm's (the deterministic mode
    runs one rank only, so there is nothing to reduce then)."""
    import qwen3_kernels

    if (get_tp_world_size() > 1 and _CUSTOM is not None and _CUSTOM.fits(x)
            and _CUSTOM.fits(residual)):
        return _CUSTOM.add_rms_norm(x, residual, weight, eps)
    return qwen3_kernels.fused_add_rms_norm(all_reduce(x), residual, weight, eps,
                                            batch_invariant=batch_invariant)


# ---- the projection's GEMV sends its row itself (always, under our all-reduce) -----------------
#
# At one token (batch-1 decode), o_proj's and down_proj's GEMV stores its output row straight into
# the peers' receive buffers of our all-reduce (qwen3_kernels.tp_gemv_push), each warp as soon as
# its outputs are summed; the all-reduce + norm after it then only waits and adds (pushed=True).
# The row's NVLink trip overlaps the GEMV's tail instead of following the all-reduce's start.
# Two H200s: 72 GEMV + all-reduce + norm pairs 12.6 vs 13.5 us a pair; Qwen3-8B TP-2 batch 1
# 374.3 / 374.3 vs 366.6 / 367.1 tok/s without the push (alternating), 1.71x TP 1 (218.9) in the
# same call (benchmarks/allreduce_latency.py, benchmarks/bench_engine.py).


def push_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x [1, K] @ weight [H, K]^T through tp_gemv_push, when our all-reduce is on and takes
    [1, H]; the next all-reduce of the result (``all_reduce_add_rms_norm`` / ``all_reduce``) then
    runs pushed. None when it does not apply: the caller runs its own linear."""
    if not (get_tp_world_size() > 1 and _CUSTOM is not None and x.is_cuda
            and x.dim() == 2 and x.shape[0] == 1 and x.dtype == _CUSTOM.dtype
            and weight.dtype == x.dtype and weight.shape[0] == _CUSTOM.hidden
            and weight.shape[1] % 8 == 0 and weight.is_contiguous()):
        return None
    return _CUSTOM.push_linear(x.contiguous(), weight)


# ---- our one-shot all-reduce fused with the residual add + RMSNorm (tp_all_reduce="custom") -----
#
# qwen3_kernels.tp_all_reduce(_add_rms_norm) (csrc/kernels/custom_all_reduce.cu): each rank
# stores its rows with a per-call flag straight into every peer's receive buffer (torch symmetric
# memory: CUDA IPC peer mappings, no multicast), polls its own buffer until every peer's flag
# arrived, sums in rank order and, after a row-parallel layer, does the residual add + RMSNorm in
# the same kernel. One kernel instead of NCCL's all-reduce plus the norm. Tensors of up to
# CUSTOM_MAX_ROWS rows (decode steps and small mixed steps) take it, larger ones stay on NCCL. A
# peer that never writes (dead) is waited for until the engine sets the abort word
# (abort_custom_all_reduce, from its worker watch): the kernel then returns; with nobody setting
# it the kernel traps after ~2^26 polls, so the launch fails instead of hanging.
# Measured on two H200s: 4.1 us per [1, 4096] bf16 all-reduce with the norm inside a CUDA graph
# (NCCL 12.9 us, and the norm is another kernel; benchmarks/allreduce_latency.py); Qwen3-8B TP-2
# batch-1 decode 343.7-344.9 vs 307.5 tok/s with NCCL; TP-2 greedy tokens == TP 1 on 7/8 prompts,
# as with NCCL. With the abort word, a killed worker makes the engine raise
# (tests/test_engine_tp.py -k two_gpus and scripts/tp_kill_stress.py: 6 of 6 kills). So "auto"
# takes it wherever it runs (CUDA, bf16 / fp16, 2..8 ranks, hidden % 8 == 0, the extension built)
# and NCCL elsewhere; "nccl" keeps NCCL. (torch's one-shot all-reduce over symmetric memory
# measured slower in the engine: 295.4 vs 303.9 tok/s against NCCL; not offered.)

CUSTOM_MAX_ROWS = 512  # rows of the receive buffer: larger all-reduces go to NCCL
_CUSTOM: "_CustomAllReduce | None" = None


class _CustomAllReduce:
    """The receive buffer, peer addresses and call counter of qwen3_kernels.tp_all_reduce for the
    default process group. Building it is a collective (every rank, same arguments)."""

    def __init__(self, max_rows: int, hidden: int, dtype: torch.dtype, device: torch.device):
        import qwen3_kernels

        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"tp_all_reduce='custom' needs a float16 / bfloat16 model, "
                             f"got {dtype}")
        if hidden % 8:
            raise ValueError(f"tp_all_reduce='custom' needs hidden_size % 8 == 0, got {hidden}")
        if not qwen3_kernels.has_cuda_kernels():
            raise RuntimeError("tp_all_reduce='custom' needs the built CUDA extension")
        world, rank = get_tp_world_size(), get_tp_rank()
        if not 2 <= world <= 8:
            raise ValueError(f"tp_all_reduce='custom' supports 2..8 ranks, got {world}")
        # Not a kernel switch: torch's own setting. Multicast must never be used on shared
        # machines (it can take the host's GPUs out of service); our kernel needs plain peer
        # stores and loads only, so torch's symmetric memory is told not to set it up.
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        from torch.distributed import _symmetric_memory as symm_mem

        # CUDA IPC peer memory, not NVSHMEM nor NCCL's window: torch's default allocator for
        # CUDA tensors, which torch 2.11 does not list by name (set_backend("CUDA") raised "does
        # not find allocation backend CUDA" on an H200), so only switch when another was chosen.
        if symm_mem.get_backend(device) not in (None, "CUDA"):
            symm_mem.set_backend("CUDA")
        nbytes = qwen3_kernels.tp_all_reduce_buffer_bytes(max_rows, hidden, world)
        self.buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        # Zeroed before any peer can write: a flag is never 0, so no packet passes before its
        # call wrote it. The barrier below orders this zeroing before every peer's first store.
        self.buf.zero_()
        handle = symm_mem.rendezvous(self.buf, dist.group.WORLD.group_name)
        # buffer_ptrs are the peers' mappings of the allocation; our tensor may sit at an offset
        # in it (torch's symmetric pools), the same on every rank: add that offset to each.
        ptrs = list(handle.buffer_ptrs)
        offset = self.buf.data_ptr() - ptrs[rank]
        self.peer_ptrs = torch.tensor([p + offset for p in ptrs], dtype=torch.int64, device=device)
        self.counters = torch.zeros(2, dtype=torch.int32, device=device)  # call count, CTAs done
        # pinned host word the kernel reads while it waits: set by abort() when a peer died
        self.abort_flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        torch.cuda.synchronize(device)
        dist.barrier()
        self.max_rows, self.hidden, self.dtype, self.rank = max_rows, hidden, dtype, rank
        self.pushed: torch.Tensor | None = None  # the row push_linear sent, until its all-reduce

    def fits(self, x: torch.Tensor) -> bool:
        return (x.dtype == self.dtype and x.is_cuda and x.dim() == 2 and x.is_contiguous()
                and x.shape[1] == self.hidden and x.shape[0] <= self.max_rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        import qwen3_kernels

        return qwen3_kernels.tp_all_reduce(x, self.buf, self.peer_ptrs, self.counters,
                                           self.abort_flag, self.rank, self._take_pushed(x))

    def add_rms_norm(self, x, residual, weight, eps):
        import qwen3_kernels

        return qwen3_kernels.tp_all_reduce_add_rms_norm(
            x, residual, weight, eps, self.buf, self.peer_ptrs, self.counters, self.abort_flag,
            self.rank, self._take_pushed(x))

    def push_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        import qwen3_kernels

        if self.pushed is not None:
            raise RuntimeError("tp_gemv_push: the previous pushed row was never all-reduced")
        out = qwen3_kernels.tp_gemv_push(x, weight, self.buf, self.peer_ptrs, self.counters,
                                         self.rank)
        self.pushed = out
        return out

    def _take_pushed(self, x: torch.Tensor) -> bool:
        """Whether this all-reduce is of the row the last push_linear sent (then it runs pushed).
        Any other all-reduce in between would reuse the pushed call's buffer slots: an error."""
        pushed, self.pushed = self.pushed, None
        if pushed is None:
            return False
        if pushed is not x:
            raise RuntimeError("our all-reduce: a pushed row (tp_gemv_push) must be the very next "
                               "all-reduce on these buffers; got another tensor first")
        return True

    def abort(self) -> None:
        """A peer died: the waiting kernel (and every later one) returns instead of spinning.
        A host write to pinned memory: no CUDA call, safe from any thread."""
        self.abort_flag.numpy()[0] = 1


def init_all_reduce(choice: str, hidden_size: int, dtype: torch.dtype,
                    device: torch.device) -> bool:
    """Every rank, after the process group and before graph capture: set up the all-reduce that
    ``choice`` (Config.tp_all_reduce) names: 'custom' (ours, fused with the norm), 'nccl', or
    'auto' (custom where it runs, else nccl). A collective: all ranks must call it (and all
    decide alike: the same dtype, sizes and build). Returns whether ours is on (False: NCCL)."""
    global _CUSTOM
    if choice not in ("auto", "custom", "nccl"):
        raise ValueError(f"tp_all_reduce must be 'auto', 'custom' or 'nccl', got {choice!r}")
    _CUSTOM = None
    world = get_tp_world_size()
    if choice == "nccl" or world == 1:
        return False
    if choice == "auto":
        import qwen3_kernels

        runs = (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
                and hidden_size % 8 == 0 and 2 <= world <= 8 and qwen3_kernels.has_cuda_kernels())
        if not runs:
            return False
    if device.type != "cuda":
        raise ValueError("tp_all_reduce='custom' needs CUDA devices")
    _CUSTOM = _CustomAllReduce(CUSTOM_MAX_ROWS, hidden_size, dtype, device)
    return True


def abort_custom_all_reduce() -> None:
    """This process learnt that a tensor-parallel peer died: our all-reduce stops waiting for it
    (every call from now on returns meaningless sums), so the stream, and a CUDA graph's replay,
    drains and the engine can raise its error. No-op without it."""
    if _CUSTOM is not None:
        _CUSTOM.abort()


def release_all_reduce() -> None:
    """Drop our all-reduce's symmetric buffers (before the process group goes)."""
    global _CUSTOM
    _CUSTOM = None


def gather_to_rank0(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenate every rank's x along ``dim`` on rank 0 (rank order); other ranks get None.

    x has the same shape on every rank (the vocab split is even). Identity at world size 1.
    """
    world = get_tp_world_size()
    if world == 1:
        return x
    x = x.contiguous()
    rank = get_tp_rank()
    parts = [torch.empty_like(x) for _ in range(world)] if rank == 0 else None
    _run(dist.gather, x, parts, dst=0)
    return torch.cat(parts, dim=dim) if rank == 0 else None


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """x (rank 0's values) on every rank, in place; returns x."""
    _run(dist.broadcast, x, src=0)
    return x
