"""RMSNorm through the qwen3_kernels ops; with a residual, the add and the norm are one fused op."""

from __future__ import annotations

import torch
from torch import nn

import qwen3_kernels
from qwen3_model.distributed import all_reduce_add_rms_norm, get_tp_world_size
from qwen3_model.layers.linear import Fp8Activation, default_weight_loader


class RMSNorm(nn.Module):
    batch_invariant = False  # the deterministic mode (set on the whole model by Qwen3ForCausalLM)

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                all_reduce_x: bool = False, fp8_out: bool = False):
        """x [T, H] -> rms_norm(x); with residual [T, H]: (rms_norm(x + residual), x + residual).

        The residual form works in place: x and residual are overwritten and returned. With
        ``all_reduce_x`` (residual form only), x is this rank's partial sum from a row-parallel
        layer built with reduce_results=False: it is summed over the tensor-parallel ranks first,
        in the same kernel as the add + norm where our all-reduce is on (the TP default).
        ``fp8_out`` (one rank, not the deterministic mode): the normalised rows come quantized
        for the FP8 projections (an ``Fp8Activation``; the residual form then leaves x as it
        was and updates residual in place).
        """
        bi = self.batch_invariant
        if fp8_out:
            if bi or get_tp_world_size() > 1:
                raise ValueError("RMSNorm: fp8_out needs one rank and batch_invariant=False")
            if residual is None:
                q = qwen3_kernels.rms_norm_fp8(x, self.weight, self.eps)
                return Fp8Activation(*q, x.dtype)
            q = qwen3_kernels.fused_add_rms_norm_fp8(x, residual, self.weight, self.eps)
            return Fp8Activation(*q, x.dtype), residual
        if residual is None:
            return qwen3_kernels.rms_norm(x, self.weight, self.eps, batch_invariant=bi)
        if all_reduce_x:
            return all_reduce_add_rms_norm(x, residual, self.weight, self.eps, batch_invariant=bi)
        return qwen3_kernels.fused_add_rms_norm(x, residual, self.weight, self.eps,
                                                batch_invariant=bi)
