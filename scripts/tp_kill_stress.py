"""The two-GPU kill test, many times at once: how often does a killed worker still hang the engine?

    python scripts/tp_kill_stress.py                          # 2 waves of nccl,custom x 2 at once
    python scripts/tp_kill_stress.py --modes nccl --waves 3 --kill-at 1,2,5

Each run is the child script of tests/test_engine_tp.py (test_killed_worker_on_two_gpus_...):
an LLM at tensor_parallel_size=2 on the bf16 head_dim-128 tiny checkpoint (CUDA graphs, our
kernels), streaming, whose worker gets SIGKILL at the given streamed item. A run passes when the
engine raised the error naming the worker, exited 0 within 120 s and left no worker alive. The
runs of a wave share the two GPUs (each with a fixed KV pool, so their memory sizing does not
collide), which also varies where in a step the kill lands. Failures print their output (a hang
prints its Python and native stacks: see native_stacks_later).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.qwen3_tiny import make_tiny_qwen3  # noqa: E402
from tests.test_engine_tp import _KILL_SCRIPT, pid_alive  # noqa: E402


def run_once(path: str, allreduce: str, kill_at: int) -> tuple[bool, float, str]:
    """-> (passed, seconds, output)."""
    llm_args = dict(num_kvcache_blocks=64, tp_all_reduce=allreduce)
    args = [sys.executable, "-c", _KILL_SCRIPT, path, json.dumps(llm_args), str(kill_at)]
    t0 = time.monotonic()
    try:
        out = subprocess.run(args, cwd=ROOT, timeout=150, capture_output=True, text=True)
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return False, time.monotonic() - t0, "TIMED OUT (150 s)\n" + text
    secs = time.monotonic() - t0
    text = out.stdout + "\n--- stderr (tail) ---\n" + out.stderr[-4000:]
    ok = "RAISED LLM: tensor-parallel worker rank 1" in out.stdout and out.returncode == 0 \
        and secs < 120
    if "PIDS" in out.stdout:
        time.sleep(1)
        pids = [int(p) for p in out.stdout.split("PIDS", 1)[1].split("\n", 1)[0].split()]
        left = [p for p in pids if pid_alive(p)]
        if left:
            ok, text = False, text + f"\nworkers left alive: {left}"
    return ok, secs, text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="nccl,custom",
                   help="LLM(tp_all_reduce=...) values, comma-separated")
    p.add_argument("--per-mode", type=int, default=2, help="runs of each mode in one wave")
    p.add_argument("--waves", type=int, default=2)
    p.add_argument("--kill-at", default="1,2,3,6", help="streamed items to kill at, cycled through")
    args = p.parse_args()
    modes = args.modes.split(",")
    kill_points = itertools.cycle(int(k) for k in args.kill_at.split(","))
    with tempfile.TemporaryDirectory(prefix="qwen3-kill-") as path:
        make_tiny_qwen3(path, dict(vocab_size=512, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=128), dtype=torch.bfloat16)
        results = []
        for wave in range(args.waves):
            jobs = [(m, next(kill_points)) for m in modes for _ in range(args.per_mode)]
            with ThreadPoolExecutor(len(jobs)) as pool:
                outs = list(pool.map(lambda j: run_once(path, *j), jobs))
            for (mode, kill_at), (ok, secs, text) in zip(jobs, outs):
                results.append((mode, ok))
                print(f"wave {wave} {mode:7s} kill at item {kill_at}: "
                      f"{'pass' if ok else 'FAIL'} ({secs:.0f} s)", flush=True)
                if not ok:
                    print(text, flush=True)
        for mode in modes:
            n = sum(1 for m, _ in results if m == mode)
            good = sum(1 for m, ok in results if m == mode and ok)
            print(f"| {mode} | {good} / {n} passed |")


if __name__ == "__main__":
    main()
