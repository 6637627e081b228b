"""Tensor-parallel plumbing: one process per rank, the whole default process group is the TP group.

NCCL on GPUs, gloo on CPU (so CI tests the same split). Without an initialised process group every
helper is the identity: rank 0 of world size 1.
"""

from __future__ import annotations

import os

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


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the ranks, in place; returns x. Identity at world size 1."""
    if get_tp_world_size() > 1:
        if _ONE_SHOT is not None and _ONE_SHOT.fits(x):
            return _ONE_SHOT(x)
        dist.all_reduce(x)
    return x


# ---- opt-in: one-shot all-reduce over torch's symmetric memory (P2P loads, no multicast) ----------
#
# NCCL takes 12.4 us per all-reduce of a [1, 4096] bf16 row between two H200s even inside a CUDA
# graph (benchmarks/allreduce_latency.py, RESULTS.md 2026-11-30), and Qwen3-8B decode does 72 of
# them a step. torch's one-shot all-reduce reads every peer's buffer directly over NVLink after one
# device-side barrier. QWEN3_TP_ALLREDUCE=symm_mem turns it on for tensors of up to
# ONE_SHOT_MAX_ROWS rows (decode); larger ones (prefill) stay on NCCL. Measured on two H200s
# (RESULTS.md, 2026-11-30 evening): 7.5 vs 12.9 us per [1, 4096] all-reduce alone, same greedy
# tokens as NCCL, but Qwen3-8B TP-2 batch-1 decode was slower with it (295.4 vs 303.9 tok/s), so
# it stays off by default. Not checked: whether a killed worker still ends in an error with it on
# (the one-shot barrier spins on the device, and aborting NCCL may not release it).

ONE_SHOT_MAX_ROWS = 512
_ONE_SHOT: "_OneShotAllReduce | None" = None


class _OneShotAllReduce:
    def __init__(self, max_numel: int, dtype: torch.dtype, device: torch.device):
        # multicast must never be used on shared machines (it can take the host's GPUs out of
        # service): the one-shot kernel needs plain peer loads only, so it is switched off here
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        from torch.distributed import _symmetric_memory as symm_mem

        # CUDA IPC peer memory, not NVSHMEM nor NCCL's window. It is torch's default allocator for
        # CUDA tensors, and torch 2.11 does not list it by name: set_backend("CUDA") raised "does
        # not find allocation backend CUDA" on the H200 (2026-11-30), so only switch when another
        # backend was chosen before.
        if symm_mem.get_backend(device) not in (None, "CUDA"):
            symm_mem.set_backend("CUDA")
        self.group_name = dist.group.WORLD.group_name
        self.buf = symm_mem.empty(max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buf, self.group_name)
        self.max_numel, self.dtype = max_numel, dtype

    def fits(self, x: torch.Tensor) -> bool:
        return (x.dtype == self.dtype and x.is_cuda and x.is_contiguous()
                and x.numel() <= self.max_numel)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        staged = self.buf[: x.numel()].view_as(x)  # the peers read this rank's copy from here
        staged.copy_(x)
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, x)
        return x


def init_one_shot_all_reduce(hidden_size: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Every rank, after the process group and before graph capture: set up the opt-in one-shot
    all-reduce when QWEN3_TP_ALLREDUCE=symm_mem (a collective: all ranks must call it). Returns
    whether it is on. Any other value of QWEN3_TP_ALLREDUCE but unset / "nccl" is an error."""
    global _ONE_SHOT
    choice = os.environ.get("QWEN3_TP_ALLREDUCE", "nccl")
    if choice not in ("nccl", "symm_mem"):
        raise ValueError(f"QWEN3_TP_ALLREDUCE must be 'nccl' or 'symm_mem', got {choice!r}")
    _ONE_SHOT = None
    if choice == "nccl" or get_tp_world_size() == 1:
        return False
    if device.type != "cuda":
        raise ValueError("QWEN3_TP_ALLREDUCE=symm_mem needs CUDA devices")
    _ONE_SHOT = _OneShotAllReduce(ONE_SHOT_MAX_ROWS * hidden_size, dtype, device)
    return True


def release_one_shot_all_reduce() -> None:
    """Drop the symmetric buffer (before the process group goes)."""
    global _ONE_SHOT
    _ONE_SHOT = None


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
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=dim) if rank == 0 else None
