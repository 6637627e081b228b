"""FP8 checkpoints (Qwen3-*-FP8's format): the writer's exact format, the loader's errors, TP
sharding of the block scales, several files.

The format: config.json's quantization_config {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}; each q/k/v/o/gate/up/down
projection's ``weight`` float8_e4m3fn [N, K] and ``weight_scale_inv`` fp32 [ceil(N/128),
ceil(K/128)]; embeddings, norms and lm_head bf16.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qwen3_kernels import reference as ref
from qwen3_model.loader import CheckpointError, load_hf_config, load_model, safetensors_files
from qwen3_model.models.qwen3 import Qwen3ForCausalLM
from qwen3_model.random_checkpoint import (
    dequantize_checkpoint,
    dequantize_state_dict_fp8,
    is_fp8_projection,
    quantize_checkpoint,
    quantize_state_dict_fp8,
    quantize_weight_fp8,
    write_random_checkpoint,
)
from tests.helpers import load_checkpoint
from tests.helpers import one_thread  # noqa: F401  (autouse: one intra-op thread)
from tests.qwen3_tiny import make_tiny_qwen3

E4M3 = torch.float8_e4m3fn
QWEN_FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                   "weight_block_size": [128, 128]}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# A Qwen3-shaped tiny model: head_dim 128 (the kernels'), hidden 272 (a partial last block in
# both N and K), every fused part a multiple of 128 rows; untied so lm_head is stored.
FP8_TINY = dict(vocab_size=256, hidden_size=272, intermediate_size=384, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                tie_word_embeddings=False, max_position_embeddings=512)


def blocks(n: int) -> int:
    return -(-n // 128)


def build(path) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM(load_hf_config(path))



@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8")
    write_random_checkpoint(path, FP8_TINY, quantization="fp8", tokenizer=False)
    return path


def copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def edit_tensors(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def edit_config(path, edit):
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


# ---- the writer ---------------------------------------------------------------------------------


def test_writer_writes_qwens_fp8_format(fp8_ckpt):
    cfg = json.loads((fp8_ckpt / "config.json").read_text())
    assert cfg["quantization_config"] == QWEN_FP8_CONFIG
    assert cfg["dtype"] == "bfloat16" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    with safe_open(str(fp8_ckpt / "model.safetensors"), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    h, i, d = FP8_TINY["hidden_size"], FP8_TINY["intermediate_size"], FP8_TINY["head_dim"]
    shapes = {"q_proj": (4 * d, h), "k_proj": (2 * d, h), "v_proj": (2 * d, h),
              "o_proj": (h, 4 * d), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    seen = set()
    for layer in range(FP8_TINY["num_hidden_layers"]):
        for proj, (n, k) in shapes.items():
            block = "self_attn" if proj in PROJECTIONS[:4] else "mlp"
            name = f"model.layers.{layer}.{block}.{proj}.weight"
            w, s = tensors[name], tensors[name + "_scale_inv"]
            assert w.dtype == E4M3 and tuple(w.shape) == (n, k), name
            assert s.dtype == torch.float32 and tuple(s.shape) == (blocks(n), blocks(k)), name
            assert (s > 0).all() and s.isfinite().all()
            assert not ((w.view(torch.uint8) & 0x7F) == 0x7F).any(), f"{name}: NaN bits"
            assert is_fp8_projection(name)
            seen |= {name, name + "_scale_inv"}
    rest = set(tensors) - seen
    assert "lm_head.weight" in rest and "model.embed_tokens.weight" in rest
    for name in rest:  # embeddings, norms, lm_head: bf16, no scales
        assert tensors[name].dtype == torch.bfloat16, name
        assert not name.endswith("scale_inv") and not is_fp8_projection(name), name


def test_quantize_weight_fp8_is_per_128_block():
    g = torch.Generator().manual_seed(0)
    n, k = 300, 272  # partial last blocks in both dims
    w = torch.randn(n, k, generator=g)
    w[:128, 128:256] *= 1e3  # one loud block: its neighbours keep their own scales
    w[256:, 256:] = 0.0  # a zero block: the floor, not 0 / 0
    w[5, 7] = -3e4  # hostile magnitude: still saturates to +-448 at most
    q, s = quantize_weight_fp8(w)
    assert q.dtype == E4M3 and q.shape == (n, k) and s.shape == (3, 3) and s.dtype == torch.float32
    for r in range(3):
        for c in range(3):
            blk = w[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128]
            amax = max(blk.abs().max().item(), ref.FP8_SCALE_FLOOR)
            assert s[r, c].item() == pytest.approx(amax / 448, rel=1e-6)
            qb = q[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128].float()
            if blk.abs().max() > 0:
                assert qb.abs().max().item() == 448  # the block's max lands on e4m3's max
            else:
                assert (qb == 0).all()
    wd = ref.dequantize_fp8(q, s, 128)
    # e4m3 rounding moves a value by at most 16 / 448 of its block's amax (half the top step)
    amax_each = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k] * 448
    assert ((wd - w).abs() <= amax_each * (16 / 448) + 1e-30).all()
    # exactly round(w / scale) in e4m3, the rounding Qwen's checkpoints use
    want = (w / s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]).clamp(-448, 448)
    assert torch.equal(q.view(torch.uint8), want.to(E4M3).view(torch.uint8))


def test_state_dict_round_trip():
    g = torch.Generator().manual_seed(1)
    sd = {"model.layers.0.self_attn.q_proj.weight": torch.randn(256, 144, generator=g),
          "model.layers.0.mlp.down_proj.weight": torch.randn(144, 384, generator=g) * 1e-3,
          "model.layers.0.input_layernorm.weight": torch.randn(144, generator=g),
          "model.embed_tokens.weight": torch.randn(16, 144, generator=g),
          "lm_head.weight": torch.randn(16, 144, generator=g)}
    q = quantize_state_dict_fp8(sd)
    assert set(q) == set(sd) | {"model.layers.0.self_attn.q_proj.weight_scale_inv",
                                "model.layers.0.mlp.down_proj.weight_scale_inv"}
    back = dequantize_state_dict_fp8(q, torch.float32)
    assert set(back) == set(sd)
    for name, t in sd.items():
        if is_fp8_projection(name):
            assert q[name].dtype == E4M3
            assert (back[name] - t).norm() / t.norm() < 0.05, name  # e4m3: 3 mantissa bits
        else:
            assert q[name].dtype == torch.bfloat16
            assert torch.equal(back[name], t.to(torch.bfloat16).float()), name


def test_multi_file_checkpoint_loads_like_one_file(fp8_ckpt, tmp_path):
    sharded = tmp_path / "sharded"
    write_random_checkpoint(sharded, FP8_TINY, quantization="fp8", tokenizer=False,
                            max_shard_bytes=150_000)
    files = safetensors_files(sharded)
    assert len(files) > 2 and (sharded / "model.safetensors.index.json").is_file()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert any(k.endswith("weight_scale_inv") for k in index["weight_map"])
    a, b = load_checkpoint(fp8_ckpt), load_checkpoint(sharded)  # the same seed: the same weights
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and pa.dtype == pb.dtype
        assert torch.equal(pa.view(torch.uint8) if pa.dtype == E4M3 else pa,
                           pb.view(torch.uint8) if pb.dtype == E4M3 else pb), na


def test_quantize_and_dequantize_checkpoint_folders(tmp_path):
    src, fp8, bf16 = tmp_path / "src", tmp_path / "fp8", tmp_path / "bf16"
    make_tiny_qwen3(src, dict(FP8_TINY, tie_word_embeddings=True), max_shard_size="300KB")
    quantize_checkpoint(src, fp8)
    dequantize_checkpoint(fp8, bf16)
    assert json.loads((fp8 / "config.json").read_text())["quantization_config"] == QWEN_FP8_CONFIG
    cfg = json.loads((bf16 / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == "bfloat16"
    m8, m16 = load_checkpoint(fp8), load_checkpoint(bf16)
    assert m8.quantization == "fp8" and m16.quantization is None
    qkv8 = m8.model.layers[1].self_attn.qkv_proj
    qkv16 = m16.model.layers[1].self_attn.qkv_proj
    assert qkv8.weight.dtype == E4M3 and qkv8.weight_scale_inv.shape == (8, 3)
    assert qkv16.weight_scale_inv is None
    # the fused parameter holds q | k | v, each part's scales on its own block rows
    deq = ref.dequantize_fp8(qkv8.weight, qkv8.weight_scale_inv, 128)
    assert torch.equal(deq.to(torch.bfloat16).float(), qkv16.weight)


# ---- the loader's errors ------------------------------------------------------------------------

L0 = "model.layers.0"


@pytest.mark.parametrize("field,value,match", [
    ("quant_method", "gptq", r"quantization_config.quant_method is 'gptq', expected 'fp8'"),
    ("fmt", "e5m2", r"quantization_config.fmt is 'e5m2', expected 'e4m3'"),
    ("activation_scheme", "static",
     r"quantization_config.activation_scheme is 'static', expected 'dynamic'"),
    ("weight_block_size", [64, 64],
     r"quantization_config.weight_block_size is \[64, 64\], expected \[128, 128\]"),
    ("weight_block_size", None, r"quantization_config.weight_block_size is None"),
    ("modules_to_not_convert", ["model.layers.1.mlp.down_proj"],
     r"quantization_config.modules_to_not_convert names 'model.layers.1.mlp.down_proj'"),
    ("ignored_layers", ["q_proj"],
     r"quantization_config.ignored_layers names 'q_proj', which matches the projection "
     r"'model.layers.0.self_attn.q_proj'"),
    ("modules_to_not_convert", "lm_head",
     r"quantization_config.modules_to_not_convert must be a list"),
])
def test_unsupported_quantization_config(fp8_ckpt, tmp_path, field, value, match):
    ckpt = copy(fp8_ckpt, tmp_path)
    edit_config(ckpt, lambda c: c["quantization_config"].__setitem__(field, value))
    with pytest.raises(CheckpointError, match=r"config\.json: " + match):
        load_hf_config(ckpt)


def test_quantization_config_not_an_object(fp8_ckpt, tmp_path):
    ckpt = copy(fp8_ckpt, tmp_path)
    edit_config(ckpt, lambda c: c.__setitem__("quantization_config", "fp8"))
    with pytest.raises(CheckpointError, match="quantization_config must be a JSON object"):
        load_hf_config(ckpt)


def test_unquantized_modules_that_are_bf16_anyway_are_accepted(fp8_ckpt, tmp_path):
    ckpt = copy(fp8_ckpt, tmp_path)
    edit_config(ckpt, lambda c: c["quantization_config"].update(
        modules_to_not_convert=["lm_head", "model.embed_tokens", "norm"]))
    assert load_checkpoint(ckpt).quantization == "fp8"


@pytest.mark.parametrize("value,kind", [(float("nan"), "NaN"), (float("inf"), "Inf"),
                                        (0.0, "<= 0"), (-1e-3, "<= 0")])
def test_bad_scale_values_name_the_tensor(fp8_ckpt, tmp_path, value, kind):
    ckpt = copy(fp8_ckpt, tmp_path)
    name = f"{L0}.self_attn.k_proj.weight_scale_inv"
    edit_tensors(ckpt, lambda t: t[name].__setitem__((1, 2), value))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' in .*: 1 of 6 values are "
                                              rf"{kind}.*\(the first at index \(1, 2\)\)"):
        load_model(build(ckpt), ckpt)


def test_bad_scale_shape_names_the_tensor(fp8_ckpt, tmp_path):
    ckpt = copy(fp8_ckpt, tmp_path)
    for name, bad in ((f"{L0}.self_attn.q_proj.weight_scale_inv", (4, 2)),
                      (f"{L0}.mlp.down_proj.weight_scale_inv", (3, 4)),
                      (f"{L0}.mlp.up_proj.weight_scale_inv", (2, 3))):
        shutil.rmtree(ckpt)
        ckpt = copy(fp8_ckpt, tmp_path)
        edit_tensors(ckpt, lambda t: t.__setitem__(name, torch.ones(bad)))
        with pytest.raises(CheckpointError, match=rf"tensor '{name}' in model.safetensors: "
                                                  r"expected shape \(\d+, \d+\), got "
                                                  + rf"\({bad[0]}, {bad[1]}\)"):
            load_model(build(ckpt), ckpt)


def test_missing_scale_is_named(fp8_ckpt, tmp_path):
    ckpt = copy(fp8_ckpt, tmp_path)
    for name in (f"{L0}.mlp.down_proj.weight_scale_inv", f"{L0}.self_attn.v_proj.weight_scale_inv"):
        edit_tensors(ckpt, lambda t: t.pop(name))
        with pytest.raises(CheckpointError, match=rf"missing 1 tensor\(s\): '{name}'"):
            load_model(build(ckpt), ckpt)
        shutil.rmtree(ckpt)
        ckpt = copy(fp8_ckpt, tmp_path)


def test_bf16_tensor_in_an_fp8_checkpoint_is_named(fp8_ckpt, tmp_path):
    ckpt = copy(fp8_ckpt, tmp_path)
    name = f"{L0}.self_attn.o_proj.weight"
    edit_tensors(ckpt, lambda t: t.__setitem__(name, t[name].to(torch.bfloat16)))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' in .*: dtype bfloat16, expected "
                                              r"float8_e4m3fn"):
        load_model(build(ckpt), ckpt)


def test_fp8_tensor_for_a_bf16_model_is_named(fp8_ckpt, tmp_path):
    bf16 = tmp_path / "bf16"
    dequantize_checkpoint(fp8_ckpt, bf16)
    name = f"{L0}.mlp.gate_proj.weight"
    edit_tensors(bf16, lambda t: t.__setitem__(name, t[name].float().to(E4M3)))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' in .*: dtype float8_e4m3fn, "
                                              r"expected float32 \(the model's parameter\)"):
        load_model(build(bf16), bf16)
    # an FP8 checkpoint whose config.json lost its quantization_config: the same kind of error
    ckpt = copy(fp8_ckpt, tmp_path)
    edit_config(ckpt, lambda c: c.pop("quantization_config"))
    with pytest.raises(CheckpointError, match=r"dtype float8_e4m3fn, expected float32|"
                                              r"FP8 block scale, but config.json has no FP8"):
        load_model(build(ckpt), ckpt)


@pytest.mark.parametrize("bits", [0x7F, 0xFF])  # +NaN, -NaN: e4m3fn's only NaNs, no Inf
def test_nan_fp8_weight_is_named(fp8_ckpt, tmp_path, bits):
    ckpt = copy(fp8_ckpt, tmp_path)
    name = "model.layers.1.mlp.gate_proj.weight"

    def poison(t):
        raw = t[name].view(torch.uint8).clone()
        raw[3, 100] = bits
        t[name] = raw.view(E4M3)

    edit_tensors(ckpt, poison)
    n = FP8_TINY["intermediate_size"] * FP8_TINY["hidden_size"]
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' in .*: 1 of {n:,} values are NaN "
                                              r"\(the first at index \(3, 100\)\)"):
        load_model(build(ckpt), ckpt)
    load_model(build(ckpt), ckpt, check_finite=False)  # the check is what refuses it


# ---- tensor parallel: the scales shard with their weights ---------------------------------------


def _tp(monkeypatch, rank, tp):
    import qwen3_model.layers.embed_head as eh
    import qwen3_model.layers.linear as lin
    import qwen3_model.models.qwen3 as q3

    for mod in (lin, eh, q3):
        if hasattr(mod, "get_tp_rank"):
            monkeypatch.setattr(mod, "get_tp_rank", lambda: rank)
        monkeypatch.setattr(mod, "get_tp_world_size", lambda: tp)
    return lin


@pytest.mark.parametrize("tp", [2, 4])
def test_scales_split_with_their_weights(monkeypatch, tp):
    """Each rank's weight_scale_inv is the block rows (columns for row-parallel) of its weight
    slice: simulated in one process, as tests/test_tp.py does for the weights."""
    g = torch.Generator().manual_seed(2)
    hidden, d, hq, hkv, inter = 272, 128, 8, 2, 1024
    full = {k: torch.randn(n, kk, generator=g) for k, (n, kk) in dict(
        q=(hq * d, hidden), k=(hkv * d, hidden), v=(hkv * d, hidden), gate=(inter, hidden),
        up=(inter, hidden), down=(hidden, inter)).items()}
    quant = {k: quantize_weight_fp8(w) for k, w in full.items()}
    deq = {k: ref.dequantize_fp8(q, s, 128) for k, (q, s) in quant.items()}
    for rank in range(tp):
        lin = _tp(monkeypatch, rank, tp)
        qkv = lin.QKVParallelLinear(hidden, d, hq, hkv, quantization="fp8")
        gu = lin.MergedColumnParallelLinear(hidden, [inter, inter], quantization="fp8")
        row = lin.RowParallelLinear(inter, hidden, quantization="fp8")
        for shard in "qkv":
            for p, t in zip((qkv.weight, qkv.weight_scale_inv), quant[shard]):
                p.weight_loader(p, t, shard)
        for i, part in enumerate(("gate", "up")):
            for p, t in zip((gu.weight, gu.weight_scale_inv), quant[part]):
                p.weight_loader(p, t, i)
        for p, t in zip((row.weight, row.weight_scale_inv), quant["down"]):
            p.weight_loader(p, t)
        nq, nkv = hq // tp, max(1, hkv // tp)
        kv_head = rank // (tp // hkv) if tp > hkv else rank * nkv
        rows = lambda w, h0, n: w[h0 * d:(h0 + n) * d]  # noqa: E731
        want = torch.cat([rows(deq["q"], rank * nq, nq), rows(deq["k"], kv_head, nkv),
                          rows(deq["v"], kv_head, nkv)])
        got = ref.dequantize_fp8(qkv.weight, qkv.weight_scale_inv, 128)
        assert torch.equal(got, want), f"tp {tp} rank {rank}: qkv"
        n = inter // tp
        want = torch.cat([deq["gate"][rank * n:(rank + 1) * n], deq["up"][rank * n:(rank + 1) * n]])
        assert torch.equal(ref.dequantize_fp8(gu.weight, gu.weight_scale_inv, 128), want)
        got = ref.dequantize_fp8(row.weight, row.weight_scale_inv, 128)
        assert torch.equal(got, deq["down"][:, rank * n:(rank + 1) * n]), f"rank {rank}: down"
        with pytest.raises(ValueError, match=r"expected shape \(2, 3\), got \(1, 3\)"):
            qkv.weight_scale_inv.weight_loader(qkv.weight_scale_inv, quant["k"][1][:1], "k")


def test_shard_boundary_inside_a_block_is_refused(monkeypatch, fp8_ckpt):
    cfg = load_hf_config(fp8_ckpt)  # intermediate 384: 192 rows per rank at TP 2
    lin = _tp(monkeypatch, 0, 2)
    with pytest.raises(ValueError, match=r"FP8 gate_up_proj: part 0 \(384 rows in all\) is 192 "
                                         r"rows per rank at tensor-parallel size 2, not a "
                                         r"multiple of the 128-wide weight_scale_inv block"):
        Qwen3ForCausalLM(cfg)
    with pytest.raises(ValueError, match=r"FP8 down_proj: the input \(384 columns in all\) is "
                                         r"192 columns per rank at tensor-parallel size 2"):
        lin.RowParallelLinear(384, 272, quantization="fp8", name="down_proj")
    # head_dim 64: one kv head is half a block, so v would start inside k's last block
    lin = _tp(monkeypatch, 0, 1)
    with pytest.raises(ValueError, match=r"FP8 qkv_proj: k \(1 kv heads x head_dim 64\) is 64 "
                                         r"rows per rank, not a multiple"):
        lin.QKVParallelLinear(256, 64, 2, 1, quantization="fp8", name="qkv_proj")
    # and a bf16 model of the same shapes splits fine
    lin.QKVParallelLinear(256, 64, 2, 1)


@pytest.mark.parametrize("tp", [1, 2])
def test_memory_estimate_counts_fp8_bytes(monkeypatch, fp8_ckpt, tp):
    """memory.model_need's weights equal the bytes the FP8 model's parameters hold (1 per e4m3
    weight, 4 per block scale, the rest at the dtype), per rank."""
    from qwen3_model import memory
    from qwen3_model.loader import config_fields, read_config

    raw = dict(read_config(fp8_ckpt), intermediate_size=512)  # block-aligned at TP 2
    _tp(monkeypatch, 0, tp)
    model = Qwen3ForCausalLM(load_hf_config(fp8_ckpt).__class__(**raw))
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    need = memory.model_need(config_fields(raw, "config.json"), torch.float32, tp, kv_tokens=0)
    assert need.quantization == "fp8" and need.weights == held
    assert "with fp8 projections" in memory.describe(need, torch.float32, tp)
