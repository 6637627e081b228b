"""The engine at tensor_parallel_size=2 on CPU (gloo, one spawned worker process): greedy output
equals transformers' greedy generate, through chunked prefill and prefix-cache hits; and the
workers' lifecycle: close(), a killed worker, a worker that raises, KeyboardInterrupt on rank 0
all leave no process behind, and a dead worker is named in a RuntimeError."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time

import pytest
import torch

from qwen3_model import LLM, SamplingParams
from tests.qwen3_tiny import make_tiny_qwen3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_tied_gqa2")
    cfg, hf = make_tiny_qwen3(path, "tied_gqa2", return_model=True)
    return str(path), cfg, hf


def hf_greedy(hf, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_llm(path, device="cpu"):
    return LLM(path, tensor_parallel_size=2, kvcache_block_size=16, max_num_seqs=4,
               max_num_batched_tokens=24, device=device)


def worker_pids(llm):
    return [proc.pid for proc, _ in llm._workers]


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def assert_no_process_left(pids):
    """Every worker pid gone (reaped, not a zombie) and no multiprocessing child left."""
    assert pids, "the test expected worker processes"
    assert not [p for p in pids if pid_alive(p)]
    assert multiprocessing.active_children() == []
    assert not torch.distributed.is_initialized()


PROMPTS = [[5, 9, 2, 7, 1, 3], [4, 4, 8], [11, 2, 3, 5, 7, 13, 17, 19, 23, 29]]
LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def test_tp2_greedy_matches_transformers(ckpt):
    path, cfg, hf = ckpt
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(path, tensor_parallel_size=2, kvcache_block_size=16, max_num_seqs=4,
              max_num_batched_tokens=24, device="cpu")
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
                   for n in (1, 16, 40, 7)]
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        for _ in range(2):  # the second pass hits the prefix cache
            outs = llm.generate(prompts, sp, use_tqdm=False)
            for p, o in zip(prompts, outs):
                assert o.token_ids == hf_greedy(hf, p, 8)
        assert llm.scheduler.num_partial_prefills > 0 and llm.scheduler.num_prefix_hit_tokens > 0
        attn = llm.model_runner.model.model.layers[0].self_attn.attn
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)  # half the heads on this rank
    finally:
        llm.close()
        torch.set_num_threads(threads)
    assert not torch.distributed.is_initialized()


def test_tp_that_does_not_divide_the_heads_fails_clearly(ckpt):
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size"):
        LLM(ckpt[0], tensor_parallel_size=3, kvcache_block_size=16, max_num_seqs=4,
            max_num_batched_tokens=24, device="cpu")
    assert not torch.distributed.is_initialized()


def test_close_after_a_run_leaves_no_process(ckpt, one_thread):
    llm = make_llm(ckpt[0])
    pids = worker_pids(llm)
    assert all(pid_alive(p) for p in pids)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    t0 = time.monotonic()
    llm.close()
    assert time.monotonic() - t0 < 10  # the worker left on "exit", it was not waited out
    assert_no_process_left(pids)
    llm.close()  # idempotent
    with pytest.raises(RuntimeError, match="close"):
        llm.generate(PROMPTS, use_tqdm=False)


def test_garbage_collection_stops_the_workers(ckpt, one_thread):
    import gc

    llm = make_llm(ckpt[0])
    pids = worker_pids(llm)
    del llm
    gc.collect()
    assert_no_process_left(pids)


def test_killed_worker_raises_and_leaves_no_process(ckpt, one_thread):
    llm = make_llm(ckpt[0])
    pids = worker_pids(llm)
    steps = 0
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) died with exit code -9 "
                                           r"\(signal SIGKILL\)"):
        for _ in llm.stream(PROMPTS, LONG):  # 40 decode steps: the kill lands mid-generation
            steps += 1
            if steps == 3:
                os.kill(pids[0], signal.SIGKILL)
    assert time.monotonic() - t0 < 20
    assert 3 <= steps < 40
    assert_no_process_left(pids)
    with pytest.raises(RuntimeError, match="make a new LLM"):  # the engine refuses more steps
        llm.generate(PROMPTS, use_tqdm=False)
    llm.close()  # harmless afterwards


def test_worker_exception_surfaces_and_leaves_no_process(ckpt, one_thread):
    llm = make_llm(ckpt[0])
    pids = worker_pids(llm)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    # a step the worker cannot run: it raises inside its loop while rank 0 runs the real step
    llm.model_runner.worker_conns[0].send(("run", None))
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) died with exit code 1: "
                                           r"AttributeError"):
        llm.generate(PROMPTS, LONG, use_tqdm=False)
    assert_no_process_left(pids)
    llm.close()


def test_keyboard_interrupt_on_rank0_stops_the_workers(ckpt, one_thread):
    llm = make_llm(ckpt[0])
    pids = worker_pids(llm)
    runner = llm.model_runner
    forward, calls = runner.forward_plan, []

    def interrupted(plan):  # Ctrl-C lands in rank 0's forward while the worker is in the step
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return forward(plan)

    runner.forward_plan = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, LONG, use_tqdm=False)
    assert_no_process_left(pids)
    llm.close()


def native_stacks_later(seconds: float) -> None:
    """After ``seconds``, print this process's native stacks (py-spy --native, else gdb) if it is
    still running: faulthandler shows Python frames only, and a hang in a collective sits in NCCL
    or CUDA calls. For the GPU kill test's child process; prints nothing where no tool exists."""
    import ctypes
    import shutil
    import subprocess
    import threading

    try:  # PR_SET_PTRACER, PR_SET_PTRACER_ANY: let the tool (our child) attach under Yama
        ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)
    except (OSError, AttributeError):
        pass

    def dump():
        time.sleep(seconds)
        pid = str(os.getpid())
        for cmd in (["py-spy", "dump", "--native", "--pid", pid],
                    ["gdb", "-p", pid, "-batch", "-ex", "thread apply all bt 30"]):
            if shutil.which(cmd[0]):
                try:
                    out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
                    print("NATIVE STACKS", " ".join(cmd), "\n", out.stdout[-30000:],
                          out.stderr[-3000:], flush=True)
                except subprocess.TimeoutExpired:
                    print("NATIVE STACKS: timed out", cmd[0], flush=True)
                return
        print("NATIVE STACKS: neither py-spy nor gdb here", flush=True)

    threading.Thread(target=dump, daemon=True, name="native-stacks").start()


