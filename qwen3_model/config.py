"""Engine settings: one validated dataclass, filled from ``LLM(model, **kwargs)``."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

import torch

_DTYPES = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
}
BLOCK_SIZES = (16, 32, 64, 128, 256)  # what the paged attention kernels support
SCHEDULING_POLICIES = ("auto", "fcfs", "longest_first")
# scheduling_policy="auto": an offline batch (LLM.generate / LLM.stream) of more than
# THROUGHPUT_MAX_NUM_SEQS requests on a model with at least THROUGHPUT_MIN_WEIGHT_BYTES of weights
# per GPU runs longest first with at most THROUGHPUT_MAX_NUM_SEQS sequences and
# THROUGHPUT_MAX_NUM_BATCHED_TOKENS tokens a step (the configured values where smaller): the
# schedule that measured fastest there. The nano-vllm workload on an H200 (one call), this schedule
# / fcfs at 512 sequences and 16384 tokens: Qwen3-8B 1.06x (bf16, 15.3 GiB of weights) and 1.03x
# (FP8, 8.8 GiB), 4B 1.03x (7.5 GiB), 1.7B 1.02x (3.2 GiB); Qwen3-0.6B (1.1 GiB, host-bound at
# small steps) 0.98x in another call, so it keeps fcfs (benchmarks/RESULTS.md); the deterministic
# mode takes the same rule (scheduler.throughput_schedule). Everything else, and the online engine
# (AsyncLLM, the server) always, runs fcfs under the configured budgets.
THROUGHPUT_MIN_WEIGHT_BYTES = 2 * 2**30
THROUGHPUT_MAX_NUM_SEQS = 176
THROUGHPUT_MAX_NUM_BATCHED_TOKENS = 384
PIECEWISE_BUCKET = 32  # token-count step of the piecewise graphs (max_piecewise_graph_tokens)
TP_ALL_REDUCE_CHOICES = ("auto", "custom", "nccl")
KV_CACHE_DTYPES = ("auto", "fp8")  # Config.kv_cache_dtype
# Config.deterministic: the longest sequence (qwen3_kernels.BATCH_INVARIANT_MAX_CONTEXT, spelled
# out so that importing the config does not load the kernels)
BATCH_INVARIANT_MAX_CONTEXT = 40960


@dataclass(slots=True)
class Config:
    # a Hugging Face Qwen3 checkpoint folder, or a Hub repo id "org/name[@revision]" (resolved to
    # its snapshot folder in the HF cache, downloaded if need be: qwen3_model/hub.py)
    model: str
    max_num_batched_tokens: int = 16384  # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 512  # sequences running at once
    max_model_len: int = 4096  # prompt + output, capped by the checkpoint's max_position_embeddings
    # share of the GPU the engine may fill (the KV cache takes what the model leaves)
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False  # True: no CUDA graphs
    kvcache_block_size: int = 256  # tokens per KV block
    num_kvcache_blocks: int = -1  # -1: sized from free GPU memory (CUDA) or cpu_kvcache_gib (CPU)
    # KV budget on CPU (capped at what max_num_seqs full sequences use)
    cpu_kvcache_gib: float = 1.0
    enable_prefix_caching: bool = True
    # the paged KV cache's element type: "auto" (the model's dtype) or "fp8" (float8_e4m3fn: one
    # byte per value, so the same memory holds twice the blocks of a bf16 cache). Each layer
    # stores K / V divided by its own fp32 k_scale / v_scale and multiplies them back on read:
    # the checkpoint's model.layers.{i}.self_attn.k_scale / .v_scale where it has them (the
    # format vLLM / llm-compressor FP8-KV checkpoints use; qwen3_model/loader.py), else 1.0.
    # Values beyond +-448 * scale (e4m3's largest) saturate there. With "auto" the scales are
    # still checked on load but not applied (a cache in the model dtype stores values as they are)
    kv_cache_dtype: str = "auto"
    dtype: str | torch.dtype = "auto"  # auto: the checkpoint's bf16/fp16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda if available, else cpu
    load_format: str = "auto"  # "dummy": random weights, config.json only (benchmarks)
    seed: int = 0  # global RNG (unseeded sampling, dummy weights)
    max_cudagraph_batch_size: int = 512  # decode batches up to this replay CUDA graphs
    # steps with prompt tokens (prefill chunks + decodes) of up to this many tokens replay
    # piecewise CUDA graphs cut at each attention (qwen3_model/engine/piecewise.py), in buckets
    # of PIECEWISE_BUCKET tokens, capped at max_num_batched_tokens; 0: they run eagerly. One GPU
    # only (tensor parallel runs such steps eagerly).
    max_piecewise_graph_tokens: int = 512
    # the order waiting requests are admitted in: "fcfs" (arrival), "longest_first" (the most
    # output tokens a request may still produce first: see qwen3_model/engine/scheduler.py), or
    # "auto": fcfs, but longest first with smaller budgets for a large offline batch on a large
    # model (THROUGHPUT_* above)
    scheduling_policy: str = "auto"
    # True: generate / stream schedule and launch step k + 1 while the device runs step k, where
    # no token of step k can end a sequence (see LLMEngine._steps); False: every step's tokens are
    # read before the next step is scheduled. Same tokens either way.
    overlap_steps: bool = True
    # tensor parallel all-reduce: "custom" (ours, fused with the residual add + RMSNorm; CUDA,
    # bf16 / fp16, 2..8 ranks), "nccl" (torch.distributed: NCCL on GPUs, gloo on CPU), or
    # "auto": custom where it can run, else nccl (qwen3_model/distributed.py)
    tp_all_reduce: str = "auto"
    # tensor parallel: a step that a worker has not answered for this many seconds fails, naming
    # the worker, and every process is stopped (a worker alive but stuck, e.g. SIGSTOPped)
    tp_step_timeout: float = 30.0
    # True: the deterministic (batch-invariant) mode. A request's tokens and logprobs are then
    # bit-identical whatever else runs with it: alone or in any batch, however its prompt is
    # chunked, with its prefix from the prefix cache or not, after preemption and recompute, with
    # CUDA graphs or eager, run after run (same build, GPU model, dtype and settings). Every
    # kernel with a choice takes one configuration for every batch (qwen3_kernels.ops, "Batch
    # invariance"); costs speed (README). One GPU (tensor_parallel_size=1), bf16 / fp16
    # checkpoints (not FP8), max_model_len <= 40960; on CUDA a Hopper GPU (compute capability 9.0)
    deterministic: bool = False
    # filled in __post_init__
    hf_config: object = field(default=None, repr=False)
    torch_dtype: torch.dtype = field(default=torch.float32, repr=False)
    eos_token_ids: tuple[int, ...] = ()  # empty: from generation_config.json / config.json
    # ``model`` as given (a repo id or a folder), for display and the served model name; ``model``
    # itself becomes the checkpoint folder
    model_id: str = field(default="", init=False)

    def __post_init__(self):
        def bad(name, expected):
            raise ValueError(f"LLM: {name} must be {expected}, got {getattr(self, name)!r}")

        def pos_int(name):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(name, "an integer >= 1")

        if not isinstance(self.model, (str, os.PathLike)):
            bad("model", "a checkpoint folder or a Hugging Face repo id")
        self.model_id = self.model = os.fspath(self.model)
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len",
                     "tensor_parallel_size", "max_cudagraph_batch_size"):
            pos_int(name)
        if not 0 < self.gpu_memory_utilization <= 1:
            bad("gpu_memory_utilization", "in (0, 1]")
        if self.kvcache_block_size not in BLOCK_SIZES:
            bad("kvcache_block_size", f"one of {BLOCK_SIZES}")
        if not isinstance(self.num_kvcache_blocks, int) or not (
            self.num_kvcache_blocks == -1 or self.num_kvcache_blocks >= 1
        ):
            bad("num_kvcache_blocks", "-1 (automatic) or an integer >= 1")
        if not self.cpu_kvcache_gib > 0:
            bad("cpu_kvcache_gib", "> 0")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"LLM: max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}), or some decodes could never be scheduled"
            )
        v = self.max_piecewise_graph_tokens
        if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v % PIECEWISE_BUCKET:
            bad("max_piecewise_graph_tokens",
                f"0 (off) or a positive multiple of {PIECEWISE_BUCKET}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            bad("scheduling_policy", f"one of {SCHEDULING_POLICIES}")
        if not isinstance(self.overlap_steps, bool):
            bad("overlap_steps", "True or False")
        t = self.tp_step_timeout
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 < t < float("inf"):
            bad("tp_step_timeout", "a number of seconds > 0")
        if self.tp_all_reduce not in TP_ALL_REDUCE_CHOICES:
            bad("tp_all_reduce", f"one of {TP_ALL_REDUCE_CHOICES}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            bad("kv_cache_dtype", f"one of {KV_CACHE_DTYPES}")
        if not isinstance(self.deterministic, bool):
            bad("deterministic", "True or False")
        if self.deterministic and self.tensor_parallel_size != 1:
            raise ValueError(
                f"LLM: deterministic=True runs on one GPU (tensor_parallel_size=1), got "
                f"tensor_parallel_size={self.tensor_parallel_size}: the all-reduce's summation is "
                "not batch-invariant")
        if self.load_format not in ("auto", "dummy"):
            bad("load_format", "'auto' or 'dummy'")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cuda", "cpu"):
            bad("device", "'auto', 'cuda' or 'cpu'")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("LLM: device='cuda' but torch sees no CUDA device")

        if not os.path.isdir(self.model):  # after the checks above: a download can take a while
            from qwen3_model.hub import parse_repo_id, snapshot_folder

            repo = parse_repo_id(self.model)
            if repo is None:
                bad("model", "a checkpoint folder that exists or a Hugging Face repo id "
                             "'org/name' (optionally 'org/name@revision')")
            self.model = snapshot_folder(*repo)

        from qwen3_model.loader import config_fields, load_hf_config, read_config

        raw = read_config(self.model)  # sizes checked for sign and range
        max_position = config_fields(raw, "config.json")["max_position_embeddings"]
        self.max_model_len = min(self.max_model_len, max_position)
        if self.deterministic and self.max_model_len > BATCH_INVARIANT_MAX_CONTEXT:
            raise ValueError(
                f"LLM: deterministic=True covers sequences of at most "
                f"{BATCH_INVARIANT_MAX_CONTEXT} tokens, got max_model_len={self.max_model_len}")
        self.torch_dtype = self._resolve_dtype(raw)
        # before transformers builds its config (10**6 layers take it seconds) and long before
        # the model: against the whole device (no CUDA context made here: TP workers run this
        # before they pick their GPU); ModelRunner checks again against the free memory
        self.check_memory(torch.device(self.device), free=False)
        self.hf_config = load_hf_config(self.model)
        if self.deterministic and getattr(self.hf_config, "quantization_config", None):
            raise ValueError(
                "LLM: deterministic=True runs bf16 / fp16 checkpoints; this one is quantized "
                f"({self.hf_config.quantization_config!r}), and the FP8 kernels are not "
                "batch-invariant")
        if not self.eos_token_ids:
            self.eos_token_ids = self._find_eos_ids()
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The KV cache tensors' dtype (kv_cache_dtype resolved)."""
        return torch.float8_e4m3fn if self.kv_cache_dtype == "fp8" else self.torch_dtype

    def kv_tokens_counted(self) -> int:
        """The KV cache the memory check counts: num_kvcache_blocks if given, else one
        max_model_len sequence (the least that serves any request)."""
        if self.num_kvcache_blocks > 0:
            return self.num_kvcache_blocks * self.kvcache_block_size
        return -(-self.max_model_len // self.kvcache_block_size) * self.kvcache_block_size

    def check_memory(self, device: torch.device, free: bool = True) -> None:
        """Refuse a model (weights at torch_dtype + rope table + ``kv_tokens_counted``) that
        cannot fit on ``device`` (qwen3_model/memory.py), before anything is allocated; a
        CheckpointError naming config.json's sizes, or a ValueError naming num_kvcache_blocks
        where the weights alone would fit."""
        from qwen3_model.loader import CheckpointError, config_fields, read_config
        from qwen3_model.memory import describe, device_budget, model_need, size

        config_file = os.path.join(self.model, "config.json")
        raw = self.hf_config.to_dict() if self.hf_config is not None else read_config(self.model)
        fields = config_fields(raw, config_file)
        tp = self.tensor_parallel_size
        budget = device_budget(device, self.gpu_memory_utilization, free=free)
        if budget is None:
            return
        need = model_need(fields, self.torch_dtype, tp, self.kv_tokens_counted(),
                          kv_dtype=self.kv_cache_torch_dtype)
        # CPU ranks share the machine's RAM
        sharing = tp if device.type == "cpu" else 1
        if need.total * sharing <= budget.usable:
            return
        where = "the machine" if device.type == "cpu" else "the GPU"
        if (need.total - need.kv) * sharing <= budget.usable and self.num_kvcache_blocks > 0:
            raise ValueError(
                f"LLM: num_kvcache_blocks={self.num_kvcache_blocks} needs "
                f"{size(need.kv * sharing)} of KV cache on top of the model's "
                f"{size((need.total - need.kv) * sharing)}; {budget.what}: "
                f"lower num_kvcache_blocks (-1 sizes it to {where})")
        sizes = ", ".join(f"{k}={fields[k]:,}" for k in (
            "hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size",
            "max_position_embeddings"))
        tp_note = f" and tensor_parallel_size={tp}" if tp > 1 else ""
        raise CheckpointError(
            f"{config_file}: the model needs {describe(need, self.torch_dtype, tp)}"
            f"{f' on each of {tp} ranks sharing its RAM' if sharing > 1 else ''}; "
            f"{budget.what} ({sizes}; dtype {str(self.torch_dtype).removeprefix('torch.')}"
            f"{tp_note})")

    def _resolve_dtype(self, raw: dict) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            dt = self.dtype
        elif self.dtype == "auto":
            if self.device == "cpu":
                return torch.float32  # the CPU path runs the fp32 reference ops anyway
            ckpt = raw.get("dtype") or raw.get("torch_dtype")
            ckpt = _DTYPES.get(ckpt, ckpt) if isinstance(ckpt, str) else ckpt
            return ckpt if ckpt in (torch.bfloat16, torch.float16) else torch.bfloat16
        elif isinstance(self.dtype, str) and self.dtype in _DTYPES:
            dt = _DTYPES[self.dtype]
        else:
            raise ValueError(f"LLM: dtype must be 'auto', one of {sorted(_DTYPES)} or a torch "
                             f"dtype, got {self.dtype!r}")
        if dt not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"LLM: dtype must be bfloat16, float16 or float32, got {dt}")
        return dt

    def _find_eos_ids(self) -> tuple[int, ...]:
        """EOS ids from generation_config.json (what HF generate uses), else config.json."""
        ids = None
        if os.path.isfile(os.path.join(self.model, "generation_config.json")):
            from transformers import GenerationConfig

            ids = GenerationConfig.from_pretrained(self.model).eos_token_id
        if ids is None:
            ids = getattr(self.hf_config, "eos_token_id", None)
        if ids is None:
            return ()
        return tuple(ids) if isinstance(ids, (list, tuple)) else (int(ids),)

    @staticmethod
    def field_names() -> list[str]:
        derived = ("hf_config", "torch_dtype", "model_id")
        return [f.name for f in fields(Config) if f.name not in derived]
