"""Batch invariance on CUDA: the deterministic mode (``LLM(..., deterministic=True)``) on the
kernels, bf16, with the harness in tests/batch_invariance.py (the CPU counterpart is
tests/test_batch_invariance.py).

The acceptance: 16 prompts (1..2040 tokens) x (greedy, seeded top-p sampling), 24 tokens each
with logprobs=5, run alone (CUDA graphs on) give every token and every logprob bit-identical
when they run again inside batches of 1, 16 and 255 random other requests, split into prefill
chunks of several sizes, served from the prefix cache, under KV pressure that preempts them, with
CUDA graphs and eager, with KV blocks of 16 and 256 tokens, on fresh engines. The longest
target's decode passes the first of the mode's fixed 2048-key attention splits (launchers.h) at
its ninth token: from the prefill order's kernel, in the graphs over the narrow block table, to
the split kernel in the graphs over the full one; longer contexts and the splits' combine are
covered by test_batch_invariant_ops.py (up to 40960 keys).

And the tests fail without the mode: ``test_default_mode_differs_in_a_batch`` passes only while
the default mode's targets in a batch differ from their run alone.

Needs a compute capability 9.0 GPU (the mode's kernels are sm_90) and the built extension; skips
elsewhere. Checkpoint: random weights, hidden 1024, 4 layers, 16 q / 8 kv heads, head_dim 128
(what the kernels need), intermediate 3072, vocab 32768, bf16. About 17 engines are built (each
loads the weights and, unless eager, captures the decode graphs of up to 64 rows and the
piecewise graphs).

    pytest -q -s tests/test_batch_invariance_cuda.py
"""

from __future__ import annotations

import gc

import pytest
import torch

from tests import batch_invariance as bi
from tests.helpers import HAS_CUDA, requires_cuda

SM90 = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)

pytestmark = [requires_cuda, pytest.mark.skipif(
    not SM90, reason="the deterministic mode's CUDA kernels need a compute capability 9.0 GPU")]

SHAPE = dict(vocab_size=32768, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128,
             tie_word_embeddings=False, max_position_embeddings=4096)
V = SHAPE["vocab_size"]
# the harness's lengths with 211 dropped and 2040 added: 2040 + 24 keys pass the first split
LENGTHS = (1, 2, 7, 15, 16, 17, 31, 33, 48, 64, 97, 128, 150, 256, 300, 2040)
NUM_OTHERS = 16
# the base engine: one step holds any target prompt whole (the run alone is one prefill, then
# one-token decodes); a fixed KV cache (1 GiB), so engines do not size it from free memory
BASE = dict(device="cuda", kvcache_block_size=16, num_kvcache_blocks=4096, max_model_len=4096,
            max_num_seqs=64, max_num_batched_tokens=2048)
# blocks of 256 tokens: the same 1 GiB of cache
BASE_256 = dict(BASE, kvcache_block_size=256, num_kvcache_blocks=256)
# a batch: every prompt in one step (no chunks), no preemption
BATCH = dict(max_num_batched_tokens=8192, max_num_seqs=64)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from qwen3_model.random_checkpoint import write_random_checkpoint

    path = tmp_path_factory.mktemp("batch_invariance_cuda")
    write_random_checkpoint(path, SHAPE, dtype=torch.bfloat16, tokenizer=False)
    return str(path)


@pytest.fixture(scope="module")
def det_factory(ckpt):
    """The engine in its deterministic (batch-invariant) mode."""
    return bi.make_llm_factory(ckpt, deterministic=True, **BASE)


@pytest.fixture(scope="module")
def det_factory_256(ckpt):
    return bi.make_llm_factory(ckpt, deterministic=True, **BASE_256)


@pytest.fixture(scope="module")
def factory(ckpt):
    """The engine in its default mode (not batch-invariant)."""
    return bi.make_llm_factory(ckpt, deterministic=False, **BASE)


@pytest.fixture(scope="module")
def targets():
    return bi.target_requests(V, LENGTHS)