# The same kill on two GPUs (NCCL), in a child process: a hang there must fail this test after
# its timeout, not take the pytest process down with it. A hung child prints every thread's stack
# (faulthandler) before it is ended, so the failure shows where it hung.
_KILL_SCRIPT = """
import faulthandler, json, os, signal, sys
from tests.test_engine_tp import native_stacks_later
native_stacks_later(50)
faulthandler.dump_traceback_later(75, exit=True)
from qwen3_model import LLM, SamplingParams
from tests.test_engine_tp import PROMPTS, LONG
if __name__ == "__main__":
    # argv: checkpoint [, JSON of LLM arguments to override [, the streamed item to kill at]]
    kwargs = dict(gpu_memory_utilization=0.3, **json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}"))
    kill_at = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    llm = LLM(sys.argv[1], tensor_parallel_size=2, kvcache_block_size=16, max_num_seqs=4,
              max_num_batched_tokens=24, device="cuda", **kwargs)
    pids = [proc.pid for proc, _ in llm._workers]
    print("PIDS", *pids, flush=True)
    print("GRAPHS", len(llm.model_runner.graphs), flush=True)
    try:
        for i, _ in enumerate(llm.stream(PROMPTS, LONG)):
            if i == kill_at:
                os.kill(pids[0], signal.SIGKILL)
                print("KILLED", flush=True)
    except RuntimeError as e:
        print("RAISED", e, flush=True)
    faulthandler.cancel_dump_traceback_later()
"""


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    """bf16 with head_dim 128: the engine runs our kernels and replays decode from CUDA graphs
    (NCCL inside the graphs). The fp32 ``ckpt`` runs eagerly on the reference attention, whose
    host syncs sit inside the forward."""
    path = tmp_path_factory.mktemp("tp_bf16_hd128")
    make_tiny_qwen3(path, dict(vocab_size=512, hidden_size=256, intermediate_size=512,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=128), dtype=torch.bfloat16)
    return str(path)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("which,allreduce", [("fp32_eager", "nccl"), ("bf16_graphs", "nccl"),
                                             ("fp32_eager", "custom"), ("bf16_graphs", "custom")])
