"""The harness of the batch-invariance tests (functions only; the tests are
tests/test_batch_invariance.py on the CPU and tests/test_batch_invariance_cuda.py on CUDA, both
with ``make_llm_factory(path, deterministic=True, ...)``: the engine's deterministic mode).

The property (the acceptance of the deterministic / batch-invariant mode): a request's tokens and
logprobs do not depend on what else the engine runs. Every token and every logprob (the sampled
token's, its rank and the top-N ids and values) of a target request must be bit-identical to the
same request run alone, whether it runs

* inside a batch of 1..256 random other requests (random lengths, tokens and sampling settings,
  temperature > 0 with and without seeds, top-k / top-p / min-p, logprobs, prompt logprobs),
  submitted in a shuffled order (``run_in_batch`` and its ``order_seed``, ``batch_scenario``);
* with its prompt split into prefill chunks of several sizes (``chunked_prefill_scenario``);
* served from the prefix cache (``prefix_cache_scenario``: the same requests were submitted
  before, and others share long prefixes with them);
* under KV pressure that preempts it and recomputes it (``kv_pressure_scenario``);
* with CUDA graphs or eager (``eager=`` on every builder: ``enforce_eager``; the CPU has no
  graphs, so there both are the same run).

Usage:

    factory = make_llm_factory(path, deterministic=True, kvcache_block_size=16)
    targets = target_requests(vocab_size)                 # 16 prompts x (greedy, seeded)
    alone = run_alone(factory, [r.prompt for r in targets], [r.params for r in targets])
    sc = chunked_prefill_scenario(vocab_size, budget=24, num_others=7, seed=1)
    got = run_scenario(factory, targets, sc)                  # checks the scenario happened
    assert_identical(alone, got, sc.name)

``llm_factory(**overrides) -> LLM``: every run builds its engine through it, with the scenario's
engine settings as keywords (so the factory decides the model, the device and the mode).

The property holds only in the deterministic mode (``LLM(..., deterministic=True)``): in the
default mode the engine's GEMMs and attention round a row differently by the number of rows /
queries in the call, on the CPU (MKL's fp32 GEMM, the reference attention's batched matmuls) as on
CUDA, so a request's logprobs change in their last bits with the batch (the tests show that too).
The mode computes every row the same way whatever the batch: on the CPU F.linear one row at a
time (``qwen3_model.layers.linear.row_invariant_linear``) and the attention one query at a time
(``qwen3_kernels.reference._attention_invariant``); on CUDA kernels whose per-row order of
sums the batch does not change.
"""

from __future__ import annotations

import math
import random
import struct
from dataclasses import dataclass, field
from typing import Callable, Sequence

from qwen3_model import LLM, SamplingParams

LLMFactory = Callable[..., LLM]

NUM_TARGET_PROMPTS = 16
TARGET_MAX_TOKENS = 24
TARGET_LOGPROBS = 5
TARGET_SEED = 1234
# prompt lengths 1..300: block-aligned ones, one past a block, and odd ones (block size 16)
TARGET_LENGTHS = (1, 2, 7, 15, 16, 17, 31, 33, 48, 64, 97, 128, 150, 211, 256, 300)

# the settings of the run alone: one prefill for the whole prompt (the budget covers the longest
# prompt), then one decode per step, and nothing cached from the previous prompt's call
ALONE_OVERRIDES = dict(enable_prefix_caching=False)


# ---- the engine ---------------------------------------------------------------------------------

def make_llm_factory(model: str, *, deterministic: bool | None = None,
                     **base) -> LLMFactory:
    """``factory(**overrides) -> LLM(model, **base, **overrides)``. ``deterministic``: passed to
    the LLM when not None (True: the engine's batch-invariant mode; None passes nothing: the
    engine's default, which is not batch-invariant)."""
    def factory(**overrides) -> LLM:
        kw = dict(base)
        if deterministic is not None:
            kw["deterministic"] = deterministic
        kw.update(overrides)
        return LLM(model, **kw)

    return factory


# ---- requests -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Request:
    prompt: list[int]
    params: SamplingParams


def greedy_params(max_tokens: int = TARGET_MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=TARGET_LOGPROBS)


