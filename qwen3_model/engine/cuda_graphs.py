"""CUDA graphs of the model runner: decode graphs per batch-size bucket, and the piecewise graphs
of mixed steps (``piecewise.py``).

A decode-only step on CUDA replays the graph captured for the smallest batch-size bucket that
fits, with the unused rows padded (slot -1: no cache write; seq_len 1 over block 0: a harmless
read whose result is dropped). The deterministic mode captures each bucket twice: over the full
block table, and over its narrow one (``short_table_blocks``) for steps whose every context
fits. A step with prompt tokens of up to ``max_piecewise_graph_tokens`` (one GPU) replays the
piecewise graphs of its 32-token bucket with its attention run eagerly between them; larger ones,
and all on CPU, run eagerly.
"""

from __future__ import annotations

import time
import warnings

import torch

import qwen3_kernels
from qwen3_model.config import PIECEWISE_BUCKET
from qwen3_model.engine.scheduler import ScheduledBatch
from qwen3_model.engine.step_inputs import Layout, typed_torch
from qwen3_model.utils.blas import prefer_cublaslt
from qwen3_model.utils.context import Context, reset_context, set_context


class CudaGraphs:
    """ModelRunner's CUDA graphs (a base of ModelRunner: the model, the device, the config)."""

    def init_graphs(self) -> None:
        """At start-up, once the KV cache exists: capture the decode graphs and (one GPU) the
        piecewise graphs, unless eager or not possible (a warning says why)."""
        config = self.config
        self.graph_layout: Layout | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.short_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # over short_block_tables
        self.graph_batch_sizes: list[int] = []
        self.num_graph_steps = 0
        self.last_step_used_graph = False
        why_not = self._why_no_graphs()
        if why_not and not self.enforce_eager:
            warnings.warn(f"qwen3_model: CUDA graphs off ({why_not}); decode runs eagerly",
                          stacklevel=3)
        elif not self.enforce_eager:
            self.capture_cudagraph()
        self.piecewise = None
        # tensor parallel: the all-reduces inside these graphs are not measured yet (eager there)
        if (config.max_piecewise_graph_tokens and not why_not and not self.enforce_eager
                and self.world_size == 1):
            self.capture_piecewise(config.max_piecewise_graph_tokens)

    def _why_no_graphs(self) -> str | None:
        """Graphs need every op on its CUDA kernel: the reference fallbacks sync with the host."""
        if not self.use_cuda:
            return None
        if not qwen3_kernels.has_cuda_kernels():
            return "the qwen3_kernels CUDA extension is not built"
        if self.config.torch_dtype not in (torch.bfloat16, torch.float16):
            return f"dtype {self.config.torch_dtype} runs the attention reference, not a kernel"
        if self.head_dim != 128:
            return f"head_dim {self.head_dim} runs the attention reference (kernels: 128)"
        if (self.config.kv_cache_dtype == "fp8"
                and torch.cuda.get_device_capability(self.device) < (9, 0)):
            return "an fp8 KV cache runs the attention reference below compute capability 9.0"
        return None

    def _graph_bucket(self, batch: ScheduledBatch) -> int | None:
        if not self.graphs or batch.prefills:
            return None
        n = len(batch.decodes)
        return next((b for b in self.graph_batch_sizes if b >= n), None)

    def replay_decode_graph(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Context,
                            bucket: int) -> torch.Tensor:
        """-> hidden [T, hidden], a view of the graph's output buffer."""
        n = input_ids.shape[0]
        g = self.graph_vars
        if input_ids.data_ptr() != g["input_ids"].data_ptr():
            # inputs built elsewhere (plan_tensors writes graph steps straight into these)
            g["input_ids"][:n].copy_(input_ids, non_blocking=True)
            g["positions"][:n].copy_(positions, non_blocking=True)
            g["slot_mapping"][:n].copy_(ctx.slot_mapping, non_blocking=True)
            g["slot_mapping"][n:bucket].fill_(-1)
            g["seq_lens"][:n].copy_(ctx.decode_seq_lens, non_blocking=True)
            g["seq_lens"][n:bucket].fill_(1)
        tables = ctx.decode_block_tables
        short = tables.shape[1] < self.max_blocks_per_seq  # (plan_step's narrow table)
        if input_ids.data_ptr() != g["input_ids"].data_ptr():
            field = "short_block_tables" if short else "block_tables"
            g[field][:n, : tables.shape[1]].copy_(tables, non_blocking=True)
        (self.short_graphs if short else self.graphs)[bucket].replay()
        return g["outputs"][:n]

    def make_graph_buffers(self, max_bs: int) -> None:
        """The static inputs / outputs every decode graph reads and writes (rows [0, bs)).

        The inputs are views of one buffer (``graph_layout``), so that a decode step's inputs
        arrive with one host-to-device copy straight into them.
        """
        dev, cfg = self.device, self.config
        self.graph_layout = (
            Layout().add("input_ids", "int64", max_bs).add("positions", "int64", max_bs)
            .add("pending_rows", "int64", max_bs).add("pending_src", "int64", max_bs)
            .add("slot_mapping", "int32", max_bs).add("seq_lens", "int32", max_bs)
            .add("block_tables", "int32", max_bs, self.max_blocks_per_seq)
        )
        if self.short_table_blocks is not None:  # (after block_tables: see plan_step's copy)
            self.graph_layout.add("short_block_tables", "int32", max_bs, self.short_table_blocks)
        self.graph_inputs = torch.zeros(-(-self.graph_layout.nbytes // 8) * 8, dtype=torch.uint8,
                                        device=dev)
        self.graph_vars = self.graph_layout.views(typed_torch(self.graph_inputs))
        self.graph_vars["slot_mapping"].fill_(-1)
        self.graph_vars["seq_lens"].fill_(1)
        self.graph_vars["outputs"] = torch.zeros(max_bs, cfg.hf_config.hidden_size,
                                                 dtype=cfg.torch_dtype, device=dev)

    def graph_forward(self, bs: int, short: bool = False) -> None:
        """The decode forward a graph of batch size ``bs`` holds: static buffers in, static out
        (``short``: over the narrow block table)."""
        g = self.graph_vars
        set_context(Context(
            slot_mapping=g["slot_mapping"][:bs],
            decode_seq_lens=g["seq_lens"][:bs],
            decode_block_tables=g["short_block_tables" if short else "block_tables"][:bs],
            decode_workspace=None if self.workspace is None else self.workspace[:bs],
        ))
        try:
            g["outputs"][:bs] = self.model(g["input_ids"][:bs], g["positions"][:bs])
        finally:
            reset_context()

    def capture_piecewise(self, max_tokens: int) -> None:
        """Mixed steps of up to ``max_tokens`` tokens (rounded down to the bucket step) replay
        piecewise CUDA graphs cut at every attention (qwen3_model/engine/piecewise.py)."""
        from qwen3_model.engine.piecewise import PiecewiseGraphs

        step = PIECEWISE_BUCKET
        max_tokens = min(max_tokens, self.config.max_num_batched_tokens) // step * step
        if max_tokens < step:
            return
        self.piecewise = PiecewiseGraphs(
            self.model, max_tokens, step, self.num_q_heads, self.head_dim,
            self.config.hf_config.hidden_size, self.config.torch_dtype, self.device)
        with prefer_cublaslt(self.use_cuda):
            self.piecewise.capture(torch.cuda.graph_pool_handle())

    @torch.inference_mode()
    def capture_cudagraph(self) -> None:
        """One graph per decode batch-size bucket, largest first, all in one memory pool.

        The graphs read static buffers (graph_vars); a replay copies the step's inputs into their
        first rows. The Context captured points at slices of the same buffers.
        """
        cfg = self.config
        max_bs = min(cfg.max_num_seqs, cfg.max_cudagraph_batch_size)
        sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 16)) + [max_bs]
        self.graph_batch_sizes = sorted(set(sizes))
        self.make_graph_buffers(max_bs)
        pool = None
        start = time.perf_counter()
        with prefer_cublaslt(self.use_cuda):
            for bs in reversed(self.graph_batch_sizes):
                for short, graphs in ((False, self.graphs), (True, self.short_graphs)):
                    if short and self.short_table_blocks is None:
                        continue
                    # warm-up outside the graph (lazy inits, autotuning)
                    self.graph_forward(bs, short)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool):
                        self.graph_forward(bs, short)
                    if pool is None:
                        pool = graph.pool()
                    graphs[bs] = graph
                    torch.cuda.synchronize()
        self.graph_pool = pool
        self.capture_seconds = time.perf_counter() - start
