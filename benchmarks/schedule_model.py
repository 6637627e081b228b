"""What a scheduling setting would cost on one H200, without a GPU: the engine's own Scheduler runs
the nano-vllm workload, and each step it makes is priced by a model of Qwen3-8B's step time.

    python benchmarks/schedule_model.py                      # fcfs / longest_first at a few budgets
    python benchmarks/schedule_model.py --budgets 320 384    # chosen budgets only
    python benchmarks/schedule_model.py --budgets 384 --max-num-seqs 176 256   # and running caps

Why: a step's projections read every weight (15 GB at 8B) whatever its token count, so up to
~200 tokens a step costs about the same GEMM time (the GEMMs are bound by the weight read), and only
beyond that grows with its tokens (bound by the tensor cores). The workload's first nine steps
compute the 143k prompt tokens at the full compute price, while the last ~500 decode steps run
fewer than 128 tokens each and leave the tensor cores idle. With ``longest_first`` and a budget of a
few hundred tokens, the prompts of the shorter requests are computed in those steps instead. The
model says how much that can give; the engine measures what it gives (RESULTS.md, 2026-12-02).
A cap on the running sequences below the batch's size (``max_num_seqs``) pays too: with all 256
requests running from the first steps, every prompt is computed by step ~400 and the last ~370
steps decode fewer than 128 sequences; with 176 running at most, the shortest requests wait for a
slot and their prompts fill those steps (modelled 12.76 s against 13.24 at 384 / 176 vs 512 / 256;
measured 1.022-1.026x, RESULTS.md, twenty-second session). The model is optimistic at the
smallest budgets (320 and below), where measured gains fell short of it.

The step model (ms), fitted to the 8B workload's step timeline (RESULTS.md, 2026-11-30; it
reproduces its 9,760-9,830 tok/s within 1%):
  projections   36 layers x max(110 + 0.1 T, 0.54 T + 18) us  (T tokens in the step)
  LM head       max(0.30, 0.0017 S)  (S sampled rows)
  elementwise   max(0.29, 0.00141 T)
  launch gaps   0.7 (a decode graph) or 1.0 (an eager step)
  attention     K/V bytes of the decodes' contexts at 4.0 TB/s + 0.1, and the prompt chunks'
                causal FLOPs at 450 TFLOP/s
It does not see the host: an eager step whose launches take longer than its kernels (the host
needs ~9 ms for an 8B eager step) runs at the host's pace.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import nano_vllm_workload  # noqa: E402
from qwen3_model.engine.scheduler import Scheduler  # noqa: E402
from qwen3_model.engine.sequence import Sequence  # noqa: E402
from qwen3_model.sampling_params import SamplingParams  # noqa: E402

LAYERS = 36
KV_BYTES_PER_TOKEN = LAYERS * 2 * 8 * 128 * 2  # K and V, 8 kv heads of 128, bf16
ATTN_FLOP_PER_QK = LAYERS * 4 * 32 * 128  # QK^T and PV, 32 q heads of 128


def step_ms(decode_contexts: list[int], chunks: list[tuple[int, int]], graph: bool) -> float:
    """decode_contexts: each decode's cached keys; chunks: (keys before it, length) of each prompt chunk."""
    t = len(decode_contexts) + sum(n for _, n in chunks)
    sampled = len(decode_contexts) + len(chunks)
    ms = LAYERS * max(110 + 0.1 * t, 0.54 * t + 18) / 1e3
    ms += max(0.30, 0.0017 * sampled) + max(0.29, 0.00141 * t) + (0.7 if graph else 1.0)
    ms += 0.1 + sum(decode_contexts) * KV_BYTES_PER_TOKEN / 4.0e9
    ms += sum(ATTN_FLOP_PER_QK * n * (start + n / 2) for start, n in chunks) / 450e9
    return ms


def model_workload(policy: str, budget: int, num_seqs: int = 256, max_num_seqs: int = 256,
                   block_size: int = 256) -> dict:
    """-> output tok/s, seconds and steps of the workload under (policy, budget, max_num_seqs),
    as modelled."""
    prompts, max_tokens = nano_vllm_workload(num_seqs)
    blocks = num_seqs * -(-(1024 + 1024) // block_size) + 8  # room for everything: no preemption
    sched = Scheduler(num_blocks=blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=budget, max_model_len=4096,
                      enable_prefix_caching=False, policy=policy)
    for p, m in zip(prompts, max_tokens):
        sched.add(Sequence(p, SamplingParams(ignore_eos=True, max_tokens=m)))
    total_ms, steps = 0.0, 0
    while not sched.is_finished():
        batch = sched.schedule()
        chunks = [(s.num_computed_tokens, n) for s, n in batch.prefills]
        contexts = [s.num_computed_tokens for s in batch.decodes]
        total_ms += step_ms(contexts, chunks, graph=not batch.prefills)
        sched.advance(batch)  # placeholder tokens: ignore_eos, only the counts matter
        steps += 1
    out = sum(max_tokens)
    return dict(policy=policy, budget=budget, max_num_seqs=max_num_seqs, tok_s=out / total_ms * 1e3,
                seconds=total_ms / 1e3, steps=steps)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", type=int, nargs="+", default=[288, 320, 384, 512, 1024, 16384])
    p.add_argument("--max-num-seqs", type=int, nargs="+", default=[256],
                   help="caps on the running sequences (each with every budget)")
    p.add_argument("--num-seqs", type=int, default=256)
    args = p.parse_args(argv)
    base = model_workload("fcfs", 16384, args.num_seqs)
    print(f"modelled Qwen3-8B workload, {args.num_seqs} requests (H200 step model; no host limit)")
    print("| policy | max_num_batched_tokens | max_num_seqs | steps | seconds | output tok/s | "
          "vs fcfs 16384 |")
    print("|---|---|---|---|---|---|---|")
    rows = [base] + [model_workload("longest_first", b, args.num_seqs, max_num_seqs=m)
                     for m in args.max_num_seqs for b in args.budgets]
    for r in rows:
        print(f"| {r['policy']} | {r['budget']} | {r['max_num_seqs']} | {r['steps']} | "
              f"{r['seconds']:.2f} | {r['tok_s']:,.0f} | {r['tok_s'] / base['tok_s']:.3f}x |")


if __name__ == "__main__":
    main()
