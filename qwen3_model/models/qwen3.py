"""Qwen3 dense models (0.6B ... 32B) over the qwen3_kernels ops, split for tensor parallelism.

    model = Qwen3ForCausalLM(hf_config)          # params in the current default dtype / device
    load_model(model, path)                      # qwen3_model.loader
    hidden = model(input_ids, positions)         # [T] int64, [T] int64 -> [T, hidden]
    logits = model.compute_logits(hidden[last])  # [N, hidden] -> [N, vocab] fp32 (rank 0)

Parameter names follow the Hugging Face checkpoint, except the fused projections listed in
``packed_modules_mapping`` (q/k/v -> qkv_proj, gate/up -> gate_up_proj).

A config with Qwen's FP8 ``quantization_config`` (Qwen3-*-FP8) builds the seven projections
with float8_e4m3fn weights and their ``weight_scale_inv`` block scales (layers/linear.py);
embeddings, norms and lm_head stay at the default dtype.
"""

from __future__ import annotations

import torch
from torch import nn

import qwen3_kernels
from qwen3_model.distributed import divide, get_tp_world_size
from qwen3_model.layers.attention import Attention
from qwen3_model.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from qwen3_model.layers.layernorm import RMSNorm
from qwen3_model.layers.linear import (
    Fp8Activation,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    linear,
    linear_silu_and_mul,
)
from qwen3_model.layers.rotary import RotaryEmbedding, rope_parameters
from qwen3_model.loader import quantization_method


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def quantization_of(config) -> str | None:
    """None (bf16 weights) or "fp8", from the config's quantization_config (checked: a
    CheckpointError, a ValueError, for a format this model does not run)."""
    fields = {"quantization_config": getattr(config, "quantization_config", None),
              "num_hidden_layers": config.num_hidden_layers}
    return quantization_method(fields, "Qwen3 config")


def check_qwen3_config(config) -> None:
    """Reject what this model does not implement, with the field that says so."""
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"Qwen3 model: hidden_act must be 'silu', got {act!r}")
    if getattr(config, "use_sliding_window", False):
        raise ValueError("Qwen3 model: use_sliding_window=True is not supported (full attention only)")
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if kv < 1 or heads % kv:
        raise ValueError(
            f"Qwen3 model: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})"
        )
    # Tensor parallel: heads, the MLP and the vocab split evenly (no padding); fewer kv heads than
    # ranks are replicated, which needs the rank count to be a multiple of them.
    tp = get_tp_world_size()
    for field in ("num_attention_heads", "intermediate_size", "vocab_size"):
        divide(getattr(config, field), tp, f"Qwen3 config {field}")
    if kv >= tp:
        divide(kv, tp, "Qwen3 config num_key_value_heads")
    elif tp % kv:
        raise ValueError(
            f"Qwen3 config num_key_value_heads ({kv}) is smaller than the tensor-parallel size ({tp}) "
            f"and does not divide it, so kv heads cannot be replicated evenly"
        )


class Qwen3Attention(nn.Module):
    def __init__(self, config, rotary_emb: RotaryEmbedding, quantization: str | None = None):
        super().__init__()
        head_dim = head_dim_of(config)
        eps = config.rms_norm_eps
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, config.num_attention_heads, config.num_key_value_heads,
            bias, quantization, "qkv_proj"
        )
        self.num_heads = self.qkv_proj.num_heads  # local
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # local
        # q width = heads * head_dim, not hidden_size (they differ for 0.6B, 1.7B, 4B, 32B)
        # unreduced: the decoder sums it over the ranks inside the next residual add + norm
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias,
                                        reduce_results=False, quantization=quantization,
                                        name="o_proj")
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        self.rotary_emb = rotary_emb  # one table shared by every layer
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5, eps)

    def forward(self, positions: torch.Tensor,
                x: torch.Tensor | Fp8Activation) -> torch.Tensor:  # x [T, hidden]
        qkv = self.qkv_proj(x)
        o = self.attn(qkv, positions, self.q_norm.weight, self.k_norm.weight, self.rotary_emb.cos_sin_cache)
        return self.o_proj(o)


