"""A minimal paged-cache driver for the model tests: what the engine's model runner does, without
the scheduler. It owns each sequence's block table, builds the per-step Context (prefill chunks
first, then one token per decoding sequence) and runs the model.

Blocks are handed out in a shuffled order so a sequence's blocks are never contiguous, and unused
block-table entries are padded with ``pad_block`` (-1 like nano-vllm by default): a model or op that
reads past a sequence's blocks, or a slot it never wrote (caches start as NaN with ``poison``),
shows up as NaN or an error instead of a lucky match.
"""

from __future__ import annotations

import torch

from qwen3_model.layers.attention import Attention
from qwen3_model.utils.context import Context, reset_context, set_context


class PagedRunner:
    def __init__(self, model, num_blocks: int = 64, block_size: int = 16, *, seed: int = 0,
                 poison: bool = True, pad_block: int = -1, dtype=None, device=None):
        self.model = model
        self.block_size = block_size
        self.pad_block = pad_block
        p = next(model.parameters())
        self.dtype = dtype or p.dtype
        self.device = device or p.device
        fill = float("nan") if poison else 0.0
        self.layers = [m for m in model.modules() if isinstance(m, Attention)]
        for attn in self.layers:
            shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
            attn.k_cache = torch.full(shape, fill, dtype=self.dtype, device=self.device)
            attn.v_cache = torch.full(shape, fill, dtype=self.dtype, device=self.device)
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}  # tokens already in the cache

    def _slots(self, sid: int, n: int) -> list[int]:
        """Reserve the cache slots for the next n tokens of sequence sid."""
        table = self.tables.setdefault(sid, [])
        start = self.lens.get(sid, 0)
        slots = []
        for pos in range(start, start + n):
            if pos // self.block_size >= len(table):
                table.append(self.free.pop())
            slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
        self.lens[sid] = start + n
        return slots

    def _tables(self, sids: list[int]) -> torch.Tensor:
        width = max(len(self.tables[s]) for s in sids) + 1  # one spare column of padding
        rows = [self.tables[s] + [self.pad_block] * (width - len(self.tables[s])) for s in sids]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)

    def step(self, prefills: list[tuple[int, list[int]]] = (), decodes: list[tuple[int, int]] = (),
             split_attention: bool = False):
        """Run one forward. prefills: (seq id, chunk of token ids) each; decodes: (seq id,
        token id).

        ``split_attention``: as a piecewise CUDA graph step runs it
        (qwen3_model/engine/piecewise.py): every layer writes q into one shared buffer and leaves
        its attention to the split hook, which runs ``attend`` on the shared q / output buffers
        right there.

        Returns hidden [T, hidden] and, per prefill then per decode, the row of its last token.
        """
        ids, pos, slots, last = [], [], [], []
        cu, lens_k = [0], []
        for sid, chunk in prefills:
            start = self.lens.get(sid, 0)
            ids += chunk
            pos += range(start, start + len(chunk))
            slots += self._slots(sid, len(chunk))
            cu.append(cu[-1] + len(chunk))
            lens_k.append(self.lens[sid])
            last.append(len(ids) - 1)
        for sid, tok in decodes:
            ids.append(tok)
            pos.append(self.lens[sid])
            slots += self._slots(sid, 1)
            last.append(len(ids) - 1)
        dev, i32 = self.device, torch.int32
        ctx = Context(slot_mapping=torch.tensor(slots, dtype=i32, device=dev),
                      num_prefill_tokens=cu[-1])
        if prefills:
            psids = [s for s, _ in prefills]
            ctx.cu_seqlens_q = torch.tensor(cu, dtype=i32, device=dev)
            ctx.max_seqlen_q = max(len(c) for _, c in prefills)
            ctx.prefill_seq_lens_k = torch.tensor(lens_k, dtype=i32, device=dev)
            ctx.prefill_block_tables = self._tables(psids)
        if decodes:
            dsids = [s for s, _ in decodes]
            ctx.decode_seq_lens = torch.tensor([self.lens[s] for s in dsids], dtype=i32, device=dev)
            ctx.decode_block_tables = self._tables(dsids)
        if split_attention:
            a = self.layers[0]
            ctx.attn_q = torch.full((len(ids), a.num_heads, a.head_dim), float("nan"),
                                    dtype=self.dtype, device=dev)
            ctx.attn_out = torch.full_like(ctx.attn_q, float("nan"))
            ctx.attn_split = lambda layer: layer.attend(ctx.attn_q, ctx.attn_out)
        set_context(ctx)
        try:
            with torch.no_grad():
                hidden = self.model(torch.tensor(ids, dtype=torch.int64, device=dev),
                                    torch.tensor(pos, dtype=torch.int64, device=dev))
        finally:
            reset_context()
        return hidden, last

    def greedy(self, prompts: list[list[int]], max_new_tokens: int,
               first_sid: int = 0) -> list[list[int]]:
        """Prefill all prompts in one step, then decode them together greedily."""
        sids = list(range(first_sid, first_sid + len(prompts)))
        hidden, last = self.step(prefills=list(zip(sids, prompts)))
        with torch.no_grad():
            toks = self.model.compute_logits(hidden[last]).argmax(-1).tolist()
        out = [[t] for t in toks]
        for _ in range(max_new_tokens - 1):
            hidden, last = self.step(decodes=[(s, o[-1]) for s, o in zip(sids, out)])
            with torch.no_grad():
                toks = self.model.compute_logits(hidden[last]).argmax(-1).tolist()
            for o, t in zip(out, toks):
                o.append(t)
        return out
