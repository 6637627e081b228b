"""Paged KV-cache blocks: allocation, reference counts, and prefix caching by chained block hashes.

A block holds the K/V of ``block_size`` consecutive tokens of one or more sequences (shared when
their prefixes are equal). A full block whose K/V have been computed gets a hash chained over the
whole prefix: hash(hash of the previous block, this block's tokens). A new sequence whose first
blocks hash the same reuses them instead of recomputing.

Every sequence holding blocks also owns a row of ``tables`` (int32 [rows, max_blocks_per_seq]), a
copy of its ``block_table`` kept up to date as blocks are appended, so that the model runner
gathers a step's block tables with one numpy ``take`` instead of padding Python lists every step.

Freed blocks keep their hash and content until they are handed out again, so a later request (or a
preempted sequence coming back) can still hit them; the free list is ordered so that blocks with
nothing worth keeping go first, then the least recently freed.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from qwen3_model.engine.sequence import Sequence

_ROOT_HASH = 0  # the "previous block" hash of a sequence's first block


def chain_hash(prev_hash: int, token_ids: tuple[int, ...]) -> int:
    # Python's tuple hash of ints is deterministic across runs; a 64-bit collision is also
    # guarded against by comparing the stored tokens on every hit.
    return hash((prev_hash, token_ids))


def _may_hit(seq: Sequence) -> bool:
    """Whether ``seq`` may take cached blocks (its blocks are cached for others either way)."""
    return seq.params.prompt_logprobs is None


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None  # set once the block is full and computed
        self.token_ids: tuple[int, ...] | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 max_blocks_per_seq: int = 16, max_seqs: int = 16):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, got "
                             f"{num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # the block-table mirror: row r is the table of the sequence whose table_row is r,
        # padded with 0 (a valid block id: entries past a sequence's length are never read, but a
        # valid index keeps a stray read in bounds). Grows if a sequence or the batch outgrows it.
        self.tables = np.zeros((max(1, max_seqs), max(1, max_blocks_per_seq)), dtype=np.int32)
        self._free_rows = list(range(self.tables.shape[0] - 1, -1, -1))  # popped from the end
        self._row_seq: list[Sequence | None] = [None] * self.tables.shape[0]  # (for the checks)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        # ref_count == 0 blocks; popped from the front. OrderedDict: O(1) removal on a cache hit.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # counters, for tests and logs
        self.num_hit_blocks = 0
        self.num_queried_blocks = 0

    # ---- sizes -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs so that its table covers ``num_tokens`` slots."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    # ---- admission: prefix-cache lookup + allocation of the whole sequence ---------------------

    def match_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Cached blocks equal to ``seq``'s leading full blocks: (block ids, their hashes).

        Never covers the last token: its logits are needed, so it must be computed even when the
        whole prompt is cached (and the block holding it is then recomputed into a fresh block,
        so a shared block is never written). Nothing for a request with prompt_logprobs: they
        come from the logits of every prompt token, so its whole prompt must be computed.
        """
        if not self.enable_prefix_caching or seq.block_table or not _may_hit(seq):
            return [], []
        ids, hashes = [], []
        h = _ROOT_HASH
        bs = self.block_size
        for i in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = chain_hash(h, tokens)
            bid = self.hash_to_block.get(h)
            if bid is None or self.blocks[bid].token_ids != tokens:
                break
            ids.append(bid)
            hashes.append(h)
        return ids, hashes

    def can_admit(self, seq: Sequence, hit_ids: list[int], reserve: int = 0) -> bool:
        """Whether blocks for all of ``seq``'s tokens can be had, keeping ``reserve`` free."""
        new = self.blocks_for(seq.num_tokens) - len(hit_ids)
        # hit blocks nobody holds sit in the free list; taking them shrinks it too
        idle_hits = sum(1 for b in hit_ids if self.blocks[b].ref_count == 0)
        return len(self.free) - idle_hits - new >= reserve

    def admit(self, seq: Sequence, hit_ids: list[int], hit_hashes: list[int]) -> None:
        """Give ``seq`` the hit blocks plus fresh ones for the rest of its tokens."""
        assert not seq.block_table, f"{seq} already holds blocks"
        for bid in hit_ids:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free[bid]
            block.ref_count += 1
        seq.block_table = list(hit_ids)
        seq.block_hashes = list(hit_hashes)
        seq.table_row = self._take_row()
        self._row_seq[seq.table_row] = seq
        self._write_row(seq, 0)
        seq.num_computed_tokens = seq.num_cached_tokens = len(hit_ids) * self.block_size
        self.num_hit_blocks += len(hit_ids)
        if self.enable_prefix_caching and _may_hit(seq):
            self.num_queried_blocks += (seq.num_tokens - 1) // self.block_size
        self.grow(seq, seq.num_tokens)

    # ---- growth, release -----------------------------------------------------------------------

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self.free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Append fresh blocks so ``seq.block_table`` covers ``num_tokens`` slots."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free):
            raise RuntimeError(f"out of KV blocks: {seq} needs {need}, {len(self.free)} free")
        if need:
            start = len(seq.block_table)
            for _ in range(need):
                seq.block_table.append(self._take_fresh())
            self._write_row(seq, start)

    def _take_fresh(self) -> int:
        bid, _ = self.free.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None and self.hash_to_block.get(block.hash) == bid:
            del self.hash_to_block[block.hash]  # its old content is about to be overwritten
        block.hash = None
        block.token_ids = None
        block.ref_count = 1
        return bid

    def free_seq(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (finish or preemption). Its K/V is forgotten by the sequence."""
        # Tail first: a prefix block is more likely to be shared again than the tail after it.
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {bid} freed more often than taken"
            if block.ref_count == 0:
                self.free[bid] = None
                if block.hash is None:  # nothing reusable in it: hand it out first
                    self.free.move_to_end(bid, last=False)
        if seq.table_row >= 0:
            self.tables[seq.table_row, : len(seq.block_table)] = 0
            self._free_rows.append(seq.table_row)
            self._row_seq[seq.table_row] = None
            seq.table_row = -1
        seq.block_table = []
        seq.block_hashes = []
        # (num_cached_tokens stays: the last admission's hit, for stats)
        seq.num_computed_tokens = 0

    # ---- the block-table mirror --------------------------------------------------------------

    def _take_row(self) -> int:
        if not self._free_rows:  # more sequences hold blocks than rows: double the rows
            old = self.tables.shape[0]
            self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
            self._row_seq += [None] * old
        return self._free_rows.pop()

    def _write_row(self, seq: Sequence, start: int) -> None:
        """Copy ``seq.block_table[start:]`` into its row (after an admission or a growth)."""
        end = len(seq.block_table)
        if end > self.tables.shape[1]:  # longer than max_blocks_per_seq said: widen
            wider = np.zeros((self.tables.shape[0], max(end, 2 * self.tables.shape[1])),
                             dtype=np.int32)
            wider[:, : self.tables.shape[1]] = self.tables
            self.tables = wider
        if end > start:
            self.tables[seq.table_row, start:end] = seq.block_table[start:end]

    # ---- prefix cache registration -----------------------------------------------------------

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` that became full and computed since the last call.

        Done only after their K/V are written (not at allocation), so that with chunked prefill
        no other sequence can hit a block whose K/V is still to come.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        h = seq.block_hashes[-1] if seq.block_hashes else _ROOT_HASH
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = chain_hash(h, tokens)
            block = self.blocks[seq.block_table[i]]
            block.hash = h
            block.token_ids = tokens
            # if an identical block is already registered, the newer one wins; the older one
            # stays valid for whoever holds it
            self.hash_to_block[h] = block.block_id
            seq.block_hashes.append(h)

    def check_invariants(self) -> None:
        """Consistency of ref counts and the free list (used by the tests)."""
        for b in self.blocks:
            assert b.ref_count >= 0
            assert (b.ref_count == 0) == (b.block_id in self.free), f"block {b.block_id}"
        for h, bid in self.hash_to_block.items():
            assert self.blocks[bid].hash == h
        free_rows = set(self._free_rows)
        assert len(free_rows) == len(self._free_rows)
        for r, seq in enumerate(self._row_seq):
            row = self.tables[r]
            if seq is None:
                assert r in free_rows and not row.any(), f"free table row {r} not cleared"
            else:
                n = len(seq.block_table)
                assert r not in free_rows and seq.table_row == r
                assert row[:n].tolist() == seq.block_table and not row[n:].any(), (
                    f"table row {r} {row.tolist()} does not mirror {seq}")
