"""One decode step from its CUDA graph, replayed alone: the GPU time of the model's forward at a
small batch, under several launch variants in one process (the model is built once; each variant
re-captures the graphs).

    cd benchmarks
    python decode_step.py --size 8B                  # batch 1, every variant below
    python decode_step.py --size 8B --shard 2        # one rank's shapes under tensor parallel 2
                                                           # (heads and MLP halved; no all-reduce)
    python decode_step.py --size 8B --variants default,gemv=pdl,fuse=0
    python decode_step.py --size 8B --profile silu=auto_nopdl+norm=auto_nopdl   # + kernel by kernel

Why: bench_engine.py --batch1 times the whole loop (sampling, host, streaming) and needs ~40 s
per setting; this times what the kernels can change, the graph replay (events around 200
replays after a warm-up), at a few seconds per setting. The LM head and sampling run outside the
decode graph and are not in these numbers.

A variant is '+'-joined knob=value settings: gemv=<QWEN3_GEMV_VARIANT name>, silu=<...>,
norm=<...> (qwen3_kernels.elementwise_tuning), fuse=0|1 (linear.FUSE_GATE_UP_SILU: the gate_up
GEMV with silu_and_mul fused), gemv_max=<tokens> (linear.GEMV_MAX_TOKENS), and
paged_attention_decode's tuning (decode_tuning): splits=<n> (0 = its automatic choice),
dvariant=<name> (w4s3, w8s3, ...; auto = by batch), dflags=<bits> (INTERLEAVE 1, FAST_COMBINE 2,
PDL 4, FUSED_COMBINE 8; a variant other than auto runs with exactly these); "default" is none.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qwen3_model.llm import LLM  # noqa: E402
from qwen3_model.random_checkpoint import QWEN3_SIZES, write_random_checkpoint  # noqa: E402

DEFAULT_VARIANTS = "default,gemv=pdl,fuse=0,gemv=pdl+fuse=0"


def apply(variant: str) -> dict:
    """Sets the knobs of one variant; returns what to restore."""
    from qwen3_kernels import elementwise_tuning as et
    from qwen3_model.layers import linear

    undo = {}
    if variant == "default":
        return undo
    for setting in variant.split("+"):
        knob, _, value = setting.partition("=")
        if knob in et.OPS:
            undo[knob] = et.select(knob, value)
        elif knob == "fuse":
            undo[knob] = linear.FUSE_GATE_UP_SILU
            linear.FUSE_GATE_UP_SILU = value != "0"
        elif knob == "gemv_max":
            undo[knob] = linear.GEMV_MAX_TOKENS
            linear.GEMV_MAX_TOKENS = int(value)
        elif knob in ("splits", "dvariant", "dflags"):
            from qwen3_kernels import decode_tuning as dt

            now = dt.get()
            undo.setdefault("decode", now)
            splits, variant, flags = now
            if knob == "splits":
                splits = int(value)
            elif knob == "dvariant":
                variant = value
            else:
                flags = int(value)
            dt.set_tuning(splits, variant, flags)
        else:
            raise ValueError(f"unknown knob {knob!r} in variant {variant!r}")
    return undo


def restore(undo: dict) -> None:
    from qwen3_kernels import elementwise_tuning as et
    from qwen3_model.layers import linear

    for knob, value in undo.items():
        if knob in et.OPS:
            et.select(knob, value)
        elif knob == "fuse":
            linear.FUSE_GATE_UP_SILU = value
        elif knob == "decode":
            from qwen3_kernels import decode_tuning as dt

            dt.set_tuning(*value)
        else:
            linear.GEMV_MAX_TOKENS = value


@torch.inference_mode()  # the graph buffers are inference tensors (captured in inference mode)
def time_replay(runner, bs: int, context: int, replays: int) -> float:
    """us per replay of the batch-size-bs decode graph, every sequence at `context` tokens."""
    g = runner.graph_vars
    block = runner.config.kvcache_block_size
    blocks = -(-(context + 1) // block)
    g["seq_lens"][:bs].fill_(context + 1)
    g["positions"][:bs].fill_(context)
    g["slot_mapping"][:bs] = torch.arange(bs, device=g["slot_mapping"].device, dtype=torch.int32) \
        * blocks * block + context
    g["block_tables"][:bs, :blocks] = torch.arange(bs * blocks, device=g["block_tables"].device,
                                                   dtype=torch.int32).view(bs, blocks)
    graph = runner.graphs[bs]
    for _ in range(20):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def profile_replay(runner, bs: int, replays: int = 10, top: int = 25) -> None:
    """Kernel by kernel: each kernel's device time per step, and what the step spends between
    kernels (replay time minus the kernels' sum). With PDL on, a kernel's time includes its wait
    for the one before (griddepcontrol.wait), so profile a variant with PDL off to read gaps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    graph = runner.graphs[bs]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    rows = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0
                   and getattr(e, "device_type", None) == DeviceType.CUDA),
                  key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in rows) / replays
    launches = sum(e.count for e in rows) / replays
    print(f"\nkernels: {launches:.0f} a step, {total:,.1f} us of kernel time a step")
    print("| kernel | calls/step | us/step | us/call |\n|---|---|---|---|")
    for e in rows[:top]:
        name = e.key if len(e.key) <= 90 else e.key[:87] + "..."
        us, calls = e.self_device_time_total / replays, e.count / replays
        print(f"| `{name}` | {calls:.0f} | {us:,.1f} | {us / max(calls, 1):.2f} |")
    return total, launches


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(QWEN3_SIZES), default="8B")
    p.add_argument("--shard", type=int, default=1,
                   help="divide the q / kv heads and the MLP by this: one rank's shapes under "
                        "tensor parallel N, run on one GPU without the all-reduce")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--variants", default=DEFAULT_VARIANTS)
    p.add_argument("--profile", metavar="VARIANT",
                   help="then profile this variant's replays kernel by kernel ('default' for none)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_step.py needs a CUDA GPU")
        return
    hidden, layers, heads, kv, inter, tied = QWEN3_SIZES[args.size]
    if heads % args.shard or kv % args.shard or inter % args.shard:
        raise SystemExit(f"--shard {args.shard} does not divide {args.size}'s heads / kv heads / MLP")
    with tempfile.TemporaryDirectory(prefix="qwen3-step-") as tmp:
        write_random_checkpoint(tmp, args.size, dtype=torch.bfloat16, weights=False, tokenizer=False,
                                num_attention_heads=heads // args.shard,
                                num_key_value_heads=kv // args.shard,
                                intermediate_size=inter // args.shard)
        llm = LLM(tmp, load_format="dummy", dtype="bfloat16", max_num_seqs=max(args.batch, 1),
                  max_model_len=4096, kvcache_block_size=256, gpu_memory_utilization=0.5)
        runner = llm.model_runner
        if args.batch not in runner.graphs:
            raise SystemExit(f"no decode graph for batch {args.batch}: {sorted(runner.graphs)}")
        weight_bytes = sum(q.numel() * q.element_size() for n, q in runner.model.named_parameters()
                           if "embed" not in n and "lm_head" not in n)
        name = f"Qwen3-{args.size}" + (f" / {args.shard} (one TP-{args.shard} rank)" if args.shard > 1 else "")
        print(f"\n{name}, decode step of batch {args.batch} at {args.context} tokens, graph replay "
              f"(no LM head, no sampling); layer weights {weight_bytes / 1e9:.2f} GB")
        print("| variant | us/step | layer weights read | vs default |\n|---|---|---|---|")
        first = None
        for variant in args.variants.split(","):
            undo = apply(variant)
            try:
                runner.graphs.clear()
                torch.cuda.synchronize()
                runner.capture_cudagraph()
                us = time_replay(runner, args.batch, args.context, args.replays)
            finally:
                restore(undo)
            first = first or us
            print(f"| {variant} | {us:,.1f} | {weight_bytes / us / 1e6:.2f} TB/s | "
                  f"{first / us:.3f}x |", flush=True)
        if args.profile:
            undo = apply(args.profile)
            try:
                runner.graphs.clear()
                torch.cuda.synchronize()
                runner.capture_cudagraph()
                us = time_replay(runner, args.batch, args.context, args.replays)
                total, launches = profile_replay(runner, args.batch)
            finally:
                restore(undo)
            print(f"{args.profile}: replay {us:,.1f} us/step, kernels {total:,.1f} us: "
                  f"{us - total:,.1f} us between kernels, {(us - total) / max(launches, 1):.2f} us "
                  f"per kernel boundary")
        llm.close()


if __name__ == "__main__":
    main()
