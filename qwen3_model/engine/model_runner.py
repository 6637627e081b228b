"""Runs the model for one scheduled step on this rank: owns the model and the paged KV cache, runs
the step's forward (a decode graph, piecewise graphs or eagerly: ``cuda_graphs.py``) on inputs
planned and staged by ``step_inputs.py``, and samples.

``launch`` queues a step up to its sampled tokens' copy back and returns; ``wait`` reads them.
The engine uses the pair to schedule and launch step k + 1 while the device still runs step k
(``LLMEngine._steps``), feeding step k's tokens to step k + 1 on the device.

Rank-aware for tensor parallelism: every rank runs the forward; rank 0 samples and sends the plan
of each step to the other ranks (``workers.py``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import qwen3_kernels
from qwen3_kernels.ops import BATCH_INVARIANT_SPLIT_KEYS
from qwen3_model.config import Config
from qwen3_model.distributed import broadcast_from_rank0, init_all_reduce
from qwen3_model.engine.cuda_graphs import CudaGraphs
from qwen3_model.engine.scheduler import ScheduledBatch
from qwen3_model.engine.sequence import Sequence, TokenLogprobs
from qwen3_model.engine.step_inputs import StepInputs, StepPlan, HostStaging, typed_torch
from qwen3_model.layers.sampler import Sampler, SamplingBatch
from qwen3_model.sampling_params import MAX_LOGPROBS
from qwen3_model.utils.blas import prefer_cublaslt
from qwen3_model.utils.context import Context, reset_context, set_context


@dataclass
class LogprobRows:
    """Logprobs of some rows of a step's logits (``logprob_stats``), on the device or, once
    copied back, on the host: column 0 the row's own token (its logprob; its rank), then the
    top-K most likely (their logprobs; their ids)."""

    values: torch.Tensor  # [R, 1 + K] fp32
    ids: torch.Tensor  # [R, 1 + K] int64

    def to_host(self, pin: bool) -> "LogprobRows":
        """Asynchronous copies into pinned memory (CUDA): read them after the step's event."""
        if not pin:
            return self
        out = []
        for t in (self.values, self.ids):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            out.append(host)
        return LogprobRows(*out)

    def entries(self, token_ids: list[int], num_top: list[int]) -> list[TokenLogprobs]:
        """Per row: its token (``token_ids``) and its top ``num_top`` (<= K), as host objects."""
        values, ids = self.values.tolist(), self.ids.tolist()
        return [TokenLogprobs(t, v[0], i[0], list(zip(i[1 : 1 + n], v[1 : 1 + n])))
                for t, v, i, n in zip(token_ids, values, ids, num_top)]


