"""Tensor-parallel plumbing: one process per rank, the whole default process group is the TP group.

NCCL on GPUs, gloo on CPU (so CI tests the same split). Without an initialised process group every
helper is the identity: rank 0 of world size 1.
"""

from __future__ import annotations

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
        dist.all_reduce(x)
    return x


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
