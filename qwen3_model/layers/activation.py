"""SwiGLU's gate: silu(gate) * up on the fused gate_up output."""

from __future__ import annotations

import torch
from torch import nn

import qwen3_kernels


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, 2I] (gate | up) -> [T, I]
        return qwen3_kernels.silu_and_mul(x)
