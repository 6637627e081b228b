"""Checkpoint loading: config validation, and clear errors for broken checkpoints."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen3_model.loader import CheckpointError, load_hf_config, load_model
from qwen3_model.models.qwen3 import Qwen3ForCausalLM
from tests.qwen3_tiny import make_tiny_qwen3
from tests.helpers import one_thread  # noqa: F401  (autouse: one intra-op thread)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """One single-file and one sharded checkpoint, written once."""
    single = tmp_path_factory.mktemp("single")
    make_tiny_qwen3(single, "tied_gqa2")
    sharded = tmp_path_factory.mktemp("sharded")
    make_tiny_qwen3(sharded, "untied_gqa4_sharded")
    return single, sharded


def copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def build(path):
    return Qwen3ForCausalLM(load_hf_config(path))


def rewrite_single(path, edit):
    """Apply edit(dict of tensors) to the single-file checkpoint in place."""
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_good_checkpoints_load(good):
    for path in good:
        model = build(path)
        load_model(model, path)


def test_missing_folder_and_config(tmp_path, good):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_config(tmp_path / "nowhere")
    ckpt = copy(good[0], tmp_path)
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf_config(ckpt)


@pytest.mark.parametrize(
    "model_type, archs, match",
    [
        ("llama", ["LlamaForCausalLM"], "model_type is 'llama', expected 'qwen3'"),
        ("qwen3_moe", ["Qwen3MoeForCausalLM"], "model_type is 'qwen3_moe'"),
        ("qwen3", ["Qwen3ForSequenceClassification"], "architectures is"),
    ],
)
def test_non_qwen3_architecture(tmp_path, good, model_type, archs, match):
    ckpt = copy(good[0], tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = model_type, archs
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match):
        load_hf_config(ckpt)


def test_missing_tensor(tmp_path, good):
    ckpt = copy(good[0], tmp_path)
    rewrite_single(ckpt, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): 'model.layers.1.self_attn.k_proj.weight'"):
        load_model(build(ckpt), ckpt)
    ckpt2 = copy(good[0], tmp_path / "b")
    rewrite_single(ckpt2, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match="'model.norm.weight'"):
        load_model(build(ckpt2), ckpt2)


def test_untied_checkpoint_without_lm_head(tmp_path, good):
    ckpt = copy(good[1], tmp_path)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    file = ckpt / index["weight_map"]["lm_head.weight"]
    tensors = load_file(file)
    tensors.pop("lm_head.weight")
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="'lm_head.weight'"):
        load_model(build(ckpt), ckpt)


@pytest.mark.parametrize(
    "name, shape",
    [
        ("model.layers.0.self_attn.q_proj.weight", (64, 48)),
        ("model.layers.0.mlp.up_proj.weight", (95, 64)),
        ("model.layers.1.self_attn.o_proj.weight", (64, 32)),
        ("model.embed_tokens.weight", (255, 64)),
        ("model.layers.0.self_attn.q_norm.weight", (32,)),
    ],
)
def test_wrong_shape(tmp_path, good, name, shape):
    ckpt = copy(good[0], tmp_path)

    def edit(t):
        t[name] = torch.randn(shape)

    rewrite_single(ckpt, edit)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' in model.safetensors: expected shape .* got {tuple(shape)}".replace("(", r"\(").replace(")", r"\)")):
        load_model(build(ckpt), ckpt)


def test_unexpected_extra_tensor(tmp_path, good):
    ckpt = copy(good[0], tmp_path)

    def edit(t):
        t["model.layers.0.self_attn.sinks"] = torch.zeros(4)

    rewrite_single(ckpt, edit)
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.0.self_attn.sinks'"):
        load_model(build(ckpt), ckpt)


def test_config_with_more_layers_than_checkpoint(tmp_path, good):
    ckpt = copy(good[0], tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    cfg.pop("layer_types", None)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="'model.layers.2.self_attn.q_proj.weight'"):
        load_model(build(ckpt), ckpt)


def test_invalid_config_values(tmp_path, good):
    ckpt = copy(good[0], tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_hidden_layers"] = 3  # layer_types still lists 2: transformers rejects it
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="(?s)config.json.*num_hidden_layers"):
        load_hf_config(ckpt)
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_hf_config(ckpt)


def test_no_safetensors_and_broken_index(tmp_path, good):
    ckpt = copy(good[0], tmp_path)
    (ckpt / "model.safetensors").rename(ckpt / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="no \\*.safetensors.*pytorch_model.bin"):
        load_model(build(ckpt), ckpt)
    ckpt2 = copy(good[1], tmp_path / "b")
    shard = sorted(ckpt2.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"names files that are not in .*{shard.name}"):
        load_model(build(ckpt2), ckpt2)


def test_tied_checkpoint_with_stored_lm_head_and_ignored_tensors(tmp_path, good):
    """Some exporters store lm_head.weight for tied models, or rotary inv_freq buffers: skipped."""
    ckpt = copy(good[0], tmp_path)

    def edit(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    rewrite_single(ckpt, edit)
    model = build(ckpt)
    load_model(model, ckpt)
    assert torch.equal(model.lm_head.weight, load_file(ckpt / "model.safetensors")["model.embed_tokens.weight"])


def test_bf16_checkpoint_into_fp32_model(tmp_path):
    ckpt = tmp_path / "bf16"
    make_tiny_qwen3(ckpt, "tied_gqa2", dtype=torch.bfloat16)
    model = build(ckpt)
    for p in model.parameters():
        p.data.fill_(float("nan"))
    load_model(model, ckpt)
    stored = load_file(ckpt / "model.safetensors")
    assert stored["model.norm.weight"].dtype == torch.bfloat16
    assert torch.equal(model.model.norm.weight, stored["model.norm.weight"].float())
    assert not any(p.isnan().any() for p in model.parameters())
