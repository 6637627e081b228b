"""Qwen3ForCausalLM on the CPU reference path against transformers' own Qwen3, in fp32.

Every preset in tests/qwen3_tiny.py (tied / untied, GQA 2:1, 4:1, 5:1 and MHA with qkv bias,
hidden != heads * head_dim, one and several safetensors files) is written by transformers, loaded by
our loader and run through a paged cache with shuffled, NaN-poisoned blocks.
"""

import pytest
import torch

from qwen3_model.loader import load_hf_config, load_model
from qwen3_model.models.qwen3 import Qwen3ForCausalLM
from tests.helpers import rel_err
from tests.paged_runner import PagedRunner
from tests.qwen3_tiny import TINY_CONFIGS, make_tiny_qwen3, tiny_config
from tests.helpers import one_thread  # noqa: F401  (autouse: one intra-op thread)

PRESETS = list(TINY_CONFIGS)
TOL = 1e-4  # fp32, relative (TARGETS / issue 3)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """preset -> (folder, transformers model), written once per module."""
    out = {}
    for name in PRESETS:
        path = tmp_path_factory.mktemp(name)
        _, hf = make_tiny_qwen3(path, name, seed=len(out), return_model=True)
        out[name] = (path, hf)
    return out


def load_ours(path, dtype=torch.float32):
    config = load_hf_config(path)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    for p in model.parameters():  # poison: load_model must write every element
        p.data.fill_(float("nan"))
    load_model(model, path)
    return model


