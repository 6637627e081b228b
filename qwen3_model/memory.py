"""What a model needs in memory, against what the device has: checked before anything large is
allocated, so an absurd config.json (hidden_size=10**9, num_hidden_layers=10**6) or
num_kvcache_blocks=10**9 fails at once with "needs ~X GiB, the GPU has Y" instead of in the
allocator after minutes.

    need = model_need(fields, dtype, tp, kv_tokens)   # weights + rope table + KV cache, one rank
    need = model_need(fields, dtype, tp, kv_tokens, kv_dtype=torch.float8_e4m3fn)  # fp8 KV
    check_fits(need, device_budget(device, utilization), where=config_file, ...)

The estimate counts what the model's parameters and buffers hold (qwen3_model/models/qwen3.py);
activations and CUDA graphs are not counted (the KV cache sizing leaves room for them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

GiB = 2**30


@dataclass(frozen=True)
class ModelNeed:
    """Bytes one rank holds for a model."""

    weights: int  # parameters at the engine dtype (FP8 projections: 1 byte + block scales)
    rope: int  # the fp32 cos | sin table [max_position_embeddings, head_dim]
    kv: int  # the KV cache counted (kv_tokens tokens)
    kv_tokens: int
    quantization: str | None = None  # "fp8": the projections' weights are e4m3
    kv_dtype: torch.dtype | None = None  # the KV cache's element type (None: the model's)

    @property
    def total(self) -> int:
        return self.weights + self.rope + self.kv


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads one rank holds: split over the ranks, or replicated when fewer than ranks."""
    return num_kv_heads // tp if num_kv_heads >= tp else 1


def model_need(fields: dict, dtype: torch.dtype, tp: int, kv_tokens: int,
               kv_dtype: torch.dtype | None = None) -> ModelNeed:
    """``fields``: the Qwen3 config values (hidden_size, ..., head_dim resolved), checked >= 1,
    and its quantization_config if any (FP8: 1 byte per projection weight + one fp32 scale per
    128 x 128 block); ``kv_dtype``: the KV cache's (None: ``dtype``). Python ints throughout: no
    overflow whatever the values."""
    h, inter = fields["hidden_size"], fields["intermediate_size"]
    layers, vocab = fields["num_hidden_layers"], fields["vocab_size"]
    heads, kv, hd = fields["num_attention_heads"], fields["num_key_value_heads"], fields["head_dim"]
    kv_local = kv_heads_per_rank(kv, tp)
    q_local = -(-heads // tp)
    inter_local = -(-inter // tp)
    # [N, K] per rank of qkv_proj, o_proj, gate_up_proj, down_proj
    projections = [((q_local + 2 * kv_local) * hd, h), (h, q_local * hd),
                   (2 * inter_local, h), (h, inter_local)]
    others = (
        2 * h + 2 * hd  # input / post-attention norms, q / k norms
        + (q_local + 2 * kv_local) * hd * bool(fields.get("attention_bias"))
    )
    itemsize = torch.empty((), dtype=dtype).element_size()
    qc = fields.get("quantization_config")
    quantization = "fp8" if isinstance(qc, dict) and qc.get("quant_method") == "fp8" else None
    if quantization:
        blocks = lambda n: -(-n // 128)  # noqa: E731
        proj_bytes = sum(n * k + 4 * blocks(n) * blocks(k) for n, k in projections)
    else:
        proj_bytes = sum(n * k for n, k in projections) * itemsize
    vocab_local = -(-vocab // tp)
    embed = vocab_local * h * (1 if fields.get("tie_word_embeddings") else 2)
    weights = layers * (proj_bytes + others * itemsize) + (embed + h) * itemsize
    rope = fields["max_position_embeddings"] * hd * 4
    kv_itemsize = torch.empty((), dtype=kv_dtype or dtype).element_size()  # fp8: 1
    kv_bytes = 2 * layers * kv_local * hd * kv_itemsize * kv_tokens
    return ModelNeed(weights, rope, kv_bytes, kv_tokens, quantization, kv_dtype)


@dataclass(frozen=True)
class DeviceBudget:
    """Bytes the engine may fill on a device, and how to say so."""

    usable: int
    what: str  # e.g. "the GPU cuda:0 has 75.2 GiB free of 79.1 (71.2 usable at ...)"


def physical_ram() -> int | None:
    """The machine's physical memory in bytes (os.sysconf), None where it cannot say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def device_budget(device: torch.device, utilization: float, *,
                  free: bool = True) -> DeviceBudget | None:
    """CUDA: ``utilization`` of the GPU less what is in use already (``free``: queried, which
    needs a context on the device), or of its total memory (``free=False``: no context made).
    CPU: the physical RAM. None where the size is unknown (nothing is refused then)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        if not free:
            usable = int(total * utilization)
            return DeviceBudget(usable, f"the GPU cuda:{index} has {size(total)} ({size(usable)} "
                                        f"usable at gpu_memory_utilization={utilization})")
        free_bytes, total = torch.cuda.mem_get_info(index)
        usable = int(total * utilization - (total - free_bytes))
        return DeviceBudget(usable, f"the GPU cuda:{index} has {size(free_bytes)} free of "
                                    f"{size(total)} ({size(max(usable, 0))} usable at "
                                    f"gpu_memory_utilization={utilization})")
    ram = physical_ram()
    if ram is None:
        return None
    return DeviceBudget(ram, f"the machine has {size(ram)} of RAM")


def size(n: int) -> str:
    """Bytes as GiB (MiB below one GiB), for messages."""
    return f"{n / GiB:,.1f} GiB" if n >= GiB else f"{n / 2**20:,.1f} MiB"


def describe(need: ModelNeed, dtype: torch.dtype, tp: int) -> str:
    dt = str(dtype).removeprefix("torch.")
    ranks = f" per rank of {tp}" if tp > 1 else ""
    if need.quantization:
        dt += f" with {need.quantization} projections"
    kv_dt = ("" if need.kv_dtype in (None, dtype)
             else f" at {str(need.kv_dtype).removeprefix('torch.')}")
    return (f"~{size(need.total)}{ranks} (weights {size(need.weights)} at {dt}, rope table "
            f"{size(need.rope)}, KV cache {size(need.kv)} for {need.kv_tokens:,} tokens{kv_dt})")
