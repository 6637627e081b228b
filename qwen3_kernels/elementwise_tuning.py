"""Launch variants of the silu_and_mul, RMSNorm and GEMV CUDA kernels, for benchmarks and tests.

    from qwen3_kernels import elementwise_tuning as et
    et.variants("silu")                    # ['auto', 'legacy', 'flat128x1', ...]; index 0 is the default
    with et.variant("norm", "cluster4"):   # rms_norm and fused_add_rms_norm, T < 1024 only
        qwen3_kernels.rms_norm(x, w, 1e-6)

What each variant launches is documented at the top of csrc/kernels/activation.cu ("silu"),
csrc/kernels/norm.cu ("norm"), csrc/kernels/gemm/linear_gemv.cu ("gemv": the launch of the
weight-streaming GEMV behind linear at T = 1 and linear_silu_and_mul; "gemv_loads": the L2 hint
of its weight loads; "gemv_silu": linear_silu_and_mul's kernel at T = 1) and
csrc/kernels/decode_chain.cu ("chain").
The choice is process-wide and applies to launches made after it is set (a CUDA graph keeps what
was set when it was captured). It lives in the extension (exported C functions found through
ctypes), so an op pays one relaxed atomic load for it; the environment variables
QWEN3_SILU_VARIANT / QWEN3_NORM_VARIANT / QWEN3_GEMV_VARIANT / QWEN3_GEMV_LOADS /
QWEN3_GEMV_SILU / QWEN3_CHAIN_VARIANT (a name or an index) give the initial value.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools

OPS = ("silu", "norm", "gemv", "gemv_loads", "gemv_silu", "chain")


@functools.lru_cache(maxsize=None)
def _lib():
    """The loaded extension as a ctypes library, or None (no extension, or built without hooks)."""
    from .ops import extension_cdll

    lib = extension_cdll()
    if lib is None:
        return None
    try:
        for op in OPS:
            getattr(lib, f"qwen3_{op}_set_variant").argtypes = [ctypes.c_int]
            getattr(lib, f"qwen3_{op}_set_variant").restype = ctypes.c_int
            getattr(lib, f"qwen3_{op}_get_variant").restype = ctypes.c_int
            getattr(lib, f"qwen3_{op}_num_variants").restype = ctypes.c_int
            getattr(lib, f"qwen3_{op}_variant_name").argtypes = [ctypes.c_int]
            getattr(lib, f"qwen3_{op}_variant_name").restype = ctypes.c_char_p
    except AttributeError:
        return None
    return lib


def available() -> bool:
    """Whether the built extension has the variant hooks."""
    return _lib() is not None


def _fn(op: str, what: str):
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    lib = _lib()
    if lib is None:
        raise RuntimeError("qwen3_kernels.elementwise_tuning: the CUDA extension (with the "
                           "variant hooks) is not loaded")
    return getattr(lib, f"qwen3_{op}_{what}")


def variants(op: str) -> list[str]:
    """Variant names of op (one of OPS) by index; index 0 is the default."""
    name = _fn(op, "variant_name")
    return [name(i).decode() for i in range(_fn(op, "num_variants")())]


def current(op: str) -> str:
    """The variant now in force."""
    return variants(op)[_fn(op, "get_variant")()]


def select(op: str, variant: int | str) -> str:
    """Selects a variant by name or index; returns the previous one's name."""
    names = variants(op)
    index = names.index(variant) if isinstance(variant, str) and variant in names else variant
    before = _fn(op, "set_variant")(index) if isinstance(index, int) else -1
    if before < 0:
        raise ValueError(f"unknown {op} variant {variant!r}; known: {names}")
    return names[before]


@contextlib.contextmanager
def variant(op: str, name: int | str):
    """Runs the block with op's variant set to name, then restores the previous one."""
    before = select(op, name)
    try:
        yield
    finally:
        select(op, before)
