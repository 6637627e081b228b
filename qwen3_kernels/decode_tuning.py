"""Run-time switches of the paged_attention_decode CUDA kernel, for benchmarks and tests.

    from qwen3_kernels import decode_tuning as dt
    with dt.tuning(num_splits=4, variant="w8s3", flags=dt.INTERLEAVE | dt.FAST_COMBINE):
        qwen3_kernels.paged_attention_decode(...)

What each switch does is documented at the top of csrc/kernels/attention/decode.cu ("Tuning").
The settings are process-wide and apply to launches made after they are set (a CUDA graph keeps
what was set when it was captured). They live in the extension (exported C functions found through
ctypes), so setting them costs the op nothing per call; the environment variables
QWEN3_DECODE_SPLITS / QWEN3_DECODE_VARIANT / QWEN3_DECODE_FLAGS give their initial values.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools

INTERLEAVE = 1    # split s takes chunks s, s + num_splits, ...: its start does not wait on seq_lens
FAST_COMBINE = 2  # the combine kernel loads every partial at once
PDL = 4           # the main kernel is launched with programmatic dependent launch too
FUSED_COMBINE = 8  # no combine kernel: the split CTA that finishes last merges the partials
FLAG_NAMES = {INTERLEAVE: "interleave", FAST_COMBINE: "fast_combine", PDL: "pdl",
              FUSED_COMBINE: "fused_combine"}


@functools.lru_cache(maxsize=None)
def _lib():
    """The loaded extension as a ctypes library, or None (no extension, or built without hooks)."""
    from .ops import extension_cdll

    lib = extension_cdll()
    if lib is None:
        return None
    try:
        lib.qwen3_decode_set_tuning.argtypes = [ctypes.c_int] * 3
        lib.qwen3_decode_set_tuning.restype = ctypes.c_int
        lib.qwen3_decode_get_tuning.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.qwen3_decode_get_tuning.restype = None
        lib.qwen3_decode_num_variants.restype = ctypes.c_int
        lib.qwen3_decode_variant_name.argtypes = [ctypes.c_int]
        lib.qwen3_decode_variant_name.restype = ctypes.c_char_p
        lib.qwen3_decode_variant_smem_bytes.argtypes = [ctypes.c_int]
        lib.qwen3_decode_variant_smem_bytes.restype = ctypes.c_int
        lib.qwen3_decode_last_num_splits.restype = ctypes.c_int
    except AttributeError:
        return None
    return lib


def available() -> bool:
    """Whether the built extension has the tuning hooks."""
    return _lib() is not None


def _need():
    lib = _lib()
    if lib is None:
        raise RuntimeError("qwen3_kernels.decode_tuning: the CUDA extension (with the decode "
                           "tuning hooks) is not loaded")
    return lib


def variants() -> list[str]:
    """Variant names by index; the default is index -1 (AUTO): w4s3 when the batch fills the
    GPU without splits, otherwise w8s3c1 (w8s3 in chunks of one tile per warp) with interleaved
    splits, the fast combine and PDL (see decode.cu)."""
    lib = _need()
    n = lib.qwen3_decode_num_variants()
    return [lib.qwen3_decode_variant_name(i).decode() for i in range(n)]


def variant_smem_bytes(variant: int | str) -> int:
    """Dynamic shared memory of the variant's main kernel (vs the device's opt-in maximum)."""
    return _need().qwen3_decode_variant_smem_bytes(_index(variant))


AUTO = -1  # the default variant index: chosen per call from the batch


def _index(variant: int | str) -> int:
    if variant == "auto":
        return AUTO
    if isinstance(variant, str):
        names = variants()
        if variant not in names:
            raise ValueError(f"unknown decode variant {variant!r}; known: {names}")
        return names.index(variant)
    return int(variant)


def get() -> tuple[int, int, int]:
    """(num_splits, variant index, flags) now in force."""
    buf = (ctypes.c_int * 3)()
    _need().qwen3_decode_get_tuning(buf)
    return buf[0], buf[1], buf[2]


def set_tuning(num_splits: int = 0, variant: int | str = 0, flags: int = 0) -> None:
    """num_splits 0 = the automatic choice; variant by name or index; flags: INTERLEAVE | ..."""
    if _need().qwen3_decode_set_tuning(int(num_splits), _index(variant), int(flags)) != 0:
        raise ValueError(f"bad decode tuning: num_splits={num_splits} variant={variant} "
                         f"flags={flags}")


@contextlib.contextmanager
def tuning(num_splits: int = 0, variant: int | str = 0, flags: int = 0):
    """Sets the tuning for the block and restores the previous one after it."""
    before = get()
    set_tuning(num_splits, variant, flags)
    try:
        yield
    finally:
        set_tuning(*before)


def last_num_splits() -> int:
    """Split count of the most recent launch (what the automatic choice picked)."""
    return _need().qwen3_decode_last_num_splits()


def describe(num_splits: int = 0, variant: int | str = 0, flags: int = 0) -> str:
    """A short label such as 'w4s3 splits=auto' or 'w8s3 splits=4 +interleave+fast_combine'."""
    name = variants()[_index(variant)] if not isinstance(variant, str) else variant
    label = f"{name} splits={num_splits or 'auto'}"
    return label + "".join(f"+{n}" for bit, n in FLAG_NAMES.items() if flags & bit)