def logprob_stats(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> LogprobRows:
    """logits [R, V] (raw: the LM head's output), tokens [R] int64 -> each token's fp32
    logprob and rank (1 + the tokens strictly more likely), and the top-k of each row."""
    x = logits.float()
    lp = torch.log_softmax(x, dim=-1)
    tokens = tokens.unsqueeze(1)
    rank = (x > x.gather(1, tokens)).sum(dim=-1, keepdim=True) + 1
    values, ids = [lp.gather(1, tokens)], [rank]
    k = min(k, lp.shape[1])
    if k:
        # A request's top-N must not depend on what else is in its step: torch.topk orders tied
        # values differently for different k, and k is the step's largest request. So the top
        # MAX_LOGPROBS always, ordered by (logprob descending, token id ascending), then cut.
        top = lp.topk(min(MAX_LOGPROBS, lp.shape[1]), dim=-1)
        by_id = top.indices.argsort(dim=-1)
        top_ids, top_values = top.indices.gather(1, by_id), top.values.gather(1, by_id)
        order = top_values.argsort(dim=-1, descending=True, stable=True)[:, :k]
        values.append(top_values.gather(1, order))
        ids.append(top_ids.gather(1, order))
    return LogprobRows(torch.cat(values, dim=1), torch.cat(ids, dim=1))


@dataclass
class PendingTokens:
    """A launched step's sampled tokens: on the device, and (CUDA) on their way to ``host``."""

    tokens: torch.Tensor | None  # [N] int64 on the device; None: the step sampled nothing
    host: torch.Tensor | None  # [N] int64, pinned; valid once ``event`` has completed
    event: object  # torch.cuda.Event or None
    sample_seqs: list  # the sequences the rows belong to, in order
    # the logprobs the step's sequences asked for (SamplingParams.logprobs / prompt_logprobs),
    # on their way to the host like ``host``; None: none asked (the common case)
    logprobs: tuple[LogprobRows, list[int]] | None = None  # and the rows of sample_seqs
    # and (sequence, first position, count) per run of rows
    prompt_logprobs: tuple[LogprobRows, list[tuple[Sequence, int, int]]] | None = None


class ModelRunner(StepInputs, CudaGraphs):
    """The model, its KV cache, and one step's run on this rank (step_inputs.py plans and stages
    the step's inputs, cuda_graphs.py holds the graphs)."""

    def __init__(self, config: Config, rank: int = 0):
        from qwen3_model.models.qwen3 import Qwen3ForCausalLM

        self.config = config
        hf = config.hf_config
        self.rank = rank
        self.worker_conns: list = []  # rank 0, tensor parallel: pipes to the other ranks
        # rank 0, tensor parallel on CUDA: called while a step's tokens are awaited; raises if a
        # worker died (set by the engine, which knows the worker processes)
        self.tp_watch = None
        self.world_size = config.tensor_parallel_size
        self.block_size = config.kvcache_block_size
        self.vocab_size = hf.vocab_size
        self.device = torch.device("cuda", rank) if config.device == "cuda" else torch.device("cpu")
        self.use_cuda = self.device.type == "cuda"
        self.enforce_eager = config.enforce_eager or not self.use_cuda
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        # The deterministic mode's decode in a step whose every context fits in its first split
        # (BATCH_INVARIANT_SPLIT_KEYS keys) reads a table this narrow, eager and from graphs of
        # its own: the kernel then launches no split or combine kernel for keys no row has (its
        # sums do not depend on the table's width). None: one width (any other case).
        short = BATCH_INVARIANT_SPLIT_KEYS // self.block_size
        self.short_table_blocks = (short if config.deterministic
                                   and 0 < short < self.max_blocks_per_seq else None)
        if self.use_cuda:
            torch.cuda.set_device(self.device)
            cap = torch.cuda.get_device_capability(self.device)
            if (config.deterministic and config.torch_dtype != torch.float32
                    and cap != (9, 0)):
                raise ValueError(
                    f"LLM: deterministic=True on CUDA runs the batch-invariant kernels of a "
                    f"compute capability 9.0 GPU (Hopper); {self.device} is {cap}")
        torch.manual_seed(config.seed)
        # the weights + a minimal KV cache against this device's free memory, before building
        config.check_memory(self.device)

        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.torch_dtype)
        try:
            with torch.device(self.device):
                self.model = Qwen3ForCausalLM(hf, batch_invariant=config.deterministic)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            self._init_dummy_weights()
        else:
            from qwen3_model.loader import load_model

            # the checkpoint's per-layer KV scales apply to an fp8 cache only (the ops refuse
            # scales != 1 with a cache in the model dtype); checked either way
            load_model(self.model, config.model, apply_kv_scales=config.kv_cache_dtype == "fp8")
        self.model.eval()
        # config.tp_all_reduce: ours unless 'nccl' or it cannot run; a collective: every rank
        if self.world_size > 1:
            init_all_reduce(config.tp_all_reduce, hf.hidden_size, config.torch_dtype, self.device)
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
        # a step's packed inputs: built in a host staging buffer, copied once into _step_inputs
        # (eager steps) or into the graphs' static input buffer (graph steps)
        self._staging = HostStaging(pin=self.use_cuda)
        self._step_inputs = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._step_typed = typed_torch(self._step_inputs)
        self._staged: tuple[StepPlan, int] | None = None  # the plan built here, its host buffer
        self._sample_index: torch.Tensor | None = None
        # the last launched step's sampled tokens on the device, and two pinned buffers they are
        # read back through in turn (a step's copy may be in flight while the previous is read)
        self._last_sampled: torch.Tensor | None = None
        self._token_bufs: list[torch.Tensor | None] = [None, None]
        self._token_turn = 0
        # rank 0: the prompt-logprob rows of the plan built here, (sequence, first position,
        # count) per run (plan_step), and their logprobs once the forward computed them
        self._prompt_owners: list[tuple[Sequence, int, int]] = []
        self._prompt_logprobs: LogprobRows | None = None
        self.kv_cache: torch.Tensor | None = None
        self.num_blocks = self.allocate_kv_cache()
        self.init_graphs()  # (cuda_graphs.py)

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
            elif p.dtype == torch.float8_e4m3fn:  # FP8: N(0, 1) in e4m3 times 0.02 (the scales)
                p.copy_(torch.empty(p.shape, dtype=torch.bfloat16, device=p.device)
                        .normal_(0.0, 1.0, generator=gen))
            elif name.endswith("weight_scale_inv"):
                p.fill_(0.02)
            else:
                p.normal_(0.0, 0.02, generator=gen)

    # ---- KV cache ------------------------------------------------------------------------------

    def block_bytes(self) -> int:
        """Bytes of one block over all layers, K and V (1 byte per value for an fp8 cache)."""
        itemsize = torch.empty((), dtype=self.config.kv_cache_torch_dtype).element_size()
        return (2 * len(self.attn_modules) * self.block_size * self.num_kv_heads * self.head_dim
                * itemsize)

    def _set_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = None  # drop the old one before allocating the new
        for m in self.attn_modules:
            m.k_cache = m.v_cache = torch.tensor([])
        # One tensor for all layers: a single allocation, sliced (views) per layer.
        self.kv_cache = torch.zeros(
            2, len(self.attn_modules), num_blocks, self.block_size, self.num_kv_heads,
            self.head_dim,
            dtype=self.config.kv_cache_torch_dtype, device=self.device,
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
        self._check_kv_fits(num_blocks)
        if num_blocks < 1:
            raise RuntimeError(
                f"no room for the KV cache: one block needs {self.block_bytes() / 2**20:.1f} MiB; "
                "raise gpu_memory_utilization, lower max_num_batched_tokens / max_num_seqs, or set "
                "num_kvcache_blocks"
            )
        self._set_kv_cache(num_blocks)
        return num_blocks

    def _check_kv_fits(self, num_blocks: int) -> None:
        """A KV cache of ``num_blocks`` (num_kvcache_blocks, or sized from cpu_kvcache_gib) that
        cannot fit in the device's free memory (CUDA) or the machine's RAM (CPU) is refused with
        the bytes it needs, before the allocation is tried."""
        from qwen3_model.memory import physical_ram, size

        need = num_blocks * self.block_bytes()
        if self.use_cuda:
            if self.config.num_kvcache_blocks < 1:
                return  # sized from the free memory itself
            have = torch.cuda.mem_get_info(self.device)[0]
            what = f"the GPU {self.device} has {size(have)} free"
            knob = "num_kvcache_blocks"
        else:
            have = physical_ram()
            if have is None:
                return
            have //= self.world_size  # the CPU ranks share the machine's RAM
            what = (f"the machine has {size(have * self.world_size)} of RAM"
                    + (f" for {self.world_size} ranks" if self.world_size > 1 else ""))
            knob = ("num_kvcache_blocks" if self.config.num_kvcache_blocks > 0
                    else "cpu_kvcache_gib")
        if need > have:
            raise ValueError(
                f"LLM: a KV cache of {num_blocks:,} blocks of {self.block_size} tokens needs "
                f"{size(need)} ({need:,} bytes); {what}: lower {knob}")

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
            with prefer_cublaslt(self.use_cuda):
                hidden = self.model(input_ids, positions)
                rows = min(cfg.max_num_seqs, num_tokens)
                logits = self.model.compute_logits(hidden[:rows], dtype=None)  # as a step's
        finally:
            reset_context()
        if logits is not None:
            from qwen3_model.sampling_params import SamplingParams

            worst = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05)
            batch = SamplingBatch.build([worst] * rows, [0] * rows, [[]] * rows, self.vocab_size,
                                        dev)
            self.sampler(logits, batch)
        del hidden, logits

    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Context,
                  bucket: int | None) -> torch.Tensor:
        """-> hidden [T, hidden] (a view of the graph's output buffer when replayed)."""
        if bucket is None:
            pw = self.piecewise
            pw_bucket = None if pw is None else pw.bucket(input_ids.shape[0])
            if pw_bucket is not None:
                return self.piecewise.run(input_ids, positions, ctx, pw_bucket)
            set_context(ctx)
            # On CUDA the ops skip their tensor checks here: every argument is the engine's own
            # (the model's tests and the CPU engine run the same calls checked), and in a step of
            # a few hundred tokens the checks were a third of the host's time, the host the
            # step's bottleneck (qwen3_kernels.trusted_inputs)
            try:
                with qwen3_kernels.trusted_inputs() if self.use_cuda else contextlib.nullcontext():
                    return self.model(input_ids, positions)
            finally:
                reset_context()
        return self.replay_decode_graph(input_ids, positions, ctx, bucket)

    @torch.inference_mode()
    def forward_plan(self, plan: StepPlan) -> torch.Tensor | None:
        """Every rank: the forward of one step and the logits of its sampled rows
        ([N, vocab] fp32 on rank 0, None elsewhere or when nothing is sampled)."""
        input_ids, positions, ctx = self.plan_tensors(plan)
        self.last_step_used_graph = plan.bucket is not None
        self.num_graph_steps += plan.bucket is not None
        with prefer_cublaslt(self.use_cuda):
            hidden = self.run_model(input_ids, positions, ctx, plan.bucket)
            logits = self._logits(plan, hidden)
            if plan.prompt_rows is not None:  # (before a next replay reuses hidden's buffer)
                self._prompt_logprobs = self._prompt_logits(plan, hidden)
            return logits

    def _prompt_logits(self, plan: StepPlan, hidden: torch.Tensor) -> LogprobRows | None:
        """Every rank (the LM head is collective): the LM head over the step's prompt-logprob
        rows of ``hidden`` [T, hidden], in pieces of at most max_num_seqs rows (the logits the
        warm-up's memory peak allowed for); rank 0 reduces each piece to the logprob and rank of
        the next prompt token and the top-K (None elsewhere)."""
        rows = self._to_device(plan.prompt_rows, torch.int64)
        targets, k = None, 0
        if self.rank == 0:
            owners = self._prompt_owners
            targets = self._to_device(
                [t for seq, p, c in owners for t in seq.token_ids[p + 1 : p + 1 + c]], torch.int64)
            k = max([seq.params.prompt_logprobs for seq, _, _ in owners])
        piece = max(1, self.config.max_num_seqs)
        parts = []
        for a in range(0, rows.shape[0], piece):
            logits = self.model.compute_logits(hidden[rows[a : a + piece]], dtype=None)
            if logits is not None:
                parts.append(logprob_stats(logits, targets[a : a + piece], k))
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        return LogprobRows(torch.cat([q.values for q in parts]), torch.cat([q.ids for q in parts]))

    def _logits(self, plan: StepPlan, hidden: torch.Tensor) -> torch.Tensor | None:
        """The LM head over the step's sampled rows of ``hidden`` [T, hidden] (forward_plan)."""
        if plan.sample_rows is None:
            last = hidden  # every token is sampled (decode-only steps): no gather
        elif len(plan.sample_rows) == 0:
            return None
        elif self._sample_index is not None:
            last = hidden[self._sample_index]
        else:  # a graph step with a one-token prompt chunk among its rows (rare)
            last = hidden[self._to_device(plan.sample_rows, torch.int64)]
        # collective across the TP ranks; the model's dtype, which the sampler reads as it is
        return self.model.compute_logits(last, dtype=None)

    @torch.inference_mode()
    def receive_sampled(self, plan: StepPlan) -> None:
        """TP ranks > 0, after ``forward_plan``: the step's sampled tokens [N] int64, broadcast by
        rank 0 (``launch``), kept on the device like rank 0 keeps its own, so that an overlapped
        next step's pending rows (``_fill_pending``) read the same tokens on every rank."""
        n = plan.num_tokens if plan.sample_rows is None else len(plan.sample_rows)
        if n == 0:
            return
        tokens = torch.empty(n, dtype=torch.int64, device=self.device)
        broadcast_from_rank0(tokens)
        self._last_sampled = tokens

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[int]:
        """Rank 0: run one step on every rank; returns the sampled token of each sequence whose
        chunk reached its last token, in batch order (what ``Scheduler.postprocess`` expects)."""
        return self.wait(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> "PendingTokens":
        """Rank 0: queue one step on every rank, up to the sampled tokens' copy to the host;
        returns without waiting for the device (``wait`` reads the tokens)."""
        plan, sample_seqs = self.plan_step(batch)
        for conn in self.worker_conns:  # the other TP ranks run the same step
            conn.send(("run", plan))
        logits = self.forward_plan(plan)
        prompt = None
        if plan.prompt_rows is not None:
            prompt = (self._prompt_logprobs, self._prompt_owners)
            self._prompt_logprobs, self._prompt_owners = None, []
        if logits is None:
            return self._read_back(None, sample_seqs, None, prompt)
        params = [s.params for s in sample_seqs]
        positions = banned = None
        # (list comprehensions and C-level list scans: this runs every step over every row)
        if [p.seed for p in params].count(None) != len(params):  # seeds key on output position
            positions = [len(s.token_ids) - s.num_prompt_tokens for s in sample_seqs]
        if any([p.min_tokens for p in params]):
            banned = [self._banned_ids(s) if s.params.min_tokens else () for s in sample_seqs]
        history = None
        if [s.penalty_state for s in sample_seqs].count(None) != len(sample_seqs):
            history = [penalty_history(s) if s.penalty_state else None for s in sample_seqs]
        sampling = SamplingBatch.build(params, positions, banned, self.vocab_size, self.device,
                                       history)
        # (trusted: the temperatures come from validated SamplingParams, and the checked op's
        # host sync would end the overlap of this step with the next one's scheduling)
        with qwen3_kernels.trusted_inputs() if self.use_cuda else contextlib.nullcontext():
            tokens = self.sampler(logits, sampling)  # [N] int64, on the device
        self._last_sampled = tokens  # the next step may take them as inputs before they are read
        if self.worker_conns:  # ... on every rank: the other ranks get them from here
            broadcast_from_rank0(tokens)
        asked = None
        if [p.logprobs for p in params].count(None) != len(params):
            asked = self._sampled_logprobs(logits, tokens, params)
        return self._read_back(tokens, sample_seqs, asked, prompt)

    def _sampled_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor,
                          params: list) -> tuple[LogprobRows, list[int]]:
        """The logprobs of the sampled tokens [N] of the rows that ask (raw ``logits`` [N, V]:
        the sampler does not change them), and those rows."""
        rows = [r for r, p in enumerate(params) if p.logprobs is not None]
        k = max([params[r].logprobs for r in rows])
        if len(rows) < len(params):
            index = self._to_device(rows, torch.int64)
            logits, tokens = logits[index], tokens[index]
        return logprob_stats(logits, tokens, k), rows

    def _read_back(self, tokens: torch.Tensor | None, sample_seqs: list, asked, prompt):
        """Queue the step's results' copies to the host (CUDA: asynchronous, into pinned memory,
        then an event the host waits on instead of the stream)."""
        if tokens is None and prompt is None:
            return PendingTokens(None, None, None, sample_seqs)
        pin = self.use_cuda
        if asked is not None:
            asked = (asked[0].to_host(pin), asked[1])
        if prompt is not None and prompt[0] is not None:
            prompt = (prompt[0].to_host(pin), prompt[1])
        if not pin or tokens is None:
            host = tokens
        else:
            self._token_turn ^= 1
            host = self._token_bufs[self._token_turn]
            if host is None or host.numel() < tokens.numel():
                host = torch.empty(max(tokens.numel(), 1024), dtype=torch.int64, pin_memory=True)
                self._token_bufs[self._token_turn] = host
            host = host[: tokens.numel()]
            host.copy_(tokens, non_blocking=True)
        event = None
        if pin:
            event = torch.cuda.Event()
            event.record()
        return PendingTokens(tokens, host, event, sample_seqs, asked, prompt)

    def wait(self, pending: "PendingTokens") -> list[int]:
        """The step's sampled tokens (the step's one host sync); the logprobs asked for go to
        their sequences (``Sequence.logprobs`` / ``prompt_logprobs``)."""
        if pending.host is None and pending.prompt_logprobs is None:
            return []
        if pending.event is not None:
            if self.tp_watch is None:
                pending.event.synchronize()
            else:
                self._wait_watched(pending.event)
        tokens = [] if pending.host is None else pending.host.tolist()
        if pending.logprobs is not None:
            stats, rows = pending.logprobs
            seqs = [pending.sample_seqs[r] for r in rows]
            entries = stats.entries([tokens[r] for r in rows],
                                    [s.params.logprobs for s in seqs])
            for seq, entry in zip(seqs, entries):
                seq.logprobs.append(entry)
        if pending.prompt_logprobs is not None:
            self._store_prompt_logprobs(*pending.prompt_logprobs)
        return tokens

    @staticmethod
    def _store_prompt_logprobs(stats: LogprobRows | None,
                               owners: list[tuple[Sequence, int, int]]) -> None:
        """Row j of a run (sequence, p, c) is the logprob of prompt token p + 1 + j (stored over
        an earlier value: a preempted sequence recomputes its prompt)."""
        if stats is None:
            return
        targets, num_top = [], []
        for seq, p, c in owners:
            targets += seq.token_ids[p + 1 : p + 1 + c]
            num_top += [seq.params.prompt_logprobs] * c
        entries = iter(stats.entries(targets, num_top))
        for seq, p, c in owners:
            for pos in range(p + 1, p + 1 + c):
                seq.prompt_logprobs[pos] = next(entries)

    def _wait_watched(self, event) -> None:
        """Poll the step's event instead of blocking on it: if a worker dies mid-step, this
        rank's NCCL kernel waits for it forever, and a blocked synchronize would never return
        to notice. tp_watch raises (after aborting the communicator) once a worker is gone."""
        next_check = 0.0
        while not event.query():
            now = time.monotonic()
            if now >= next_check:
                self.tp_watch()
                next_check = now + 0.01
            time.sleep(0)  # let other threads run; the step's own time dominates anyway

    def _banned_ids(self, seq: Sequence) -> list[int]:
        """Ids that may not be sampled yet: EOS and stop ids before min_tokens."""
        p = seq.params
        if seq.num_completion_tokens >= p.min_tokens:
            return []
        ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            ids.update(self.config.eos_token_ids)
        return sorted(i for i in ids if 0 <= i < self.vocab_size)


def penalty_history(seq: Sequence) -> tuple[dict[int, int], set[int]]:
    """A penalized sequence's (count of each token in its output so far, its prompt's ids): what
    the penalties read. Counted incrementally on the sequence: a step adds its new tokens. The
    tokens are values here, never an overlapped step's placeholders (``Sequence.needs_tokens``
    is set for a penalized request)."""
    state = seq.penalty_state
    counts, counted, prompt_ids = state
    new = seq.token_ids[seq.num_prompt_tokens + counted:]
    if new:
        assert min(new) >= 0, "a penalized request's tokens are read before it samples again"
        counts.update(new)
        state[1] = counted + len(new)
    return counts, prompt_ids
