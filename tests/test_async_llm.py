"""The online engine (AsyncLLM) on CPU with the demo checkpoint: concurrent generate_async streams
equal the offline LLM.generate (greedy); a request added while another runs joins the batch;
abort_request, leaving the `async for` and cancelling the task free the request's KV blocks;
add_request rejects bad requests at once; a request's outputs read after it finished are whole;
a failure inside one request fails only that one;
deltas carry logprobs; shutdown returns in bounded time, draining or aborting what is in flight.

Each test drives its own event loop with asyncio.run, under a wait_for bound.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from qwen3_model import LLM, SamplingParams
from qwen3_model.engine.async_llm import AsyncLLM
from qwen3_model.engine.detokenizer import Detokenizer
from qwen3_model.random_checkpoint import write_random_checkpoint
from tests.helpers import one_thread  # noqa: F401  (autouse: one intra-op thread)

BS = 16  # KV block size
ENGINE = dict(device="cpu", kvcache_block_size=BS, max_model_len=1024, num_kvcache_blocks=192,
              max_num_seqs=16)
BOUND_S = 60  # no test's event loop runs longer than this


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("async_ckpt")
    write_random_checkpoint(path, "demo")  # 4 layers, hidden 128, vocab 512, char tokenizer
    return str(path)


@pytest.fixture(scope="module")
def ref(ckpt):
    return LLM(ckpt, **ENGINE)


@pytest.fixture(scope="module")
def engine(ckpt):
    eng = AsyncLLM(ckpt, **ENGINE)
    yield eng
    eng.shutdown()


def run(coro, timeout=BOUND_S):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def collect(engine, prompt, params, request_id=None):
    """-> the deltas of one request, in order."""
    return [d async for d in engine.generate_async(prompt, params, request_id=request_id)]


async def until(predicate, timeout, what):
    """Poll (yielding to the event loop) until ``predicate()``; AssertionError after timeout."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        await asyncio.sleep(0.01)


def idle(engine):
    s = engine.stats()
    return s["kv_blocks_used"] == 0 and s["running"] == 0 and s["waiting"] == 0


def joined(deltas):
    """(token ids, text, finish_reason) of a whole stream; checks the last delta ends it."""
    assert deltas and deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert all(d.index == 0 for d in deltas)
    return ([t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas),
            deltas[-1].finish_reason)


PROMPTS = ["Hello, my name is", "The capital of France", [5, 6, 7, 8, 9, 10], "a",
           "Once upon a time, in a land far away, there lived", [40, 41] * 20, "xyz", "0123456789"]


def test_concurrent_streams_equal_offline_generate(engine, ref):
    params = [SamplingParams(temperature=0, max_tokens=4 + 5 * i, ignore_eos=i % 2 == 1)
              for i in range(len(PROMPTS))]
    want = ref.generate(PROMPTS, params, use_tqdm=False)

    async def main():
        return await asyncio.gather(*(collect(engine, p, sp) for p, sp in zip(PROMPTS, params)))

    got = run(main())
    for i, (deltas, w) in enumerate(zip(got, want)):
        ids, text, reason = joined(deltas)
        assert ids == w.token_ids, f"request {i}"
        assert text == w.text and reason == w.finish_reason, f"request {i}"
    assert idle(engine)


def test_a_request_added_while_another_runs_joins_the_batch(engine, ref):
    long_p = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    short_p = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want_long, want_short = ref.generate(["long one", "short one"], [long_p, short_p],
                                         use_tqdm=False)
    order = []

    async def consume(name, prompt, sp, started=None):
        deltas = []
        async for d in engine.generate_async(prompt, sp):
            deltas.append(d)
            if started is not None and not started.is_set():
                started.set()
        order.append(name)
        return deltas

    async def main():
        started = asyncio.Event()
        long_task = asyncio.create_task(consume("long", "long one", long_p, started))
        await started.wait()  # the long request has produced its first token
        assert engine.stats()["running"] == 1
        short = await consume("short", "short one", short_p)
        assert engine.stats()["running"] == 1  # the long one is still going
        return await long_task, short

    long_d, short_d = run(main())
    assert order == ["short", "long"]
    assert joined(long_d)[0] == want_long.token_ids and joined(short_d)[0] == want_short.token_ids
    assert len(long_d) > 100  # it streamed token by token, not in one piece


