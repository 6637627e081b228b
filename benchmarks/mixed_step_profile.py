"""Mixed (prompt chunks + decodes) steps of the nano-vllm workload under a scheduling setting:
their kernels, and the host's time to launch each step, to see which of the two sets the pace.

    python benchmarks/mixed_step_profile.py 8B 320 150 8   # size, budget, profile from step 150, 8 steps

Runs the workload with ``scheduling_policy="longest_first"`` and ``max_num_batched_tokens`` =
budget in generate's overlapped loop up to the given step, then profiles some steps (CUDA kernels
only) and runs 3 more under ``torch.cuda.set_sync_debug_mode("warn")`` (a synchronizing call
would warn). Prints the steps' shapes, the host's launch time per step (``ModelRunner.launch``:
the step's schedule is not in it) before and during the profile, and the kernels per step.
Needs CUDA and the built extension.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import nano_vllm_workload  # noqa: E402
from qwen3_model.llm import LLM  # noqa: E402
from qwen3_model.random_checkpoint import write_random_checkpoint  # noqa: E402
from qwen3_model.sampling_params import SamplingParams  # noqa: E402


def main(size: str, budget: int, at: int, steps: int) -> None:
    path = tempfile.mkdtemp()
    write_random_checkpoint(path, size, dtype=torch.bfloat16, weights=False, tokenizer=False)
    llm = LLM(path, load_format="dummy", max_num_seqs=256, max_num_batched_tokens=budget,
              scheduling_policy="longest_first")
    llm.generate([[1, 2, 3, 4] * 8], SamplingParams(max_tokens=16), use_tqdm=False)  # warm-up
    runner, host, shapes = llm.model_runner, [], []
    plain = runner.launch

    def launch(batch):
        t = time.perf_counter()
        pending = plain(batch)
        host.append(time.perf_counter() - t)
        shapes.append((batch.num_prefill_tokens, len(batch.prefills), len(batch.decodes)))
        return pending

    runner.launch = launch
    prompts, max_tokens = nano_vllm_workload(256)
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        llm.add_request(p, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m), i)
    loop = llm._steps()
    for _ in range(at):
        next(loop)
    torch.cuda.synchronize()
    k0 = len(host)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            next(loop)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    launched = len(host) - k0
    torch.cuda.set_sync_debug_mode("warn")
    for _ in range(3):
        next(loop)
    torch.cuda.set_sync_debug_mode(0)
    loop.close()
    llm.scheduler.abort_all()
    rows = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0
                   and getattr(e, "device_type", None) == DeviceType.CUDA),
                  key=lambda e: -e.self_device_time_total)
    kernels_ms = sum(e.self_device_time_total for e in rows) / 1e3
    print(f"{size}, longest_first, budget {budget}: steps {k0}..{k0 + launched}; (prompt tokens, "
          f"chunks, decodes) {shapes[k0:k0 + 4]} ...")
    print(f"  wall {wall * 1e3 / steps:.2f} ms per step read; kernels {kernels_ms / launched:.2f} ms "
          f"per step launched ({launched} launched while {steps} were read)")
    print(f"  host launch, ms: mean {1e3 * sum(host[10:k0]) / max(1, k0 - 10):.2f} before the "
          f"profile; during it {[round(h * 1e3, 1) for h in host[k0:k0 + 12]]}")
    for e in rows[:20]:
        print(f"  {e.self_device_time_total / 1e3 / launched:8.3f} ms/step  "
              f"{e.count / launched:6.1f}/step  {e.key[:90]}")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("mixed_step_profile.py needs CUDA")
    size, budget, at, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    main(size, budget, at, steps)
