"""Step planning and input staging: a scheduled step -> its packed integer inputs on the device.

Host cost per step is kept small because the device waits on it between steps: a step's integer
inputs (token ids, positions, slots, sequence lengths, block tables) are built with numpy in a
pinned staging buffer (block tables gathered from the block manager's mirror, not padded from
lists) and cross to the device in one asynchronous copy (``Layout``); a graph step's inputs land
straight in the decode graphs' static buffers (``cuda_graphs.py``). A ``StepPlan`` is also what
rank 0 sends the other tensor-parallel ranks.

Step layout (``qwen3_model.utils.context``): the prefill chunks first, then one token per decoding
sequence. A decode row whose input is the previous step's sampled token, not read back yet (an
overlapped step: ``LLMEngine._steps``), is filled on the device from that step's tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from qwen3_model.engine.scheduler import ScheduledBatch
from qwen3_model.engine.sequence import Sequence
from qwen3_model.utils.context import Context


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


def typed_torch(buf: torch.Tensor) -> dict[str, torch.Tensor]:
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
    # the field of the decode block table: "decode_block_tables" (eager), or the graphs'
    # "block_tables" / "short_block_tables" (the graphs of that table's width)
    table_field: str = "decode_block_tables"
    # rows whose input token is the previous step's k-th sampled token, not read back yet
    # (fields "pending_rows" / "pending_src"; ``pending_in_order``: rows T_pre + k, k = 0..)
    num_pending: int = 0
    pending_in_order: bool = False
    # rows whose logits give prompt logprobs (SamplingParams.prompt_logprobs): row j of a chunk
    # at position p predicts the prompt token at p + 1; None = no such row (the common case)
    prompt_rows: np.ndarray | None = None


class HostStaging:
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


class StepInputs:
    """ModelRunner's step planning and staging (a base of ModelRunner, which owns the state it
    uses: block_size, max_blocks_per_seq, short_table_blocks, the staging buffers, the decode
    graphs' buffers)."""

    def _to_device(self, data, dtype) -> torch.Tensor:
        t = torch.as_tensor(data, dtype=dtype)  # (lists and numpy arrays alike)
        if self.use_cuda:
            t = t.pin_memory()  # a copy: the non-blocking copy below may outlive ``data``
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
            # the deterministic mode's narrow decode table (ModelRunner.short_table_blocks)
            short = self.short_table_blocks
            if short is not None and int(dec_pos.max()) < short * bs:
                width = short
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

        # rows whose logits give prompt logprobs (one list scan of the step's prompt chunks; the
        # decode rows only when some is a prompt token, not its sequence's last)
        segments = []
        if P and [s.params.prompt_logprobs for s in pre_seqs].count(None) != P:
            segments += self._prompt_segments(pre_seqs, pre_start, pre_n, cu_q[:-1])
        if dec_done is not None and not dec_done.all():
            part = [k for k in np.flatnonzero(~dec_done).tolist()
                    if decodes[k].params.prompt_logprobs is not None]
            if part:
                segments += self._prompt_segments([decodes[k] for k in part], dec_pos[part],
                                                  np.ones(len(part), dtype=np.int64),
                                                  T_pre + np.array(part, dtype=np.int64))
        prompt_rows = None
        if segments:
            prompt_rows = np.concatenate([np.arange(r, r + c) for _, _, c, r in segments])
            self._prompt_owners = [(seq, p, c) for seq, p, c, _ in segments]

        bucket = self._graph_bucket(batch)
        if bucket is not None:
            layout, n_rows = self.graph_layout, bucket
            tab_field = "block_tables" if width == self.max_blocks_per_seq else "short_block_tables"
            lens_field = "seq_lens"
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
            f[tab_field][D:bucket] = 0
        if sample_rows is not None and bucket is None:
            f["sample_rows"][:] = sample_rows
        if bucket is not None:  # the copy covers the static buffer up to the bucket's last row
            _, start, shape = layout.fields[tab_field]
            nbytes = 4 * (start + shape[1] * n_rows)
        else:
            nbytes = layout.nbytes
        plan = StepPlan(data=buf[:nbytes], layout=layout, num_tokens=T, num_prefill_tokens=T_pre,
                        num_prefills=P, num_decodes=D, max_q=int(pre_n.max()) if P else 0,
                        sample_rows=sample_rows, bucket=bucket, table_field=tab_field,
                        num_pending=num_pending,
                        pending_in_order=in_order, prompt_rows=prompt_rows)
        self._staged = (plan, i)
        return plan, sample_seqs

    @staticmethod
    def _prompt_segments(seqs: list[Sequence], start: np.ndarray, n: np.ndarray,
                         first_row: np.ndarray) -> list[tuple[Sequence, int, int, int]]:
        """Of chunks ``[start, start + n)`` (one per sequence, at step row ``first_row``): the
        positions whose logits predict a prompt token of a sequence with prompt_logprobs, as
        (sequence, first position, count, first row). The last prompt token's row predicts the
        first output token (sampled, not a prompt logprob), and a recomputed chunk past the
        prompt (after a preemption) has none."""
        out = []
        for seq, p0, c, r in zip(seqs, start.tolist(), n.tolist(), first_row.tolist()):
            if seq.params.prompt_logprobs is None:
                continue
            c = min(c, seq.num_prompt_tokens - 1 - p0)
            if c > 0:
                out.append((seq, p0, c, r))
        return out

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
                self._step_typed = typed_torch(self._step_inputs)
            dst = self._step_inputs
            t = plan.layout.views(self._step_typed)
        self._staging.copy_to(i, dst, nbytes)
        T, D, P = plan.num_tokens, plan.num_decodes, plan.num_prefills
        ctx = Context(slot_mapping=t["slot_mapping"][:T])
        if plan.bucket is not None:
            ctx.decode_seq_lens = t["seq_lens"][:D]
            ctx.decode_block_tables = t[plan.table_field][:D]
        elif D:
            ctx.decode_seq_lens = t["decode_seq_lens"]
            # Full width (or the deterministic mode's narrow one, chosen as for the graphs), as
            # in the decode graphs: the split-KV count is chosen from the table width, so eager
            # and replayed decode then sum in the same order and give identical tokens
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
