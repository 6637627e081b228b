"""qwen3_model: a thin nano-vllm-style Qwen3 engine over the qwen3_kernels ops.

    from qwen3_model import LLM, SamplingParams
    llm = LLM("/path/to/Qwen3-0.6B")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))

Importing the package is cheap: the engine modules load on first use.
"""

_LAZY = {"LLM": "qwen3_model.llm", "SamplingParams": "qwen3_model.sampling_params"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'qwen3_model' has no attribute {name!r}")
