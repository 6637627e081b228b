"""Host (CPU) cost of one engine step, without a GPU: the bench_engine workload through the real
scheduler, block manager, input building, sampling and postprocess, with the model forward faked.

    python benchmarks/profile_host.py                       # block size 256 and 16, ms per step
    python benchmarks/profile_host.py --block-size 16 --cprofile 25
    python benchmarks/profile_host.py --device cuda         # on a GPU host: real copies, launches

Why: a decode step of Qwen3-0.6B at 256 sequences is a few ms of GPU time, and every ms the host
spends between two steps (schedule, build the inputs, sample, read the tokens back, postprocess)
leaves the GPU idle, since the step's sampled tokens are read back once per step. This measures
those ms here, on any CPU.

The fake forward: ``ModelRunner.run_model`` returns a preallocated hidden buffer and
``compute_logits`` a preallocated random [N, 8] logits tensor, both instantly, and decode-only
steps take the CUDA-graph path (its inputs built, nothing replayed); everything else
(scheduler, block manager, runner input building, SamplingBatch + Sampler on a small vocab, the
engine loop) is the real code. On CPU the host-to-device copies are memcpys; ``--device cuda``
runs the same with real pinned copies and kernel launches (the tiny model runs eagerly there).

Times are wall time (``--clock wall``, the default) or this thread's CPU time (``--clock cpu``;
on a VM it also counts stolen time, and measured higher than wall time here). Phases (ms per
step, the median over the decode-only steps with ``--running`` sequences; a busy machine only adds
time, so of ``--repeat`` runs the lowest):
    schedule     Scheduler.schedule
    prepare      ModelRunner.launch (or run) but sampling: the step's inputs, on the device
    sample       logits -> tokens: SamplingBatch.build, Sampler, reading the tokens back
    postprocess  Scheduler.postprocess (or advance + fill, overlapped)
    loop         the rest of the generate loop (detok, progress bar)

With overlapped steps (LLM(overlap_steps=True), the default) the same host work runs while the GPU
computes the previous step, so on a GPU only what exceeds the GPU's step time shows in the wall
time; run with --no-overlap-steps to time the step-by-step loop.

This is the project's one profiling tool for the host; the GPU side of a step, kernel by kernel,
is bench_engine.py's --profile mode (decode steps, or one prefill step with --profile-prefill).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_engine import nano_vllm_workload  # noqa: E402  (the same workload)
from qwen3_model.layers import sampler as sampler_mod  # noqa: E402
from qwen3_model.llm import LLM  # noqa: E402
from qwen3_model.random_checkpoint import write_random_checkpoint  # noqa: E402
from qwen3_model.sampling_params import SamplingParams  # noqa: E402

# A model as small as the engine accepts: its weights, KV cache and forward do not matter here
# (the forward is faked), only the vocabulary size the sampler sees: small, so that the sampler's
# CPU ops cost about what launching them costs on a GPU, not the arithmetic.
TINY = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True,
            max_position_embeddings=40960)


CLOCK = time.perf_counter  # set by --clock


class Timers:
    """Time spent in wrapped methods, accumulated per phase until the next step boundary."""

    def __init__(self):
        self.step = defaultdict(float)

    def wrap(self, obj, name: str, phase: str) -> None:
        fn = getattr(obj, name)
        step = self.step

        def timed(*a, **kw):
            t0 = CLOCK()
            try:
                return fn(*a, **kw)
            finally:
                step[phase] += CLOCK() - t0

        setattr(obj, name, timed)


def fake_forward(llm: LLM, timers: Timers) -> None:
    """Replace the model forward and the LM head by instant stand-ins (see the module doc)."""
    runner = llm.model_runner
    hf = llm.config.hf_config
    max_tokens = llm.config.max_num_batched_tokens
    dev = runner.device
    hidden = torch.zeros(max_tokens, hf.hidden_size, dtype=llm.config.torch_dtype, device=dev)
    gen = torch.Generator().manual_seed(0)
    # 8 columns, not the vocabulary: the sampler's ops then cost their dispatch (what launching
    # them costs on a GPU), not CPU arithmetic (exponential_ alone is ~0.1 us per element here)
    logits = torch.randn(llm.config.max_num_seqs, 8, generator=gen).to(dev)

    def run_model(input_ids, positions, ctx, bucket):
        return hidden[: input_ids.shape[0]]

    def compute_logits(h, dtype=torch.float32):
        return logits[: h.shape[0]]

    runner.run_model = run_model
    runner.model.compute_logits = compute_logits
    if hasattr(runner, "make_graph_buffers") and not runner.graphs:
        # decode-only steps as on the H200, where they replay CUDA graphs: the runner builds
        # them for the graphs' static buffers (the fake forward replays nothing)
        max_bs = min(llm.config.max_num_seqs, llm.config.max_cudagraph_batch_size)
        sizes = [1, 2, 4, 8] + list(range(16, max_bs, 16)) + [max_bs]
        runner.graph_batch_sizes = sorted(set(sizes))
        runner.make_graph_buffers(max_bs)
        runner.graphs = {b: None for b in runner.graph_batch_sizes}
    # the sampling phase: settings to tensors, the sampler, and its one read-back (inside run)
    timers.wrap(runner.sampler, "forward", "sample")
    build = sampler_mod.SamplingBatch.build
    step = timers.step

    def timed_build(*a, **kw):
        t0 = CLOCK()
        try:
            return build(*a, **kw)
        finally:
            step["sample"] += CLOCK() - t0

    sampler_mod.SamplingBatch.build = staticmethod(timed_build)
    return build


def run_workload(block_size: int, args, profile: cProfile.Profile | None = None):
    """-> per-step records (n_prefill, n_decode, {phase: seconds}) and the wall time."""
    prompts, max_tokens = nano_vllm_workload(args.num_seqs, 0, args.max_input_len,
                                             args.max_output_len)
    prompts = [[t % TINY["vocab_size"] for t in p] for p in prompts]
    with tempfile.TemporaryDirectory(prefix="qwen3-host-") as tmp:
        write_random_checkpoint(tmp, dict(TINY), weights=False, tokenizer=False)
        longest = max(len(p) + m for p, m in zip(prompts, max_tokens))
        num_blocks = 2 * args.num_seqs * -(-longest // block_size)  # no preemption, as on the H200
        llm = LLM(tmp, device=args.device, load_format="dummy", max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  kvcache_block_size=block_size, num_kvcache_blocks=num_blocks,
                  overlap_steps=not args.no_overlap_steps)
    timers = Timers()
    build = fake_forward(llm, timers)
    try:
        return _run(llm, timers, prompts, max_tokens, args, profile)
    finally:
        sampler_mod.SamplingBatch.build = staticmethod(build)


def _run(llm, timers, prompts, max_tokens, args, profile):
    sched, runner = llm.scheduler, llm.model_runner
    timers.wrap(sched, "schedule", "schedule")
    for name in ("postprocess", "advance", "fill"):  # (advance / fill: the overlapped loop)
        if hasattr(sched, name):
            timers.wrap(sched, name, "postprocess")
    for name in ("run", "launch", "wait"):  # run = launch + wait where both exist
        if hasattr(runner, name) and not (name == "run" and hasattr(runner, "launch")):
            timers.wrap(runner, name, "run")
    if hasattr(runner, "wait"):
        timers.wrap(runner, "wait", "sample")  # reading the tokens back: part of sampling
    records = []
    last = [None]

    def boundary(n_prefill, n_decode):
        """A step's result reached the generate loop: everything since the previous one (the
        loop's own work included) is this step's host time."""
        now = CLOCK()
        if last[0] is not None:
            timers.step["step"] = now - last[0]
            records.append((n_prefill, n_decode, dict(timers.step)))
        timers.step.clear()
        last[0] = now

    if hasattr(llm, "_steps"):  # the generate loop iterates _steps(), overlapped or not
        steps = llm._steps

        def timed_steps():
            for item in steps():
                boundary(item[-2], item[-1])
                yield item

        llm._steps = timed_steps
    else:  # the step-by-step loop of earlier versions
        engine_step = llm.step

        def timed_step():
            got, n_prefill, n_decode = engine_step()
            boundary(n_prefill, n_decode)
            return got, n_prefill, n_decode

        llm.step = timed_step
    # every request samples (temperature 0.6), as in bench_engine
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    llm.generate([[1, 2, 3, 4] * 8], SamplingParams(max_tokens=16), use_tqdm=False)  # warm-up
    records.clear()
    last[0] = None
    prev = None
    if profile is not None:
        prev = sys.getprofile()
        profile.enable()
    start = CLOCK()
    outs = llm.generate(prompts, params, use_tqdm=args.tqdm)
    wall = CLOCK() - start
    if profile is not None:
        profile.disable()
        sys.setprofile(prev)
    n_out = sum(len(o.token_ids) for o in outs)
    assert n_out == sum(max_tokens), "ignore_eos: every request must produce max_tokens"
    return records, wall, llm.scheduler.num_steps, llm.scheduler.num_preemptions


def phases(rec: dict, total: float) -> dict:
    """Split one step's (or a whole run's) seconds into the named phases."""
    run = rec.get("run", 0.0)
    sample = rec.get("sample", 0.0)
    out = dict(schedule=rec.get("schedule", 0.0), prepare=run - sample, sample=sample,
               postprocess=rec.get("postprocess", 0.0))
    out["loop"] = total - sum(out.values())
    return out


def report(block_size: int, args) -> None:
    """Per phase, the median over the selected steps of one run; of ``--repeat`` runs the
    lowest (a busy machine only ever adds time)."""
    best, best_wall = None, None
    for _ in range(args.repeat):
        records, wall, steps, preempt = run_workload(block_size, args)
        sel = [r for r in records if r[0] == 0 and r[1] == args.running]
        if not sel:
            print(f"\nblock size {block_size}: no decode-only step with exactly {args.running} "
                  "sequences")
            return
        split = [dict(phases(rec, rec["step"]), step=rec["step"]) for _, _, rec in sel]
        med = {k: statistics.median(s[k] for s in split) for k in split[0]}
        best = med if best is None else {k: min(v, med[k]) for k, v in best.items()}
        best_wall = wall if best_wall is None else min(best_wall, wall)
    print(f"\nblock size {block_size}: {len(records)} steps ({preempt} preemptions), generate "
          f"{best_wall:.2f} s host = {1e3 * best_wall / len(records):.2f} ms/step over the whole "
          "run")
    parts = "  ".join(f"{k} {1e3 * v:.3f}" for k, v in best.items() if k != "step")
    print(f"  decode steps with {args.running} running ({len(sel)} steps): "
          f"{1e3 * best['step']:.3f} ms/step host  =  {parts}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block-size", type=int, nargs="*", default=[256, 16])
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--running", type=int, default=None,
                   help="report decode steps with this many sequences (default: --num-seqs)")
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--repeat", type=int, default=3, help="runs per block size (the best counts)")
    p.add_argument("--clock", choices=["cpu", "wall"], default="wall")
    p.add_argument("--tqdm", action="store_true", help="the progress bar on, as bench_engine")
    p.add_argument("--no-overlap-steps", action="store_true",
                   help="LLM(overlap_steps=False): the step-by-step loop")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="also run under cProfile and print the top N functions (tottime)")
    args = p.parse_args(argv)
    args.running = args.running or args.num_seqs
    global CLOCK
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(1)  # the host thread of one engine; the sampler's tiny ops stay serial
    for bs in args.block_size:
        report(bs, args)
        if args.cprofile:
            prof = cProfile.Profile()
            run_workload(bs, args, prof)
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.cprofile)
            print(s.getvalue())


if __name__ == "__main__":
    main()
