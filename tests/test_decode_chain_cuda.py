"""CUDA: decode_chain (one token from a layer's attention output to the next layer's qkv) against
the fp32 reference (skips without a GPU, or where the kernel does not run: not sm_90).

Tolerance (TARGETS.md, the FA3 rule for bf16 GEMMs): against the chain computed in fp32 without
any intermediate rounding, the kernel's error is at most 2x that of the same chain run by PyTorch
in the dtype (cuBLAS matmuls, the unfused ops' roundings), plus a floor of a few ulps for cases
where both are tiny. The kernel is deterministic (each output is one warp's fixed-order sum), so
repeated calls, graph replays and the launch variants must agree bit for bit.
"""

import pytest
import torch
import torch.nn.functional as F

import qwen3_kernels
from qwen3_kernels import elementwise_tuning as et
from qwen3_kernels import reference as ref
from tests.helpers import rel_err, requires_cuda

pytestmark = requires_cuda

EPS = 1e-6
# name: (hidden, q width, intermediate, next qkv rows or 0 = the last layer)
SHAPES = {
    "8B": (4096, 4096, 12288, 6144),
    "8B_last": (4096, 4096, 12288, 0),
    "0.6B": (1024, 2048, 3072, 4096),
    "odd": (2048, 1024, 5120, 1280),
    "32B": (5120, 8192, 25600, 10240),
}


def _supported(h, q, i):
    return qwen3_kernels.decode_chain_supported(h, q, i, "cuda")


def make_layer(h, q, i, n, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)

    return dict(
        attn=rnd(1, q),
        residual=rnd(1, h, scale=2.0),
        o_weight=rnd(h, q, scale=q**-0.5),
        post_norm_weight=(1 + 0.2 * torch.randn(h, generator=g, device="cuda")).to(dtype),
        gate_up_weight=rnd(2 * i, h, scale=h**-0.5),
        down_weight=rnd(h, i, scale=i**-0.5),
        next_norm_weight=(1 + 0.2 * torch.randn(h, generator=g, device="cuda")).to(dtype),
        next_qkv_weight=rnd(n, h, scale=h**-0.5) if n else None,
    )


def torch_chain(L):
    """The same chain in the dtype through PyTorch: cuBLAS matmuls, the unfused ops' roundings."""
    o = L["attn"] @ L["o_weight"].t()
    h, r1 = ref.fused_add_rms_norm(o, L["residual"], L["post_norm_weight"], EPS)
    gu = h @ L["gate_up_weight"].t()
    act = ref.silu_and_mul(gu)
    d = act @ L["down_weight"].t()
    x, r2 = ref.fused_add_rms_norm(d, r1, L["next_norm_weight"], EPS)
    return (x if L["next_qkv_weight"] is None else x @ L["next_qkv_weight"].t()), r2


def fp32_chain(L):
    f = {k: (v.float() if v is not None else None) for k, v in L.items()}
    return ref.decode_chain(f["attn"], f["residual"], f["o_weight"], f["post_norm_weight"],
                            f["gate_up_weight"], f["down_weight"], f["next_norm_weight"],
                            f["next_qkv_weight"], EPS)


def run_chain(L, ws, out=None, **kw):
    residual = L["residual"].clone()
    out = qwen3_kernels.decode_chain(L["attn"], residual, L["o_weight"], L["post_norm_weight"],
                                     L["gate_up_weight"], L["down_weight"], L["next_norm_weight"],
                                     L["next_qkv_weight"], EPS, ws, out=out, **kw)
    return out, residual


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_decode_chain_matches_reference(shape, dtype):
    h, q, i, n = SHAPES[shape]
    if not _supported(h, q, i):
        pytest.skip("decode_chain does not run here (needs sm_90)")
    L = make_layer(h, q, i, n, dtype)
    ws = qwen3_kernels.decode_chain_workspace(h, i, "cuda")
    width = n or h
    buf = torch.full((width + 64,), float("nan"), dtype=dtype, device="cuda")
    out = buf[32:32 + width].view(1, width)  # poisoned, with poisoned neighbours
    got, res = run_chain(L, ws, out=out)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    assert torch.isnan(buf[:32]).all() and torch.isnan(buf[32 + width:]).all(), "wrote outside out"
    assert torch.isfinite(got).all() and torch.isfinite(res).all()
    want, want_res = fp32_chain(L)
    base, base_res = torch_chain(L)
    ulp = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -11
    for name, a, b, w in (("out", got, base, want), ("residual", res, base_res, want_res)):
        err, base_err = rel_err(a, w), rel_err(b, w)
        assert err <= 2 * base_err + ulp, f"{name}: error {err:.3e} vs PyTorch's {base_err:.3e}"
    # the barrier's arrival count is back to 0 for the next call
    assert ws[:4].view(torch.int32).item() == 0


def _eight_b(dtype=torch.bfloat16, last=False):
    h, q, i, n = SHAPES["8B_last" if last else "8B"]
    if not _supported(h, q, i):
        pytest.skip("decode_chain does not run here (needs sm_90)")
    return make_layer(h, q, i, n, dtype, seed=1), qwen3_kernels.decode_chain_workspace(h, i, "cuda")