@pytest.fixture(autouse=True)
def free_cuda():
    """Each test's engines go with it: their memory back before the next test builds one."""
    yield
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def run_alone(llm_factory, targets, eager: bool = False) -> list[bi.Result]:
    """The targets alone on one engine (graphs unless ``eager``), checked to have used it so."""
    llm = llm_factory(**bi.ALONE_OVERRIDES, enforce_eager=eager)
    res = bi.run_alone(llm_factory, [r.prompt for r in targets], [r.params for r in targets],
                       llm=llm)
    bi.assert_comparable(res, targets)
    assert_ran(llm, eager, prompts_in_graphs=True)
    return res


@pytest.fixture(scope="module")
def alone(det_factory, targets):
    """Every target alone, deterministic mode, CUDA graphs (decode graphs and piecewise graphs
    for the prompts up to 512 tokens), blocks of 16."""
    return run_alone(det_factory, targets)


@pytest.fixture(scope="module")
def alone_256(det_factory_256, targets):
    """The same with blocks of 256 tokens."""
    return run_alone(det_factory_256, targets)


def assert_ran(llm, eager: bool, prompts_in_graphs: bool = False) -> None:
    """The engine ran as asked: decode steps replayed graphs (and, with ``prompts_in_graphs``,
    steps with prompt tokens replayed the piecewise graphs), or nothing did (eager)."""
    runner = llm.model_runner
    pw = getattr(runner, "piecewise", None)
    pw_steps = 0 if pw is None else pw.num_steps
    if eager:
        assert runner.num_graph_steps == 0 and pw_steps == 0
        return
    assert runner.graphs, "no decode graphs captured"
    assert runner.num_graph_steps > 0, "no step replayed a decode graph"
    if prompts_in_graphs:
        assert pw is not None and pw_steps > 0, "no step replayed the piecewise graphs"


def check(alone, got, targets, what: str) -> None:
    """assert_identical, after checking that the results are whole and that the comparison sees
    a one-ulp change of them."""
    bi.assert_comparable(got, targets)
    assert bi.differences(got, bi.perturbed(got, 0, 0, "logprob")), "a change went unseen"
    bi.assert_identical(alone, got, what)


def run(llm_factory, targets, sc: bi.Scenario) -> bi.BatchResults:
    """``sc`` on an engine built with its settings, checked to have used graphs or not."""
    llm = llm_factory(**sc.overrides)
    got = bi.run_scenario(llm_factory, targets, sc, llm=llm)
    assert_ran(llm, sc.overrides.get("enforce_eager", False))
    return got


# ---- alone --------------------------------------------------------------------------------------

def test_alone_is_repeatable(det_factory, targets, alone):
    """Alone again on a fresh engine: bit-identical."""
    check(alone, run_alone(det_factory, targets), targets, "alone again, a fresh engine")


def test_alone_eager_equals_graphs(det_factory, targets, alone):
    """Alone, eager (no decode or piecewise graphs): bit-identical to alone with graphs."""
    check(alone, run_alone(det_factory, targets, eager=True), targets, "alone, eager")


# ---- in a batch ---------------------------------------------------------------------------------

@pytest.mark.parametrize("num_others, eager", [(1, False), (16, False), (16, True)],
                         ids=["1-graphs", "16-graphs", "16-eager"])
def test_in_a_batch_of_others(det_factory, targets, alone, num_others, eager):
    """All targets in one generate() call with ``num_others`` random requests (random lengths
    and sampling settings), shuffled; every prompt in the first step, no prefix cache."""
    sc = bi.batch_scenario(V, num_others, seed=num_others, eager=eager, **BATCH)
    got = run(det_factory, targets, sc)
    assert got.stats.num_partial_prefills == 0 and got.stats.num_preemptions == 0
    check(alone, got, targets, sc.name)


def test_in_a_batch_of_255_others(det_factory, targets, alone):
    """255 others + the 32 targets: 287 sequences, decode steps replaying graphs of up to 288
    rows."""
    sc = bi.batch_scenario(V, 255, seed=255, eager=False, max_num_batched_tokens=32768,
                           max_num_seqs=288, max_cudagraph_batch_size=288)
    got = run(det_factory, targets, sc)
    assert got.stats.num_partial_prefills == 0 and got.stats.num_preemptions == 0
    check(alone, got, targets, sc.name)


