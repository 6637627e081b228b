"""Tiny random Qwen3 checkpoints written by transformers itself, for the CPU tests.

    from tests.qwen3_tiny import TINY_CONFIGS, make_tiny_qwen3
    cfg = make_tiny_qwen3(tmp_path / "ckpt", "untied_gqa4_sharded")   # writes config.json + safetensors
    cfg = make_tiny_qwen3(tmp_path / "ckpt", dict(TINY_CONFIGS["tied_gqa2"], num_hidden_layers=1))

The weights are drawn with a larger spread than transformers' default init (std 0.02 gives almost
flat logits, so greedy decoding would hinge on ties) and the norm weights are perturbed away from 1,
so that a norm weight that is not loaded, or loaded into the wrong place, changes the output.

``gain`` scales the fan-in init. At the default 1.5 a perturbation grows from layer to layer, so bf16
rounding flips greedy choices within a few tokens (transformers bf16 vs its own fp32: all 32 greedy
tokens equal on 2 of 6 prompts, 4-layer d=1024 model, measured on CPU). ``gain=0.5, embed_std=1.0``
is the stable regime where perturbations shrink (4 of 6 prompts equal for all 32 tokens) while the
outputs stay varied: the GPU tests that compare greedy tokens across bf16 implementations use it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Each preset covers something a real Qwen3 size does. hidden != heads * head_dim is the common
# case in real Qwen3 (0.6B, 1.7B, 4B, 32B), so most presets have it. Vocab and head counts divide
# by 2 so the same presets run under tensor parallel 2.
TINY_CONFIGS: dict[str, dict] = {
    # GQA 2:1, tied embeddings, one safetensors file, q width == hidden
    "tied_gqa2": dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
    ),
    # GQA 4:1, untied, sharded safetensors, q width (8 * 16 = 128) != hidden (96)
    "untied_gqa4_sharded": dict(
        vocab_size=320, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
        max_shard_size="100KB",
    ),
    # GQA 5:1, tied, head_dim 32, q width (10 * 32 = 320) != hidden (80), sharded
    "tied_gqa5_sharded": dict(
        vocab_size=192, hidden_size=80, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=10, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
        max_shard_size="100KB",
    ),
    # MHA (1:1), untied, head_dim 64, qkv bias on, q width (2 * 64 = 128) != hidden (48)
    "untied_mha_bias": dict(
        vocab_size=160, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False,
        attention_bias=True,
    ),
}

_DEFAULTS = dict(rms_norm_eps=1e-6, max_position_embeddings=512, rope_theta=1_000_000.0)


def tiny_config(spec: str | dict, **overrides):
    """A transformers Qwen3Config from a preset name or a dict of Qwen3Config fields."""
    from transformers import Qwen3Config

    fields = dict(TINY_CONFIGS[spec] if isinstance(spec, str) else spec)
    fields.update(overrides)
    fields.pop("max_shard_size", None)
    rope_theta = fields.pop("rope_theta", _DEFAULTS["rope_theta"])
    kw = {k: v for k, v in _DEFAULTS.items() if k != "rope_theta"}
    kw.update(fields)
    cfg = Qwen3Config(**kw)
    # transformers 5 keeps rope theta in rope_parameters; older versions in rope_theta.
    if isinstance(getattr(cfg, "rope_parameters", None), dict):
        cfg.rope_parameters["rope_theta"] = rope_theta
    else:
        cfg.rope_theta = rope_theta
    cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


def tiny_hf_model(cfg, seed: int = 0, gain: float = 1.5, embed_std: float = 0.5):
    """transformers' Qwen3ForCausalLM(cfg) in fp32 with well-spread random weights, in eval mode."""
    from transformers import Qwen3ForCausalLM

    gen = torch.Generator().manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(embed_std * torch.randn(p.shape, generator=gen))
            else:  # fan-in scaled so activations stay O(1) and logits are spread out
                p.copy_(torch.randn(p.shape, generator=gen) * (gain / p.shape[-1] ** 0.5))
    return model


def make_tiny_qwen3(
    path: str | os.PathLike,
    spec: str | dict = "tied_gqa2",
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    dtype: torch.dtype = torch.float32,
    return_model: bool = False,
    with_tokenizer: bool = False,
    gain: float = 1.5,
    embed_std: float = 0.5,
    **overrides,
):
    """Write a random tiny Qwen3 checkpoint (config.json + *.safetensors) to ``path``.

    max_shard_size: e.g. "100KB" to get several safetensors files and model.safetensors.index.json;
    defaults to the preset's own (None: one file). with_tokenizer: also write a word-level tokenizer
    (``write_tiny_tokenizer``) so prompts can be strings. Returns the Qwen3Config, or (config, hf_model)
    with ``return_model=True`` (the fp32 model, for comparisons).
    """
    fields = dict(TINY_CONFIGS[spec] if isinstance(spec, str) else spec)
    shard = max_shard_size or fields.get("max_shard_size") or "2GB"
    cfg = tiny_config(fields, **overrides)
    model = tiny_hf_model(cfg, seed, gain, embed_std)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    to_save = model if dtype == torch.float32 else tiny_hf_model(cfg, seed, gain, embed_std).to(dtype)
    to_save.save_pretrained(path, max_shard_size=shard)
    if with_tokenizer:
        write_tiny_tokenizer(path, cfg.vocab_size)
    return (cfg, model) if return_model else cfg


def write_tiny_tokenizer(path: str | os.PathLike, vocab_size: int, eos_token_id: int = 1) -> None:
    """A word-level tokenizer whose token i is the word ``w{i}``: "w3 w5" -> [3, 5], decode([3, 5])
    -> "w3 w5". Unknown words map to 0 (``w0``); ``w{eos_token_id}`` is the eos token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token=f"w{eos_token_id}")
    fast.save_pretrained(path)