class Qwen3MLP(nn.Module):
    def __init__(self, config, quantization: str | None = None):
        super().__init__()
        i = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [i, i],
                                                       quantization=quantization,
                                                       name="gate_up_proj")
        self.down_proj = RowParallelLinear(i, config.hidden_size, reduce_results=False,  # as o_proj
                                           quantization=quantization, name="down_proj")

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:  # x [T, hidden]
        gu = self.gate_up_proj
        if isinstance(x, Fp8Activation):  # FP8 above one token: silu_and_mul quantizes too
            gate_up = linear(x, gu.weight, gu.bias, gu.weight_scale_inv)  # [T, 2I]
            h = qwen3_kernels.silu_and_mul_fp8(gate_up)
            return self.down_proj(Fp8Activation(*h, gate_up.dtype))
        # silu_and_mul(gate_up_proj(x)), fused into the GEMV where that runs
        h = linear_silu_and_mul(x, gu.weight, gu.bias, gu.weight_scale_inv,
                                gu.batch_invariant)  # [T, I]
        return self.down_proj(h)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config, rotary_emb: RotaryEmbedding, quantization: str | None = None):
        super().__init__()
        self.self_attn = Qwen3Attention(config, rotary_emb, quantization)
        self.mlp = Qwen3MLP(config, quantization)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # FP8 projections on one rank: above one token the norms and silu_and_mul hand them
        # their input quantized (Fp8Activation), one pass each instead of linear_fp8's own
        # quantize_fp8 launch; at one token the FP8 GEMV quantizes x itself. Under tensor
        # parallelism the norms are fused with the all-reduce instead.
        self.fp8_activations = quantization == "fp8" and get_tp_world_size() == 1

    def forward(self, positions, hidden, residual):
        """hidden [T, H]; residual [T, H] or None (first layer: hidden is the embedding). Returns
        the pre-norm pair for the next layer: the MLP's output is still this rank's partial sum
        (o_proj and down_proj do not reduce): the all-reduce and the residual add are fused into
        the next norm (``all_reduce_x``)."""
        fp8 = self.fp8_activations and hidden.shape[0] > 1
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden, fp8_out=fp8)
        elif fp8:
            hidden, residual = self.input_layernorm(hidden, residual, fp8_out=True)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, all_reduce_x=True)
        hidden = self.self_attn(positions, hidden)
        if fp8:
            hidden, residual = self.post_attention_layernorm(hidden, residual, fp8_out=True)
        else:
            hidden, residual = self.post_attention_layernorm(hidden, residual, all_reduce_x=True)
        return self.mlp(hidden), residual


class Qwen3Model(nn.Module):
    def __init__(self, config, quantization: str | None = None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # [max_position, head_dim] fp32, built once: a copy per layer would cost ~0.6 GB at 28 layers
        rotary = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, rope_parameters(config))
        self.layers = nn.ModuleList([Qwen3DecoderLayer(config, rotary, quantization)
                                     for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        if residual is None:  # zero layers
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual, all_reduce_x=True)  # the last down_proj's partials
        return hidden


class Qwen3ForCausalLM(nn.Module):
    # checkpoint module name -> (our fused module, shard id passed to its weight_loader)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, batch_invariant: bool = False):
        """``batch_invariant``: the deterministic mode (Config.deterministic): every layer with a
        kernel choice (projections, norms, attention, LM head) computes each token's row the
        same way whatever else is in the step, so its output is bit-identical alone or in any
        batch. Not with FP8 weights or tensor parallelism (the engine refuses both)."""
        super().__init__()
        check_qwen3_config(config)
        self.config = config
        self.quantization = quantization_of(config)
        self.tp_size = get_tp_world_size()
        self.model = Qwen3Model(config, self.quantization)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            # One parameter, listed once (as model.embed_tokens.weight) in named_parameters().
            self.lm_head.weight = self.model.embed_tokens.weight
        for m in self.modules():  # the layer classes that have the mode declare it
            if hasattr(type(m), "batch_invariant"):
                m.batch_invariant = bool(batch_invariant)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 (one step's flat tokens) -> hidden [T, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor,
                       dtype: torch.dtype | None = torch.float32) -> torch.Tensor | None:
        """hidden [N, hidden] -> logits [N, vocab] on rank 0 (fp32, or ``dtype``; None keeps the
        model's), None on other ranks."""
        return self.lm_head.compute_logits(hidden, dtype)
