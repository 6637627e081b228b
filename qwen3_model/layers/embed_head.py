"""Vocab-parallel embedding and LM head: each rank holds vocab / tp rows of the table.

The embedding looks up the ids that fall in this rank's range (zeros for the rest) and all-reduces,
so every rank ends with the full hidden state. The LM head computes this rank's slice of the logits
and gathers the full vocab on rank 0, where the sampler runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qwen3_model.distributed import (all_reduce, divide, gather_to_rank0, get_tp_rank,
                                     get_tp_world_size)
from qwen3_model.layers.linear import check_loaded_shape, linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_world_size()
        self.num_embeddings = num_embeddings
        self.num_local = divide(num_embeddings, self.tp_size, "vocab_size")
        self.vocab_start = self.tp_rank * self.num_local
        self.weight = nn.Parameter(torch.empty(self.num_local, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        check_loaded_shape(loaded, (self.num_embeddings, param.shape[1]))
        param.data.copy_(loaded.narrow(0, self.vocab_start, self.num_local))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] int64 -> [T, hidden]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_local)
        # Masked lookup, no data-dependent shapes: stays CUDA-graph capturable.
        y = F.embedding(local.masked_fill(~mine, 0), self.weight)
        y = y.masked_fill(~mine.unsqueeze(1), 0)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """logits = hidden @ weight^T over this rank's vocab slice, gathered on rank 0.

    With tied embeddings the model points ``weight`` at the embedding's parameter.
    ``batch_invariant``: the deterministic mode (set on the whole model by Qwen3ForCausalLM).
    """

    batch_invariant = False

    def forward(self, hidden: torch.Tensor):  # pragma: no cover - use compute_logits
        raise RuntimeError("ParallelLMHead is applied through compute_logits(hidden)")

    def compute_logits(self, hidden: torch.Tensor,
                       dtype: torch.dtype | None = torch.float32) -> torch.Tensor | None:
        """hidden [N, hidden] -> logits [N, vocab] on rank 0 (in ``dtype``; None: the model's
        dtype); None on the other ranks.

        Every rank must call it (the gather is collective). The engine keeps the model's dtype:
        its sampler reads bf16 / fp16 logits directly, and the fp32 copy of [256, 151936] logits
        cost 116 us of a 14 ms Qwen3-8B decode step
        (``benchmarks/bench_engine.py --size 8B --profile --num-seqs 256``).
        """
        logits = linear(hidden, self.weight, batch_invariant=self.batch_invariant)  # [N, vocab / tp]
        logits = gather_to_rank0(logits, dim=-1)
        if logits is None or dtype is None:
            return logits
        return logits.to(dtype)
