"""Runs the model for one scheduled step: builds the flat batch and its attention Context, owns the
paged KV cache, replays CUDA graphs for decode-only steps, and samples.

Step layout (``qwen3_model.utils.context``): the prefill chunks first, then one token per decoding
sequence. Mixed and prefill steps run eagerly; a decode-only step on CUDA replays the graph
captured for the smallest batch-size bucket that fits, with the unused rows padded (slot -1: no
cache write; seq_len 1 over block 0: a harmless read whose result is dropped).

Rank-aware for tensor parallelism: every rank runs the forward; rank 0 samples.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

import qwen3_kernels
from qwen3_model.config import Config
from qwen3_model.engine.scheduler import ScheduledBatch
from qwen3_model.engine.sequence import Sequence
from qwen3_model.layers.sampler import Sampler, SamplingBatch
from qwen3_model.utils.context import Context, reset_context, set_context


@dataclass
class StepPlan:
    """One step's inputs as plain lists (picklable: what rank 0 sends the other TP ranks)."""

    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slots: list[int]  # [T]
    sample_rows: list[int]  # rows of the step whose logits are sampled
    bucket: int | None = None  # CUDA graph batch size to replay, None = eager
    cu_q: list[int] | None = None  # [P + 1] prefill part, None when there is none
    lens_k: list[int] | None = None  # [P]
    prefill_tables: list[list[int]] | None = None
    max_q: int = 0
    decode_lens: list[int] | None = None  # [D] decode part, None when there is none
    decode_tables: list[list[int]] | None = None


