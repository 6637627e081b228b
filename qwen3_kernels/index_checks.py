"""The index values each op reads, checked where they are: one host sync per op call.

An op's shape / dtype checks (``ops.py``) say nothing about the values inside its index tensors:
a block id past the cache, a slot past the cache (an out-of-bounds *write* in qk_norm_rope's
kernel), a position past the rope table, offsets that decrease. Each function here builds one
bool mask per rule on the tensors' own device, concatenates them, and reads back a single bool
(``.item()``: the one host sync); only when that says something is wrong does it look for the
first bad entry and raise a ValueError naming the op, the argument, the index and the value.

Cost: a dozen tiny elementwise kernels over the index tensors (a few KB) and that one sync. On
the CPU the rules run in numpy on views of the tensors (torch's per-op overhead was 4x the
total): for an engine-sized step (320 tokens, 16 sequences, 64-column tables) about 30 us for
qk_norm_rope's, 60 us for decode's, 110 us for prefill's and 15 us for sample_tokens' on a busy
2-core runner (torch ops instead: 125 / 300 / 490 / 60 us). On CUDA the sync also stalls the
host until the queue drains, which is why the engine, whose tables are its own (built by the
block manager and the scheduler), calls the ops inside ``qwen3_kernels.trusted_inputs()``.

Skipped while ``torch.compile`` traces (no values exist then; the op's CPU implementation, the
reference, checks them when it runs) and while a CUDA graph is being captured (a sync is not
allowed there; a replay reads whatever the static buffers hold, the engine's own).

Used by the checked wrappers (``qwen3_kernels.<op>``) before a CUDA kernel launch, and by the
references (``reference.py``), which every CPU call runs, so both paths refuse the same inputs
with the same words.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

# (the bad entries of one rule: a bool tensor, any shape; what to say given the first bad index)
Rule = tuple["torch.Tensor | np.ndarray", Callable[[tuple[int, ...]], str]]


def skipped(t: torch.Tensor) -> bool:
    """No values to check: ``torch.compile`` is tracing, or ``t``'s stream is capturing a graph."""
    if torch.compiler.is_compiling():
        return True
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _arrays(*ts: torch.Tensor):
    """CPU tensors as numpy arrays (views, no copy): numpy's ops on a few hundred ints cost ~1 us
    each, torch's several; device tensors as they are. The rules below use operators only, so
    they read the same on both."""
    return tuple(t.detach().numpy() if t.device.type == "cpu" and t.dtype != torch.bfloat16
                 else t for t in ts)


def _arange(like, n: int):
    return np.arange(n) if isinstance(like, np.ndarray) else torch.arange(n, device=like.device)


def raise_first(op: str, rules: list[Rule]) -> None:
    """One host sync over every rule (none on the CPU); a ValueError naming the first bad entry
    of the first rule that has one."""
    if not rules:
        return
    if isinstance(rules[0][0], np.ndarray):
        if not any(bad.any() for bad, _ in rules):
            return
    elif not bool(torch.cat([bad.reshape(-1) for bad, _ in rules]).any()):
        return
    for bad, say in rules:
        where = np.argwhere(bad) if isinstance(bad, np.ndarray) else bad.nonzero()
        if where.shape[0]:
            raise ValueError(f"qwen3_kernels.{op}: {say(tuple(where[0].tolist()))}")


def _at(name: str, t: torch.Tensor, i: tuple[int, ...]) -> str:
    return f"{name}[{', '.join(map(str, i))}] = {t[i].item()}"


def _block_table_rules(block_tables: torch.Tensor, lens: torch.Tensor, lens_name: str,
                       num_blocks: int, block_size: int) -> list[Rule]:
    """block_tables [B, max_blocks] int32: the entries row b reads (the first
    ceil(lens[b] / block_size); the rest is padding, never read) in [0, num_blocks)."""
    used = (lens * (lens > 0) + block_size - 1) // block_size  # [B]
    cols = _arange(block_tables, block_tables.shape[1])
    bad = (cols[None, :] < used[:, None]) & ((block_tables < 0) | (block_tables >= num_blocks))
    return [(bad, lambda i: (
        f"{_at('block_tables', block_tables, i)} is not a block of the cache: must be in "
        f"[0, {num_blocks}) (k_cache.shape[0]); row {i[0]} reads its first "
        f"{used[i[0]].item()} entries ({lens_name}[{i[0]}] = {lens[i[0]].item()} keys)"))]


