"""A few calls of one prefill problem, for a profiler (ncu) to look at; prints each path's time.

    python3 benchmarks/prefill_profile.py [--batch 1 --seqlen 4096 --hq 32 --hkv 8 --bs 256]
    ncu --clock-control none -k regex:prefill -s 3 -c 1 --set full -o rep \\
        python3 benchmarks/prefill_profile.py --calls 4

QWEN3_PREFILL_VARIANT picks the kernel as in the op (ws, ws3, ws3p, ws_nopp, ws3_nopp, sm90;
unset: the default, on Hopper ws3p up to 8192 queries a sequence, ws3 above).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention_prefill import causal_flops, make_inputs  # noqa: E402

import qwen3_kernels.ops as ops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--bs", type=int, default=256)
    ap.add_argument("--calls", type=int, default=20)
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    s = make_inputs(a.batch, a.seqlen, a.hq, a.hkv, a.bs, gen)
    scale = 1.0 / math.sqrt(128)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(a.calls):
        start.record()
        ops.paged_attention_prefill(s["q_packed"], s["k_cache"], s["v_cache"], s["cu"], s["lens"],
                                    s["block_tables"], a.seqlen, scale, out=s["out"])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    best = min(times)
    flops = causal_flops(a.batch, a.seqlen, a.hq)
    print(f"prefill {os.environ.get('QWEN3_PREFILL_VARIANT', 'default')} B={a.batch} "
          f"L={a.seqlen} {a.hq}/{a.hkv} bs={a.bs}: best {best:.1f} us of {a.calls} "
          f"({flops / best / 1e6:.0f} TFLOP/s)")


if __name__ == "__main__":
    main()
