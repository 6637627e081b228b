"""Broken and hostile checkpoints (issue #42): every one refused with a CheckpointError (or, for
an engine argument, a ValueError) naming the file and the tensor or field, before anything large is
allocated. Tiny checkpoints from random_checkpoint / tests.qwen3_tiny, broken on purpose."""

import json
import math
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import qwen3_model.memory as memory
from qwen3_model import LLM
from qwen3_model.loader import CheckpointError, load_hf_config, load_model
from qwen3_model.models.qwen3 import Qwen3ForCausalLM
from qwen3_model.random_checkpoint import write_random_checkpoint
from tests.helpers import one_thread  # noqa: F401  (autouse: one intra-op thread)
from tests.qwen3_tiny import make_tiny_qwen3

KW = dict(device="cpu", kvcache_block_size=16, max_model_len=64)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A random_checkpoint demo model (weights + tokenizer), written once."""
    path = tmp_path_factory.mktemp("demo")
    write_random_checkpoint(path, "demo")
    return path


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded")
    make_tiny_qwen3(path, "untied_gqa4_sharded")
    return path


def copy(src, tmp_path, name="ckpt"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def edit_config(path, **changes):
    """Set (or, with None, remove) config.json fields."""
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path, edit):
    """edit(dict of tensors) on the single-file checkpoint, in place."""
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


# ---- safetensors files ------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [0.5, 0.999, 12])
def test_truncated_safetensors(tmp_path, demo, keep):
    """Cut in the data, just before the end, or inside the header: the file is named."""
    ckpt = copy(demo, tmp_path)
    file = ckpt / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        LLM(str(ckpt), **KW)


def test_garbage_safetensors(tmp_path, demo, sharded):
    ckpt = copy(demo, tmp_path)
    (ckpt / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a readable safetensors"):
        LLM(str(ckpt), **KW)
    ckpt2 = copy(sharded, tmp_path, "b")  # one shard of several
    shard = sorted(ckpt2.glob("model-*.safetensors"))[-1]
    shard.write_bytes(b"\x00" * 7)
    with pytest.raises(CheckpointError, match=shard.name):
        load_model(Qwen3ForCausalLM(load_hf_config(ckpt2)), ckpt2)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool,
                                   torch.float8_e4m3fn])
def test_non_float_weights_refused(tmp_path, demo, dtype):
    """Not cast silently: the tensor, the file and the dtype are named."""
    ckpt = copy(demo, tmp_path)
    name = "model.layers.2.mlp.up_proj.weight"

    def edit(t):
        t[name] = t[name].to(dtype)

    edit_tensors(ckpt, edit)
    dt = str(dtype).removeprefix("torch.")
    with pytest.raises(CheckpointError,
                       match=rf"tensor '{name}' in .*model\.safetensors: dtype {dt}, expected"):
        LLM(str(ckpt), **KW)


@pytest.mark.parametrize("name, shape", [
    ("model.embed_tokens.weight", (512, 128, 1)),
    ("model.layers.0.self_attn.k_proj.weight", (64, 127)),
    ("model.layers.3.mlp.down_proj.weight", (128,)),
    ("model.norm.weight", (64,)),
])
def test_shape_mismatch_named(tmp_path, demo, name, shape):
    ckpt = copy(demo, tmp_path)

    def edit(t):
        t[name] = torch.randn(shape)

    edit_tensors(ckpt, edit)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' in model\.safetensors"):
        LLM(str(ckpt), **KW)


# ---- config.json ------------------------------------------------------------------------------


def test_non_utf8_config(tmp_path, demo):
    ckpt = copy(demo, tmp_path)
    raw = (ckpt / "config.json").read_bytes()
    (ckpt / "config.json").write_bytes(raw.replace(b'"qwen3"', b'"qwen3\xff\xfe"', 1))
    with pytest.raises(CheckpointError, match=r"config\.json is not UTF-8"):
        LLM(str(ckpt), **KW)
    with pytest.raises(CheckpointError, match=r"config\.json is not UTF-8"):
        load_hf_config(ckpt)
    (ckpt / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"config\.json: expected a JSON object"):
        load_hf_config(ckpt)


@pytest.mark.parametrize("field, value", [
    ("hidden_size", -64), ("hidden_size", 0), ("hidden_size", "128"), ("hidden_size", 128.0),
    ("intermediate_size", 0), ("intermediate_size", -1),
    ("num_hidden_layers", 0), ("num_hidden_layers", -3), ("num_hidden_layers", True),
    ("num_attention_heads", 0), ("num_key_value_heads", -2), ("head_dim", 0), ("head_dim", 31),
    ("vocab_size", 0), ("vocab_size", -512),
    ("max_position_embeddings", 0), ("max_position_embeddings", -5),
    ("rms_norm_eps", 0), ("rms_norm_eps", -1e-6), ("rms_norm_eps", math.nan),
    ("rms_norm_eps", "1e-6"),
])
def test_config_sizes_checked(tmp_path, demo, field, value):
    ckpt = copy(demo, tmp_path)
    edit_config(ckpt, **{field: value, "layer_types": None})
    with pytest.raises(CheckpointError, match=rf"config\.json: {field} must be"):
        LLM(str(ckpt), **KW)


@pytest.mark.parametrize("theta", [-1.0, 0.0, math.nan, math.inf, "1e6"])
def test_rope_theta_checked(tmp_path, demo, theta):
    """Negative rope_theta gave NaN rotations; both places transformers keeps it are read."""
    for where in ("rope_parameters", "rope_theta"):
        ckpt = copy(demo, tmp_path, where)
        if where == "rope_parameters":
            edit_config(ckpt, rope_parameters={"rope_type": "default", "rope_theta": theta})
        else:
            edit_config(ckpt, rope_parameters=None, rope_theta=theta)
        with pytest.raises(CheckpointError, match=r"config\.json: rope_theta must be a finite"):
            LLM(str(ckpt), **KW)


def test_heads_not_a_multiple_of_kv_heads(tmp_path, demo):
    ckpt = copy(demo, tmp_path)
    edit_config(ckpt, num_key_value_heads=3)
    with pytest.raises(CheckpointError, match="num_attention_heads .4. must be a multiple of "
                                              "num_key_value_heads .3."):
        LLM(str(ckpt), **KW)


# ---- memory: refused before anything large is allocated --------------------------------------


@pytest.mark.parametrize("changes", [
    dict(hidden_size=10**9),
    dict(vocab_size=10**10),
    dict(num_hidden_layers=10**6, layer_types=None),
    dict(intermediate_size=10**12),
    dict(max_position_embeddings=10**11),  # the rope table
])
def test_absurd_sizes_refused_at_once(tmp_path, demo, changes):
    """Each died in the allocator, or allocated layer by layer for minutes, before."""
    ckpt = copy(demo, tmp_path)
    edit_config(ckpt, **changes)
    field = next(iter(changes))
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=rf"(?s)config\.json: the model needs ~[\d,.]+ GiB"
                                              rf".*the machine has [\d.]+ GiB of RAM.*{field}="):
        LLM(str(ckpt), **KW)
    assert time.perf_counter() - start < 1.0


def test_num_kvcache_blocks_refused_with_its_bytes(demo):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"num_kvcache_blocks=1000000000 needs [\d,.]+ GiB of KV "
                                         r"cache .*the machine has"):
        LLM(str(demo), num_kvcache_blocks=10**9, **KW)
    assert time.perf_counter() - start < 1.0


def test_memory_estimate_against_the_machine(demo, monkeypatch):
    """The check's boundary, with the machine's RAM faked: the demo model's weights (~3.3 MiB
    fp32) fit 16 MiB, a KV cache of 1,000 blocks (31 MiB) does not, nor does the model in 2 MiB;
    a cpu_kvcache_gib cache larger than the RAM is refused when the cache is sized."""
    fake = {"ram": 16 * 2**20}
    monkeypatch.setattr(memory, "physical_ram", lambda: fake["ram"])
    llm = LLM(str(demo), num_kvcache_blocks=8, **KW)
    assert llm.model_runner.num_blocks == 8
    del llm
    with pytest.raises(ValueError, match=r"num_kvcache_blocks=1000 needs 31.2 MiB of KV cache "
                                         r"on top of the model's [\d.]+ MiB; "
                                         r"the machine has 16.0 MiB"):
        LLM(str(demo), num_kvcache_blocks=1000, **KW)
    with pytest.raises(ValueError, match=r"KV cache of [\d,]+ blocks .* lower cpu_kvcache_gib"):
        LLM(str(demo), **KW, cpu_kvcache_gib=1.0, max_num_seqs=512)
    fake["ram"] = 2 * 2**20
    with pytest.raises(CheckpointError, match=r"the model needs ~[\d.]+ MiB \(weights 3.\d MiB at "
                                              r"float32.*the machine has 2.0 MiB of RAM"):
        LLM(str(demo), **KW)


def test_memory_estimate_matches_the_model(demo):
    """The estimate counts what the model holds: its parameters at the dtype, the rope table."""
    from qwen3_model.loader import config_fields

    cfg = load_hf_config(demo)
    fields = config_fields(cfg.to_dict(), "config.json")
    for dtype in (torch.float32, torch.bfloat16):
        torch.set_default_dtype(dtype)
        try:
            model = Qwen3ForCausalLM(cfg)
        finally:
            torch.set_default_dtype(torch.float32)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        need = memory.model_need(fields, dtype, tp=1, kv_tokens=0)
        assert need.weights == params
        assert need.rope == model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.nbytes


# ---- NaN / Inf --------------------------------------------------------------------------------


@pytest.mark.parametrize("name, index, value", [
    ("model.layers.1.mlp.down_proj.weight", (3, 5), math.nan),
    ("model.layers.0.self_attn.k_proj.weight", (0, 0), math.inf),  # inside a fused parameter
    ("model.embed_tokens.weight", (511, 127), -math.inf),
    ("model.layers.3.post_attention_layernorm.weight", (7,), math.nan),
])
def test_non_finite_weights_refused(tmp_path, demo, name, index, value):
    ckpt = copy(demo, tmp_path)

    def edit(t):
        t[name][index] = value

    edit_tensors(ckpt, edit)
    kind = "NaN" if math.isnan(value) else "Inf"
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' in .*model\.safetensors: 1 of "
                                              rf"[\d,]+ values are {kind} \(the first at index "
                                              rf"\({', '.join(map(str, index))},?\)\)"):
        LLM(str(ckpt), **KW)
    # load_format='dummy' reads config.json only: no check, no error
    LLM(str(ckpt), load_format="dummy", **KW)


def test_overflow_into_the_model_dtype_refused(tmp_path):
    """Finite as stored (fp32 1e30) but Inf once cast into an fp16 model."""
    ckpt = tmp_path / "ckpt"
    make_tiny_qwen3(ckpt, "tied_gqa2")
    name = "model.layers.0.mlp.gate_proj.weight"

    def edit(t):
        t[name][2, 2] = 1e30

    edit_tensors(ckpt, edit)
    torch.set_default_dtype(torch.float16)
    try:
        model = Qwen3ForCausalLM(load_hf_config(ckpt))
    finally:
        torch.set_default_dtype(torch.float32)
    with pytest.raises(CheckpointError, match=rf"gate_up_proj.weight'.*{name}.*finite as stored"):
        load_model(model, ckpt)
    load_model(model, ckpt, check_finite=False)  # the check, not the load, refused it