def seeded_params(max_tokens: int = TARGET_MAX_TOKENS, seed: int = TARGET_SEED) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=max_tokens,
                          ignore_eos=True, logprobs=TARGET_LOGPROBS)


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


def target_prompts(vocab_size: int, lengths: Sequence[int] = TARGET_LENGTHS,
                   seed: int = 0) -> list[list[int]]:
    rng = random.Random(f"targets-{seed}")
    return [random_tokens(rng, n, vocab_size) for n in lengths]


def target_requests(vocab_size: int, lengths: Sequence[int] = TARGET_LENGTHS, *,
                    max_tokens: int = TARGET_MAX_TOKENS, seed: int = 0,
                    sampling_seed: int = TARGET_SEED) -> list[Request]:
    """Every prompt twice: greedy with logprobs=5, then seeded sampling (temperature 0.8,
    top_p 0.9, ``sampling_seed``) with logprobs=5; ignore_eos, so each makes ``max_tokens``."""
    prompts = target_prompts(vocab_size, lengths, seed)
    return ([Request(p, greedy_params(max_tokens)) for p in prompts]
            + [Request(p, seeded_params(max_tokens, sampling_seed)) for p in prompts])


def random_params(rng: random.Random, max_tokens: tuple[int, int] = (1, 32)) -> SamplingParams:
    """Random sampling settings: greedy, or temperature > 0 (with or without a seed) with or
    without top-k / top-p / min-p; random logprobs / prompt logprobs; some stop on EOS."""
    kind = rng.random()
    kw: dict = dict(max_tokens=rng.randint(*max_tokens), ignore_eos=rng.random() < 0.7)
    if kind < 0.25:
        kw["temperature"] = 0.0
    else:
        kw["temperature"] = rng.choice([0.3, 0.7, 0.8, 1.0, 1.3])
        if rng.random() < 0.7:
            kw["seed"] = rng.randrange(1 << 40)
        if rng.random() < 0.3:
            kw["top_k"] = rng.choice([1, 5, 40])
        if rng.random() < 0.4:
            kw["top_p"] = rng.choice([0.5, 0.9, 0.95])
        if rng.random() < 0.2:
            kw["min_p"] = rng.choice([0.05, 0.1])
    r = rng.random()
    if r < 0.4:
        kw["logprobs"] = rng.randint(0, 20)
    if rng.random() < 0.1:
        kw["prompt_logprobs"] = rng.randint(0, 3)
    return SamplingParams(**kw)


