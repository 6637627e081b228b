"""Runs the model for one scheduled step: builds the flat batch and its attention Context, owns the
paged KV cache, replays CUDA graphs for decode-only steps, and samples.

Step layout (``qwen3_model.utils.context``): the prefill chunks first, then one token per decoding
sequence. A decode-only step on CUDA replays the graph captured for the smallest batch-size bucket
that fits, with the unused rows padded (slot -1: no cache write; seq_len 1 over block 0: a
harmless read whose result is dropped). A step with prompt tokens of up to
``max_piecewise_graph_tokens`` (one GPU) replays the piecewise graphs of its 32-token bucket with
its attention run eagerly between them (``qwen3_model/engine/piecewise.py``); larger ones, and all
on CPU, run eagerly.

Host cost per step is kept small because the device waits on it between steps: a step's integer
inputs (token ids, positions, slots, sequence lengths, block tables) are built with numpy in a
pinned staging buffer (block tables gathered from the block manager's mirror, not padded from
lists) and cross to the device in one asynchronous copy; a graph step's inputs land straight in
the graphs' static buffers. ``launch`` queues a step up to its sampled tokens' copy back and
returns; ``wait`` reads them. The engine uses the pair to schedule and launch step k + 1 while the
device still runs step k (``LLMEngine._steps``), feeding step k's tokens to step k + 1 on the
device.

Rank-aware for tensor parallelism: every rank runs the forward; rank 0 samples.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

import qwen3_kernels
from qwen3_model.config import PIECEWISE_BUCKET, Config
from qwen3_model.distributed import broadcast_from_rank0, init_all_reduce
from qwen3_model.engine.scheduler import ScheduledBatch
from qwen3_model.engine.sequence import Sequence
from qwen3_model.layers.sampler import Sampler, SamplingBatch
from qwen3_model.utils.context import Context, reset_context, set_context


_ALIGN = 512  # byte alignment of each packed field: what a fresh CUDA allocation guarantees


class Layout:
    """Named int arrays packed into one byte buffer, each field ``_ALIGN``-aligned: a step's
    inputs then cross to the device in ONE host-to-device copy instead of one per tensor."""

    __slots__ = ("fields", "nbytes")

    def __init__(self):
        # name -> (dtype "int64" / "int32", first element in that dtype's units, shape)
        self.fields: dict[str, tuple[str, int, tuple[int, ...]]] = {}
        self.nbytes = 0

    def add(self, name: str, dtype: str, *shape: int) -> "Layout":
        off = -(-self.nbytes // _ALIGN) * _ALIGN
        size = _ITEMSIZE[dtype]
        self.fields[name] = (dtype, off // size, shape)
        self.nbytes = off + size * math.prod(shape)
        return self

    def views(self, typed: dict) -> dict:
        """The fields as views of one buffer, given as {dtype: the whole buffer viewed with that
        dtype} (numpy arrays or torch tensors alike): a slice (and a reshape) per field."""
        out = {}
        for name, (dtype, start, shape) in self.fields.items():
            v = typed[dtype][start : start + math.prod(shape)]
            out[name] = v if len(shape) == 1 else v.reshape(shape)
        return out


_ITEMSIZE = {"int64": 8, "int32": 4}


def _typed_numpy(buf: np.ndarray) -> dict[str, np.ndarray]:
    """uint8 [n] (n % 8 == 0) -> {dtype: the same memory as that dtype}."""
    return {"int64": buf.view(np.int64), "int32": buf.view(np.int32)}


def _typed_torch(buf: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"int64": buf.view(torch.int64), "int32": buf.view(torch.int32)}


@dataclass
class StepPlan:
    """One step's inputs, packed (picklable: what rank 0 sends the other TP ranks).

    ``data`` holds the fields of ``layout`` (input_ids, positions, slot_mapping, the prefill and
    decode metadata); on rank 0 it is a view of the pinned staging buffer it was built in.
    A graph step (``bucket``) uses the fixed layout of the graphs' static input buffer, with its
    padding rows filled, and ``data`` covers it up to the bucket's last block-table row.
    """

    data: np.ndarray  # uint8 [nbytes]
    layout: Layout
    num_tokens: int  # T
    num_prefill_tokens: int = 0
    num_prefills: int = 0  # P
    num_decodes: int = 0  # D
    max_q: int = 0
    sample_rows: np.ndarray | None = None  # rows of the step whose logits are sampled; None = all
    bucket: int | None = None  # CUDA graph batch size to replay, None = eager
    # rows whose input token is the previous step's k-th sampled token, not read back yet
    # (fields "pending_rows" / "pending_src"; ``pending_in_order``: rows T_pre + k, k = 0..)
    num_pending: int = 0
    pending_in_order: bool = False


@dataclass
class PendingTokens:
    """A launched step's sampled tokens: on the device, and (CUDA) on their way to ``host``."""

    tokens: torch.Tensor | None  # [N] int64 on the device; None: the step sampled nothing
    host: torch.Tensor | None  # [N] int64, pinned; valid once ``event`` has completed
    event: object  # torch.cuda.Event or None
    sample_seqs: list  # the sequences the rows belong to, in order