def test_killed_worker_on_two_gpus_raises_and_leaves_no_process(which, allreduce, request):
    """On two GPUs, with NCCL's all-reduce and with ours (tp_all_reduce='custom', whose kernel
    the engine's abort word releases). ("fp32_eager": the tiny fp32 checkpoint, which the engine
    runs in bf16 with the reference attention, eagerly.)"""
    import subprocess
    import sys

    path = request.getfixturevalue("ckpt")[0] if which == "fp32_eager" else request.getfixturevalue("bf16_ckpt")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    t0 = time.monotonic()
    args = json.dumps(dict(tp_all_reduce=allreduce))
    out = subprocess.run([sys.executable, "-c", _KILL_SCRIPT, path, args], cwd=root, timeout=150,
                         capture_output=True, text=True)
    print(out.stdout, out.stderr[-6000:])
    pids = [int(p) for p in out.stdout.split("PIDS", 1)[1].split("\n", 1)[0].split()]
    if which == "bf16_graphs":
        assert "GRAPHS 0" not in out.stdout, "the bf16 engine did not capture graphs"
    assert "RAISED LLM: tensor-parallel worker rank 1" in out.stdout
    assert out.returncode == 0 and time.monotonic() - t0 < 120
    time.sleep(1)
    assert not [p for p in pids if pid_alive(p)]


