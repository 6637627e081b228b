"""The parts of the command lines (``python -m qwen3_model`` and ``... serve``) that both share:
their argparse parser class, the engine's flags and the Config keywords they give, and the guard
that turns any failure into one line on stderr.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback


class Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (its own print the whole usage first)."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def error_line(e: BaseException) -> str:
    """``e`` as one line: its lines joined."""
    text = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
    if not isinstance(e, (ValueError, NotImplementedError, OSError)) or not text:
        text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text


def guarded(fn, debug: bool):
    """Run ``fn()`` as a command: an exception is one line on stderr ("error: ...", exit 1), a
    KeyboardInterrupt the line "interrupted" (exit 130); ``debug`` prints the traceback too."""
    try:
        return fn()
    except KeyboardInterrupt:
        # a second Ctrl-C while the engine stops (its workers, its graphs) exits at once, quietly
        signal.signal(signal.SIGINT, lambda *_: os._exit(130))
        if debug:
            traceback.print_exc()
        print("interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - a command line shows no traceback without --debug
        if debug:
            traceback.print_exc()
        raise SystemExit(f"error: {error_line(e)}") from None


def add_debug_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true",
                   help="show the traceback of an error or Ctrl-C (default: one line)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's settings (Config fields), shared by generate and serve."""
    e = p.add_argument_group("engine")
    e.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    e.add_argument("--device", default="auto", help="auto, cuda or cpu")
    e.add_argument("--max-model-len", type=int, default=4096)
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=16384)
    e.add_argument("--block-size", type=int, default=256, help="KV cache block size (tokens)")
    e.add_argument("--num-kvcache-blocks", type=int, default=-1, help="-1 = automatic")
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    e.add_argument("--max-piecewise-graph-tokens", type=int, default=512,
                   help="steps with prompt tokens up to this size replay piecewise CUDA graphs "
                        "(a multiple of 32; 0 = eager)")
    e.add_argument("--no-prefix-caching", action="store_true")
    # (config.KV_CACHE_DTYPES spelled out, as --scheduling-policy's below)
    e.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="KV cache element type: the model's dtype (auto), or float8 e4m3 with the "
                        "checkpoint's per-layer k_scale / v_scale, else 1.0 (fp8: twice the "
                        "blocks of bf16 in the same memory)")
    # (config.SCHEDULING_POLICIES spelled out: importing config loads torch, and --help stays light)
    e.add_argument("--scheduling-policy", choices=["auto", "fcfs", "longest_first"],
                   default="auto",
                   help="admission order: arrival (fcfs), the most max_tokens first "
                        "(longest_first), or auto (fcfs; longest first with smaller step budgets "
                        "for a large offline batch on a model of 1.7B and up)")
    e.add_argument("--tensor-parallel-size", type=int, default=1)
    # (config.TP_ALL_REDUCE_CHOICES spelled out, as above)
    e.add_argument("--tp-all-reduce", choices=["auto", "custom", "nccl"], default="auto",
                   help="tensor-parallel all-reduce: ours fused with the norm (custom), NCCL / "
                        "gloo (nccl), or custom where it can run (auto)")
    e.add_argument("--no-overlap-steps", action="store_true",
                   help="read every step's tokens before scheduling the next (no host / device "
                        "overlap; same tokens)")
    e.add_argument("--deterministic", action="store_true",
                   help="batch-invariant mode: a request's tokens and logprobs do not depend on "
                        "what else runs (one GPU, bf16 / fp16, Hopper on CUDA; slower)")
    e.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights from config.json alone (benchmarks at real shapes)")


def engine_kwargs(args) -> dict:
    return dict(
        dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kvcache_block_size=args.block_size, num_kvcache_blocks=args.num_kvcache_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        max_piecewise_graph_tokens=args.max_piecewise_graph_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_cache_dtype=args.kv_cache_dtype,
        scheduling_policy=args.scheduling_policy,
        tensor_parallel_size=args.tensor_parallel_size,
        tp_all_reduce=args.tp_all_reduce,
        overlap_steps=not args.no_overlap_steps,
        deterministic=args.deterministic,
        load_format=args.load_format,
    )
