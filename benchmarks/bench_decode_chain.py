"""decode_chain (one token: o_proj .. the next layer's qkv_proj in one kernel) against the same six
launches it replaces (our GEMVs and norms: what the model runs without it) and cuBLAS for the
matmuls, at the Qwen3 sizes, bf16.

    cd benchmarks && pytest -q -s bench_decode_chain.py

A CUDA graph of 36 layers (Qwen3-8B's count) replays over 8 weight sets, so every layer streams
its weights from HBM (8 x 386 MB at 8B, far past the L2). Bytes that must move: the chain's
weights (the activations are a few KB). Rows: "chain" the default launch, "chain[pdl]" the PDL
launch; both alternated with the baselines by rematch.
"""

import pytest
import torch

import qwen3_kernels
from qwen3_kernels import elementwise_tuning as et
from common import rematch, time_gpu

DT = torch.bfloat16
EPS = 1e-6
LAYERS = 36
SETS = 8
SHAPES = {  # hidden, q width, intermediate, qkv rows
    "Qwen3-8B": (4096, 4096, 12288, 6144),
    "Qwen3-0.6B": (1024, 2048, 3072, 4096),
    "Qwen3-32B": (5120, 8192, 25600, 10240),
}


def _weights(h, q, i, n, sets):
    def r(*shape, scale):
        return (torch.randn(*shape, device="cuda") * scale).to(DT)

    return [dict(o=r(h, q, scale=q**-0.5), post=1 + r(h, scale=0.1), gu=r(2 * i, h, scale=h**-0.5),
                 down=r(h, i, scale=i**-0.5), nxt=1 + r(h, scale=0.1), qkv=r(n, h, scale=h**-0.5))
            for _ in range(sets)]


@pytest.mark.parametrize("model", list(SHAPES))
def test_decode_chain(model, report):
    h, q, i, n = SHAPES[model]
    if not qwen3_kernels.decode_chain_supported(h, q, i, "cuda"):
        pytest.skip("decode_chain needs an sm_90 GPU")
    per_set = 2 * (h * q + 2 * i * h + h * i + n * h)
    sets = max(2, min(SETS, int(4e9 // per_set)))  # keep the 32B case under ~4 GB
    W = _weights(h, q, i, n, sets)
    attn = torch.randn(1, q, device="cuda").to(DT)
    residual = torch.randn(1, h, device="cuda").to(DT)
    ws = qwen3_kernels.decode_chain_workspace(h, i, "cuda")
    out = torch.empty(1, n, device="cuda", dtype=DT)

    def chain(s):
        w = W[s]
        return lambda: qwen3_kernels.decode_chain(attn, residual, w["o"], w["post"], w["gu"],
                                                  w["down"], w["nxt"], w["qkv"], EPS, ws, out=out)

    # the unfused layer as the model runs it at batch 1 without the chain (our ops), and with
    # cuBLAS for the four matmuls
    o_buf = torch.empty(1, h, device="cuda", dtype=DT)
    act = torch.empty(1, i, device="cuda", dtype=DT)
    gu_buf = torch.empty(1, 2 * i, device="cuda", dtype=DT)

    def unfused(s):
        w = W[s]

        def run():
            qwen3_kernels.linear(attn, w["o"], out=o_buf)
            qwen3_kernels.fused_add_rms_norm(o_buf, residual, w["post"], EPS)
            qwen3_kernels.linear_silu_and_mul(o_buf, w["gu"], out=act)
            qwen3_kernels.linear(act, w["down"], out=o_buf)
            qwen3_kernels.fused_add_rms_norm(o_buf, residual, w["nxt"], EPS)
            qwen3_kernels.linear(o_buf, w["qkv"], out=out)
        return run

    def cublas(s):
        w = W[s]

        def run():
            torch.mm(attn, w["o"].t(), out=o_buf)
            qwen3_kernels.fused_add_rms_norm(o_buf, residual, w["post"], EPS)
            torch.mm(o_buf, w["gu"].t(), out=gu_buf)
            qwen3_kernels.silu_and_mul(gu_buf, out=act)
            torch.mm(act, w["down"].t(), out=o_buf)
            qwen3_kernels.fused_add_rms_norm(o_buf, residual, w["nxt"], EPS)
            torch.mm(o_buf, w["qkv"].t(), out=out)
        return run

    kw = dict(reps=10, calls_per_replay=LAYERS)
    paths = {
        "chain": [chain(s) for s in range(sets)],
        "unfused (our GEMVs + norms)": [unfused(s) for s in range(sets)],
        "cuBLAS + our norms": [cublas(s) for s in range(sets)],
    }
    best = {}
    with et.variant("chain", "pdl"):
        best["chain[pdl]"] = min(time_gpu([chain(s) for s in range(sets)], **kw) for _ in range(3))
    rematch(paths, best, rounds=3, **kw)
    torch.cuda.synchronize()
    assert ws[:4].view(torch.int32).item() == 0
    base = {k: v for k, v in best.items() if not k.startswith("chain")}
    for name in ("chain", "chain[pdl]"):
        report("decode_chain", f"{model} [{name}] one layer, weights rotated", best[name], base,
               nbytes=per_set)
    ratio = best["unfused (our GEMVs + norms)"] / best["chain"]
    print(f"\n{model}: chain {best['chain'] * 1e6:.1f} us/layer ({per_set / best['chain'] / 1e12:.2f} TB/s), "
          f"pdl {best['chain[pdl]'] * 1e6:.1f}; unfused "
          f"{best['unfused (our GEMVs + norms)'] * 1e6:.1f} ({ratio:.3f}x), cuBLAS "
          f"{best['cuBLAS + our norms'] * 1e6:.1f}")
