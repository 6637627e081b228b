"""Piecewise CUDA graphs for mixed steps (prompt chunks + decodes): everything but the attention.

Why: a mixed step of a few hundred tokens runs eagerly, and launching its ~400 kernels one op at
a time takes the host ~9 ms at Qwen3-8B, about as long as the kernels take (a mixed step in
``benchmarks/bench_engine.py --size 8B --profile``), so the host sets the pace of such steps. The
attention cannot be captured once for all such steps (its grids follow the number of prompt
chunks, their lengths and the decodes), but everything between two attentions only depends on
the token count: the projections, the norms, qk_norm_rope with its cache write (rows past the
step's tokens write nowhere: slot -1), the MLP.

So for each bucket of token counts (multiples of ``step`` up to ``max_tokens``) the model's forward
is captured as num_layers + 1 graphs, cut at each layer's attention: graph i runs from after
attention i - 1 (the embedding for i = 0) up to layer i's qk_norm_rope, which writes q into one
static buffer; a step then replays graph i, runs layer i's attention kernels eagerly from that
buffer into a static output buffer (the step's own prefill / decode metadata, as in an eager
step), and goes on with graph i + 1, whose first op (o_proj) reads it. The last graph ends with
the final norm and copies the hidden states into a static output.

One q and one attention-output buffer serve every layer and bucket: layer i + 1's qk_norm_rope
writes q after layer i's o_proj has read the output, in stream order. Rows past the step's tokens
hold whatever an earlier step left there (finite values or not): every op of the graphs treats
rows independently and only the step's rows are read back.
"""

from __future__ import annotations

import time

import torch

import qwen3_kernels
from qwen3_model.utils.context import Context, reset_context, set_context


class PiecewiseGraphs:
    def __init__(self, model, max_tokens: int, step: int, num_q_heads: int, head_dim: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device):
        if max_tokens < step or max_tokens % step:
            raise ValueError(f"piecewise graphs: max_tokens ({max_tokens}) must be a positive "
                             f"multiple of the bucket step ({step})")
        self.model = model
        self.buckets = list(range(step, max_tokens + 1, step))
        self.max_tokens = max_tokens
        z = dict(device=device)
        # the graphs' static inputs and outputs (rows [0, bucket) of each)
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, **z)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, **z)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int32, **z)
        self.q = torch.zeros(max_tokens, num_q_heads, head_dim, dtype=dtype, **z)
        self.attn_out = torch.zeros(max_tokens, num_q_heads, head_dim, dtype=dtype, **z)
        self.hidden = torch.zeros(max_tokens, hidden_size, dtype=dtype, **z)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.attn_layers: list = []  # the Attention modules, in the order the graphs cut at them
        self.num_steps = 0
        self.capture_seconds = 0.0

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest bucket that holds a step of ``num_tokens``, or None (run it eagerly)."""
        if not self.graphs or num_tokens > self.max_tokens:
            return None
        return -(-num_tokens // self.buckets[0]) * self.buckets[0]

    def _forward(self, n: int, split) -> None:
        set_context(Context(slot_mapping=self.slot_mapping[:n], attn_q=self.q[:n],
                            attn_out=self.attn_out[:n], attn_split=split))
        try:
            self.hidden[:n] = self.model(self.input_ids[:n], self.positions[:n])
        finally:
            reset_context()

    @torch.inference_mode()
    def capture(self, pool) -> None:
        """Every bucket, largest first, into ``pool`` (a graph pool handle)."""
        start = time.perf_counter()
        stream = torch.cuda.Stream()
        for n in reversed(self.buckets):
            # warm-up on the capture stream (lazy inits, autotuning, its cuBLAS workspace)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(n, split=lambda layer: None)
            torch.cuda.synchronize()
            graphs, layers = [], []

            def begin():
                g = torch.cuda.CUDAGraph()
                g.capture_begin(pool=pool)
                graphs.append(g)

            def split(layer):
                graphs[-1].capture_end()
                layers.append(layer)
                begin()

            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                begin()
                try:
                    self._forward(n, split)
                finally:
                    graphs[-1].capture_end()
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            if len(graphs) != len(layers) + 1 or (self.attn_layers and layers != self.attn_layers):
                raise RuntimeError(f"piecewise capture of {n} tokens cut the forward into "
                                   f"{len(graphs)} graphs at {len(layers)} attention layers")
            self.attn_layers = layers
            self.graphs[n] = graphs
        self.capture_seconds = time.perf_counter() - start

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Context,
            bucket: int) -> torch.Tensor:
        """One mixed step: input_ids / positions [T] and its eager Context (prompt chunks then
        decodes, as ``ModelRunner.plan_tensors`` builds it) -> hidden [T, hidden] (a view of the
        static output)."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(ctx.slot_mapping, non_blocking=True)
        if bucket > n:
            self.slot_mapping[n:bucket].fill_(-1)  # padding rows write no K / V
        q, out = self.q[:n], self.attn_out[:n]
        graphs = self.graphs[bucket]
        set_context(ctx)
        try:
            with qwen3_kernels.trusted_inputs():
                for graph, layer in zip(graphs, self.attn_layers):
                    graph.replay()
                    layer.attend(q, out)
                graphs[-1].replay()
        finally:
            reset_context()
        self.num_steps += 1
        return self.hidden[:n]