def qk_norm_rope(op: str, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 max_position: int, num_blocks: int, block_size: int) -> None:
    """positions [T] in [0, max_position) (the rope table's rows); slot_mapping [T] in
    [-1, num_blocks * block_size), -1 = the token's K / V are not written."""
    if skipped(positions):
        return
    positions, slot_mapping = _arrays(positions, slot_mapping)
    slots = num_blocks * block_size
    raise_first(op, [
        ((positions < 0) | (positions >= max_position), lambda i: (
            f"{_at('positions', positions, i)} is outside the rope table: must be in "
            f"[0, {max_position}) (cos_sin_cache.shape[0])")),
        ((slot_mapping < -1) | (slot_mapping >= slots), lambda i: (
            f"{_at('slot_mapping', slot_mapping, i)} is not a slot of the cache: must be in "
            f"[0, {slots}) (num_blocks {num_blocks} x block_size {block_size}), or -1 to skip "
            "the token")),
    ])


def paged_attention_decode(op: str, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           num_blocks: int, block_size: int) -> None:
    """seq_lens [B] in [1, max_blocks * block_size]; the block-table entries they read in
    [0, num_blocks)."""
    if skipped(seq_lens):
        return
    block_tables, seq_lens = _arrays(block_tables, seq_lens)
    cap = block_tables.shape[1] * block_size
    raise_first(op, [
        ((seq_lens < 1) | (seq_lens > cap), lambda i: (
            f"{_at('seq_lens', seq_lens, i)} must be in [1, {cap}] (the new token's key "
            f"included; at most block_tables' {block_tables.shape[1]} columns x block_size "
            f"{block_size})")),
        *_block_table_rules(block_tables, seq_lens, "seq_lens", num_blocks, block_size),
    ])


def paged_attention_prefill(op: str, cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor,
                            block_tables: torch.Tensor, num_q_tokens: int,
                            max_seqlen_q: int | None, num_blocks: int, block_size: int) -> None:
    """cu_seqlens_q [B + 1]: 0 first, non-decreasing, num_q_tokens (Tq) last; seq_lens_k [B] at
    least each sequence's query count and at most the block table's capacity; max_seqlen_q (when
    given: the kernel sizes its grid by it) at least the longest query count; the block-table
    entries the keys read in [0, num_blocks)."""
    if skipped(cu_seqlens_q):
        return
    cu, seq_lens_k, block_tables = _arrays(cu_seqlens_q, seq_lens_k, block_tables)
    q_lens = cu[1:] - cu[:-1]  # [B]
    cap = block_tables.shape[1] * block_size
    rules: list[Rule] = [
        (cu[:1] != 0, lambda i: f"{_at('cu_seqlens_q', cu, i)} must be 0"),
        (q_lens < 0, lambda i: (
            f"{_at('cu_seqlens_q', cu, (i[0] + 1,))} is below "
            f"{_at('cu_seqlens_q', cu, i)}: offsets must not decrease")),
        (cu[-1:] != num_q_tokens, lambda i: (
            f"{_at('cu_seqlens_q', cu, (cu.shape[0] - 1,))} must equal Tq = {num_q_tokens} "
            "(q's rows)")),
        ((seq_lens_k < q_lens * (q_lens > 0)) | (seq_lens_k > cap), lambda i: (
            f"{_at('seq_lens_k', seq_lens_k, i)} must be in [{q_lens[i].item()}, {cap}]: at "
            f"least sequence {i[0]}'s query count, at most block_tables' "
            f"{block_tables.shape[1]} columns x block_size {block_size}")),
    ]
    if max_seqlen_q is not None:
        rules.append((q_lens > max_seqlen_q, lambda i: (
            f"max_seqlen_q = {max_seqlen_q} is below sequence {i[0]}'s query count "
            f"{q_lens[i].item()} (cu_seqlens_q[{i[0] + 1}] - cu_seqlens_q[{i[0]}]); its rows "
            "past max_seqlen_q would not be computed")))
    rules += _block_table_rules(block_tables, seq_lens_k, "seq_lens_k", num_blocks, block_size)
    raise_first(op, rules)


def sample_tokens(op: str, temperatures: torch.Tensor) -> None:
    """temperatures [N] finite (T <= 0 is greedy; NaN and inf have no meaning)."""
    if skipped(temperatures):
        return
    (temps,) = _arrays(temperatures)
    finite = np.isfinite(temps) if isinstance(temps, np.ndarray) else torch.isfinite(temps)
    raise_first(op, [(~finite, lambda i: (
        f"{_at('temperatures', temps, i)} must be finite (T <= 0 is greedy)"))])