def random_others(n: int, vocab_size: int, seed: int, *, max_len: int = 200,
                  max_tokens: tuple[int, int] = (1, 32),
                  prefixes: Sequence[list[int]] = (), prefix_share: float = 0.0) -> list[Request]:
    """``n`` random requests: lengths 1..max_len (skewed short), random tokens, ``random_params``.
    With ``prefixes``, a share ``prefix_share`` of them starts with a long prefix of one of them
    (then a random tail), so they hit (or fill) the prefix cache beside the targets."""
    rng = random.Random(f"others-{seed}")
    out = []
    for _ in range(n):
        if prefixes and rng.random() < prefix_share:
            base = rng.choice(prefixes)
            cut = rng.randint(len(base) // 2, len(base))
            prompt = base[:cut] + random_tokens(rng, rng.randint(1, 40), vocab_size)
        else:
            length = min(max_len, 1 + int(max_len * rng.random() ** 2))
            prompt = random_tokens(rng, length, vocab_size)
        out.append(Request(prompt, random_params(rng, max_tokens)))
    return out


# ---- results ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    """One generated token with its logprobs exactly as the engine returned them."""

    token_id: int
    logprob: float | None  # None: the request asked for no logprobs
    rank: int | None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Result:
    prompt_len: int
    steps: tuple[Step, ...]
    finish_reason: str | None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def token_ids(self) -> list[int]:
        return [s.token_id for s in self.steps]

    @property
    def logprobs(self) -> list[float | None]:
        return [s.logprob for s in self.steps]


def to_result(out) -> Result:
    """A RequestOutput as a Result (the logprobs are the floats the engine made: fp32 values,
    exact as Python floats)."""
    lps = out.logprobs
    if lps is not None:
        assert len(lps) == len(out.token_ids), "one logprob entry per generated token"
        steps = tuple(Step(t, e.logprob, e.rank, tuple((i, v) for i, v in e.top))
                      for t, e in zip(out.token_ids, lps))
        for t, e in zip(out.token_ids, lps):
            assert e.token_id == t, f"logprob entry of token {e.token_id} for token {t}"
    else:
        steps = tuple(Step(t, None, None) for t in out.token_ids)
    return Result(len(out.prompt_token_ids), steps, out.finish_reason, out.num_cached_tokens)


@dataclass
class EngineStats:
    """The scheduler's counters over one generate call (None: the engine has no such counter),
    and what happened to the targets in it."""

    num_steps: int | None = None
    num_preemptions: int | None = None
    num_partial_prefills: int | None = None
    num_prefix_hit_tokens: int | None = None
    # target index -> its prompt chunks (tokens per step that computed prompt tokens)
    prompt_chunks: dict[int, list[int]] = field(default_factory=dict)
    preempted_targets: set[int] = field(default_factory=set)  # targets preempted at least once


_COUNTERS = ("num_steps", "num_preemptions", "num_partial_prefills", "num_prefix_hit_tokens")


class BatchResults(list):
    """The targets' Results (a list, in target order) and the run's ``stats``."""

    stats: EngineStats


# ---- runs ---------------------------------------------------------------------------------------

def _as_list(params, n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    assert len(params) == n, f"{n} prompts but {len(params)} SamplingParams"
    return params


def run_alone(llm_factory: LLMFactory, prompts: Sequence[list[int]], params,
              llm: LLM | None = None) -> list[Result]:
    """Each prompt in its own generate() call, on one engine with the prefix cache off (so no
    call sees another's blocks): the reference every other run is held to."""
    params = _as_list(params, len(prompts))
    llm = llm or llm_factory(**ALONE_OVERRIDES)
    out = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        (o,) = llm.generate([list(p)], sp, use_tqdm=False)
        r = to_result(o)
        assert r.num_cached_tokens == 0, f"prompt {i} alone was served from the prefix cache"
        out.append(r)
    return out


def _instrument(llm: LLM, slot_to_target: dict[int, int], stats: EngineStats):
    """Record, through instance wrappers of the scheduler's ``schedule`` / ``_preempt`` (when it
    has them), the targets' prompt chunks and preemptions. Returns an undo callable."""
    sched = getattr(llm, "scheduler", None)
    undo = []
    if sched is None:
        return lambda: None
    if hasattr(sched, "schedule"):
        inner_schedule = sched.schedule

        def schedule(*a, **k):
            batch = inner_schedule(*a, **k)
            for seq, n in batch.items():
                t = slot_to_target.get(seq.index)
                # a step that computes prompt tokens (a recomputation after a preemption also
                # starts in the prompt: its chunks are recorded too)
                if t is not None and seq.num_computed_tokens < seq.num_prompt_tokens:
                    stats.prompt_chunks.setdefault(t, []).append(n)
            return batch

        sched.schedule = schedule
        undo.append(lambda: delattr(sched, "schedule"))
    if hasattr(sched, "_preempt"):
        inner_preempt = sched._preempt

        def preempt(seq, *a, **k):
            t = slot_to_target.get(seq.index)
            if t is not None:
                stats.preempted_targets.add(t)
            return inner_preempt(seq, *a, **k)

        sched._preempt = preempt
        undo.append(lambda: delattr(sched, "_preempt"))

    def restore():
        for f in undo:
            f()

    return restore


def _counters(llm: LLM) -> dict[str, int | None]:
    sched = getattr(llm, "scheduler", None)
    return {k: getattr(sched, k, None) for k in _COUNTERS}


def run_in_batch(llm_factory: LLMFactory, prompts: Sequence[list[int]], params,
                 others: Sequence[Request], order_seed: int, *,
                 overrides: dict | None = None, warmup: Sequence[Request] = (),
                 llm: LLM | None = None) -> BatchResults:
    """The target ``prompts`` (with ``params``) mixed with ``others`` in one generate() call, in
    the order a ``random.Random(order_seed)`` shuffle gives, on an engine built with
    ``overrides`` (after ``warmup`` requests, if any, ran on it in a call of their own). Returns
    the targets' Results in target order, with the call's ``stats``."""
    params = _as_list(params, len(prompts))
    llm = llm or llm_factory(**(overrides or {}))
    if warmup:
        llm.generate([list(r.prompt) for r in warmup], [r.params for r in warmup],
                     use_tqdm=False)
    reqs = [(list(p), sp, t) for t, (p, sp) in enumerate(zip(prompts, params))]
    reqs += [(list(r.prompt), r.params, None) for r in others]
    random.Random(f"order-{order_seed}").shuffle(reqs)
    slot_to_target = {slot: t for slot, (_, _, t) in enumerate(reqs) if t is not None}

    stats = EngineStats()
    before = _counters(llm)
    restore = _instrument(llm, slot_to_target, stats)
    try:
        outs = llm.generate([p for p, _, _ in reqs], [sp for _, sp, _ in reqs], use_tqdm=False)
    finally:
        restore()
    after = _counters(llm)
    for k in _COUNTERS:
        if before[k] is not None and after[k] is not None:
            setattr(stats, k, after[k] - before[k])
    assert len(outs) == len(reqs)
    results = BatchResults([None] * len(prompts))
    for slot, t in slot_to_target.items():
        assert outs[slot].index == slot and outs[slot].prompt_token_ids == reqs[slot][0]
        results[t] = to_result(outs[slot])
    results.stats = stats
    return results


# ---- scenarios ----------------------------------------------------------------------------------

@dataclass
class Scenario:
    """One way of running the targets among others: the engine settings, the other requests, the
    order, the requests run before on the same engine, and ``check(results, targets)``, which
    asserts that what the scenario is about did happen (chunks, hits, preemptions)."""

    name: str
    overrides: dict
    others: list[Request]
    order_seed: int = 0
    warmup: list[Request] = field(default_factory=list)
    check: Callable[[BatchResults, Sequence[Request]], None] | None = None


def run_scenario(llm_factory: LLMFactory, targets: Sequence[Request], sc: Scenario,
                 llm: LLM | None = None) -> BatchResults:
    """``run_in_batch`` of ``targets`` under ``sc``, then ``sc.check``."""
    got = run_in_batch(llm_factory, [r.prompt for r in targets], [r.params for r in targets],
                       sc.others, sc.order_seed, overrides=sc.overrides, warmup=sc.warmup,
                       llm=llm)
    if sc.check is not None:
        sc.check(got, targets)
    return got


def _mode(eager: bool) -> str:
    return "eager" if eager else "graphs"


def batch_scenario(vocab_size: int, num_others: int, seed: int, *, eager: bool = True,
                   max_len: int = 200, **overrides) -> Scenario:
    """The targets among ``num_others`` random requests, one large step budget, no prefix cache
    (so that only the batch differs from the run alone)."""
    ov = dict(enable_prefix_caching=False, enforce_eager=eager)
    ov.update(overrides)
    return Scenario(f"batch of {num_others} others (seed {seed}, {_mode(eager)})", ov,
                    random_others(num_others, vocab_size, seed, max_len=max_len), seed)


def chunked_prefill_scenario(vocab_size: int, budget: int, num_others: int, seed: int, *,
                             eager: bool = True, max_num_seqs: int | None = None,
                             **overrides) -> Scenario:
    """A step budget of ``budget`` tokens (prefill chunks and decodes share it), so that the
    prompts are split into chunks of several sizes; no prefix cache. The check: some target was
    split, and the targets' chunks come in at least two sizes."""
    seqs = max_num_seqs or min(budget, 64)
    ov = dict(max_num_batched_tokens=budget, max_num_seqs=seqs, enable_prefix_caching=False,
              enforce_eager=eager)
    ov.update(overrides)

    def check(got: BatchResults, targets):
        st = got.stats
        split = {t: c for t, c in st.prompt_chunks.items() if len(c) > 1}
        assert split, f"no target prompt was split into chunks (budget {budget})"
        sizes = {n for c in st.prompt_chunks.values() for n in c}
        assert len(sizes) >= 2, f"the targets' prompt chunks all have one size: {sizes}"
        if st.num_partial_prefills is not None:
            assert st.num_partial_prefills > 0

    return Scenario(f"chunked prefill, budget {budget}, {num_others} others (seed {seed}, "
                    f"{_mode(eager)})", ov,
                    random_others(num_others, vocab_size, seed), seed, check=check)


def prefix_cache_scenario(vocab_size: int, targets: Sequence[Request], num_others: int,
                          seed: int, *, block_size: int, eager: bool = True,
                          **overrides) -> Scenario:
    """The targets submitted twice: first (with others sharing their prefixes) in a warm-up call,
    then again, measured, among others that share long prefixes with them, on the same engine:
    every target with a full block before its last token is served from the prefix cache. The
    check: each such target reports cached prompt tokens, and the scheduler counted hits."""
    ov = dict(enable_prefix_caching=True, enforce_eager=eager)
    ov.update(overrides)
    prefixes = [r.prompt for r in targets]
    warmup = list(targets) + random_others(num_others, vocab_size, seed + 1000,
                                           prefixes=prefixes, prefix_share=0.5)
    others = random_others(num_others, vocab_size, seed, prefixes=prefixes, prefix_share=0.7)

    def check(got: BatchResults, targets):
        eligible = [t for t, r in enumerate(got) if (r.prompt_len - 1) // block_size > 0]
        assert eligible, "no target is long enough for a prefix-cache hit"
        missed = [t for t in eligible if got[t].num_cached_tokens == 0]
        assert not missed, f"targets {missed} were not served from the prefix cache"
        if got.stats.num_prefix_hit_tokens is not None:
            assert got.stats.num_prefix_hit_tokens > 0

    return Scenario(f"prefix cache, {num_others} others (seed {seed}, {_mode(eager)})", ov,
                    others, seed, warmup=warmup, check=check)


def kv_pressure_scenario(vocab_size: int, num_blocks: int, num_others: int, seed: int, *,
                         eager: bool = True, enable_prefix_caching: bool = True,
                         **overrides) -> Scenario:
    """A KV cache of ``num_blocks`` blocks, far less than the batch needs: running sequences are
    preempted (their blocks freed) and recomputed later (from their prefix-cache blocks where
    those survived). The check: preemptions happened, and at least one target was preempted."""
    ov = dict(num_kvcache_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching,
              enforce_eager=eager)
    ov.update(overrides)

    def check(got: BatchResults, targets):
        st = got.stats
        if st.num_preemptions is not None:
            assert st.num_preemptions > 0, f"no preemption with {num_blocks} KV blocks"
        assert st.preempted_targets, f"no target was preempted with {num_blocks} KV blocks"

    cache = "prefix cache" if enable_prefix_caching else "no prefix cache"
    return Scenario(f"KV pressure, {num_blocks} blocks, {cache}, {num_others} others "
                    f"(seed {seed}, {_mode(eager)})", ov,
                    random_others(num_others, vocab_size, seed), seed, check=check)


# ---- comparison ---------------------------------------------------------------------------------

def _bits(x: float | None):
    """A float's exact bits (so -0.0 != 0.0 and a NaN equals only the same NaN)."""
    return None if x is None else struct.unpack("<Q", struct.pack("<d", x))[0]


def _show(x: float | None) -> str:
    if x is None:
        return "None"
    if math.isnan(x):
        return f"nan ({_bits(x):#018x})"
    return f"{x!r} ({x.hex()})"


def step_difference(a: Step, b: Step) -> str | None:
    """What differs between two steps (None: bit-identical)."""
    if a.token_id != b.token_id:
        return f"token {a.token_id} vs {b.token_id}"
    if _bits(a.logprob) != _bits(b.logprob):
        return f"logprob of token {a.token_id}: {_show(a.logprob)} vs {_show(b.logprob)}"
    if a.rank != b.rank:
        return f"rank of token {a.token_id}: {a.rank} vs {b.rank}"
    if len(a.top) != len(b.top):
        return f"top-N has {len(a.top)} vs {len(b.top)} entries"
    for j, ((ia, va), (ib, vb)) in enumerate(zip(a.top, b.top)):
        if ia != ib:
            return f"top-{j + 1} token {ia} vs {ib}"
        if _bits(va) != _bits(vb):
            return f"top-{j + 1} (token {ia}) logprob {_show(va)} vs {_show(vb)}"
    return None


def result_difference(a: Result, b: Result) -> tuple[int, str] | None:
    """The first difference between two results of one prompt: (step, what), or None. Step -1:
    the results differ as a whole (prompt length, number of tokens, finish reason)."""
    if a.prompt_len != b.prompt_len:
        return -1, f"prompt length {a.prompt_len} vs {b.prompt_len}"
    for k, (sa, sb) in enumerate(zip(a.steps, b.steps)):
        d = step_difference(sa, sb)
        if d is not None:
            return k, d
    if len(a.steps) != len(b.steps):
        return min(len(a.steps), len(b.steps)), (f"{len(a.steps)} vs {len(b.steps)} generated "
                                                 "tokens")
    if a.finish_reason != b.finish_reason:
        return -1, f"finish reason {a.finish_reason!r} vs {b.finish_reason!r}"
    return None


def differences(alone: Sequence[Result], other: Sequence[Result]) -> list[tuple[int, int, str]]:
    """(prompt index, first differing step, what) for every prompt that differs."""
    assert len(alone) == len(other), f"{len(alone)} vs {len(other)} results"
    out = []
    for i, (a, b) in enumerate(zip(alone, other)):
        d = result_difference(a, b)
        if d is not None:
            out.append((i, *d))
    return out


def assert_identical(alone: Sequence[Result], other: Sequence[Result], what: str) -> None:
    """Every token and every logprob (the token's, its rank, the top-N ids and values) of every
    prompt bit-identical; else an AssertionError naming, per differing prompt, the first
    differing step and both values (alone first). Refuses to compare nothing: the results must
    be non-empty and each must have generated a token."""
    assert len(alone) > 0, f"{what}: no results to compare"
    for i, r in enumerate(alone):
        assert r.steps, f"{what}: prompt {i} generated nothing alone"
    diffs = differences(alone, other)
    if diffs:
        lines = [f"  prompt {i} ({alone[i].prompt_len} prompt tokens), step {k}: {d} "
                 f"(alone vs {what})" for i, k, d in diffs[:12]]
        more = f"\n  ... and {len(diffs) - 12} more" if len(diffs) > 12 else ""
        raise AssertionError(f"{what}: {len(diffs)} of {len(alone)} prompts differ from their "
                             f"run alone:\n" + "\n".join(lines) + more)


def assert_comparable(results: Sequence[Result], targets: Sequence[Request]) -> None:
    """The results carry what the comparison needs: each target made its max_tokens tokens, with
    a logprob entry and the top-N per token when it asked for logprobs."""
    assert len(results) == len(targets)
    for i, (r, t) in enumerate(zip(results, targets)):
        assert len(r.steps) == t.params.max_tokens, f"prompt {i}: {len(r.steps)} tokens"
        if t.params.logprobs is not None:
            for s in r.steps:
                assert s.logprob is not None and len(s.top) == t.params.logprobs, f"prompt {i}"


def perturbed(results: Sequence[Result], prompt: int, step: int,
              kind: str = "logprob") -> list[Result]:
    """A copy of ``results`` with one value changed by the least amount: the logprob of
    (``prompt``, ``step``) one ulp away (``kind="logprob"``), its last top-N value one ulp away
    ("top"), or its token id + 1 ("token"). For checking that a comparison catches it."""
    out = list(results)
    r = out[prompt]
    steps = list(r.steps)
    s = steps[step]
    if kind == "logprob":
        s = Step(s.token_id, math.nextafter(s.logprob, -math.inf), s.rank, s.top)
    elif kind == "top":
        (i, v) = s.top[-1]
        s = Step(s.token_id, s.logprob, s.rank, s.top[:-1] + ((i, math.nextafter(v, 0.0)),))
    elif kind == "token":
        s = Step(s.token_id + 1, s.logprob, s.rank, s.top)
    else:
        raise ValueError(kind)
    steps[step] = s
    out[prompt] = Result(r.prompt_len, tuple(steps), r.finish_reason, r.num_cached_tokens)
    return out