def test_outputs_read_after_the_request_finished(engine, ref):
    """A server queues a request, then starts its stream: a short request may end in between.
    Its reader still gets every delta; each request has one reader; an unread finished request
    keeps its id until it is read."""
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    want = ref.generate(["late reader"], sp, use_tqdm=False)[0]

    async def main():
        rid = engine.add_request("late reader", sp)
        await until(lambda: engine.stats()["requests"] == 0, 30, "the request finishing")
        with pytest.raises(ValueError, match="already running or its outputs are unread"):
            engine.add_request("again", sp, request_id=rid)
        deltas = [d async for d in engine.outputs(rid)]
        with pytest.raises(ValueError, match="another caller reads them"):
            async for _ in engine.outputs(rid):
                pass
        return deltas

    assert joined(run(main()))[0] == want.token_ids
    rid = engine.add_request("late reader", sp)  # outside an event loop: the blocking reader
    deadline = time.monotonic() + 30
    while engine.stats()["requests"]:
        assert time.monotonic() < deadline, "the request did not finish"
        time.sleep(0.01)
    assert joined(list(engine.iter_outputs(rid, timeout=30)))[0] == want.token_ids
    with pytest.raises(ValueError, match="added from an event loop"):
        run(engine.outputs(rid).__anext__())
    assert idle(engine) and not engine._unclaimed


def test_an_unread_aborted_request_is_forgotten(engine):
    """abort_request(unread=True): a request nobody will read (a client gone before its stream
    started) leaves nothing behind, running or done, and its id is free at once; a request
    someone reads is aborted as usual and its reader gets the last delta."""
    sp = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)

    async def main():
        running = engine.add_request("nobody reads me", sp, request_id="unread-1")
        engine.abort_request(running, unread=True)  # before it finished
        done = engine.add_request("a", SamplingParams(max_tokens=1), request_id="unread-2")
        await until(lambda: engine.stats()["requests"] == 0, 30, "both ending")
        engine.abort_request(done, unread=True)  # after it finished
        await until(lambda: not engine._unclaimed, 5, "both forgotten")
        for rid in (running, done):  # free again
            engine.abort_request(engine.add_request("x", SamplingParams(max_tokens=1),
                                                    request_id=rid), unread=True)
        read = engine.add_request("someone reads me", sp, request_id="read")
        deltas = []
        async for d in engine.outputs(read):
            deltas.append(d)
            if len(deltas) == 2:
                engine.abort_request(read, unread=True)  # claimed: only the abort applies
        await until(lambda: idle(engine) and not engine._unclaimed, 5, "all done")
        return deltas

    deltas = run(main())
    assert deltas[-1].finish_reason == "abort" and len(deltas) < 100


def test_abort_request_frees_blocks_and_ends_the_stream(engine):
    sp = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)

    async def main():
        deltas = []
        async for d in engine.generate_async("abort me", sp, request_id="to-abort"):
            deltas.append(d)
            if len(deltas) == 3:
                assert engine.stats()["kv_blocks_used"] > 0
                engine.abort_request("to-abort")
        await until(lambda: idle(engine), 5, "KV blocks freed after abort_request")
        return deltas

    deltas = run(main())
    assert deltas[-1].finished and deltas[-1].finish_reason == "abort"
    assert 3 <= len(deltas) < 100  # ended soon after the abort, not at max_tokens
    engine.abort_request("to-abort")  # finished or unknown ids: ignored
    engine.abort_request("never-existed")


def test_leaving_the_loop_or_cancelling_aborts(engine):
    sp = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)

    async def break_out():
        n = 0
        async for _ in engine.generate_async("break out", sp):
            n += 1
            if n == 3:
                break
        await until(lambda: idle(engine), 5, "KV blocks freed after leaving the async for")

    async def cancel():
        got = asyncio.Event()

        async def consume():
            async for _ in engine.generate_async("cancel me", sp):
                got.set()

        task = asyncio.create_task(consume())
        await got.wait()
        assert engine.stats()["kv_blocks_used"] > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: idle(engine), 5, "KV blocks freed after cancelling the task")

    async def raise_inside():
        with pytest.raises(KeyError, match="consumer failed"):
            async for _ in engine.generate_async("raise inside", sp):
                raise KeyError("consumer failed")
        await until(lambda: idle(engine), 5, "KV blocks freed after the consumer raised")

    run(break_out())
    run(cancel())
    run(raise_inside())


def test_add_request_rejects_bad_requests_at_once(engine):
    sp = SamplingParams(temperature=0, max_tokens=4)
    bad = [
        ("a" * 1100, sp, "max_model_len"),  # 1100 tokens: longer than max_model_len
        ([1, 2, 512], sp, "vocabulary"),  # vocab is 512
        ([1, -1], sp, "vocabulary"),
        ("", sp, "empty"),
        (3.5, sp, "prompt"),
        ("hi", "not params", "SamplingParams"),
    ]
    for prompt, params, words in bad:
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=words):
            rid = engine.add_request(prompt, params)
            engine.abort_request(rid)  # (accepted: the test fails; do not leave it running)
        assert time.monotonic() - t0 < 2
    changed = SamplingParams(temperature=0)
    changed.top_p = 0  # a field changed after construction is caught too
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request("hi", changed)

    async def in_generate():
        with pytest.raises(ValueError, match="vocabulary"):
            async for _ in engine.generate_async([999], sp):
                pass

    run(in_generate())
    assert idle(engine) and engine.stats()["kv_blocks_total"] == 192