def hf_logits(hf, ids: list[int]) -> torch.Tensor:  # [L, vocab]
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def random_prompts(vocab, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", PRESETS)
def test_loaded_parameters_match_transformers(checkpoints, name):
    path, hf = checkpoints[name]
    ours = load_ours(path)
    hf_params = dict(hf.named_parameters())
    for pname, p in ours.named_parameters():
        assert not p.isnan().any(), f"{pname} not fully written by load_model"
    layer = ours.model.layers[0]
    attn = "model.layers.0.self_attn."
    want_qkv = torch.cat([hf_params[attn + f"{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(layer.self_attn.qkv_proj.weight, want_qkv)
    mlp = "model.layers.0.mlp."
    want_gu = torch.cat([hf_params[mlp + "gate_proj.weight"], hf_params[mlp + "up_proj.weight"]])
    assert torch.equal(layer.mlp.gate_up_proj.weight, want_gu)
    assert torch.equal(ours.lm_head.weight, hf.lm_head.weight)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == TINY_CONFIGS[name]["tie_word_embeddings"]


@pytest.mark.parametrize("name", PRESETS)
def test_prefill_logits_match_transformers(checkpoints, name):
    path, hf = checkpoints[name]
    ours = load_ours(path)
    vocab = hf.config.vocab_size
    # one sequence, then three of odd lengths in one step (crossing block boundaries)
    for lengths in ([37], [5, 17, 33]):
        prompts = random_prompts(vocab, lengths, seed=sum(lengths))
        runner = PagedRunner(ours, num_blocks=16, block_size=16, seed=len(lengths))
        hidden, _ = runner.step(prefills=list(enumerate(prompts)))
        logits = ours.compute_logits(hidden)
        assert logits.shape == (sum(lengths), vocab) and logits.dtype == torch.float32
        start = 0
        for p in prompts:
            got = logits[start : start + len(p)]
            err = rel_err(got, hf_logits(hf, p))
            assert err <= TOL, f"{name} lengths {lengths}: rel err {err:.2e} for a {len(p)}-token prompt"
            start += len(p)


@pytest.mark.parametrize("name", ["untied_gqa4_sharded", "tied_gqa5_sharded"])
def test_chunked_prefill_mixed_with_decode(checkpoints, name):
    """Queries aligned to the end of the keys: a prompt prefilled in two chunks, the second chunk
    sharing its step with another sequence's decode token."""
    path, hf = checkpoints[name]
    ours = load_ours(path)
    a, b = random_prompts(hf.config.vocab_size, [41, 12], seed=7)
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    runner = PagedRunner(ours, num_blocks=16, block_size=16, seed=3)
    hidden, last = runner.step(prefills=[(0, a[:19]), (1, b[:-1])])
    got = ours.compute_logits(hidden)
    assert rel_err(got[:19], ref_a[:19]) <= TOL
    assert rel_err(got[last[1]], ref_b[-2]) <= TOL
    # a's second chunk (22 queries over 41 keys) and b's last token as a decode, in one step
    hidden, last = runner.step(prefills=[(0, a[19:])], decodes=[(1, b[-1])])
    got = ours.compute_logits(hidden)
    assert rel_err(got[:22], ref_a[19:]) <= TOL
    assert rel_err(got[last[1]], ref_b[-1]) <= TOL


def test_split_attention_step_equals_the_plain_step(checkpoints):
    """A mixed step run as the piecewise graphs run it (q into one buffer shared by every layer,
    each layer's attention by ``attend`` at the split) is the plain forward, bit for bit."""
    path, hf = checkpoints["untied_gqa4_sharded"]
    ours = load_ours(path)
    a, b, c = random_prompts(hf.config.vocab_size, [41, 12, 7], seed=8)
    outs = []
    for split in (False, True):
        runner = PagedRunner(ours, num_blocks=16, block_size=16, seed=3)
        runner.step(prefills=[(0, a[:19]), (1, b[:-1])])
        hidden, _ = runner.step(prefills=[(0, a[19:]), (2, c)], decodes=[(1, b[-1])],
                                split_attention=split)
        outs.append(hidden)
    assert torch.isfinite(outs[1]).all()
    assert torch.equal(outs[0], outs[1])


def test_piecewise_buckets():
    """The bucket a step of n tokens replays: the smallest multiple of the step that holds it,
    none past max_tokens or before capture; max_tokens must be a positive multiple of the step."""
    from qwen3_model.engine.piecewise import PiecewiseGraphs

    pw = PiecewiseGraphs(None, 96, 32, 4, 8, 16, torch.float32, torch.device("cpu"))
    assert pw.buckets == [32, 64, 96]
    assert pw.bucket(5) is None  # nothing captured yet: the step runs eagerly
    pw.graphs = {n: [] for n in pw.buckets}
    assert [pw.bucket(n) for n in (1, 32, 33, 64, 65, 96, 97)] == [32, 32, 64, 64, 96, 96, None]
    for bad in (0, 48, 16):
        with pytest.raises(ValueError, match="must be a positive multiple of the bucket step"):
            PiecewiseGraphs(None, bad, 32, 4, 8, 16, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("name", PRESETS)
def test_greedy_32_tokens_identical_to_transformers_generate(checkpoints, name):
    path, hf = checkpoints[name]
    ours = load_ours(path)
    prompts = random_prompts(hf.config.vocab_size, [9, 23, 3], seed=11)
    runner = PagedRunner(ours, num_blocks=24, block_size=16, seed=5)
    got = runner.greedy(prompts, max_new_tokens=32)
    for p, g in zip(prompts, got):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, len(p):].tolist()
        assert g == want, f"{name}: prompt of {len(p)} tokens diverges at token {next(i for i, (x, y) in enumerate(zip(g, want)) if x != y)}"


def test_rope_yarn_and_linear_match_transformers():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    from qwen3_model.layers.rotary import RotaryEmbedding, rope_parameters

    for scaling in (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "default"},
    ):
        cfg = tiny_config("tied_gqa2", head_dim=64, max_position_embeddings=512)
        cfg.rope_parameters = {"rope_theta": 1_000_000.0, **scaling}
        ours = RotaryEmbedding(64, 512, rope_parameters(cfg)).cos_sin_cache
        pos = torch.arange(512)[None]
        cos, sin = Qwen3RotaryEmbedding(cfg)(torch.zeros(1, 512, 64), pos)
        assert rel_err(ours[:, :32], cos[0, :, :32]) < 1e-5, scaling
        assert rel_err(ours[:, 32:], sin[0, :, :32]) < 1e-5, scaling


def test_rope_parameters_old_and_new_config_styles():
    from types import SimpleNamespace

    from qwen3_model.layers.rotary import rope_parameters

    old = SimpleNamespace(rope_theta=5e5, rope_scaling=None)
    assert rope_parameters(old) == {"rope_theta": 5e5, "rope_type": "default"}
    old_yarn = SimpleNamespace(rope_theta=1e6, rope_scaling={"type": "yarn", "factor": 4.0})
    assert rope_parameters(old_yarn)["rope_type"] == "yarn"
    new = SimpleNamespace(rope_parameters={"rope_theta": 1e6, "rope_type": "default"})
    assert rope_parameters(new)["rope_theta"] == 1e6


def test_unsupported_config_raises_clearly():
    cfg = tiny_config("tied_gqa2")
    cfg.rope_parameters = {"rope_theta": 1e6, "rope_type": "dynamic", "factor": 2.0}
    with pytest.raises(ValueError, match="rope type 'dynamic' is not supported"):
        Qwen3ForCausalLM(cfg)
    cfg = tiny_config("tied_gqa2", hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act"):
        Qwen3ForCausalLM(cfg)
    cfg = tiny_config("tied_gqa2", num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        Qwen3ForCausalLM(cfg)


def test_forward_without_cache_or_context_raises_clearly(checkpoints):
    ours = load_ours(checkpoints["tied_gqa2"][0])
    with pytest.raises(RuntimeError, match="k_cache / v_cache are not assigned"):
        ours(torch.tensor([1, 2]), torch.tensor([0, 1]))
    PagedRunner(ours)
    with pytest.raises(RuntimeError, match="no attention Context"):
        ours(torch.tensor([1, 2]), torch.tensor([0, 1]))


def test_real_qwen3_shapes_build_under_another_default_device():
    """Qwen3-0.6B and -8B shapes, built on the meta device (no memory): what the runner does with
    a CUDA default device, so nothing may be created on the CPU by accident."""
    for spec, n_params, tied in (
        (dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
              num_key_value_heads=8, tie_word_embeddings=True), 596_049_920, True),
        (dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
              num_key_value_heads=8, tie_word_embeddings=False), 8_190_735_360, False),
    ):
        cfg = tiny_config(dict(spec, vocab_size=151936, head_dim=128), max_position_embeddings=40960)
        with torch.device("meta"):
            model = Qwen3ForCausalLM(cfg)
        assert sum(p.numel() for p in model.parameters()) == n_params
        attn = model.model.layers[0].self_attn
        q_width = spec["num_attention_heads"] * 128
        assert attn.qkv_proj.weight.shape == (q_width + 2 * 8 * 128, spec["hidden_size"])
        assert attn.o_proj.weight.shape == (spec["hidden_size"], q_width)
        assert attn.rotary_emb.cos_sin_cache.shape == (40960, 128)
        assert all(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
