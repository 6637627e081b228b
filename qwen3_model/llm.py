"""The public entry point, vLLM's convention.

    from qwen3_model import LLM, SamplingParams
    llm = LLM("/path/to/Qwen3-0.6B", max_model_len=4096)
    outs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.6, max_tokens=64))
    print(outs[0].text, outs[0].finish_reason)
"""

from qwen3_model.engine.llm_engine import LLMEngine, RequestOutput, StreamDelta  # noqa: F401
from qwen3_model.sampling_params import SamplingParams  # noqa: F401


class LLM(LLMEngine):
    """``LLM(model, tensor_parallel_size=1, dtype="auto", max_model_len=4096,
    gpu_memory_utilization=0.9, enforce_eager=False, kvcache_block_size=256,
    max_num_batched_tokens=16384, max_num_seqs=512, enable_prefix_caching=True,
    kv_cache_dtype="auto", ...)``; every setting is a field of ``qwen3_model.config.Config``
    (``kv_cache_dtype="fp8"``: an e4m3 KV cache, its scales as Config.kv_cache_dtype says).

    With ``tensor_parallel_size=N > 1`` the engine spawns N - 1 worker processes (one per GPU,
    NCCL; gloo on CPU) and this process is rank 0; ``llm.close()`` (or garbage collection, or
    interpreter exit) stops them. A worker that dies or raises makes the running generate raise a
    RuntimeError naming its rank and exit code; any failed step (KeyboardInterrupt included) stops
    every worker, and the engine then refuses further work. The workers inherit this process's
    environment unchanged (NCCL_* included)."""