def test_a_failure_inside_one_request_fails_only_that_one(engine, ref, monkeypatch):
    poison = "poison pill"
    poison_ids = engine.tokenizer(poison)["input_ids"]
    real_step = Detokenizer.step

    def step(self, seq, state, want_text):
        if seq.token_ids[: seq.num_prompt_tokens] == poison_ids:
            raise RuntimeError("detokenizer exploded")
        return real_step(self, seq, state, want_text)

    monkeypatch.setattr(Detokenizer, "step", step)
    good = ["healthy one", "healthy two"]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = ref.generate(good, sp, use_tqdm=False)

    async def main():
        return await asyncio.gather(collect(engine, good[0], sp), collect(engine, poison, sp),
                                    collect(engine, good[1], sp), return_exceptions=True)

    first, failed, second = run(main())
    assert isinstance(failed, Exception) and "detokenizer exploded" in repr(failed) + repr(
        failed.__cause__), repr(failed)
    assert joined(first)[:2] == (want[0].token_ids, want[0].text)
    assert joined(second)[:2] == (want[1].token_ids, want[1].text)

    async def settle():
        await until(lambda: idle(engine), 5, "the failed request's blocks freed")

    run(settle())
    monkeypatch.undo()
    again = run(collect(engine, "after the failure", sp))  # the engine still serves
    assert joined(again)[0] == ref.generate(["after the failure"], sp,
                                            use_tqdm=False)[0].token_ids


def test_deltas_carry_logprobs(engine, ref):
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    want = ref.generate(["logprobs here"], sp, use_tqdm=False)[0]
    deltas = run(collect(engine, "logprobs here", sp))
    entries = []
    for d in deltas:
        assert d.logprobs is not None and len(d.logprobs) == len(d.token_ids)
        for tok, e in zip(d.token_ids, d.logprobs):
            assert e.token_id == tok
        entries += d.logprobs
    assert [e.token_id for e in entries] == want.token_ids
    for e, w in zip(entries, want.logprobs):
        assert e.rank == 1  # greedy picks the most likely
        assert len(e.top) == 3 and e.top[0][0] == e.token_id
        assert e.logprob <= 0 and e.logprob == pytest.approx(e.top[0][1], abs=1e-5)
        assert [lp for _, lp in e.top] == sorted((lp for _, lp in e.top), reverse=True)
        assert e.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [t for t, _ in e.top] == [t for t, _ in w.top]
    # not asked: None
    plain = run(collect(engine, "no logprobs", SamplingParams(temperature=0, max_tokens=3)))
    assert all(d.logprobs is None for d in plain)


def test_shutdown_drains_or_aborts_in_bounded_time(ckpt):
    """drain_timeout lets a short request finish; a long one is aborted when it runs out."""
    eng = AsyncLLM(ckpt, **ENGINE)
    try:
        short = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        long_p = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)

        async def main():
            started = asyncio.Event()

            async def consume(prompt, sp):
                deltas = []
                try:
                    async for d in eng.generate_async(prompt, sp):
                        deltas.append(d)
                        started.set()
                except Exception as e:  # noqa: BLE001 - an aborted stream may end by raising
                    deltas.append(e)
                return deltas

            tasks = [asyncio.create_task(consume("short", short)),
                     asyncio.create_task(consume("long", long_p))]
            await started.wait()
            t0 = time.monotonic()
            await asyncio.to_thread(eng.shutdown, 1.0)
            took = time.monotonic() - t0
            return await asyncio.wait_for(asyncio.gather(*tasks), 5), took

        (short_d, long_d), took = run(main())
        assert took < 10, f"shutdown(drain_timeout=1) took {took:.1f} s"
        assert joined(short_d)[2] == "length"  # finished within the drain time
        last = long_d[-1]
        assert isinstance(last, Exception) or (last.finished and last.finish_reason == "abort"), (
            last)
        assert sum(len(d.token_ids) for d in long_d if not isinstance(d, Exception)) < 1000
        with pytest.raises(Exception):  # no longer admitting
            eng.add_request("after shutdown", short)
    finally:
        eng.shutdown()  # a second call is harmless
