"""sample_tokens (one pass over the logits) vs the engine's tensor path and torch.compile of it.

    cd benchmarks && pytest -q -s bench_sample.py      # -> results/bench_sample.json

Qwen3 vocab (151936), bf16 logits as the LM head writes them, temperature 0.6 (the nano-vllm
bench workload's), N = 1 .. 256 rows. The baseline is what the sampler did before the kernel
(and still does for top-k / top-p / min-p rows): fp32 copy, divide by T, softmax, Exp(1) noise,
divide, argmax; "compile" is that sequence under torch.compile. Bytes that must move: the logits,
read once. Input sets rotate past the L2; every time is a CUDA graph replay of many calls, and
ours and compile are timed again alternating (common.rematch). The ratio is against compile.
"""

import pytest
import torch

import qwen3_kernels
from common import rematch, sets_for, time_gpu

VOCAB = 151936
TEMP = 0.6


def tensor_path(logits, temps):
    x = logits.float() / temps.unsqueeze(1)
    probs = torch.softmax(x, dim=-1)
    noise = torch.empty_like(probs).exponential_()
    return (probs / noise).argmax(dim=-1)


_compiled = None


@pytest.mark.parametrize("n", [1, 8, 64, 256])
def test_sample_tokens(n, report):
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(tensor_path, dynamic=False)
    nbytes = n * VOCAB * 2
    sets = []
    for i in range(sets_for(nbytes)):
        logits = torch.randn(n, VOCAB, device="cuda", dtype=torch.bfloat16) * 3
        temps = torch.full((n,), TEMP, device="cuda")
        keys = torch.randint(0, 1 << 32, (n, 3), device="cuda", dtype=torch.int64)
        out = torch.empty(n, dtype=torch.int64, device="cuda")
        sets.append((logits, temps, keys, out))
    # a correctness guard before timing: the kernel's tokens against the reference scores
    logits, temps, keys, out = sets[0]
    torch.ops.qwen3_kernels.sample_tokens(out, logits, temps, keys)
    scores = qwen3_kernels.reference.sample_scores(logits, temps, keys)
    got = scores.gather(1, out.unsqueeze(1)).squeeze(1)
    assert (got >= scores.max(-1).values - 1e-3).all()

    ours_fns = [lambda s=s: torch.ops.qwen3_kernels.sample_tokens(s[3], s[0], s[1], s[2])
                for s in sets]
    comp_fns = [lambda s=s: _compiled(s[0], s[1]) for s in sets]
    ours = time_gpu(ours_fns, calls_per_replay=64)
    eager = time_gpu([lambda s=s: tensor_path(s[0], s[1]) for s in sets], calls_per_replay=16)
    comp = time_gpu(comp_fns, calls_per_replay=16)
    best = rematch({"ours": ours_fns, "compile": comp_fns}, {"ours": ours, "compile": comp},
                   calls_per_replay=16)
    report("sample_tokens", f"N={n} V={VOCAB} bf16 T={TEMP}", best["ours"],
           {"compile": best["compile"], "tensor_path": eager}, nbytes=nbytes, baseline="compile",
           size=n, size_name="N", headline=n == 256)
