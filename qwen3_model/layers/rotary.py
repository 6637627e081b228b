"""Rotary position embedding: the cos | sin table that ``qwen3_kernels.qk_norm_rope`` reads.

Qwen3 uses neox-style RoPE (HF ``rotate_half``) with rope_theta 1e6. Checkpoints extended to long
contexts use YaRN (``"rope_type": "yarn"``); linear position interpolation is cheap to support too.
Types whose frequencies depend on the running sequence length (dynamic NTK, longrope) cannot live
in one precomputed table and get a clear error.

The parameters come from ``config.rope_parameters`` (transformers >= 5) or from
``config.rope_theta`` + ``config.rope_scaling`` (older versions).
"""

from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")


def rope_parameters(config) -> dict:
    """The rope settings of a Qwen3Config as one dict with at least rope_theta and rope_type."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
    params = dict(params)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    # old configs spell the type "type"
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def _yarn_inv_freq(head_dim: int, theta: float, params: dict,
                   max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): keep high-frequency dims (many rotations over the original context)
    as they are, interpolate low-frequency dims by ``factor``, blend linearly in between; scale
    cos / sin by the attention factor 0.1 * ln(factor) + 1."""
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings") or max_position
    if factor is None:
        factor = max_position / original
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (mscale(factor, m) / mscale(factor, m_all) if (m and m_all)
                            else mscale(factor))
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        # the dim index whose wavelength fits `rotations` times into the original context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    dims = torch.arange(head_dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((dims - low) / (high - low)).clamp(0, 1)
    even = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu")
    base_freq = theta ** (even / head_dim)
    keep = 1.0 - ramp  # 1: extrapolate (unchanged frequency), 0: interpolate (frequency / factor)
    inv_freq = (1.0 / (factor * base_freq)) * (1.0 - keep) + (1.0 / base_freq) * keep
    return inv_freq, float(attention_factor)


def rope_inv_freq(head_dim: int, params: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] fp32 on the CPU, cos/sin scale) for the rope type in ``params``.

    Always on the CPU, whatever the default device (cuda, meta): the table is built there once."""
    theta = float(params["rope_theta"])
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)}); "
            "types whose frequencies change with the sequence length cannot use a precomputed table"
        )
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, params, max_position)
    even = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu")
    inv_freq = 1.0 / theta ** (even / head_dim)
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Holds ``cos_sin_cache`` [max_position, head_dim] fp32: cos | sin halves per position."""

    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embedding, got {head_dim}")
        inv_freq, scale = rope_inv_freq(head_dim, params, max_position)
        # Built on the CPU in fp32 whatever the defaults are, so every device gets the same table.
        t = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim / 2]
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * scale
        device = torch.empty(0).device  # the current default device
        self.register_buffer("cos_sin_cache", cache.to(device), persistent=False)