class _HostStaging:
    """Two host buffers used in turn (pinned on CUDA), each reused once its last copy to the
    device is done: filling one while the copy of the other may still be in flight is safe."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.bufs: list[torch.Tensor | None] = [None, None]
        self.arrays: list[np.ndarray | None] = [None, None]
        self.typed: list[dict | None] = [None, None]  # numpy views of bufs[i] by dtype
        self.events: list = [None, None]
        self.turn = 0

    def acquire(self, nbytes: int) -> tuple[int, np.ndarray, dict]:
        self.turn ^= 1
        i = self.turn
        if self.events[i] is not None:
            self.events[i].synchronize()  # (normally long done: the step after it synced)
        if self.bufs[i] is None or self.bufs[i].numel() < nbytes:
            size = max(nbytes, 2 * (0 if self.bufs[i] is None else self.bufs[i].numel()), 1 << 16)
            size = -(-size // 8) * 8
            self.bufs[i] = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self.arrays[i] = self.bufs[i].numpy()
            self.typed[i] = _typed_numpy(self.arrays[i])
        return i, self.arrays[i], self.typed[i]

    def copy_to(self, i: int, dst: torch.Tensor, nbytes: int) -> None:
        """dst[:nbytes] = buffer i's first nbytes, asynchronously from pinned memory."""
        dst[:nbytes].copy_(self.bufs[i][:nbytes], non_blocking=self.pin)
        if self.pin:
            if self.events[i] is None:
                self.events[i] = torch.cuda.Event()
            self.events[i].record()


@contextlib.contextmanager
def _prefer_cublaslt(use_cuda: bool):
    """torch's matmuls through cuBLASLt while the model runs (the projections that
    qwen3_kernels.linear hands to at::mm, and the LM head), restored after.

    Measured (H200, Qwen3-8B workload of benchmarks/bench_engine.py, alternating in one call, two
    machines): 10,011 / 10,000 tok/s against 9,920 / 9,952 with cuBLAS, and 9,760 / 9,731 against
    9,675 / 9,655: every decode step ~1% faster (at 128 sequences o and down run nvjet 64x64
    without cuBLAS's split-K reduce after down; o at 256 tokens 16.8 against 18.4 us), prefill
    steps equal. Only while the model runs, so a program that embeds the engine keeps its own
    choice for its own matmuls. torch warns once per process that the setting is experimental.
    """
    if not use_cuda:
        yield
        return
    old = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(old)


