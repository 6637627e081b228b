"""Engine throughput: the nano-vllm bench workload, and batch-1 decode, at real Qwen3 shapes.

    cd benchmarks
    python bench_engine.py --size 0.6B                       # 256 requests, output tok/s
    python bench_engine.py --size 0.6B --baseline hf         # + transformers generate_batch, ratio
    python bench_engine.py --size 8B --num-seqs 64           # a smaller run of the same workload
    python bench_engine.py --size 8B --batch1                # 128-token prompt, 512 new tokens
    python bench_engine.py --size 8B --scheduling-policy fcfs  # first come first served (the
                                                             # default "auto" runs this workload
                                                             # longest first, 176 / 384)
    python bench_engine.py --model ~/Qwen3-0.6B              # a real checkpoint instead
    python bench_engine.py --size 0.6B --profile --num-seqs 256   # a decode step, kernel by kernel
    python bench_engine.py --size 8B --profile --profile-overlap --num-seqs 1 --tp 2  # in generate
    python bench_engine.py --size 8B --no-overlap-steps --tp-all-reduce nccl --tp 2  # LLM settings

Each workload run (not --profile) also writes its row into results/bench_engine.json (--results-dir
to put it elsewhere; a row with the same workload, model and settings is replaced, others kept):
python report.py turns the file into RESULTS.md's engine table and plots/engine.png.

The workload (TARGETS.md, as nano-vllm's bench.py): 256 requests, seed 0, prompt lengths uniform
in [100, 1024] of random token ids in [0, 10000], max_tokens uniform in [100, 1024], ignore_eos,
temperature 0.6; throughput = output tokens / wall time of one ``generate`` after a warm-up.

--size writes a config.json at the real shape (bf16) to a temp dir and runs it with random weights
(load_format="dummy"): the speed is the same as a trained checkpoint's, with ignore_eos.
--quantization fp8 writes it as Qwen3-*-FP8's (e4m3 projections with 128 x 128 block scales).
--kv-cache-dtype fp8 runs the engine with an e4m3 KV cache (Config.kv_cache_dtype; the scales are
1.0 with random weights, a --model checkpoint's own where it has them).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

# The repository after PYTHONPATH: an A/B run may import another tree's qwen3_model / qwen3_kernels
# (scripts/gpu_round.sh: ENGINE="PYTHONPATH=... --size 8B"), which a front entry would shadow.
sys.path.append(str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import record  # noqa: E402

from qwen3_model.config import (  # noqa: E402
    KV_CACHE_DTYPES, SCHEDULING_POLICIES, TP_ALL_REDUCE_CHOICES)
from qwen3_model.llm import LLM  # noqa: E402
from qwen3_model.loader import quantization_method, read_config  # noqa: E402
from qwen3_model.random_checkpoint import QWEN3_SIZES, write_random_checkpoint  # noqa: E402
from qwen3_model.sampling_params import SamplingParams  # noqa: E402

H200_READ_TBS = record.H200_READ_TBS


class GpuClocks:
    """Polls ``nvidia-smi`` for the GPU's SM / memory clocks, power and temperature on a thread
    while a timed run goes, and tells which GPU it was (its UUID): the same build measured the 8B
    workload at 9,684-10,072 tok/s on five H200s, and these are what may tell such machines
    apart. Without CUDA or nvidia-smi it samples nothing."""

    FIELDS = "clocks.sm,clocks.mem,power.draw,temperature.gpu"

    def __init__(self, period_s: float = 0.5, enabled: bool = True):
        self.period_s = period_s
        self.enabled = enabled
        self.samples: list[tuple[float, float, float, float]] = []
        self.uuid = None
        self._stop = threading.Event()
        self._thread = None

    @staticmethod
    def parse(line: str) -> tuple[float, float, float, float] | None:
        """'1980, 3201, 512.34, 45' (MHz, MHz, W, C) -> numbers; None for '[N/A]' and the like."""
        parts = [p.strip() for p in line.split(",")]
        try:
            sm, mem, power, temp = (float(p) for p in parts)
        except ValueError:
            return None
        return sm, mem, power, temp

    def __enter__(self) -> "GpuClocks":
        if not (self.enabled and torch.cuda.is_available() and shutil.which("nvidia-smi")):
            return self
        try:  # which GPU this process runs on, as nvidia-smi names it
            uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        except (AttributeError, RuntimeError):
            return self  # no UUID from this torch: no samples rather than another GPU's
        self.uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _poll(self) -> None:
        cmd = ["nvidia-smi", "-i", self.uuid, f"--query-gpu={self.FIELDS}",
               "--format=csv,noheader,nounits"]
        while not self._stop.is_set():
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout
            except (OSError, subprocess.SubprocessError):
                return
            sample = self.parse(out.strip().splitlines()[0]) if out.strip() else None
            if sample is not None:
                self.samples.append(sample)
            self._stop.wait(self.period_s)

    def summary(self) -> dict | None:
        """min / median SM clock, median memory clock, median / max power, max temperature."""
        if not self.samples:
            return None
        sm, mem, power, temp = zip(*self.samples)
        return dict(gpu_uuid=self.uuid, clock_samples=len(sm), sm_mhz_min=min(sm),
                    sm_mhz_median=statistics.median(sm), mem_mhz_median=statistics.median(mem),
                    power_w_median=statistics.median(power), power_w_max=max(power),
                    temp_c_max=max(temp))

    def describe(self) -> str:
        s = self.summary()
        if s is None:
            return ""
        return (f"  GPU {s['gpu_uuid']} during the run ({s['clock_samples']} samples): SM clock "
                f"min / median {s['sm_mhz_min']:.0f} / {s['sm_mhz_median']:.0f} MHz, memory "
                f"{s['mem_mhz_median']:.0f} MHz, power median / max {s['power_w_median']:.0f} / "
                f"{s['power_w_max']:.0f} W, up to {s['temp_c_max']:.0f} C")


def nano_vllm_workload(num_seqs: int = 256, seed: int = 0, max_input_len: int = 1024,
                       max_output_len: int = 1024):
    """-> (prompts as token-id lists, max_tokens per request), drawn in nano-vllm's order."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, max_input_len))]
               for _ in range(num_seqs)]
    max_tokens = [rng.randint(100, max_output_len) for _ in range(num_seqs)]
    return prompts, max_tokens


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: every parameter once, except an untied input
    embedding (a lookup reads one row); a tied table is read once, as the LM head."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # tied counted once
    if not getattr(model, "tie_word_embeddings", False):
        emb = model.model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    return total


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_gpu():
    """Give the memory of objects the caller has just dropped back (the next engine needs it)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---- ours -------------------------------------------------------------------------------------

def make_llm(path: str, args, dummy: bool) -> LLM:
    kw = dict(max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
              gpu_memory_utilization=args.gpu_memory_utilization,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              kvcache_block_size=args.block_size, dtype=args.dtype,
              tensor_parallel_size=args.tensor_parallel_size,
              scheduling_policy=args.scheduling_policy,
              max_piecewise_graph_tokens=args.max_piecewise_graph_tokens,
              overlap_steps=not args.no_overlap_steps, tp_all_reduce=args.tp_all_reduce,
              kv_cache_dtype=args.kv_cache_dtype, deterministic=args.deterministic)
    if dummy:
        kw["load_format"] = "dummy"
    start = time.perf_counter()
    llm = LLM(path, **kw)
    print(f"engine ready in {time.perf_counter() - start:.1f} s: {llm.model_runner.num_blocks} KV "
          f"blocks of {args.block_size} tokens ({args.kv_cache_dtype}), CUDA graphs for "
          f"{len(llm.model_runner.graphs)} batch sizes"
          + (f", piecewise graphs for mixed steps of up to {pw.max_tokens} tokens "
             f"({len(pw.buckets)} buckets, {pw.capture_seconds:.1f} s)"
             if (pw := llm.model_runner.piecewise) is not None else ""), flush=True)
    return llm


def run_ours_throughput(llm: LLM, prompts, max_tokens, timeline: bool = False):
    """-> (seconds, output tokens, the step timeline's summary or None)."""
    llm.generate([[1, 2, 3, 4] * 8], SamplingParams(max_tokens=16), use_tqdm=False)  # warm-up
    records = attach_timeline(llm) if timeline else None
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - start
    n_out = sum(len(o.token_ids) for o in outs)
    assert n_out == sum(max_tokens), "ignore_eos: every request must produce max_tokens"
    return seconds, n_out, timeline_summary(records) if records else None


# Decode steps by batch size (the graphs' buckets are multiples of 16): where the workload's time
# goes.
TIMELINE_BINS = (16, 64, 128, 192, 256, 10**9)


def attach_timeline(llm: LLM) -> list:
    """Record CUDA events around every step ``llm`` launches from now on (rank 0's stream).

    -> the list it fills with (prefill tokens, decodes, start event, end event). The events cost
    the host nothing it waits on: read them after the run (``timeline_summary``)."""
    runner, records = llm.model_runner, []
    plain = runner.launch

    def launch(batch):
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        pending = plain(batch)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        records.append((batch.num_prefill_tokens, len(batch.decodes), start, end))
        return pending

    runner.launch = launch  # run() and the overlapped loop both go through it
    return records


def timeline_summary(records: list) -> dict:
    """GPU time of the steps that carry prefill tokens and of the decode-only steps by batch
    size, and the device's idle time between steps (host-bound gaps), from ``attach_timeline``."""
    sync()
    rows = {}  # bin -> [steps, ms, tokens]
    idle_ms, prev = 0.0, None
    for n_pre, n_dec, start, end in records:
        ms = start.elapsed_time(end)
        if prev is not None:
            idle_ms += max(0.0, prev.elapsed_time(start))
        prev = end
        key = "prefill" if n_pre else next(b for b in TIMELINE_BINS if n_dec <= b)
        r = rows.setdefault(key, [0, 0.0, 0])
        r[0] += 1
        r[1] += ms
        r[2] += n_dec
    wall_ms = records[0][2].elapsed_time(records[-1][3]) if records else 0.0
    print(f"\nstep timeline ({len(records)} steps, device wall {wall_ms:,.0f} ms, idle between "
          f"steps {idle_ms:,.1f} ms):\n  | steps | count | GPU ms | share | ms/step | decode "
          f"tokens | tok/s |\n  |---|---|---|---|---|---|---|")
    out = {}
    for i, key in enumerate(["prefill"] + list(TIMELINE_BINS)):
        if key not in rows:
            continue
        n, ms, tok = rows[key]
        label = ("with prefill tokens" if key == "prefill"
                 else f"decode {(TIMELINE_BINS[i - 2] if i > 1 else 0) + 1}..{key}")
        print(f"  | {label} | {n} | {ms:,.1f} | {ms / max(wall_ms, 1e-9):.1%} | {ms / n:.2f} | "
              f"{tok} | {tok / max(ms, 1e-9) * 1e3:,.0f} |")
        out[str(key)] = dict(steps=n, ms=ms, decode_tokens=tok)
    return dict(timeline=out, timeline_wall_ms=wall_ms, timeline_idle_ms=idle_ms)


def run_ours_batch1(llm: LLM, prompt, new_tokens: int) -> tuple[float, float]:
    """-> (decode tok/s between the first and the last token, end-to-end tok/s)."""
    sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=new_tokens)
    llm.generate([prompt], SamplingParams(temperature=0, ignore_eos=True, max_tokens=32),
                 use_tqdm=False)  # warm-up
    stamps = []
    start = time.perf_counter()
    for delta in llm.stream([prompt], sp):
        stamps.append((time.perf_counter(), len(delta.token_ids)))
    end = time.perf_counter()
    n = sum(k for _, k in stamps)
    assert n == new_tokens
    decode = (n - stamps[0][1]) / (stamps[-1][0] - stamps[0][0])
    return decode, n / (end - start)


