"""Random-weight Qwen3 checkpoints: for the CLI demo, the benchmarks and the tests.

    write_random_checkpoint(path, "demo")                    # small, fp32, weights + tokenizer
    write_random_checkpoint(path, "0.6B", weights=False)     # the real 0.6B shape, config only
                                                             # (run it with load_format="dummy")

The tokenizer is character-level (printable ASCII, newline, a few Qwen-style special tokens and a
chat template), built offline with the ``tokenizers`` library, so string prompts and ``--chat`` work
without downloading anything.
"""

from __future__ import annotations

import itertools
import os
import string
from pathlib import Path

import torch

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
    **overrides,
):
    """Write config.json (+ random safetensors with ``weights``, + a char tokenizer) to ``path``.

    Returns the Qwen3Config. The tokenizer's <|im_end|> (id 2) is the EOS, as in Qwen3.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = qwen3_config(size_or_fields, **overrides)
    if tokenizer:
        cfg.eos_token_id = SPECIAL_TOKENS.index("<|im_end|>")
        char_tokenizer(cfg.vocab_size).save_pretrained(path)
    if weights:
        from transformers import Qwen3ForCausalLM

        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg).to(dtype)
        with torch.no_grad():  # spread the logits so a random model does not just repeat itself
            for name, p in model.named_parameters():
                if not name.endswith("norm.weight"):
                    p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
        model.save_pretrained(path)
    else:
        cfg.dtype = dtype
        cfg.save_pretrained(path)
    return cfg