class ModelRunner:
    def __init__(self, config: Config, rank: int = 0):
        from qwen3_model.models.qwen3 import Qwen3ForCausalLM

        self.config = config
        hf = config.hf_config
        self.rank = rank
        self.worker_conns: list = []  # rank 0, tensor parallel: pipes to the other ranks
        self.world_size = config.tensor_parallel_size
        self.block_size = config.kvcache_block_size
        self.vocab_size = hf.vocab_size
        self.device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
        self.use_cuda = self.device.type == "cuda"
        self.enforce_eager = config.enforce_eager or not self.use_cuda
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        if self.use_cuda:
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.seed)

        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.torch_dtype)
        try:
            with torch.device(self.device):
                self.model = Qwen3ForCausalLM(hf)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            self._init_dummy_weights()
        else:
            from qwen3_model.loader import load_model

            load_model(self.model, config.model)
        self.model.eval()
        self.sampler = Sampler()
        self.attn_modules = [m for m in self.model.modules()
                             if hasattr(m, "k_cache") and hasattr(m, "v_cache")]
        if not self.attn_modules:
            raise RuntimeError("the model has no modules with k_cache / v_cache to give a KV cache")
        # this rank's heads, as the model split them (kv heads may be replicated, not split)
        self.num_q_heads = self.attn_modules[0].num_heads
        self.num_kv_heads = self.attn_modules[0].num_kv_heads
        # the split-KV scratch of decode attention, sliced per step (no allocation in the graphs)
        self.workspace = (
            qwen3_kernels.decode_workspace(config.max_num_seqs, self.num_q_heads, self.head_dim,
                                           self.device)
            if self.use_cuda else None
        )
        self.kv_cache: torch.Tensor | None = None
        self.num_blocks = self.allocate_kv_cache()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_batch_sizes: list[int] = []
        self.num_graph_steps = 0
        self.last_step_used_graph = False
        why_not = self._why_no_graphs()
        if why_not and not self.enforce_eager:
            warnings.warn(f"qwen3_model: CUDA graphs off ({why_not}); decode runs eagerly",
                          stacklevel=2)
        elif not self.enforce_eager:
            self.capture_cudagraph()

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
        return None

    # ---- weights -------------------------------------------------------------------------------

    @torch.no_grad()
    def _init_dummy_weights(self) -> None:
        """Random weights (load_format='dummy'): benchmarks at real shapes without a checkpoint."""
        gen = torch.Generator(device=self.device).manual_seed(self.config.seed)
        for name, p in self.model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)

    # ---- KV cache ------------------------------------------------------------------------------

    def block_bytes(self) -> int:
        """Bytes of one block over all layers, K and V."""
        itemsize = torch.empty((), dtype=self.config.torch_dtype).element_size()
        return (2 * len(self.attn_modules) * self.block_size * self.num_kv_heads * self.head_dim
                * itemsize)

    def _set_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = None  # drop the old one before allocating the new
        for m in self.attn_modules:
            m.k_cache = m.v_cache = torch.tensor([])
        # One tensor for all layers: a single allocation, sliced (views) per layer.
        self.kv_cache = torch.zeros(
            2, len(self.attn_modules), num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
            dtype=self.config.torch_dtype, device=self.device,
        )
        for i, m in enumerate(self.attn_modules):
            m.k_cache = self.kv_cache[0, i]
            m.v_cache = self.kv_cache[1, i]

    def allocate_kv_cache(self) -> int:
        cfg = self.config
        if cfg.num_kvcache_blocks > 0:
            num_blocks = cfg.num_kvcache_blocks
        elif self.use_cuda:
            num_blocks = self._blocks_from_free_memory()
        else:
            useful = cfg.max_num_seqs * self.max_blocks_per_seq  # more could never be used
            num_blocks = min(int(cfg.cpu_kvcache_gib * 2**30) // self.block_bytes(), useful)
        if self.world_size > 1 and dist.is_initialized():
            # every rank must page the same block ids: take the smallest pool any rank can hold
            n = torch.tensor([num_blocks], device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MIN)
            num_blocks = int(n.item())
        if num_blocks < 1:
            raise RuntimeError(
                f"no room for the KV cache: one block needs {self.block_bytes() / 2**20:.1f} MiB; "
                "raise gpu_memory_utilization, lower max_num_batched_tokens / max_num_seqs, or set "
                "num_kvcache_blocks"
            )
        self._set_kv_cache(num_blocks)
        return num_blocks

    def _blocks_from_free_memory(self) -> int:
        """KV blocks that fit in gpu_memory_utilization of the GPU, after the peak of a warm-up
        step as large as the scheduler can make (activations, logits and sampling)."""
        self._set_kv_cache(1)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self.warmup_model()
        self._set_kv_cache(1)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        stats = torch.cuda.memory_stats()
        activation_peak = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
        budget = total * self.config.gpu_memory_utilization - (total - free) - activation_peak
        return int(budget) // self.block_bytes()

    @torch.inference_mode()
    def warmup_model(self) -> None:
        """One step of max_num_batched_tokens prefill tokens plus sampling of max_num_seqs rows.

        Runs against a one-block cache: every slot is -1 (nothing written) and every block table
        entry is 0, so the step reads valid (meaningless) memory; only its memory peak matters.
        """
        cfg = self.config
        total = cfg.max_num_batched_tokens
        seq_len = min(cfg.max_model_len, total)
        lens = [seq_len] * (total // seq_len) + ([total % seq_len] if total % seq_len else [])
        lens = lens[: cfg.max_num_seqs]
        num_tokens = sum(lens)
        dev = self.device
        cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        ctx = Context(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int32, device=dev),
            num_prefill_tokens=num_tokens,
            cu_seqlens_q=cu.to(dev),
            max_seqlen_q=max(lens),
            prefill_seq_lens_k=torch.tensor(lens, dtype=torch.int32, device=dev),
            prefill_block_tables=torch.zeros(len(lens), self.max_blocks_per_seq, dtype=torch.int32,
                                             device=dev),
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        set_context(ctx)
        try:
            hidden = self.model(input_ids, positions)
        finally:
            reset_context()
        rows = min(cfg.max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[:rows])
        if logits is not None:
            from qwen3_model.sampling_params import SamplingParams

            worst = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05)
            batch = SamplingBatch.build([worst] * rows, [0] * rows, [[]] * rows, self.vocab_size, dev)
            self.sampler(logits, batch)
        del hidden, logits

    # ---- one step ------------------------------------------------------------------------------

    def _to_device(self, data, dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype, pin_memory=self.use_cuda)
        return t.to(self.device, non_blocking=True)

    def _slots(self, seq: Sequence, start: int, end: int, out: list[int]) -> None:
        """Append the cache slots of positions [start, end) of ``seq`` to ``out``."""
        bs = self.block_size
        table = seq.block_table
        pos = start
        while pos < end:
            block, off = divmod(pos, bs)
            stop = min(end, (block + 1) * bs)
            base = table[block] * bs - block * bs
            out.extend(range(base + pos, base + stop))
            pos = stop

    def _block_tables(self, tables: list[list[int]], width: int = 0) -> torch.Tensor:
        width = max(width, max(len(t) for t in tables))
        # padding 0 (a valid block) rather than -1: entries past a sequence's length are never
        # read, but a valid index keeps a stray read in bounds
        return self._to_device([t + [0] * (width - len(t)) for t in tables], torch.int32)

    def plan_step(self, batch: ScheduledBatch) -> tuple[StepPlan, list[Sequence]]:
        """The step's flat batch as plain lists, and the sequences whose logits get sampled."""
        bs = self.block_size
        plan = StepPlan([], [], [], [])
        sample_seqs: list[Sequence] = []
        if batch.prefills:
            plan.cu_q, plan.lens_k, plan.prefill_tables = [0], [], []
            for seq, n in batch.prefills:
                start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
                plan.input_ids.extend(seq.token_ids[start:end])
                plan.positions.extend(range(start, end))
                self._slots(seq, start, end, plan.slots)
                plan.cu_q.append(plan.cu_q[-1] + n)
                plan.lens_k.append(end)
                plan.prefill_tables.append(seq.block_table)
                if end == len(seq.token_ids):
                    plan.sample_rows.append(plan.cu_q[-1] - 1)
                    sample_seqs.append(seq)
            plan.max_q = max(n for _, n in batch.prefills)
        if batch.decodes:
            n_pre = len(plan.input_ids)
            plan.decode_lens, plan.decode_tables = [], []
            for i, seq in enumerate(batch.decodes):
                pos = seq.num_computed_tokens
                plan.input_ids.append(seq.token_ids[pos])
                plan.positions.append(pos)
                plan.slots.append(seq.block_table[pos // bs] * bs + pos % bs)
                plan.decode_lens.append(pos + 1)
                plan.decode_tables.append(seq.block_table)
                if pos + 1 == len(seq.token_ids):
                    plan.sample_rows.append(n_pre + i)
                    sample_seqs.append(seq)
        plan.bucket = self._graph_bucket(batch)
        return plan, sample_seqs

    def plan_tensors(self, plan: StepPlan):
        """-> input_ids [T] int64, positions [T] int64 and the attention Context, on the device."""
        ctx = Context()
        if plan.cu_q is not None:
            ctx.num_prefill_tokens = plan.cu_q[-1]
            ctx.cu_seqlens_q = self._to_device(plan.cu_q, torch.int32)
            ctx.max_seqlen_q = plan.max_q
            ctx.prefill_seq_lens_k = self._to_device(plan.lens_k, torch.int32)
            ctx.prefill_block_tables = self._block_tables(plan.prefill_tables)
        if plan.decode_lens is not None:
            ctx.decode_seq_lens = self._to_device(plan.decode_lens, torch.int32)
            # Full width, as in the decode graphs: the split-KV count is chosen from the table width,
            # so eager and replayed decode then sum in the same order and give identical tokens
            # (measured: a narrower eager table changed a greedy token after 37 steps, H200).
            ctx.decode_block_tables = self._block_tables(plan.decode_tables, self.max_blocks_per_seq)
            if self.workspace is not None:
                ctx.decode_workspace = self.workspace[: len(plan.decode_lens)]
        ctx.slot_mapping = self._to_device(plan.slots, torch.int32)
        return (self._to_device(plan.input_ids, torch.int64),
                self._to_device(plan.positions, torch.int64), ctx)

    def prepare_step(self, batch: ScheduledBatch):
        """-> input_ids [T] int64, positions [T] int64, Context, sample_rows (hidden rows whose
        logits are sampled, batch order) and the sequences they belong to."""
        plan, sample_seqs = self.plan_step(batch)
        input_ids, positions, ctx = self.plan_tensors(plan)
        return input_ids, positions, ctx, plan.sample_rows, sample_seqs

    def _graph_bucket(self, batch: ScheduledBatch) -> int | None:
        if not self.graphs or batch.prefills:
            return None
        n = len(batch.decodes)
        return next((b for b in self.graph_batch_sizes if b >= n), None)

    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Context,
                  bucket: int | None) -> torch.Tensor:
        """-> hidden [T, hidden] (a view of the graph's output buffer when replayed)."""
        if bucket is None:
            set_context(ctx)
            try:
                return self.model(input_ids, positions)
            finally:
                reset_context()
        n = input_ids.shape[0]
        g = self.graph_vars
        g["input_ids"][:n].copy_(input_ids, non_blocking=True)
        g["positions"][:n].copy_(positions, non_blocking=True)
        g["slot_mapping"][:n].copy_(ctx.slot_mapping, non_blocking=True)
        g["slot_mapping"][n:bucket].fill_(-1)
        g["seq_lens"][:n].copy_(ctx.decode_seq_lens, non_blocking=True)
        g["seq_lens"][n:bucket].fill_(1)
        tables = ctx.decode_block_tables
        g["block_tables"][:n, : tables.shape[1]].copy_(tables, non_blocking=True)
        self.graphs[bucket].replay()
        return g["outputs"][:n]

    @torch.inference_mode()
    def forward_plan(self, plan: StepPlan) -> torch.Tensor | None:
        """Every rank: the forward of one step and the logits of its sampled rows
        ([N, vocab] fp32 on rank 0, None elsewhere or when nothing is sampled)."""
        input_ids, positions, ctx = self.plan_tensors(plan)
        self.last_step_used_graph = plan.bucket is not None
        self.num_graph_steps += plan.bucket is not None
        hidden = self.run_model(input_ids, positions, ctx, plan.bucket)
        if not plan.sample_rows:
            return None
        if len(plan.sample_rows) == hidden.shape[0]:
            last = hidden  # every token is sampled (decode-only steps): no gather
        else:
            last = hidden[self._to_device(plan.sample_rows, torch.int64)]
        return self.model.compute_logits(last)  # collective across the TP ranks

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int]:
        """Rank 0: run one step on every rank; returns the sampled token of each sequence whose
        chunk reached its last token, in batch order (what ``Scheduler.postprocess`` expects)."""
        plan, sample_seqs = self.plan_step(batch)
        for conn in self.worker_conns:  # the other TP ranks run the same step
            conn.send(("run", plan))
        logits = self.forward_plan(plan)
        if logits is None:
            return []
        sampling = SamplingBatch.build(
            [s.params for s in sample_seqs],
            [len(s.token_ids) - s.num_prompt_tokens for s in sample_seqs],
            [self._banned_ids(s) if s.params.min_tokens else () for s in sample_seqs],
            self.vocab_size,
            self.device,
        )
        return self.sampler(logits, sampling).tolist()  # the step's one host sync

    def _banned_ids(self, seq: Sequence) -> list[int]:
        """Ids that may not be sampled yet: EOS and stop ids before min_tokens."""
        p = seq.params
        if seq.num_completion_tokens >= p.min_tokens:
            return []
        ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            ids.update(self.config.eos_token_ids)
        return sorted(i for i in ids if 0 <= i < self.vocab_size)

    # ---- CUDA graphs ---------------------------------------------------------------------------

    def make_graph_buffers(self, max_bs: int) -> None:
        """The static inputs / outputs every decode graph reads and writes (rows [0, bs))."""
        dev, cfg = self.device, self.config
        self.graph_vars = dict(
            input_ids=torch.zeros(max_bs, dtype=torch.int64, device=dev),
            positions=torch.zeros(max_bs, dtype=torch.int64, device=dev),
            slot_mapping=torch.full((max_bs,), -1, dtype=torch.int32, device=dev),
            seq_lens=torch.ones(max_bs, dtype=torch.int32, device=dev),
            block_tables=torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32,
                                     device=dev),
            outputs=torch.zeros(max_bs, cfg.hf_config.hidden_size, dtype=cfg.torch_dtype,
                                device=dev),
        )

    def graph_forward(self, bs: int) -> None:
        """The decode forward a graph of batch size ``bs`` holds: static buffers in, static out."""
        g = self.graph_vars
        set_context(Context(
            slot_mapping=g["slot_mapping"][:bs],
            decode_seq_lens=g["seq_lens"][:bs],
            decode_block_tables=g["block_tables"][:bs],
            decode_workspace=None if self.workspace is None else self.workspace[:bs],
        ))
        try:
            g["outputs"][:bs] = self.model(g["input_ids"][:bs], g["positions"][:bs])
        finally:
            reset_context()

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
        for bs in reversed(self.graph_batch_sizes):
            self.graph_forward(bs)  # warm-up outside the graph (lazy inits, autotuning)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.graph_forward(bs)
            if pool is None:
                pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()
        self.graph_pool = pool
        self.capture_seconds = time.perf_counter() - start