class ModelRunner:
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
        self._staging = _HostStaging(pin=self.use_cuda)
        self._step_inputs = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._step_typed = _typed_torch(self._step_inputs)
        self._staged: tuple[StepPlan, int] | None = None  # the plan built here, its host buffer
        self._sample_index: torch.Tensor | None = None
        # the last launched step's sampled tokens on the device, and two pinned buffers they are
        # read back through in turn (a step's copy may be in flight while the previous is read)
        self._last_sampled: torch.Tensor | None = None
        self._token_bufs: list[torch.Tensor | None] = [None, None]
        self._token_turn = 0
        self.graph_layout: Layout | None = None
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
            with _prefer_cublaslt(self.use_cuda):
                hidden = self.model(input_ids, positions)
                rows = min(cfg.max_num_seqs, num_tokens)
                logits = self.model.compute_logits(hidden[:rows], dtype=None)  # as a step's
        finally:
            reset_context()
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

    def plan_step(self, batch: ScheduledBatch) -> tuple[StepPlan, list[Sequence]]:
        """The step's flat batch packed in a host buffer, and the sequences whose logits get
        sampled. Per-token work is numpy over the whole step; per sequence there is one
        attribute read per field (no Python loop over tokens or block-table entries)."""
        bs = self.block_size
        width = self.max_blocks_per_seq
        prefills, decodes = batch.prefills, batch.decodes
        tables, rows_of = self._table_source(batch)
        P, D = len(prefills), len(decodes)

        # per-sequence scalars (one list comprehension each)
        if P:
            pre_seqs = [s for s, _ in prefills]
            pre_rows = rows_of(pre_seqs)
            pre_start = np.array([s.num_computed_tokens for s in pre_seqs], dtype=np.int64)
            pre_n = np.array([n for _, n in prefills], dtype=np.int64)
            pre_len = np.array([len(s.token_ids) for s in pre_seqs], dtype=np.int64)
            cu_q = np.zeros(P + 1, dtype=np.int64)
            np.cumsum(pre_n, out=cu_q[1:])
            T_pre = int(cu_q[-1])
            pre_width = max(len(s.block_table) for s in pre_seqs)
        else:
            T_pre = 0
        if D:
            dec_rows = rows_of(decodes)
            dec_pos = np.array([s.num_computed_tokens for s in decodes], dtype=np.int64)
            # a one-token chunk of a longer prompt also runs as a "decode": its token is the one
            # at its position, and it is sampled only if that is the last
            dec_ids = [s.token_ids[s.num_computed_tokens] for s in decodes]
        T = T_pre + D

        # which rows are sampled, and by which sequences: a prefill chunk's last row if it
        # reaches the end of its sequence, a decode row if its token is the last
        if not D or batch.num_partial_decodes == 0:
            dec_done = None  # every decode row's token is its sequence's last
        else:
            dec_len = np.array([len(s.token_ids) for s in decodes], dtype=np.int64)
            dec_done = dec_pos + 1 == dec_len
        if not P and (dec_done is None or dec_done.all()):
            sample_seqs, sample_rows = decodes, None  # every row: no gather
        else:
            parts, sample_seqs = [], []
            if P:
                idx = np.flatnonzero(pre_start + pre_n == pre_len)
                parts.append(cu_q[1:][idx] - 1)
                sample_seqs += [pre_seqs[k] for k in idx.tolist()]
            if D and dec_done is None:
                parts.append(T_pre + np.arange(D))
                sample_seqs += decodes
            elif D:
                idx = np.flatnonzero(dec_done)
                parts.append(T_pre + idx)
                sample_seqs += [decodes[k] for k in idx.tolist()]
            sample_rows = np.concatenate(parts)

        bucket = self._graph_bucket(batch)
        if bucket is not None:
            layout, n_rows = self.graph_layout, bucket
            tab_field, lens_field = "block_tables", "seq_lens"
        else:
            layout = Layout().add("input_ids", "int64", T).add("positions", "int64", T)
            if sample_rows is not None:
                layout.add("sample_rows", "int64", len(sample_rows))
            if D:
                layout.add("pending_rows", "int64", D).add("pending_src", "int64", D)
            layout.add("slot_mapping", "int32", T)
            if P:
                layout.add("cu_seqlens_q", "int32", P + 1).add("prefill_seq_lens_k", "int32", P)
                layout.add("prefill_block_tables", "int32", P, pre_width)
            if D:
                layout.add("decode_seq_lens", "int32", D)
                layout.add("decode_block_tables", "int32", D, width)
            n_rows = D
            tab_field, lens_field = "decode_block_tables", "decode_seq_lens"
        i, buf, typed = self._staging.acquire(layout.nbytes)
        f = layout.views(typed)
        ids, pos, slots = f["input_ids"], f["positions"], f["slot_mapping"]

        if P:
            pos_pre = np.arange(T_pre, dtype=np.int64)
            pos_pre += np.repeat(pre_start - cu_q[:-1], pre_n)
            pos[:T_pre] = pos_pre
            blocks = tables[np.repeat(pre_rows, pre_n), pos_pre // bs]
            slots[:T_pre] = blocks * bs + pos_pre % bs
            for k, (seq, n) in enumerate(prefills):  # slices of the token lists, copied in C
                start = seq.num_computed_tokens
                ids[cu_q[k] : cu_q[k] + n] = seq.token_ids[start : start + n]
            # a token not read back yet is only ever the one input of a decode row
            assert ids[:T_pre].min() >= 0, "a prefill chunk holds a token not read back yet"
            f["cu_seqlens_q"][:] = cu_q
            f["prefill_seq_lens_k"][:] = pre_start + pre_n
            # (mode "clip": no bounds-check buffering; the rows were checked in rows_of)
            np.take(tables[:, :pre_width], pre_rows, axis=0, out=f["prefill_block_tables"],
                    mode="clip")
        num_pending, in_order = 0, False
        if D:
            ids[T_pre:T] = dec_ids
            pend = np.flatnonzero(ids[T_pre:T] < 0)
            if len(pend):
                # placeholders -1 - k (Scheduler.advance): the token is the previous step's k-th
                # sampled one, still on the device; its row is filled there (plan_tensors)
                num_pending = len(pend)
                src = -1 - ids[T_pre:T][pend]
                ids[T_pre + pend] = 0
                in_order = num_pending == D and bool((src == np.arange(D)).all())
                if not in_order:
                    f["pending_rows"][:num_pending] = T_pre + pend
                    f["pending_src"][:num_pending] = src
            pos[T_pre:T] = dec_pos
            tab = f[tab_field]
            np.take(tables[:, :width], dec_rows, axis=0, out=tab[:D], mode="clip")
            slots[T_pre:T] = tab[np.arange(D), dec_pos // bs] * bs + dec_pos % bs
            f[lens_field][:D] = dec_pos + 1
        if bucket is not None and bucket > D:
            # graph padding rows: no cache write (slot -1), a 1-token read of block 0; token and
            # position 0 (the host buffer is reused: whatever is left there may be out of range)
            ids[D:bucket] = 0
            pos[D:bucket] = 0
            slots[D:bucket] = -1
            f["seq_lens"][D:bucket] = 1
            f["block_tables"][D:bucket] = 0
        if sample_rows is not None and bucket is None:
            f["sample_rows"][:] = sample_rows
        if bucket is not None:  # the copy covers the static buffer up to the bucket's last row
            _, start, shape = layout.fields["block_tables"]
            nbytes = 4 * (start + shape[1] * n_rows)
        else:
            nbytes = layout.nbytes
        plan = StepPlan(data=buf[:nbytes], layout=layout, num_tokens=T, num_prefill_tokens=T_pre,
                        num_prefills=P, num_decodes=D, max_q=int(pre_n.max()) if P else 0,
                        sample_rows=sample_rows, bucket=bucket, num_pending=num_pending,
                        pending_in_order=in_order)
        self._staged = (plan, i)
        return plan, sample_seqs

    def _table_source(self, batch: ScheduledBatch):
        """-> (int32 [rows, >= max_blocks_per_seq] block tables, seqs -> their rows in it):
        the block manager's mirror, or (a batch built by hand) one made from the lists."""
        width = self.max_blocks_per_seq
        if batch.block_tables is not None and batch.block_tables.shape[1] >= width:
            def rows_of(seqs):
                rows = np.array([s.table_row for s in seqs], dtype=np.intp)
                assert rows.min() >= 0, "a scheduled sequence holds no block-table row"
                return rows

            return batch.block_tables, rows_of
        seqs = [s for s, _ in batch.prefills] + list(batch.decodes)
        width = max([width] + [len(s.block_table) for s in seqs])
        tables = np.zeros((len(seqs), width), dtype=np.int32)
        where = {}
        for r, s in enumerate(seqs):
            tables[r, : len(s.block_table)] = s.block_table
            where[id(s)] = r
        return tables, lambda ss: np.array([where[id(s)] for s in ss], dtype=np.intp)

    @torch.inference_mode()  # the buffers are inference tensors, written in place
    def plan_tensors(self, plan: StepPlan):
        """-> input_ids [T] int64, positions [T] int64 and the attention Context, on the device
        (views of one buffer filled by one host-to-device copy)."""
        nbytes = plan.data.nbytes
        if self._staged is not None and self._staged[0] is plan:
            i = self._staged[1]  # built here: its host buffer is already the staging buffer
        else:  # a plan from rank 0 (or an older one of ours): stage a copy of it
            i, buf, _ = self._staging.acquire(nbytes)
            buf[:nbytes] = plan.data
        self._staged = None
        if plan.bucket is not None:  # the graphs' static inputs: views made once
            dst, t = self.graph_inputs, self.graph_vars
        else:
            if self._step_inputs.numel() < nbytes:
                size = -(-max(nbytes, 2 * self._step_inputs.numel()) // 8) * 8
                self._step_inputs = torch.empty(size, dtype=torch.uint8, device=self.device)
                self._step_typed = _typed_torch(self._step_inputs)
            dst = self._step_inputs
            t = plan.layout.views(self._step_typed)
        self._staging.copy_to(i, dst, nbytes)
        T, D, P = plan.num_tokens, plan.num_decodes, plan.num_prefills
        ctx = Context(slot_mapping=t["slot_mapping"][:T])
        if plan.bucket is not None:
            ctx.decode_seq_lens = t["seq_lens"][:D]
            ctx.decode_block_tables = t["block_tables"][:D]
        elif D:
            ctx.decode_seq_lens = t["decode_seq_lens"]
            # Full width, as in the decode graphs: the split-KV count is chosen from the table width,
            # so eager and replayed decode then sum in the same order and give identical tokens
            # (measured: a narrower eager table changed a greedy token after 37 steps, H200).
            ctx.decode_block_tables = t["decode_block_tables"]
        if D and self.workspace is not None:
            ctx.decode_workspace = self.workspace[:D]
        if P:
            ctx.num_prefill_tokens = plan.num_prefill_tokens
            ctx.cu_seqlens_q = t["cu_seqlens_q"]
            ctx.max_seqlen_q = plan.max_q
            ctx.prefill_seq_lens_k = t["prefill_seq_lens_k"]
            ctx.prefill_block_tables = t["prefill_block_tables"]
        self._sample_index = t.get("sample_rows")
        input_ids = t["input_ids"][:T]
        if plan.num_pending:
            self._fill_pending(plan, input_ids, t)
        return input_ids, t["positions"][:T], ctx

    def _fill_pending(self, plan: StepPlan, input_ids: torch.Tensor, t: dict) -> None:
        """Write the previous step's sampled tokens (on the device, not read back) into the rows
        that take them as input (stream order: after the copy above, before the forward)."""
        prev = self._last_sampled
        if prev is None:
            raise RuntimeError("a step takes tokens not read back yet, but no earlier step left "
                               "sampled tokens on this rank")
        n, start = plan.num_pending, plan.num_prefill_tokens
        if plan.pending_in_order:
            input_ids[start : start + n].copy_(prev[:n])
        else:
            rows, src = t["pending_rows"][:n], t["pending_src"][:n]
            input_ids.index_copy_(0, rows, prev.index_select(0, src))

    def prepare_step(self, batch: ScheduledBatch):
        """-> input_ids [T] int64, positions [T] int64, Context, sample_rows (hidden rows whose
        logits are sampled, batch order) and the sequences they belong to."""
        plan, sample_seqs = self.plan_step(batch)
        input_ids, positions, ctx = self.plan_tensors(plan)
        rows = (list(range(plan.num_tokens)) if plan.sample_rows is None
                else plan.sample_rows.tolist())
        return input_ids, positions, ctx, rows, sample_seqs

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
            pw_bucket = None if self.piecewise is None else self.piecewise.bucket(input_ids.shape[0])
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
        with _prefer_cublaslt(self.use_cuda):
            hidden = self.run_model(input_ids, positions, ctx, plan.bucket)
            return self._logits(plan, hidden)

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
        if logits is None:
            return PendingTokens(None, None, None, sample_seqs)
        params = [s.params for s in sample_seqs]
        positions = banned = None
        # (list comprehensions and C-level list scans: this runs every step over every row)
        if [p.seed for p in params].count(None) != len(params):  # seeds key on output position
            positions = [len(s.token_ids) - s.num_prompt_tokens for s in sample_seqs]
        if any([p.min_tokens for p in params]):
            banned = [self._banned_ids(s) if s.params.min_tokens else () for s in sample_seqs]
        sampling = SamplingBatch.build(params, positions, banned, self.vocab_size, self.device)
        tokens = self.sampler(logits, sampling)  # [N] int64, on the device
        self._last_sampled = tokens  # the next step may take them as inputs before they are read
        if self.worker_conns:  # ... on every rank: the other ranks get them from here
            broadcast_from_rank0(tokens)
        if not self.use_cuda:
            return PendingTokens(tokens, tokens, None, sample_seqs)
        # an asynchronous copy into pinned memory: the host waits on its event, not the stream
        self._token_turn ^= 1
        host = self._token_bufs[self._token_turn]
        if host is None or host.numel() < tokens.numel():
            host = torch.empty(max(tokens.numel(), 1024), dtype=torch.int64, pin_memory=True)
            self._token_bufs[self._token_turn] = host
        host = host[: tokens.numel()]
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return PendingTokens(tokens, host, event, sample_seqs)

    def wait(self, pending: "PendingTokens") -> list[int]:
        """The step's sampled tokens (the step's one host sync)."""
        if pending.host is None:
            return []
        if pending.event is not None:
            if self.tp_watch is None:
                pending.event.synchronize()
            else:
                self._wait_watched(pending.event)
        return pending.host.tolist()

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

    # ---- CUDA graphs ---------------------------------------------------------------------------

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
        self.graph_inputs = torch.zeros(-(-self.graph_layout.nbytes // 8) * 8, dtype=torch.uint8,
                                        device=dev)
        self.graph_vars = self.graph_layout.views(_typed_torch(self.graph_inputs))
        self.graph_vars["slot_mapping"].fill_(-1)
        self.graph_vars["seq_lens"].fill_(1)
        self.graph_vars["outputs"] = torch.zeros(max_bs, cfg.hf_config.hidden_size,
                                                 dtype=cfg.torch_dtype, device=dev)

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
        with _prefer_cublaslt(self.use_cuda):
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
        with _prefer_cublaslt(self.use_cuda):
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