def context_range(text: str) -> tuple[int, int]:
    """--profile-context: ``N`` tokens, or ``LO..HI`` (each sequence's drawn uniformly)."""
    lo, sep, hi = text.partition("..")
    try:
        lo, hi = int(lo), int(hi if sep else lo)
    except ValueError:
        lo, hi = 0, -1
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected N or LO..HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


def context_text(context: tuple[int, int]) -> str:
    return f"{context[0]}" if context[0] == context[1] else f"{context[0]}..{context[1]}"


def run_profile(llm: LLM, num_seqs: int, context: tuple[int, int], steps: int = 8,
                top: int = 14, overlap: bool = False) -> dict:
    """Profile decode steps of ``num_seqs`` running sequences at ~``context`` tokens (LO, HI:
    each sequence's drawn from it): host wall time per step, GPU kernel time per step (kernel by
    kernel), the gap between them, and the step's roofline (weights + KV cache read once at the
    H200's read ceiling).

    ``overlap``: the steps of generate's loop (the host prepares step k + 1 while the GPU runs
    step k, as in every benchmark above) instead of ``step()`` one by one, so the gap is the GPU's
    idle time per step in the real loop (with tensor parallelism: on rank 0)."""
    from torch.profiler import ProfilerActivity, profile

    vocab = llm.config.hf_config.vocab_size
    rng = random.Random(1)
    sp = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=steps + 64)
    lengths = [rng.randint(*context) for _ in range(num_seqs)]
    for i, n in enumerate(lengths):
        llm.add_request([rng.randrange(min(vocab, 10000)) for _ in range(n)], sp, i)
    while llm.scheduler.waiting or any(s.num_completion_tokens == 0 for s in llm.scheduler.running):
        llm.step()  # prefill everything
    for _ in range(4):
        _, n_pre, _ = llm.step()  # warm decode steps (and any prefill tail)
    runner = llm.model_runner
    graph_steps = runner.num_graph_steps
    walls = []
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        if overlap:
            loop = llm._steps()
            t0 = time.perf_counter()
            for _ in range(steps):
                _, _, n_pre, n_dec = next(loop)
                assert n_pre == 0 and n_dec == num_seqs, "the profiled steps must be pure decode"
            loop.close()  # reads the step in flight
            sync()
            # the loop launched one step more than it yielded (each launch runs ahead of the read),
            # and the profile holds its kernels too: per-step figures divide by steps + 1
            walls = [(time.perf_counter() - t0) / (steps + 1)] * (steps + 1)
        for _ in range(0 if overlap else steps):
            t0 = time.perf_counter()
            _, n_pre, n_dec = llm.step()
            walls.append(time.perf_counter() - t0)
            assert n_pre == 0 and n_dec == num_seqs, "the profiled steps must be pure decode"
    replayed = runner.num_graph_steps - graph_steps
    llm.scheduler.abort_all()
    # kernels only: an eager op (aten::mm, say) also carries its kernels' time, and counting both
    # doubled the eager part of the step
    from torch.autograd import DeviceType

    rows = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0
                   and getattr(e, "device_type", None) == DeviceType.CUDA),
                  key=lambda e: -e.self_device_time_total)
    n_steps = len(walls)  # steps whose kernels the profile holds
    gpu_us = sum(e.self_device_time_total for e in rows) / n_steps
    if gpu_us == 0:
        print("no CUDA kernel time recorded (no GPU, or the profiler saw no kernels)")
        return dict(mode="profile", num_seqs=num_seqs, context=context_text(context))
    wall_us = 1e6 * sum(walls) / n_steps
    model = runner.model
    cfg = llm.config.hf_config
    kv_heads = max(1, cfg.num_key_value_heads // llm.config.tensor_parallel_size)
    kv_elem = llm.config.kv_cache_torch_dtype.itemsize  # e4m3: 1
    kv_bytes = ((sum(lengths) + num_seqs * steps) * cfg.num_hidden_layers * 2 * kv_heads
                * cfg.head_dim * kv_elem)
    w_bytes = weight_bytes_per_token(model)
    ideal_us = (w_bytes + kv_bytes) / (H200_READ_TBS * 1e6)
    print(f"\ndecode step profile: {num_seqs} sequences at ~{context_text(context)} tokens, "
          f"{steps} steps "
          f"({replayed} from CUDA graphs; {'overlapped loop' if overlap else 'step() by step()'})")
    print(f"  host wall {wall_us:,.0f} us/step; GPU kernels {gpu_us:,.0f} us/step "
          f"({gpu_us / wall_us:.0%} busy, gap {wall_us - gpu_us:,.0f} us)")
    print(f"  roofline: weights {w_bytes / 1e9:.2f} GB + KV {kv_bytes / 1e9:.2f} GB at the H200's "
          f"{H200_READ_TBS} TB/s = {ideal_us:,.0f} us/step; kernels at {ideal_us / gpu_us:.0%} "
          f"of it, the step at {ideal_us / wall_us:.0%}")
    if gpu_us > wall_us:
        # PDL: a kernel is resident (and timed) from its launch, before its griddepcontrol.wait,
        # while the kernel before it still runs
        print("  kernels overlap (PDL launches): each time below includes its wait for the kernel "
              "before it, so they do not add up to the step")
    print(f"  | kernel | calls/step | us/step | share |\n  |---|---|---|---|")
    for e in rows[:top]:
        name = e.key if len(e.key) <= 70 else e.key[:67] + "..."
        us = e.self_device_time_total / n_steps
        print(f"  | `{name}` | {e.count / n_steps:.0f} | {us:,.1f} | {us / gpu_us:.1%} |")
    return dict(mode="profile", num_seqs=num_seqs, context=context_text(context), wall_us=wall_us,
                gpu_us=gpu_us, ideal_us=ideal_us, graph_steps=replayed)


def run_prefill_profile(llm: LLM, num_seqs: int, context: tuple[int, int],
                        top: int = 16) -> dict:
    """Profile one prefill step: ``num_seqs`` waiting prompts of ``context`` tokens (LO, HI: each
    prompt's drawn from it), as many as the step's token budget admits (the workload's first
    steps are such steps): kernel by kernel, the GPU time of the step and its matmul FLOPs
    against cuBLAS's measured 739 TFLOP/s."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    vocab = llm.config.hf_config.vocab_size
    rng = random.Random(2)
    sp = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=4)
    llm.generate([[1, 2, 3, 4] * 64] * 4, sp, use_tqdm=False)  # warm-up: eager kernels, autotuning
    for i in range(num_seqs):
        n = rng.randint(*context)
        llm.add_request([rng.randrange(min(vocab, 10000)) for _ in range(n)], sp, i)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        _, n_pre, n_dec = llm.step()
        sync()
        wall_us = 1e6 * (time.perf_counter() - t0)
    llm.scheduler.abort_all()
    rows = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0
                   and getattr(e, "device_type", None) == DeviceType.CUDA),
                  key=lambda e: -e.self_device_time_total)
    gpu_us = sum(e.self_device_time_total for e in rows)
    cfg = llm.config.hf_config
    params = sum(p.numel() for p in llm.model_runner.model.parameters())
    params -= 2 * cfg.vocab_size * cfg.hidden_size  # the embedding and the LM head: not per token
    matmul_tflop = 2 * n_pre * params / 1e12
    print(f"\nprefill step profile: {n_pre} prefill tokens ({num_seqs} prompts of "
          f"{context_text(context)} offered), {n_dec} decodes; wall {wall_us / 1e3:,.1f} ms, "
          f"GPU kernels {gpu_us / 1e3:,.1f} ms; the projections' {matmul_tflop:,.0f} TFLOP at "
          f"739 TFLOP/s = {matmul_tflop / 739 * 1e3:,.1f} ms")
    print("  | kernel | calls | ms | share |\n  |---|---|---|---|")
    for e in rows[:top]:
        name = e.key if len(e.key) <= 70 else e.key[:67] + "..."
        print(f"  | `{name}` | {e.count} | {e.self_device_time_total / 1e3:,.2f} | "
              f"{e.self_device_time_total / gpu_us:.1%} |")
    return dict(mode="profile_prefill", prefill_tokens=n_pre, wall_us=wall_us, gpu_us=gpu_us)


# ---- transformers -----------------------------------------------------------------------------

def hf_model(path: str, dtype, attn: str | None):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    kw = {"dtype": dtype}
    if attn:
        kw["attn_implementation"] = attn
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, **kw)
    return model.eval()


def run_hf_throughput(path: str, dtype, prompts, max_tokens) -> tuple[float, int]:
    """transformers' paged continuous batching (what generate_batch runs), with each request's
    own max_new_tokens, timed from the first add to the last result."""
    from transformers import GenerationConfig

    model = hf_model(path, dtype, "paged|sdpa")
    gen = GenerationConfig(do_sample=True, temperature=0.6, top_k=0, top_p=1.0,
                           max_new_tokens=max(max_tokens), eos_token_id=-1, pad_token_id=0)
    with torch.no_grad(), model.continuous_batching_context_manager(generation_config=gen,
                                                                    block=True) as manager:
        def run(reqs):
            ids = {manager.add_request(p, max_new_tokens=m) for p, m in reqs}
            n, done = 0, 0
            while done < len(ids):
                res = manager.get_result(timeout=5)
                if res is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' generation thread died")
                    continue
                if res.request_id in ids and res.is_finished():
                    if res.error:
                        raise RuntimeError(f"transformers request failed: {res.error}")
                    n += len(res.generated_tokens)
                    done += 1
            return n

        run([([1, 2, 3, 4] * 8, 16)])  # warm-up
        sync()
        start = time.perf_counter()
        n_out = run(list(zip(prompts, max_tokens)))
        seconds = time.perf_counter() - start
    del model, manager
    free_gpu()
    return seconds, n_out


def run_hf_batch1(path: str, dtype, prompt, new_tokens: int) -> float:
    model = hf_model(path, dtype, None)
    ids = torch.tensor([prompt], device=model.device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
              eos_token_id=None)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=16, min_new_tokens=16, **kw)
        sync()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        sync()
        seconds = time.perf_counter() - start
    del model
    free_gpu()
    return new_tokens / seconds


# ---- main -------------------------------------------------------------------------------------

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--size", choices=sorted(QWEN3_SIZES) + ["demo"], default="0.6B",
                     help="random-weight Qwen3 at this real shape (demo: a tiny one, for a CPU "
                          "smoke run)")
    src.add_argument("--model", help="a real checkpoint folder instead of --size")
    p.add_argument("--num-seqs", type=int, default=256, help="requests in the workload")
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--batch1", action="store_true",
                   help="batch-1 decode instead: 128-token prompt, 512 new tokens, tok/s and "
                        "achieved weight bandwidth")
    p.add_argument("--baseline", choices=["none", "hf"], default="none",
                   help="hf: transformers on the same requests in the same run")
    p.add_argument("--profile", action="store_true",
                   help="profile decode steps of --num-seqs sequences at --profile-context tokens")
    p.add_argument("--profile-context", type=context_range, default=(512, 512),
                   help="N tokens a sequence, or LO..HI (each drawn from it; e.g. 100..2047)")
    p.add_argument("--profile-prefill", action="store_true",
                   help="with --profile: one prefill step of --num-seqs prompts of "
                        "--profile-context tokens instead of decode steps")
    p.add_argument("--profile-overlap", action="store_true",
                   help="profile the steps of the overlapped generate loop instead of step()")
    p.add_argument("--timeline", action="store_true",
                   help="workload: also time every step on the device (CUDA events) and print "
                        "where the time goes: prefill steps, decode steps by batch size, idle")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", choices=["none", "fp8"], default="none",
                   help="--size's random checkpoint in Qwen3-*-FP8's format (fp8) or not")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="KV cache element type: the model's dtype (auto) or float8 e4m3 (fp8)")
    p.add_argument("--deterministic", action="store_true",
                   help="the batch-invariant mode (LLM's deterministic)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="auto",
                   help="the order waiting requests are admitted in (LLM's scheduling_policy)")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--max-piecewise-graph-tokens", type=int, default=512,
                   help="LLM's max_piecewise_graph_tokens (0: steps with prompt tokens run "
                        "eagerly)")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1,
                   help="GPUs (one process each); weights bandwidth is then per GPU")
    p.add_argument("--no-overlap-steps", action="store_true",
                   help="LLM(overlap_steps=False): the host prepares a step only after the last "
                        "one's tokens are read (default: overlapped)")
    p.add_argument("--tp-all-reduce", choices=TP_ALL_REDUCE_CHOICES, default="auto",
                   help="LLM's tp_all_reduce: auto = ours where it can run, else NCCL")
    p.add_argument("--no-gpu-clocks", action="store_true",
                   help="do not poll nvidia-smi for the GPU's clocks and power during the run")
    p.add_argument("--results-dir", default=None,
                   help="where results/bench_engine.json goes (default: benchmarks/results)")
    p.add_argument("--allow-reference", action="store_true",
                   help="run on a CUDA device even when the qwen3_kernels extension is not loaded "
                        "(the reference path: its numbers say nothing about the kernels)")
    args = p.parse_args(argv)
    if args.model and args.quantization != "none":
        p.error("--quantization applies to --size's random checkpoint; a --model checkpoint's "
                "config.json says its own")
    if not torch.cuda.is_available():
        print("note: no CUDA device; this runs the CPU reference path and says nothing about "
              "the kernels", flush=True)
    else:
        import qwen3_kernels

        if not qwen3_kernels.has_cuda_kernels() and not args.allow_reference:
            # a benchmark of the reference path on a GPU is not a number about this engine
            # (a run without its build printed 9-16 tok/s for Qwen3-8B)
            p.error("the qwen3_kernels CUDA extension is not loaded "
                    f"({qwen3_kernels.cuda_kernels_import_error()}); build it "
                    "(pip install --no-build-isolation -e .) or pass --allow-reference")

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16,
             "float32": torch.float32}[args.dtype]
    with tempfile.TemporaryDirectory(prefix="qwen3-bench-") as tmp:
        if args.model:
            path, dummy, name = args.model, False, Path(args.model).name
        else:
            fp8 = args.quantization == "fp8"
            write_random_checkpoint(tmp, args.size, dtype=dtype, weights=False, tokenizer=False,
                                    quantization="fp8" if fp8 else None)
            path, dummy = tmp, True
            name = f"Qwen3-{args.size}{'-FP8' if fp8 else ''} (random weights)"
        result = {"model": name, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available()
                  else "cpu", "enforce_eager": args.enforce_eager,
                  "tensor_parallel_size": args.tensor_parallel_size,
                  "quantization": quantization_method(read_config(path), path) or "none"}
        print(f"{name}: quantization {result['quantization']}", flush=True)

        if args.profile:
            llm = make_llm(path, args, dummy)
            if args.profile_prefill:
                result.update(run_prefill_profile(llm, args.num_seqs, args.profile_context))
            else:
                result.update(run_profile(llm, args.num_seqs, args.profile_context,
                                          overlap=args.profile_overlap))
            llm.close()
        elif args.batch1:
            llm = make_llm(path, args, dummy)
            vocab = llm.config.hf_config.vocab_size
            prompt = random.Random(0).choices(range(min(10000, vocab)), k=128)
            bytes_per_token = weight_bytes_per_token(llm.model_runner.model)
            with GpuClocks(enabled=not args.no_gpu_clocks) as clocks:
                decode_tps, e2e_tps = run_ours_batch1(llm, prompt, 512)
            llm.close()
            del llm
            free_gpu()
            bw = decode_tps * bytes_per_token / 1e12
            tp = args.tensor_parallel_size
            print(f"\n{name}, batch 1, 128-token prompt, 512 new tokens"
                  + (f", tensor parallel {tp} (bandwidth per GPU)" if tp > 1 else "") + ":")
            print(f"  ours: {decode_tps:,.1f} decode tok/s ({e2e_tps:,.1f} end to end); weights "
                  f"{bytes_per_token / 1e9:.2f} GB/token -> {bw:.2f} TB/s = "
                  f"{bw / H200_READ_TBS:.0%} of the H200's {H200_READ_TBS} TB/s read ceiling "
                  f"(roofline there {H200_READ_TBS * 1e12 / bytes_per_token:,.0f} tok/s)")
            if clocks.samples:
                print(clocks.describe())
            result.update(mode="batch1", decode_tok_s=decode_tps, e2e_tok_s=e2e_tps,
                          weight_tb_s=bw, **(clocks.summary() or {}))
            if args.baseline == "hf":
                hf_tps = run_hf_batch1(path, dtype, prompt, 512)
                print(f"  transformers generate: {hf_tps:,.1f} tok/s; ours / hf = "
                      f"{e2e_tps / hf_tps:.2f}x (end to end)")
                result.update(hf_tok_s=hf_tps)
        else:
            prompts, max_tokens = nano_vllm_workload(args.num_seqs, 0, args.max_input_len,
                                                     args.max_output_len)
            llm = make_llm(path, args, dummy)
            vocab = llm.config.hf_config.vocab_size
            prompts = [[t % vocab for t in p] for p in prompts]  # only the tiny demo vocab wraps
            timeline = args.timeline and torch.cuda.is_available()
            with GpuClocks(enabled=not args.no_gpu_clocks) as clocks:
                seconds, n_out, steps = run_ours_throughput(llm, prompts, max_tokens, timeline)
            sched = llm.scheduler
            stats = dict(steps=sched.num_steps, preemptions=sched.num_preemptions,
                         partial_prefills=sched.num_partial_prefills)
            if llm.model_runner.piecewise is not None:
                stats["piecewise_steps"] = llm.model_runner.piecewise.num_steps
            if llm.offline_schedule is not None:  # scheduling_policy "auto" chose it
                stats["auto_longest_first"] = "max_num_seqs %d, max_num_batched_tokens %d" % (
                    llm.offline_schedule)
            llm.close()
            del llm, sched
            free_gpu()
            tps = n_out / seconds
            print(f"\n{name}, {args.num_seqs} requests, {sum(map(len, prompts))} prompt tokens, "
                  f"{n_out} output tokens ({args.scheduling_policy}, max_num_batched_tokens "
                  f"{args.max_num_batched_tokens}, max_piecewise_graph_tokens "
                  f"{args.max_piecewise_graph_tokens}):")
            print(f"  ours: {seconds:.2f} s, {tps:,.0f} output tok/s  ({stats})")
            if clocks.samples:
                print(clocks.describe())
            result.update(mode="throughput", num_seqs=args.num_seqs, output_tokens=n_out,
                          scheduling_policy=args.scheduling_policy,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          max_piecewise_graph_tokens=args.max_piecewise_graph_tokens,
                          seconds=seconds, tok_s=tps, **stats, **(steps or {}),
                          **(clocks.summary() or {}))
            if args.baseline == "hf" and not torch.cuda.is_available():
                print("  transformers' continuous batching sizes its cache from GPU memory and "
                      "does not run on CPU: baseline skipped")
            elif args.baseline == "hf":
                hf_s, hf_n = run_hf_throughput(path, dtype, prompts, max_tokens)
                hf_tps = hf_n / hf_s
                print(f"  transformers continuous batching: {hf_s:.2f} s, {hf_tps:,.0f} output "
                      f"tok/s ({hf_n} tokens)\n  ours / hf = {tps / hf_tps:.2f}x")
                result.update(hf_tok_s=hf_tps, ratio=tps / hf_tps)
    if result.get("mode") in ("throughput", "batch1"):
        path = write_engine_row(engine_row(result, args), args.results_dir, argv)
        print(f"  -> {path}")
    return result


def engine_row(result: dict, args) -> dict:
    """The result as one row of results/bench_engine.json (record.py): workload, model, settings,
    output / decode tok/s, the baseline if one ran, the GPU's clocks, decode tok/s by batch size
    where the step timeline ran."""
    batch1 = result["mode"] == "batch1"
    workload = ("batch 1: 128-token prompt, 512 new tokens" if batch1
                else f"nano-vllm: {args.num_seqs} requests")
    settings = dict(scheduling_policy=args.scheduling_policy, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    max_piecewise_graph_tokens=args.max_piecewise_graph_tokens,
                    overlap_steps=not args.no_overlap_steps, tp_all_reduce=args.tp_all_reduce,
                    tensor_parallel_size=args.tensor_parallel_size,
                    enforce_eager=args.enforce_eager, block_size=args.block_size,
                    kv_cache_dtype=args.kv_cache_dtype, deterministic=args.deterministic)
    row = dict(workload=workload, mode=result["mode"], model=result["model"],
               size=None if args.model else args.size, settings=settings,
               output_tok_s=result.get("e2e_tok_s") if batch1 else result.get("tok_s"),
               decode_tok_s=result.get("decode_tok_s"), weight_tb_s=result.get("weight_tb_s"),
               seconds=result.get("seconds"), output_tokens=result.get("output_tokens"),
               quantization=result.get("quantization", "none"))
    if "hf_tok_s" in result:
        row.update(baseline="transformers", baseline_tok_s=result["hf_tok_s"],
                   ratio=row["output_tok_s"] / result["hf_tok_s"])
    clocks = {k: result[k] for k in ("gpu_uuid", "sm_mhz_min", "sm_mhz_median", "mem_mhz_median",
                                     "power_w_median", "power_w_max", "temp_c_max") if k in result}
    row["clocks"] = clocks or None
    if "timeline" in result:  # decode-only steps by batch size bin: decode tok/s of each
        row["decode_tok_s_by_batch"] = {
            k: v["decode_tokens"] / v["ms"] * 1e3 for k, v in result["timeline"].items()
            if k != "prefill" and v["ms"] > 0}
    return row


def write_engine_row(row: dict, results_dir=None, argv=None) -> Path:
    """Puts ``row`` into results/bench_engine.json, replacing the row of the same workload, model
    and settings; the file's run info is this run's, each row keeps its own (date, GPU, commit)."""
    info = record.run_info(["bench_engine.py", *(sys.argv[1:] if argv is None else argv)])
    row = dict(row, command=info["command"], date=info["date"], gpu=info["gpu"],
               commit=info["commit"])
    path = record.results_path("bench_engine", results_dir)
    rows = []
    if path.exists():
        try:
            rows = json.loads(path.read_text()).get("rows", [])
        except (ValueError, AttributeError):
            rows = []

    def key(r):
        # rows from before --kv-cache-dtype / --deterministic ran their defaults: the same setting
        settings = {"kv_cache_dtype": "auto", "deterministic": False, **(r.get("settings") or {})}
        return (r.get("workload"), r.get("model"), json.dumps(settings, sort_keys=True))

    rows = [r for r in rows if key(r) != key(row)] + [row]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"bench": "bench_engine", **info, "rows": rows}, indent=1) + "\n")
    return path



if __name__ == "__main__":
    main()