# ---- chunked prefill, prefix cache, KV pressure -------------------------------------------------

@pytest.mark.parametrize("budget, eager", [(64, False), (200, False), (200, True)],
                         ids=["64-graphs", "200-graphs", "200-eager"])
def test_chunked_prefill(det_factory, targets, alone, budget, eager):
    """A step budget of ``budget`` tokens: the prompts go in chunks of several sizes beside the
    others' decodes (the scenario checks it)."""
    sc = bi.chunked_prefill_scenario(V, budget, num_others=NUM_OTHERS, seed=budget, eager=eager)
    got = run(det_factory, targets, sc)
    split = [t for t, c in got.stats.prompt_chunks.items() if len(c) > 1]
    assert len(split) >= sum(len(r.prompt) > budget for r in targets)
    check(alone, got, targets, sc.name)


def test_prefix_cache_hits(det_factory, targets, alone):
    """The targets again after a first submission, among others sharing their prefixes: each
    target with a full block before its last token is served from the cache."""
    sc = bi.prefix_cache_scenario(V, targets, num_others=NUM_OTHERS, seed=6, block_size=16,
                                  eager=False)
    got = run(det_factory, targets, sc)
    check(alone, got, targets, sc.name)


@pytest.mark.parametrize("prefix_caching, eager", [(True, False), (False, True)],
                         ids=["cache-graphs", "no-cache-eager"])
def test_kv_pressure_preemption(det_factory, targets, alone, prefix_caching, eager):
    """160 KV blocks (2560 tokens) for 48 requests, one of them 1294 tokens long: sequences,
    targets among them, are preempted and recomputed."""
    sc = bi.kv_pressure_scenario(V, num_blocks=160, num_others=NUM_OTHERS,
                                 seed=7 if prefix_caching else 8, eager=eager,
                                 enable_prefix_caching=prefix_caching)
    got = run(det_factory, targets, sc)
    check(alone, got, targets, sc.name)


# ---- blocks of 256 tokens -----------------------------------------------------------------------

def test_block_size_256_alone_equals_block_size_16(alone, alone_256):
    """The attention reads keys in tiles of 16 and splits of 640 whatever the block size, so
    KV blocks of 256 tokens give the results of blocks of 16, bit for bit."""
    bi.assert_identical(alone, alone_256, "alone, blocks of 256 tokens")


def test_block_size_256_in_a_batch(det_factory_256, targets, alone_256):
    sc = bi.batch_scenario(V, NUM_OTHERS, seed=256, eager=False, **BATCH)
    got = run(det_factory_256, targets, sc)
    check(alone_256, got, targets, f"{sc.name}, blocks of 256")


def test_block_size_256_prefix_cache_hits(det_factory_256, targets, alone_256):
    sc = bi.prefix_cache_scenario(V, targets, num_others=NUM_OTHERS, seed=257, block_size=256,
                                  eager=False)
    got = run(det_factory_256, targets, sc)
    check(alone_256, got, targets, f"{sc.name}, blocks of 256")


# ---- without the mode ---------------------------------------------------------------------------

def test_default_mode_differs_in_a_batch(factory, targets):
    """Without the mode the property fails: deterministic=False, the targets alone vs among 16
    others (graphs both) differ (the GEMM / attention configuration follows the batch). This
    passes only while they do: it is the evidence that the tests above need the mode."""
    ref = run_alone(factory, targets)
    sc = bi.batch_scenario(V, NUM_OTHERS, seed=NUM_OTHERS, eager=False, **BATCH)
    got = run(factory, targets, sc)
    bi.assert_comparable(got, targets)
    diffs = bi.differences(ref, got)
    summary = (f"deterministic=False, {sc.name}: {len(diffs)} of {len(targets)} prompts differ "
               f"from their run alone")
    assert diffs, (f"{summary}; the default mode was expected to differ, so these tests no "
                   "longer show that the deterministic mode is needed")
    i, k, d = diffs[0]
    print(f"\n{summary}; first: prompt {i} ({len(targets[i].prompt)} prompt tokens), step {k}: "
          f"{d}")
