"""A tensor-parallel worker that is alive but stuck (SIGSTOP) on CPU (gloo, TP 2): rank 0 raises a
RuntimeError naming the rank within tp_step_timeout + a few s and no process is left; Ctrl-C on
rank 0 ends it promptly while the worker is stuck; the online engine fails its requests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from qwen3_model import LLM, SamplingParams
from tests.helpers import sigint_as_a_terminal_sends_it
from tests.qwen3_tiny import make_tiny_qwen3
from tests.test_engine_tp import LONG, PROMPTS, assert_no_process_left, running

TIMEOUT_S = 2.0  # tp_step_timeout of these tests
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KW = dict(tensor_parallel_size=2, kvcache_block_size=16, max_num_seqs=4,
          max_num_batched_tokens=24, device="cpu")
# long enough that the stop lands mid-generation
VERY_LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_stuck")
    make_tiny_qwen3(path, "tied_gqa2")
    return str(path)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class SafetyKill:
    """A test must not hang: if the engine has not dealt with the stopped worker after
    ``seconds``, SIGKILL it (the test then fails on its message or its time)."""

    def __init__(self, pid: int, seconds: float):
        self.pid = pid
        self.timer = threading.Timer(seconds, self.kill)
        self.timer.daemon = True
        self.timer.start()

    def kill(self):
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __exit__(self, *exc):
        self.timer.cancel()
        self.kill()

    def __enter__(self):
        return self


def test_tp_step_timeout_is_an_llm_argument(ckpt):
    with pytest.raises(ValueError, match="tp_step_timeout"):
        LLM(ckpt, tp_step_timeout=0, **KW)
    with pytest.raises(ValueError, match="tp_step_timeout"):
        LLM(ckpt, tp_step_timeout=float("inf"), **KW)
    assert not torch.distributed.is_initialized()


def test_stopped_worker_mid_generate_raises_naming_rank_1(ckpt):
    llm = LLM(ckpt, tp_step_timeout=TIMEOUT_S, **KW)
    pids = [proc.pid for proc, _ in llm._workers]
    steps, stopped_at = 0, None
    with SafetyKill(pids[0], 40):
        with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) did not answer for "
                                               r"2 s") as info:
            for _ in llm.stream(PROMPTS, VERY_LONG):
                steps += 1
                if steps == 3:
                    os.kill(pids[0], signal.SIGSTOP)
                    stopped_at = time.monotonic()
        took = time.monotonic() - stopped_at
    print(info.value, f"({took:.1f} s after the stop)")
    # its last heartbeat (every min(0.5, timeout / 4) s) came up to a beat before the stop
    assert TIMEOUT_S - 0.6 <= took < TIMEOUT_S + 4
    assert "stopped" in str(info.value)
    assert_no_process_left(pids)
    with pytest.raises(RuntimeError, match="make a new LLM"):
        llm.generate(PROMPTS, use_tqdm=False)
    llm.close()


def test_stopped_idle_worker_fails_the_next_step(ckpt):
    """A worker stopped between generate calls: the next generate raises naming it."""
    llm = LLM(ckpt, tp_step_timeout=TIMEOUT_S, **KW)
    pids = [proc.pid for proc, _ in llm._workers]
    with SafetyKill(pids[0], 40):
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        os.kill(pids[0], signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) did not answer"):
            llm.generate(PROMPTS, LONG, use_tqdm=False)
        assert time.monotonic() - t0 < TIMEOUT_S + 4
    assert_no_process_left(pids)


def test_a_slow_healthy_step_is_not_a_stuck_worker(ckpt):
    """The bound is on the worker's answer, not on the step: rank 0 may take longer than
    tp_step_timeout inside a step (here its forward sleeps) while the worker waits alive."""
    llm = LLM(ckpt, tp_step_timeout=1.0, **KW)
    runner = llm.model_runner
    forward, calls = runner.forward_plan, []

    def slow(plan):
        calls.append(1)
        if len(calls) == 2:
            time.sleep(3)  # the worker sits in the step's first collective meanwhile
        return forward(plan)

    runner.forward_plan = slow
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert [len(o.token_ids) for o in outs] == [4, 4, 4]
    finally:
        llm.close()


_SIGINT_SCRIPT = """
import os, signal, sys, time
from qwen3_model import LLM, SamplingParams
from tests.test_tp_stuck_worker import KW, PROMPTS, VERY_LONG
if __name__ == "__main__":
    import torch
    torch.set_num_threads(1)
    # tp_step_timeout far above the test's bound: Ctrl-C must not wait for it
    llm = LLM(sys.argv[1], tp_step_timeout=300, **KW)
    pids = [proc.pid for proc, _ in llm._workers]
    print("PIDS", *pids, flush=True)
    try:
        for i, _ in enumerate(llm.stream(PROMPTS, VERY_LONG)):
            if i == 2:
                os.kill(pids[0], signal.SIGSTOP)
                print("STOPPED", flush=True)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
        sys.exit(130)
    print("FINISHED", flush=True)
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_ctrl_c_on_rank0_while_a_worker_is_stopped(ckpt):
    """SIGINT to rank 0 (a subprocess) while its worker is stopped mid-step: KeyboardInterrupt
    within a few s, and no process is left (the stopped worker is killed)."""
    proc = subprocess.Popen([sys.executable, "-c", _SIGINT_SCRIPT, ckpt], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_as_a_terminal_sends_it)
    pids = []
    try:
        line = proc.stdout.readline()  # PIDS ...
        assert line.startswith("PIDS"), line + proc.stderr.read()
        pids = [int(p) for p in line.split()[1:]]
        assert proc.stdout.readline().strip() == "STOPPED"
        time.sleep(1.0)  # rank 0 is now blocked in the step the worker does not answer
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        for p in [proc.pid, *pids]:
            if running(p):
                os.kill(p, signal.SIGKILL)
        proc.wait(timeout=10)
    assert "INTERRUPTED" in out, out + err[-3000:]
    assert proc.returncode == 130 and took < 10, (took, err[-3000:])
    deadline = time.monotonic() + 5
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if running(p)], "a worker outlived rank 0"


def test_online_engine_fails_its_requests_when_a_worker_stops(ckpt):
    import asyncio

    from qwen3_model.engine.async_llm import AsyncLLM, EngineStopped

    engine = AsyncLLM(ckpt, tp_step_timeout=TIMEOUT_S, **KW)
    pids = [proc.pid for proc, _ in engine.engine._workers]
    got = []

    async def one(prompt):
        async for d in engine.generate_async(prompt, VERY_LONG):
            got.append(d)
            if len(got) == 3:
                os.kill(pids[0], signal.SIGSTOP)

    async def main():
        return await asyncio.wait_for(
            asyncio.gather(*[one(p) for p in PROMPTS], return_exceptions=True), timeout=30)

    try:
        with SafetyKill(pids[0], 40):
            t0 = time.monotonic()
            results = asyncio.run(main())
            assert time.monotonic() - t0 < TIMEOUT_S + 10
        assert all(isinstance(r, EngineStopped) for r in results), results
        assert all("worker rank 1" in str(r) and "did not answer" in str(r) for r in results)
        assert not engine.is_running
        with pytest.raises(EngineStopped):
            engine.add_request(PROMPTS[0], LONG)
    finally:
        engine.shutdown()
    assert_no_process_left(pids)
