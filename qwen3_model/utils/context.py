"""The per-forward attention context, set by the model runner and read by every Attention layer.

Keeping it out of ``model.forward(input_ids, positions)`` keeps the model code clean and the decode
step graph-capturable (the tensors below are the graph's static buffers).

A step's flat token batch is laid out prefill first, decode after:
    tokens [0, num_prefill_tokens)                 the query chunks of the prefilling sequences
    tokens [num_prefill_tokens, num_tokens)        one token per decoding sequence
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Context:
    # every token of the step: where its K/V goes in the paged cache (-1 = nowhere, graph padding)
    slot_mapping: torch.Tensor | None = None  # [T] int32
    # prefill part
    num_prefill_tokens: int = 0
    cu_seqlens_q: torch.Tensor | None = None  # [P + 1] int32
    max_seqlen_q: int = 0
    prefill_seq_lens_k: torch.Tensor | None = None  # [P] int32, cached prefix + this chunk
    prefill_block_tables: torch.Tensor | None = None  # [P, max_blocks] int32
    # decode part
    decode_seq_lens: torch.Tensor | None = None  # [D] int32, including the new token
    decode_block_tables: torch.Tensor | None = None  # [D, max_blocks] int32
    decode_workspace: torch.Tensor | None = None  # [D, Hq, splits, head_dim + 1] fp32, or None
    # piecewise CUDA graphs (qwen3_model/engine/piecewise.py): while capturing, every Attention
    # layer writes q into attn_q, leaves attn_out to its eager ``attend`` between the replays, and
    # calls attn_split(layer) where the graph must end
    attn_q: torch.Tensor | None = None  # [T, Hq, D]
    attn_out: torch.Tensor | None = None  # [T, Hq, D]
    attn_split: Callable[[object], None] | None = None


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


def set_context(ctx: Context) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def reset_context() -> None:
    global _CONTEXT
    _CONTEXT = Context()