def _graph_of_three(L, ws, first):
    """A CUDA graph of 3 chained calls (the residual carried through), replayed twice, against the
    same 3 calls eagerly, bit for bit."""
    residual = L["residual"].clone()
    outs = [torch.empty_like(first) for _ in range(3)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for o in outs:
            qwen3_kernels.decode_chain(L["attn"], residual, L["o_weight"], L["post_norm_weight"],
                                       L["gate_up_weight"], L["down_weight"],
                                       L["next_norm_weight"], L["next_qkv_weight"], EPS, ws, out=o)
    want_res = L["residual"].clone()
    want = []
    for _ in range(3):
        w = torch.empty_like(first)
        qwen3_kernels.decode_chain(L["attn"], want_res, L["o_weight"], L["post_norm_weight"],
                                   L["gate_up_weight"], L["down_weight"], L["next_norm_weight"],
                                   L["next_qkv_weight"], EPS, ws, out=w)
        want.append(w)
    for _ in range(2):
        residual.copy_(L["residual"])
        g.replay()
        torch.cuda.synchronize()
        for o, w in zip(outs, want):
            assert torch.equal(o, w)
        assert torch.equal(residual, want_res)


@pytest.mark.parametrize("last", [False, True])
def test_repeated_calls_graph_and_variants_agree_bitwise(last):
    L, ws = _eight_b(last=last)
    first, first_res = run_chain(L, ws)
    for _ in range(20):
        again, again_res = run_chain(L, ws)
        assert torch.equal(again, first) and torch.equal(again_res, first_res)
    for variant in ("pdl", "coop"):
        with et.variant("chain", variant):
            for _ in range(3):
                other, other_res = run_chain(L, ws)
                assert torch.equal(other, first) and torch.equal(other_res, first_res), variant

    _graph_of_three(L, ws, first)
    assert ws[:4].view(torch.int32).item() == 0


def test_neighbour_kernels_see_the_chain_outputs():
    """A PDL-launched kernel right after the chain (as qk_norm_rope in the model) reads what the
    chain wrote: the chain's output feeds a rms_norm launched after it, 20 times, under the pdl
    variant of both."""
    L, ws = _eight_b()
    want, _ = run_chain(L, ws)
    w = torch.ones(want.shape[1], dtype=want.dtype, device="cuda")
    want_norm = qwen3_kernels.rms_norm(want, w, EPS)
    with et.variant("chain", "pdl"), et.variant("norm", et.variants("norm")[-1]):
        for _ in range(20):
            got, _ = run_chain(L, ws)
            norm = qwen3_kernels.rms_norm(got, w, EPS)
            torch.testing.assert_close(norm, want_norm, atol=0, rtol=0)


def test_errors_are_clear():
    L, ws = _eight_b()
    with pytest.raises(ValueError, match="workspace must hold"):
        run_chain(L, ws[:100])
    with pytest.raises(ValueError, match="o_weight must have shape"):
        run_chain(dict(L, o_weight=L["o_weight"][:, :-8].contiguous()), ws)
    with pytest.raises(ValueError, match="one token"):
        run_chain(dict(L, attn=L["attn"].expand(2, -1).contiguous()), ws)
    # the raw op checks too (a RuntimeError, not a crash)
    out = torch.empty(1, L["next_qkv_weight"].shape[0], dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="down_weight must be"):
        torch.ops.qwen3_kernels.decode_chain(
            out, L["attn"], L["residual"].clone(), L["o_weight"], L["post_norm_weight"],
            L["gate_up_weight"], L["down_weight"][:, :-256].contiguous(), L["next_norm_weight"],
            L["next_qkv_weight"], EPS, ws)
    with pytest.raises(RuntimeError, match="workspace"):
        torch.ops.qwen3_kernels.decode_chain(
            out, L["attn"], L["residual"].clone(), L["o_weight"], L["post_norm_weight"],
            L["gate_up_weight"], L["down_weight"], L["next_norm_weight"], L["next_qkv_weight"],
            EPS, ws[:64])
    torch.cuda.synchronize()  # nothing launched by the failures


def test_model_chain_path_matches_unfused(tmp_path, monkeypatch):
    """The model's one-token step through decode_chain (QWEN3_DECODE_CHAIN=1) against the same
    model with the chain off, bf16, step after step on a tiny checkpoint with head_dim 128: the
    hidden states agree to bf16 rounding (the two differ only in summation order)."""
    import copy

    from qwen3_model.loader import load_hf_config, load_model
    from qwen3_model.models.qwen3 import Qwen3ForCausalLM
    from tests.paged_runner import PagedRunner
    from tests.qwen3_tiny import make_tiny_qwen3

    shape = dict(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                 tie_word_embeddings=False)
    make_tiny_qwen3(tmp_path, shape, dtype=torch.bfloat16, gain=0.5, embed_std=1.0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = Qwen3ForCausalLM(load_hf_config(tmp_path))
    finally:
        torch.set_default_dtype(prev)
    load_model(model, tmp_path)
    monkeypatch.setenv("QWEN3_DECODE_CHAIN", "1")
    if not model.model.uses_decode_chain(1):
        pytest.skip("decode_chain does not run here (needs sm_90)")
    plain = copy.deepcopy(model)
    monkeypatch.setenv("QWEN3_DECODE_CHAIN", "0")
    assert not plain.model.uses_decode_chain(1)
    chain_run, plain_run = PagedRunner(model, seed=2), PagedRunner(plain, seed=2)
    prompt = list(range(3, 40))
    for r in (chain_run, plain_run):
        r.step(prefills=[(0, prompt)])
    tok = 7
    for step in range(8):
        monkeypatch.setenv("QWEN3_DECODE_CHAIN", "1")
        got, _ = chain_run.step(decodes=[(0, tok)])
        monkeypatch.setenv("QWEN3_DECODE_CHAIN", "0")
        want, _ = plain_run.step(decodes=[(0, tok)])
        assert rel_err(got, want) < 2e-2, step
        tok = int(plain.compute_logits(want).argmax(-1))