_ORPHAN_SCRIPT = """
import os, signal, sys
from tests.test_engine_tp import PROMPTS, LONG, make_llm
if __name__ == "__main__":
    llm = make_llm(sys.argv[1], "cpu")
    print("PIDS", *[proc.pid for proc, _ in llm._workers], flush=True)
    for i, _ in enumerate(llm.stream(PROMPTS, LONG)):
        if i == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # rank 0 dies mid-generation, no cleanup at all
"""


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whatever reaps it in a container)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_killed_rank0_leaves_no_worker_behind(ckpt):
    """SIGKILL on rank 0 mid-generation: no worker outlives it. On CPU the closed pipe or gloo's
    "connection closed" ends the worker; a worker stuck in an NCCL collective is ended by the
    orphan watch (workers._watch_rank0)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _ORPHAN_SCRIPT, ckpt[0]], cwd=root, timeout=120,
                         capture_output=True, text=True)
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    pids = [int(p) for p in out.stdout.split("PIDS", 1)[1].split("\n", 1)[0].split()]
    deadline = time.monotonic() + 10
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if running(p)], "a worker outlived its killed rank 0"


def test_rank0_wait_polls_the_workers_and_returns_or_raises():
    """Rank 0 on CUDA waits for a step's tokens by polling (ModelRunner._wait_watched): it returns
    when the step's event completes, and raises as soon as the watch finds a dead worker (a
    blocking synchronize would wait forever on an NCCL collective missing its peer)."""
    import types

    from qwen3_model.engine.model_runner import ModelRunner

    class Event:
        def __init__(self, done_after):
            self.left = done_after

        def query(self):
            self.left -= 1
            return self.left < 0

    watched = []
    ModelRunner._wait_watched(types.SimpleNamespace(tp_watch=lambda: watched.append(1)), Event(50))
    assert watched  # the watch ran while it waited

    def dies():
        watched.append(1)
        if len(watched) > 3:
            raise RuntimeError("LLM: tensor-parallel worker rank 1 died")

    watched.clear()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1 died"):
        ModelRunner._wait_watched(types.SimpleNamespace(tp_watch=dies), Event(10**12))
    assert time.monotonic() - t0 < 5


def test_online_engine_at_tp2_serves_concurrent_requests_as_transformers(ckpt, one_thread):
    """AsyncLLM over TP 2: rank 0's loop thread drives the worker; requests arriving at once
    and one aborted midway; greedy tokens equal transformers', the aborted one's blocks freed,
    and shutdown leaves no process."""
    import asyncio

    from qwen3_model.engine.async_llm import AsyncLLM

    path, cfg, hf = ckpt
    engine = AsyncLLM(path, tensor_parallel_size=2, kvcache_block_size=16, max_num_seqs=4,
                      max_num_batched_tokens=24, device="cpu")
    pids = worker_pids(engine.engine)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def one(prompt):
        return [t async for d in engine.generate_async(prompt, sp) for t in d.token_ids]

    async def aborted():
        rid = engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=500,
                                                            ignore_eos=True))
        async for d in engine.outputs(rid):
            if d.token_ids:
                engine.abort_request(rid)
            if d.finished:
                return d.finish_reason

    async def main():
        return await asyncio.wait_for(
            asyncio.gather(aborted(), *[one(p) for p in PROMPTS]), timeout=120)

    try:
        reason, *outs = asyncio.run(main())
        assert reason == "abort"
        for p, toks in zip(PROMPTS, outs):
            assert toks == hf_greedy(hf, p, 8)
        assert engine.stats()["kv_blocks_used"] == 0
    finally:
        engine.shutdown()
    assert_no_process_left(pids)


# The kill test's script with the worker stopped instead (alive but stuck): the engine's watch
# finds its heartbeat stopped after tp_step_timeout, SIGKILLs it and aborts NCCL.
_STOP_SCRIPT = _KILL_SCRIPT.replace("signal.SIGKILL", "signal.SIGSTOP")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("which,allreduce", [("fp32_eager", "nccl"), ("bf16_graphs", "custom")])
def test_stopped_worker_on_two_gpus_raises_and_leaves_no_process(which, allreduce, request):
    """SIGSTOP on rank 1 mid-generation on two GPUs: rank 0 raises naming it as not answering
    within tp_step_timeout (3 s here) + a few s, and no process is left."""
    import subprocess
    import sys

    path = (request.getfixturevalue("ckpt")[0] if which == "fp32_eager"
            else request.getfixturevalue("bf16_ckpt"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = json.dumps(dict(tp_all_reduce=allreduce, tp_step_timeout=3))
    proc = subprocess.Popen([sys.executable, "-c", _STOP_SCRIPT, path, args], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = []
    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), line + proc.stderr.read()[-6000:]
        pids = [int(p) for p in line.split()[1:]]
        t0 = None
        for line in proc.stdout:
            if line.startswith("KILLED"):  # (the script's word; here: stopped)
                t0 = time.monotonic()
                break
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        for p in pids:  # a stopped worker must not outlive a failed test
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    print(out, err[-6000:])
    assert "RAISED LLM: tensor-parallel worker rank 1" in out and "did not answer for 3 s" in out
    assert proc.returncode == 0 and took < 3 + 10, took
    time.sleep(1)
    assert not [p for p in pids if pid_alive(p)]


def test_a_single_gpu_llm_beside_an_open_tp_llm_fails_clearly(ckpt, one_thread):
    """Its layers would shard over the open group and wait for peers forever: refused instead."""
    llm = make_llm(ckpt[0])
    try:
        with pytest.raises(RuntimeError, match="tensor-parallel LLM still open"):
            LLM(ckpt[0], kvcache_block_size=16, max_num_seqs=4, max_num_batched_tokens=24,
                device="cpu")
    finally:
        llm.close()
    assert not torch.distributed.is_initialized()
    LLM(ckpt[0], kvcache_block_size=16, max_num_seqs=4, max_num_batched_tokens=24, device="cpu")
