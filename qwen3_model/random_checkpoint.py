"""Random-weight Qwen3 checkpoints: for the CLI demo, the benchmarks and the tests.

    write_random_checkpoint(path, "demo")                    # small, fp32, weights + tokenizer
    write_random_checkpoint(path, "0.6B", weights=False)     # the real 0.6B shape, config only
                                                             # (run it with load_format="dummy")
    write_random_checkpoint(path, "demo", quantization="fp8")   # Qwen3-*-FP8's format
    dequantize_checkpoint(fp8_path, bf16_path)               # the same weights as bf16

The tokenizer is character-level (printable ASCII, newline, a few Qwen-style special tokens and a
chat template), built offline with the ``tokenizers`` library, so string prompts and ``--chat`` work
without downloading anything.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import string
from pathlib import Path

import torch

from qwen3_kernels.reference import FP8_GROUP, FP8_MAX, FP8_SCALE_FLOOR, dequantize_fp8
from qwen3_model.loader import FP8_PROJECTIONS, FP8_QUANTIZATION, FP8_SCALE, INDEX_FILE

# Qwen3 dense shapes (TARGETS.md): hidden, layers, q heads, kv heads, intermediate, tied embeddings.
# All: head_dim 128, vocab 151936, rope_theta 1e6, rms_norm_eps 1e-6.
QWEN3_SIZES = {
    "0.6B": (1024, 28, 16, 8, 3072, True),
    "1.7B": (2048, 28, 16, 8, 6144, True),
    "4B": (2560, 36, 32, 8, 9728, True),
    "8B": (4096, 36, 32, 8, 12288, False),
    "14B": (5120, 40, 40, 8, 17408, False),
    "32B": (5120, 64, 64, 8, 25600, False),
}

# Small enough that the CLI demo runs its batch in seconds on a laptop CPU.
DEMO_SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  tie_word_embeddings=True, max_position_embeddings=4096)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen3_config(size_or_fields: str | dict, **overrides):
    """A transformers Qwen3Config for a size name ("0.6B" ... "32B", "demo") or explicit fields."""
    from transformers import Qwen3Config

    if isinstance(size_or_fields, dict):
        fields = dict(size_or_fields)
    elif size_or_fields == "demo":
        fields = dict(DEMO_SHAPE)
    elif size_or_fields in QWEN3_SIZES:
        hidden, layers, heads, kv, inter, tied = QWEN3_SIZES[size_or_fields]
        fields = dict(vocab_size=151936, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter,
                      head_dim=128, tie_word_embeddings=tied, max_position_embeddings=40960)
    else:
        raise ValueError(f"unknown Qwen3 size {size_or_fields!r}; expected one of "
                         f"{sorted(QWEN3_SIZES)} or 'demo'")
    fields.setdefault("rms_norm_eps", 1e-6)
    fields.update(overrides)
    cfg = Qwen3Config(**fields)
    if isinstance(getattr(cfg, "rope_parameters", None), dict):
        cfg.rope_parameters["rope_theta"] = 1_000_000.0
    else:
        cfg.rope_theta = 1_000_000.0
    cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


def char_tokenizer(vocab_size: int):
    """A character-level PreTrainedTokenizerFast with exactly ``vocab_size`` entries.

    Ids: the special tokens, then printable ASCII and newline (one id per char), then two- to
    four-letter filler strings up to vocab_size (never produced by encoding, but every id decodes
    to text).
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    fillers = ("".join(p) for n in (2, 3, 4)  # (enough for Qwen3's 151,936 ids)
               for p in itertools.product(string.ascii_lowercase, repeat=n))
    pieces = SPECIAL_TOKENS + chars
    if vocab_size < len(pieces):
        raise ValueError(f"char_tokenizer needs vocab_size >= {len(pieces)}, got {vocab_size}")
    pieces += list(itertools.islice(fillers, vocab_size - len(pieces)))
    if len(pieces) < vocab_size:
        raise ValueError(f"char_tokenizer supports vocab_size <= {len(pieces)}, got {vocab_size}")
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()  # concatenate the pieces, no spaces in between
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token="<unk>", chat_template=CHAT_TEMPLATE,
    )


def write_random_checkpoint(
    path: str | os.PathLike,
    size_or_fields: str | dict = "demo",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    weights: bool = True,
    tokenizer: bool = True,
    quantization: str | None = None,
    max_shard_bytes: int | None = None,
    **overrides,
):
    """Write config.json (+ random safetensors with ``weights``, + a char tokenizer) to ``path``.

    ``quantization="fp8"``: Qwen3-*-FP8's format (``quantize_state_dict_fp8``: e4m3 projections
    with their 128 x 128 block scales, everything else bf16; config.json's quantization_config
    and dtype bfloat16); ``dtype`` is then ignored. ``max_shard_bytes`` (FP8 only) splits the
    weights over several files with an index.
    Returns the Qwen3Config. The tokenizer's <|im_end|> (id 2) is the EOS, as in Qwen3.
    """
    if quantization not in (None, "none", "fp8"):
        raise ValueError(f"quantization must be None, 'none' or 'fp8', got {quantization!r}")
    fp8 = quantization == "fp8"
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = qwen3_config(size_or_fields, **overrides)
    if fp8:
        cfg.quantization_config = dict(FP8_QUANTIZATION)
        dtype = torch.bfloat16
    if tokenizer:
        cfg.eos_token_id = SPECIAL_TOKENS.index("<|im_end|>")
        char_tokenizer(cfg.vocab_size).save_pretrained(path)
    if weights:
        from transformers import Qwen3ForCausalLM

        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg).to(torch.float32 if fp8 else dtype)
        with torch.no_grad():  # spread the logits so a random model does not just repeat itself
            for name, p in model.named_parameters():
                if not name.endswith("norm.weight"):
                    p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
        if not fp8:
            model.save_pretrained(path)
            return cfg
        tensors = dict(model.state_dict())
        if cfg.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)  # the embedding, stored once
        save_safetensors(path, quantize_state_dict_fp8(tensors), max_shard_bytes)
    cfg.dtype = dtype
    cfg.save_pretrained(path)
    return cfg


