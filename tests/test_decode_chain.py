"""decode_chain on the CPU: the op's contract (the reference path), its input checks, and the
model's chain path (Qwen3Model._forward_chain: one decode_chain per layer) against the unfused
forward on a tiny random checkpoint. The CUDA kernel is tested in test_decode_chain_cuda.py."""

import copy

import pytest
import torch

import qwen3_kernels
from qwen3_kernels import reference as ref
from qwen3_model.loader import load_hf_config, load_model
from qwen3_model.models.qwen3 import Qwen3ForCausalLM
from tests.helpers import one_thread, rel_err  # noqa: F401  (autouse: one intra-op thread)
from tests.paged_runner import PagedRunner
from tests.qwen3_tiny import make_tiny_qwen3

EPS = 1e-6


def layer(h=64, q=96, i=80, n=128, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dtype)  # noqa: E731
    return dict(attn=r(1, q), residual=r(1, h), o_weight=r(h, q, scale=q**-0.5),
                post_norm_weight=1 + r(h, scale=0.2), gate_up_weight=r(2 * i, h, scale=h**-0.5),
                down_weight=r(h, i, scale=i**-0.5), next_norm_weight=1 + r(h, scale=0.2),
                next_qkv_weight=r(n, h, scale=h**-0.5) if n else None)


def call(L, ws=None, **kw):
    ws = qwen3_kernels.decode_chain_workspace(L["residual"].shape[1], L["gate_up_weight"].shape[0] // 2,
                                              "cpu") if ws is None else ws
    res = L["residual"].clone()
    out = qwen3_kernels.decode_chain(L["attn"], res, L["o_weight"], L["post_norm_weight"],
                                     L["gate_up_weight"], L["down_weight"], L["next_norm_weight"],
                                     L["next_qkv_weight"], EPS, ws, **kw)
    return out, res


@pytest.mark.parametrize("n", [128, 0])
def test_op_is_the_six_unfused_ops(n):
    L = layer(n=n)
    out, res = call(L)
    # the unfused sequence through the public ops, each storing its rounded output
    o = qwen3_kernels.linear(L["attn"], L["o_weight"])
    r = L["residual"].clone()
    h, r = qwen3_kernels.fused_add_rms_norm(o, r, L["post_norm_weight"], EPS)
    d = qwen3_kernels.linear(qwen3_kernels.linear_silu_and_mul(h, L["gate_up_weight"]), L["down_weight"])
    x, r = qwen3_kernels.fused_add_rms_norm(d, r, L["next_norm_weight"], EPS)
    want = x if n == 0 else qwen3_kernels.linear(x, L["next_qkv_weight"])
    assert out.shape == (1, n or 64) and out.dtype == torch.bfloat16
    assert torch.equal(out, want) and torch.equal(res, r)
    # and the fp32 chain is close (the roundings are the only difference)
    f = {k: (v.float() if v is not None else None) for k, v in L.items()}
    want32, res32 = ref.decode_chain(f["attn"], f["residual"], f["o_weight"], f["post_norm_weight"],
                                     f["gate_up_weight"], f["down_weight"], f["next_norm_weight"],
                                     f["next_qkv_weight"], EPS)
    assert rel_err(out, want32) < 2e-2 and rel_err(res, res32) < 2e-2


def test_out_given():
    L = layer()
    out = torch.full((1, 128), float("nan"), dtype=torch.bfloat16)
    got, res = call(L, out=out)
    want, want_res = call(L)
    assert got is out and torch.equal(out, want) and torch.equal(res, want_res)


@pytest.mark.parametrize("change, match", [
    (dict(attn=torch.zeros(2, 96, dtype=torch.bfloat16)), "one token"),
    (dict(o_weight=torch.zeros(64, 95, dtype=torch.bfloat16)), "o_weight must have shape"),
    (dict(down_weight=torch.zeros(64, 80, dtype=torch.float16)), "down_weight must be"),
    (dict(gate_up_weight=torch.zeros(159, 64, dtype=torch.bfloat16)), "gate_up_weight must be"),
    (dict(next_qkv_weight=torch.zeros(128, 63, dtype=torch.bfloat16)), "next_qkv_weight must have shape"),
    (dict(post_norm_weight=torch.zeros(63, dtype=torch.bfloat16)), "post_norm_weight must have shape"),
])
def test_bad_inputs_raise(change, match):
    L = layer()
    L.update(change)
    with pytest.raises(ValueError, match=match):
        call(L)


def test_bad_workspace_out_eps_raise():
    L = layer()
    with pytest.raises(ValueError, match="workspace must hold"):
        call(L, ws=torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="workspace must be"):
        call(L, ws=torch.zeros(10**5, dtype=torch.int32))
    with pytest.raises(ValueError, match="out must have shape"):
        call(L, out=torch.empty(1, 64, dtype=torch.bfloat16))
    L2 = layer()
    with pytest.raises(ValueError, match="must not alias"):
        qwen3_kernels.decode_chain(L2["attn"], L2["residual"], L2["o_weight"], L2["post_norm_weight"],
                                   L2["gate_up_weight"], L2["down_weight"], L2["next_norm_weight"],
                                   None, EPS, qwen3_kernels.decode_chain_workspace(64, 80),
                                   out=L2["residual"])
    with pytest.raises(ValueError, match="eps"):
        qwen3_kernels.decode_chain(L2["attn"], L2["residual"], L2["o_weight"], L2["post_norm_weight"],
                                   L2["gate_up_weight"], L2["down_weight"], L2["next_norm_weight"],
                                   None, 0.0, qwen3_kernels.decode_chain_workspace(64, 80))


def test_not_supported_off_sm90():
    assert not qwen3_kernels.decode_chain_supported(4096, 4096, 12288, "cpu")


def test_model_chain_path_equals_unfused_forward(tmp_path, monkeypatch):
    """The model's one-token path through decode_chain (forced on: the CPU never takes it by
    itself) gives the hidden states of the unfused forward, step after step, in fp32."""
    make_tiny_qwen3(tmp_path, "untied_gqa4_sharded", seed=3)
    config = load_hf_config(tmp_path)
    model = Qwen3ForCausalLM(config)
    load_model(model, tmp_path)
    chained = copy.deepcopy(model)
    monkeypatch.setenv("QWEN3_DECODE_CHAIN", "1")
    assert not chained.model.uses_decode_chain(1)  # asked for, but the CPU has no kernel: off
    monkeypatch.setattr(chained.model, "uses_decode_chain", lambda n: n == 1)
    plain_run, chain_run = PagedRunner(model, seed=1), PagedRunner(chained, seed=1)
    prompt = [5, 17, 2, 99, 40, 3, 8]
    for runner in (plain_run, chain_run):
        runner.step(prefills=[(0, prompt)])
    tok = 11
    for step in range(6):
        want, _ = plain_run.step(decodes=[(0, tok)])
        got, _ = chain_run.step(decodes=[(0, tok)])
        assert got.shape == want.shape == (1, config.hidden_size)
        assert rel_err(got, want) < 1e-5, step
        tok = int(model.compute_logits(want).argmax(-1))
