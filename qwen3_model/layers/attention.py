"""Attention over the paged KV cache, reading the step's layout from the per-forward Context.

A step's flat token batch is prefill tokens first, then one token per decoding sequence
(``qwen3_model.utils.context``). One fused op normalises q / k per head, applies RoPE and writes
K / V into the cache; then the prefill part and the decode part each run their own kernel.
"""

from __future__ import annotations

import torch
from torch import nn

import qwen3_kernels
from qwen3_model.utils.context import get_context

class Attention(nn.Module):
    """Paged GQA attention for this rank's heads.

    ``k_cache`` / ``v_cache`` [num_blocks, block_size, num_kv_heads, head_dim] are assigned by the
    model runner once it has sized the cache; they start empty. Their dtype is the model's, or
    float8_e4m3fn (Config.kv_cache_dtype="fp8"), which stores K / V divided by ``k_scale`` /
    ``v_scale`` (this layer's, from the checkpoint; 1.0 otherwise and always for a cache in the
    model's dtype). ``batch_invariant`` (the deterministic mode, set on the whole model by
    Qwen3ForCausalLM): both kernels compute each query as decode does, whatever the batch.
    """

    batch_invariant = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, eps: float):
        super().__init__()
        self.num_heads = num_heads  # local to this rank
        self.num_kv_heads = num_kv_heads  # local to this rank
        self.head_dim = head_dim
        self.scale = float(scale)
        self.eps = float(eps)
        self.k_cache = self.v_cache = torch.tensor([])
        self.k_scale = self.v_scale = 1.0

    def forward(
        self,
        qkv: torch.Tensor,  # [T, (Hq + 2 * Hkv) * D] this rank's packed projection
        positions: torch.Tensor,  # [T] int64
        q_norm_weight: torch.Tensor,  # [D]
        k_norm_weight: torch.Tensor,  # [D]
        cos_sin_cache: torch.Tensor,  # [max_position, D] fp32
    ) -> torch.Tensor:  # [T, Hq * D]
        ctx = get_context()
        if self.k_cache.dim() != 4:
            raise RuntimeError(
                "Attention.k_cache / v_cache are not assigned: the model runner must give every "
                "Attention layer its paged cache [num_blocks, block_size, num_kv_heads, head_dim] "
                "before the first forward"
            )
        if ctx.slot_mapping is None:
            raise RuntimeError("no attention Context is set: call "
                               "qwen3_model.utils.context.set_context first")
        q = qwen3_kernels.qk_norm_rope(
            qkv, q_norm_weight, k_norm_weight, cos_sin_cache, positions, self.k_cache, self.v_cache,
            ctx.slot_mapping, self.num_heads, self.num_kv_heads, self.eps, q_out=ctx.attn_q,
            k_scale=self.k_scale, v_scale=self.v_scale,
        )  # [T, Hq, D]; K / V of every token are now in the cache
        out = torch.empty_like(q) if ctx.attn_out is None else ctx.attn_out
        if ctx.attn_split is not None:
            # a piecewise CUDA graph is being captured: it ends here, and the attention of this
            # layer runs eagerly between two graph replays (``attend`` on ctx.attn_q / attn_out)
            ctx.attn_split(self)
        else:
            self.attend(q, out)
        return out.view(q.shape[0], -1)

    def attend(self, q: torch.Tensor, out: torch.Tensor) -> None:
        """q [T, Hq, D] (normalised, rotated; K / V already cached) -> out [T, Hq, D]: the prefill
        rows then the decode rows of the step's Context, each part by its own kernel."""
        ctx = get_context()
        n_pre = ctx.num_prefill_tokens
        if n_pre > 0:
            qwen3_kernels.paged_attention_prefill(
                q[:n_pre], self.k_cache, self.v_cache, ctx.cu_seqlens_q, ctx.prefill_seq_lens_k,
                ctx.prefill_block_tables, ctx.max_seqlen_q, self.scale, out=out[:n_pre],
                k_scale=self.k_scale, v_scale=self.v_scale, batch_invariant=self.batch_invariant,
            )
        if q.shape[0] > n_pre:
            if ctx.decode_seq_lens is None:
                raise RuntimeError(
                    f"the step has {q.shape[0] - n_pre} tokens after the {n_pre} prefill tokens "
                    "but the "
                    "Context has no decode_seq_lens / decode_block_tables"
                )
            qwen3_kernels.paged_attention_decode(
                q[n_pre:], self.k_cache, self.v_cache, ctx.decode_block_tables, ctx.decode_seq_lens,
                self.scale, out=out[n_pre:], workspace=ctx.decode_workspace,
                k_scale=self.k_scale, v_scale=self.v_scale, batch_invariant=self.batch_invariant,
            )
