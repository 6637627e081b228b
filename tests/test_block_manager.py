"""BlockManager: allocation, reference counts, prefix caching by chained hashes, eviction order."""

import pytest

from qwen3_model.engine.block_manager import BlockManager
from qwen3_model.engine.sequence import Sequence
from qwen3_model.sampling_params import SamplingParams

BS = 4


def seq(tokens):
    return Sequence(list(tokens), SamplingParams())


def admit(bm, s):
    ids, hashes = bm.match_prefix(s)
    assert bm.can_admit(s, ids)
    bm.admit(s, ids, hashes)
    return ids


def compute_all(bm, s):
    """Pretend a step computed every token of s (as the scheduler's postprocess does)."""
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)


def test_allocate_covers_every_token_and_free_returns_blocks():
    bm = BlockManager(8, BS)
    s = seq(range(10))  # 3 blocks
    assert admit(bm, s) == []
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3
    assert bm.num_free_blocks == 5
    bm.check_invariants()
    bm.grow(s, 13)  # the 13th token opens a 4th block
    assert len(s.block_table) == 4 and bm.num_free_blocks == 4
    bm.grow(s, 16)  # still 4 blocks
    assert len(s.block_table) == 4
    bm.free_seq(s)
    assert bm.num_free_blocks == 8 and s.block_table == []
    bm.check_invariants()


def test_grow_without_room_raises():
    bm = BlockManager(2, BS)
    s = seq(range(8))
    admit(bm, s)
    assert not bm.can_grow(s, 9)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.grow(s, 9)


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm = BlockManager(16, BS)
    a = seq(range(10))  # blocks [0..3] [4..7] full, [8, 9] partial
    admit(bm, a)
    # before a's K/V is computed, nothing can hit (chunked prefill may not have written it)
    assert bm.match_prefix(seq(range(10))) == ([], [])
    compute_all(bm, a)
    b = seq(list(range(8)) + [100, 101, 102])
    hits = admit(bm, b)
    assert hits == a.block_table[:2]
    assert b.num_computed_tokens == b.num_cached_tokens == 8
    assert bm.blocks[hits[0]].ref_count == 2
    assert b.block_table[2] not in a.block_table  # the diverging block is b's own
    assert bm.num_hit_blocks == 2
    bm.free_seq(a)
    assert bm.blocks[hits[0]].ref_count == 1  # still held by b
    bm.free_seq(b)
    bm.check_invariants()


def test_hash_is_chained_over_the_whole_prefix():
    bm = BlockManager(16, BS)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    compute_all(bm, a)
    # same second block, different first block: no hit at all
    b = seq([0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.match_prefix(b) == ([], [])


def test_full_prompt_hit_leaves_the_last_token_to_compute():
    bm = BlockManager(16, BS)
    a = seq(range(8))  # exactly two blocks
    admit(bm, a)
    compute_all(bm, a)
    b = seq(range(8))
    hits = admit(bm, b)
    # the block holding the last token is not reused (it would be written again): 1 block hit
    assert hits == a.block_table[:1]
    assert b.num_computed_tokens == 4 and b.num_uncomputed_tokens == 4
    assert b.block_table[1] != a.block_table[1]
    c = seq(range(9))  # the same two full blocks plus one token: both blocks hit
    assert admit(bm, c) == a.block_table[:2]
    assert c.num_uncomputed_tokens == 1


def test_freed_blocks_stay_cached_until_reused_and_unhashed_go_first():
    bm = BlockManager(4, BS)
    a = seq(range(6))  # block 0 full (hashed once computed), block 1 partial
    admit(bm, a)
    compute_all(bm, a)
    full, partial = a.block_table
    bm.free_seq(a)
    # the partial block (no hash) is handed out before the cached one
    assert next(iter(bm.free)) == partial
    b = seq(range(6))
    assert admit(bm, b) == [full]  # hit a freed block: it leaves the free list
    assert bm.blocks[full].ref_count == 1 and full not in bm.free
    bm.check_invariants()
    bm.free_seq(b)
    # fill the pool with other content: the cached block is evicted and its hash forgotten
    c = seq(range(100, 116))
    admit(bm, c)
    assert bm.match_prefix(seq(range(6))) == ([], [])
    bm.check_invariants()


def test_can_admit_counts_idle_hit_blocks_against_the_free_list():
    bm = BlockManager(3, BS)
    a = seq(range(9))  # 3 blocks; two full ones get hashed
    admit(bm, a)
    compute_all(bm, a)
    bm.free_seq(a)
    b = seq(range(9))  # hits 2 idle blocks and needs 1 fresh: exactly the 3 there are
    ids, _ = bm.match_prefix(b)
    assert len(ids) == 2 and bm.can_admit(b, ids)
    assert not bm.can_admit(b, ids, reserve=1)
    bm.admit(b, ids, _)
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = seq(range(9))
    admit(bm, a)
    compute_all(bm, a)
    assert bm.match_prefix(seq(range(9))) == ([], [])
    assert not bm.hash_to_block
