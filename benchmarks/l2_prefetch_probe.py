"""Probe: does asking L2 for o_proj's weight while batch-1 attention runs make a decode step faster?

    cd benchmarks && python l2_prefetch_probe.py [--positions none,mid,pre] [--grid 132] [--reps 2]

At Qwen3-8B batch 1 the DRAM idles for ~10 us a layer while qk_norm_rope, the decode attention and
its combine run (a few MB of K/V); o_proj (32 MB) streams right after. This probe puts one extra
kernel into every layer of the decode graphs (launched with PDL on the model's stream, no fork)
that issues L2 prefetches of o_proj's weight, of the first gate / up rows, or of a scratch buffer
nobody reads (the traffic's cost alone), then times `bench_engine.py --batch1`'s loop for each
setting. Positions: "pre" after the qkv projection, "mid" after qk_norm_rope (before the decode
attention), "none" the model untouched. Two more bound what hiding the attention could give at
all (no prefetch; wrong tokens, timing only): "skip_attention" runs neither qk_norm_rope nor the
decode attention (o_proj reads a zero buffer), "skip_decode" runs qk_norm_rope but not the decode
attention and its combine. The kernel reads its setting from a device buffer, so one
engine (one graph capture) serves every setting of a position.

Settings (KB of o_proj or scratch, KB of gate rows and of up rows, mode, scratch?): mode 0 one
`cp.async.bulk.prefetch.L2` per 16 KB, 3 the same per 4 KB, 1 `prefetch.global.L2` per 128 B,
2 that with `evict_last`.

Measured (H200, 2026-12-01, fifteenth session; benchmarks/RESULTS.md): every prefetch made the step
slower, even 1 MB in bulk; prefetching o_proj was no better than prefetching scratch, i.e. o_proj
did not get faster from finding its weight in L2. The monkeypatching is the probe's, not the model's.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CUDA_SOURCE = r"""
#include <cuda_runtime.h>
// cfg [4] int32: KB of o_proj (or of scratch when cfg[3] == 1), KB of gate rows and of up rows
// each, mode, scratch. Read before the wait: no kernel writes it.
__global__ void __launch_bounds__(128) prefetch_kernel(const char* po, long long cap_o,
    const char* pg, const char* pu, long long cap_half, const char* ps, long long cap_s,
    const int* cfg) {
  const int mode = cfg[2];
  const char* p1 = cfg[3] ? ps : po;
  const long long cap1 = cfg[3] ? cap_s : cap_o;
  const int shift = mode == 0 ? 14 : mode == 3 ? 12 : 7;  // bytes per instruction: 16 KB, 4 KB, 128
  const long long mask = (1LL << 14) - 1;
  const long long n1 = min(cap1, (long long)cfg[0] * 1024) & ~mask;
  const long long n2 = min(cap_half, (long long)cfg[1] * 1024) & ~mask;
  const long long chunks1 = n1 >> shift, chunks = chunks1 + 2 * (n2 >> shift);
  for (long long c = blockIdx.x * (long long)blockDim.x + threadIdx.x; c < chunks;
       c += (long long)gridDim.x * blockDim.x) {
    const long long d = c - chunks1;  // gate and up rows alternate: the order the GEMV reads them
    const char* a = c < chunks1 ? p1 + (c << shift) : ((d & 1) ? pu : pg) + ((d >> 1) << shift);
    if (mode == 0)
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"(16384) : "memory");
    else if (mode == 3)
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"(4096) : "memory");
    else if (mode == 1)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(a) : "memory");
    else
      asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(a) : "memory");
  }
  // let the next kernel launch, then wait for the one before: the next kernel's wait then covers it
  asm volatile("griddepcontrol.launch_dependents;" ::);
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
extern "C" int prefetch_launch(const void* po, long long cap_o, const void* pg, const void* pu,
    long long cap_half, const void* ps, long long cap_s, const int* cfg, int grid, void* stream) {
  cudaLaunchConfig_t c = {};
  cudaLaunchAttribute a[1];
  a[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a[0].val.programmaticStreamSerializationAllowed = 1;
  c.gridDim = dim3(grid);
  c.blockDim = dim3(128);
  c.stream = (cudaStream_t)stream;
  c.attrs = a;
  c.numAttrs = 1;
  return (int)cudaLaunchKernelEx(&c, prefetch_kernel, (const char*)po, cap_o, (const char*)pg,
                                 (const char*)pu, cap_half, (const char*)ps, cap_s, cfg);
}
"""

SETTINGS = [(0, 0, 0, 0), (8192, 0, 0, 0), (8192, 0, 0, 1), (32768, 0, 0, 1), (8192, 0, 3, 0),
            (8192, 0, 1, 0), (32768, 0, 1, 0), (8192, 0, 2, 0), (32768, 0, 2, 0), (32768, 0, 1, 1),
            (1024, 0, 0, 0), (1024, 0, 1, 0)]


def build(tmp: str):
    src, lib = os.path.join(tmp, "prefetch.cu"), os.path.join(tmp, "prefetch.so")
    Path(src).write_text(CUDA_SOURCE)
    subprocess.run(["nvcc", "-shared", "-Xcompiler", "-fPIC", "-O3",
                    "-gencode=arch=compute_90a,code=sm_90a", src, "-o", lib], check=True)
    so = ctypes.CDLL(lib)
    so.prefetch_launch.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p,
                                   ctypes.c_longlong, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    return so


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="8B")
    p.add_argument("--positions", default="none,mid")
    p.add_argument("--grid", type=int, default=132)
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        sys.exit("needs an sm_90 GPU")

    import qwen3_kernels
    import qwen3_model.models.qwen3 as q3
    from bench_engine import free_gpu, make_llm, run_ours_batch1
    from qwen3_model.random_checkpoint import write_random_checkpoint

    tmp = tempfile.mkdtemp(prefix="l2-prefetch-")
    so = build(tmp)
    cfg = torch.zeros(4, dtype=torch.int32, device="cuda")
    scratch = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")
    state = {"pos": None, "target": None}

    def launch(attn):  # attn: a Qwen3Attention whose layer's MLP is attn._probe_mlp
        o, gu = attn.o_proj.weight, attn._probe_mlp.gate_up_proj.weight
        half = gu.numel() * gu.element_size() // 2
        err = so.prefetch_launch(o.data_ptr(), o.numel() * o.element_size(), gu.data_ptr(),
                                 gu.data_ptr() + half, half, scratch.data_ptr(), scratch.numel(),
                                 cfg.data_ptr(), args.grid, torch.cuda.current_stream().cuda_stream)
        if err:
            raise RuntimeError(f"prefetch_launch: CUDA error {err}")

    layer_init = q3.Qwen3DecoderLayer.__init__
    qk_norm_rope = qwen3_kernels.qk_norm_rope

    def init(self, *a, **k):
        layer_init(self, *a, **k)
        object.__setattr__(self.self_attn, "_probe_mlp", self.mlp)  # a plain attribute, not a submodule

    def attention_forward(self, positions, x):  # Qwen3Attention.forward with the probe's kernel
        small = x.shape[0] <= 16 and state["pos"] is not None  # decode graphs of a few rows
        qkv = self.qkv_proj(x)
        if small and state["pos"] == "skip_attention":
            if getattr(self, "_probe_zeros", None) is None:  # made in the warm-up before capture
                object.__setattr__(self, "_probe_zeros", torch.zeros(
                    16, self.num_heads * self.attn.head_dim, dtype=qkv.dtype, device=qkv.device))
            return self.o_proj(self._probe_zeros[: x.shape[0]])
        if small and state["pos"] == "pre":
            launch(self)
        state["target"] = self if small and state["pos"] == "mid" else None
        o = self.attn(qkv, positions, self.q_norm.weight, self.k_norm.weight,
                      self.rotary_emb.cos_sin_cache)
        state["target"] = None
        return self.o_proj(o)

    def qk_norm_rope_then_prefetch(*a, **k):
        r = qk_norm_rope(*a, **k)
        if state["target"] is not None:
            launch(state["target"])
        return r

    paged_attention_decode = qwen3_kernels.paged_attention_decode

    def decode_or_skip(q, *a, out=None, **k):
        if state["pos"] == "skip_decode" and q.shape[0] <= 16:
            return out  # out keeps whatever it holds
        return paged_attention_decode(q, *a, out=out, **k)

    q3.Qwen3DecoderLayer.__init__ = init
    qwen3_kernels.paged_attention_decode = decode_or_skip
    q3.Qwen3Attention.forward = attention_forward
    qwen3_kernels.qk_norm_rope = qk_norm_rope_then_prefetch

    engine_args = argparse.Namespace(max_model_len=4096, enforce_eager=False,
                                     gpu_memory_utilization=0.9, max_num_seqs=512,
                                     max_num_batched_tokens=16384, block_size=256,
                                     dtype="bfloat16", tensor_parallel_size=1)
    with tempfile.TemporaryDirectory(prefix="qwen3-bench-") as path:
        write_random_checkpoint(path, args.size, dtype=torch.bfloat16, weights=False, tokenizer=False)
        for pos in args.positions.split(","):
            state["pos"] = None if pos == "none" else pos
            llm = make_llm(path, engine_args, True)  # captures the decode graphs with the probe in
            vocab = llm.config.hf_config.vocab_size
            prompt = random.Random(0).choices(range(min(10000, vocab)), k=128)
            for _ in range(args.reps):
                for s in SETTINGS if pos in ("pre", "mid") else SETTINGS[:1]:
                    cfg.copy_(torch.tensor(s, dtype=torch.int32))
                    torch.cuda.synchronize()
                    decode, _ = run_ours_batch1(llm, prompt, 512)
                    print(f"position {pos}, setting {s} (KB o|scratch, KB gate+up each, mode, "
                          f"scratch), grid {args.grid}: {decode:.1f} decode tok/s", flush=True)
            llm.close()
            del llm
            free_gpu()


if __name__ == "__main__":
    main()
