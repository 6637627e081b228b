"""qwen3-kernels: CUDA / CUTLASS kernels for the hot path of Qwen3 inference.

    import torch, qwen3_kernels
    out = qwen3_kernels.silu_and_mul(x)            # Python wrapper: checks, allocates out
    torch.ops.qwen3_kernels.silu_and_mul(out, x)   # the raw out-variant op

Without the CUDA extension every op runs its fp32 reference (``qwen3_kernels.reference``).
"""

import warnings as _warnings

from . import reference
from .ops import (
    BATCH_INVARIANT_MAX_CONTEXT,
    MAX_DECODE_SPLITS,
    cuda_kernels_import_error,
    decode_workspace,
    fused_add_rms_norm,
    fused_add_rms_norm_fp8,
    has_cuda_kernels,
    fp8_scales_buffer,
    linear_fp8,
    linear_fp8_silu_and_mul,
    linear_silu_and_mul,
    quantize_fp8,
    paged_attention_decode,
    paged_attention_prefill,
    qk_norm_rope,
    linear,
    rms_norm,
    rms_norm_fp8,
    sample_tokens,
    silu_and_mul,
    silu_and_mul_fp8,
    tp_all_reduce,
    tp_all_reduce_add_rms_norm,
    tp_all_reduce_buffer_bytes,
    tp_gemv_push,
    trusted_inputs,
)

__all__ = [
    "BATCH_INVARIANT_MAX_CONTEXT", "MAX_DECODE_SPLITS", "cuda_kernels_import_error", "decode_workspace", "fp8_scales_buffer",
    "fused_add_rms_norm", "fused_add_rms_norm_fp8", "has_cuda_kernels", "linear", "linear_fp8",
    "linear_fp8_silu_and_mul", "linear_silu_and_mul",
    "paged_attention_decode", "paged_attention_prefill", "qk_norm_rope", "quantize_fp8",
    "reference", "rms_norm", "rms_norm_fp8", "sample_tokens", "silu_and_mul",
    "silu_and_mul_fp8", "tp_all_reduce",
    "tp_all_reduce_add_rms_norm", "tp_all_reduce_buffer_bytes", "tp_gemv_push", "trusted_inputs",
]
__version__ = "0.1.0"


def _say_once_if_reference_only():
    import torch

    if not has_cuda_kernels() and torch.cuda.is_available():
        # A CUDA machine without our extension is a broken install worth one clear line.
        _warnings.warn(
            "qwen3_kernels: CUDA is available but the CUDA extension is not built "
            f"({cuda_kernels_import_error()}); ops run the slow PyTorch reference. "
            "Reinstall with nvcc on PATH: pip install --no-build-isolation -e .",
            stacklevel=2,
        )


_say_once_if_reference_only()