# ---- FP8 checkpoints (Qwen3-*-FP8) -------------------------------------------------------------


def is_fp8_projection(name: str) -> bool:
    """Whether a checkpoint tensor is a projection weight an FP8 checkpoint stores in e4m3."""
    parts = name.split(".")
    return (len(parts) >= 3 and parts[-1] == "weight"
            and parts[-2] in FP8_PROJECTIONS.get(parts[-3], ()))


def quantize_weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (weight [N, K] float8_e4m3fn, weight_scale_inv [ceil(N/128), ceil(K/128)]
    fp32), Qwen's FP8 format: per 128 x 128 block (the last ones partial), scale =
    max(|block|, FP8_SCALE_FLOOR) / 448 and weight = w / scale rounded to e4m3, saturating."""
    n, k = w.shape
    rows, cols = -(-n // FP8_GROUP), -(-k // FP8_GROUP)
    padded = torch.zeros(rows * FP8_GROUP, cols * FP8_GROUP, dtype=torch.float32)
    padded[:n, :k] = w.float()
    blocks = padded.view(rows, FP8_GROUP, cols, FP8_GROUP)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(FP8_SCALE_FLOOR) / FP8_MAX  # [rows, cols]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(rows * FP8_GROUP, cols * FP8_GROUP)[:n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def quantize_state_dict_fp8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Qwen3 state dict -> Qwen3-*-FP8's: each projection's ``<name>.weight`` in e4m3 and its
    ``<name>.weight_scale_inv`` (``quantize_weight_fp8``), every other tensor in bf16."""
    out = {}
    for name, t in tensors.items():
        if is_fp8_projection(name):
            out[name], out[name + "_scale_inv"] = quantize_weight_fp8(t)
        else:
            out[name] = t.to(torch.bfloat16).contiguous()
    return out


def dequantize_state_dict_fp8(tensors: dict[str, torch.Tensor],
                              dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The inverse of ``quantize_state_dict_fp8`` up to its rounding: each e4m3 weight times its
    block's scale (reference.dequantize_fp8), in ``dtype``; the scales dropped."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("." + FP8_SCALE):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = tensors.get(name + "_scale_inv")
            if scale is None:
                raise ValueError(f"FP8 tensor {name!r} has no {name + '_scale_inv'!r}")
            t = dequantize_fp8(t, scale, FP8_GROUP)
        out[name] = t.to(dtype).contiguous()
    return out


def save_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor],
                     max_shard_bytes: int | None = None) -> list[Path]:
    """Write ``tensors`` as model.safetensors, or, past ``max_shard_bytes``, as
    model-0000i-of-0000n.safetensors files and model.safetensors.index.json (Hugging Face's
    layout; a tensor is never split). Returns the files written."""
    path = Path(path)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    from safetensors.torch import save_file

    if len(shards) == 1:
        save_file(shards[0], path / "model.safetensors", metadata={"format": "pt"})
        return [path / "model.safetensors"]
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        file = path / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, file, metadata={"format": "pt"})
        files.append(file)
        weight_map.update({name: file.name for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / INDEX_FILE).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return files


def _convert(src, dst, convert, edit_config, max_shard_bytes) -> None:
    """Copy the checkpoint folder ``src`` to ``dst`` with its tensors ``convert``-ed and its
    config.json object ``edit_config``-ed; tokenizer and other files as they are."""
    from safetensors.torch import load_file

    from qwen3_model.loader import safetensors_files

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for file in safetensors_files(src):
        tensors.update(load_file(file))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in (INDEX_FILE,
                                                                         "config.json"):
            shutil.copy2(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    edit_config(config)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_safetensors(dst, convert(tensors), max_shard_bytes)


def quantize_checkpoint(src: str | os.PathLike, dst: str | os.PathLike,
                        max_shard_bytes: int | None = None) -> None:
    """A bf16 / fp32 Qwen3 checkpoint folder -> the same model in Qwen3-*-FP8's format."""
    def edit(config):
        config["quantization_config"] = dict(FP8_QUANTIZATION)
        config.pop("torch_dtype", None)
        config["dtype"] = "bfloat16"

    _convert(src, dst, quantize_state_dict_fp8, edit, max_shard_bytes)


def dequantize_checkpoint(src: str | os.PathLike, dst: str | os.PathLike,
                          dtype: torch.dtype = torch.bfloat16,
                          max_shard_bytes: int | None = None) -> None:
    """An FP8 checkpoint folder -> the same weights dequantized (``dequantize_state_dict_fp8``)
    in ``dtype``, without quantization_config: what the FP8 model computes, less the activation
    quantization."""
    def edit(config):
        config.pop("quantization_config", None)
        config.pop("torch_dtype", None)
        config["dtype"] = str(dtype).removeprefix("torch.")

    _convert(src, dst, lambda t: dequantize_state_dict_fp8(t, dtype), edit, max_shard_bytes)
