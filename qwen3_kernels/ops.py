"""The ops: each schema and each op's input checks, once.

Every op is an out-variant in the dispatcher (``Tensor!`` outputs, returns ``()``), so it can run
inside a CUDA graph with buffers allocated once. The functions here allocate ``out`` when it is
not given and return it.

One contract per op, in this file:
  - Schemas. ``SCHEMAS`` below is the only schema text: this module defines the
    ``qwen3_kernels`` library from it before it imports the CUDA extension
    (``qwen3_kernels._C``), which only registers CUDA implementations (TORCH_LIBRARY_IMPL in
    csrc/torch_bindings.cpp). Without the extension (no CUDA torch or no nvcc at install time)
    every device runs the fp32 reference in ``reference.py``. Either way the CPU implementation
    is the reference, and each op has a fake impl so ``torch.compile(fullgraph=True)`` traces it.
  - Input checks. ``qwen3_kernels.<op>`` (the functions below) is the checked API: types, dims,
    dtypes, devices, shapes, strides and alignment, each a ValueError that names the op and the
    argument. The C++ side keeps only its dtype dispatch and the launch-error check, so a raw
    ``torch.ops.qwen3_kernels.<op>`` call is an unchecked launch, as vLLM's ``_C`` ops are. Why
    here and not in C++: the engine's host path. Checks in C++ ran on every launch, even for
    arguments the engine built itself from tensors it owns; in Python the engine's eager steps
    skip them (``trusted_inputs()``), while its tests and every other caller keep them.
  - Batch invariance. ``batch_invariant=True`` (rms_norm, fused_add_rms_norm, linear,
    paged_attention_decode / _prefill; the engine's deterministic mode) makes each output row a
    function of its own inputs alone, bit for bit, whatever else shares the call: each row's sums
    run in an order fixed by its own shape, never by the batch (csrc/include/qwen3_kernels/
    launchers.h), and in the references one row (one query) at a time. The other ops compute each row alone already. On CUDA it needs
    the sm_90 kernels (a ValueError elsewhere) and contexts of at most
    BATCH_INVARIANT_MAX_CONTEXT keys.
  - Index checks. The values inside the index tensors (positions, slot_mapping, block_tables,
    seq_lens, cu_seqlens_q, max_seqlen_q) and sample_tokens' temperatures are checked too, by
    ``index_checks`` (one fused check, one host sync per call): here before a CUDA kernel
    launches, in the reference on every CPU call (so the CPU path checks them once). A bad value
    is a ValueError naming the argument and its first bad entry, before anything is written.
    ``trusted_inputs()`` skips them with the tensor checks (the references keep theirs).
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import torch

from . import index_checks
from . import reference as ref

# The schema of every op; the CUDA extension registers implementations for these names only.
SCHEMAS = {
    "silu_and_mul": "silu_and_mul(Tensor! out, Tensor x) -> ()",
    "rms_norm": (
        "rms_norm(Tensor! out, Tensor x, Tensor weight, float eps, bool batch_invariant=False) "
        "-> ()"
    ),
    "fused_add_rms_norm": (
        "fused_add_rms_norm(Tensor! x, Tensor! residual, Tensor weight, float eps, "
        "bool batch_invariant=False) -> ()"
    ),
    "qk_norm_rope": (
        "qk_norm_rope(Tensor! q_out, Tensor qkv, Tensor q_norm_weight, Tensor k_norm_weight, "
        "Tensor cos_sin_cache, Tensor positions, Tensor! k_cache, Tensor! v_cache, "
        "Tensor slot_mapping, int num_q_heads, int num_kv_heads, float eps, float k_scale=1., "
        "float v_scale=1.) -> ()"
    ),
    "paged_attention_decode": (
        "paged_attention_decode(Tensor! out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, Tensor! workspace, float k_scale=1., "
        "float v_scale=1., bool batch_invariant=False) -> ()"
    ),
    "paged_attention_prefill": (
        "paged_attention_prefill(Tensor! out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor cu_seqlens_q, Tensor seq_lens_k, Tensor block_tables, int max_seqlen_q, "
        "float scale, float k_scale=1., float v_scale=1., bool batch_invariant=False) -> ()"
    ),
    "linear": "linear(Tensor! out, Tensor x, Tensor weight, bool batch_invariant=False) -> ()",
    "linear_silu_and_mul": "linear_silu_and_mul(Tensor! out, Tensor x, Tensor weight) -> ()",
    "quantize_fp8": "quantize_fp8(Tensor! out, Tensor! x_scales, Tensor x) -> ()",
    "linear_fp8": (
        "linear_fp8(Tensor! out, Tensor x, Tensor weight, Tensor weight_scale_inv, "
        "Tensor? x_scales=None) -> ()"
    ),
    "linear_fp8_silu_and_mul": (
        "linear_fp8_silu_and_mul(Tensor! out, Tensor x, Tensor weight, Tensor weight_scale_inv) "
        "-> ()"
    ),
    "rms_norm_fp8": (
        "rms_norm_fp8(Tensor! out, Tensor! x_scales, Tensor x, Tensor weight, float eps) -> ()"
    ),
    "fused_add_rms_norm_fp8": (
        "fused_add_rms_norm_fp8(Tensor! out, Tensor! x_scales, Tensor x, Tensor! residual, "
        "Tensor weight, float eps) -> ()"
    ),
    "silu_and_mul_fp8": "silu_and_mul_fp8(Tensor! out, Tensor! x_scales, Tensor x) -> ()",
    "sample_tokens": (
        "sample_tokens(Tensor! out, Tensor logits, Tensor temperatures, Tensor seed_keys) -> ()"
    ),
    "tp_all_reduce": (
        "tp_all_reduce(Tensor! x, Tensor! buffer, Tensor peer_ptrs, Tensor! counters, "
        "Tensor abort_flag, int rank, bool pushed=False) -> ()"
    ),
    "tp_all_reduce_add_rms_norm": (
        "tp_all_reduce_add_rms_norm(Tensor! x, Tensor! residual, Tensor weight, float eps, "
        "Tensor! buffer, Tensor peer_ptrs, Tensor! counters, Tensor abort_flag, int rank, "
        "bool pushed=False) -> ()"
    ),
    "tp_gemv_push": (
        "tp_gemv_push(Tensor! out, Tensor x, Tensor weight, Tensor! buffer, Tensor peer_ptrs, "
        "Tensor counters, int rank) -> ()"
    ),
}

_lib_def = torch.library.Library("qwen3_kernels", "DEF")
for _schema in SCHEMAS.values():
    _lib_def.define(_schema)

try:
    from . import _C  # noqa: F401  (registers the CUDA implementations)

    _HAS_CUDA_KERNELS = True
    _IMPORT_ERROR = None
except ImportError as e:  # built without CUDA, or the build is missing
    _HAS_CUDA_KERNELS = False
    _IMPORT_ERROR = e

_OPS = torch.ops.qwen3_kernels


def has_cuda_kernels() -> bool:
    """True when the CUDA extension was built and loaded; otherwise ops run the reference."""
    return _HAS_CUDA_KERNELS


def cuda_kernels_import_error() -> ImportError | None:
    return _IMPORT_ERROR


# ----------------------------------------------------------------------------------------------
# Input checks: shared by every path, so the reference fallback fails exactly like the kernel.
# ----------------------------------------------------------------------------------------------

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# True inside a ``trusted_inputs`` block of this thread / asyncio task (a context variable: the
# caller's own; another thread's calls keep their checks).
_TRUSTED = contextvars.ContextVar("qwen3_kernels_trusted_inputs", default=False)


# (read once per trace by torch.compile, which cannot trace ContextVar.get: a compiled function
# keeps the checks of the context it was traced in, shape checks that compile to guards anyway)
@torch.compiler.assume_constant_result
def _trusted() -> bool:
    return _TRUSTED.get()


def checks_enabled() -> bool:
    """Whether this caller's op calls run their tensor and index checks (not in trusted_inputs)."""
    return not _trusted()


@contextlib.contextmanager
def trusted_inputs():
    """Inside the block the ops skip their tensor checks (types, dims, dtypes, devices, shapes,
    strides) and their index-value checks (``index_checks``: a host sync each) and launch
    straight away; the few scalar checks and the references' own index checks stay.

    Per caller: the flag is a context variable, so it holds for this thread (and for asyncio
    tasks created inside the block); other threads' calls keep every check meanwhile.

    For a caller that builds every argument itself from tensors it owns, and whose calls the
    tests run with the checks on: the engine's eager steps on CUDA. There the checks are ~35
    helper calls a layer, about a third of the host's time per step (a profile of an eager
    Qwen3-8B step of ~320 tokens: the host took ~11 ms for ~7-10 ms of kernels; python
    benchmarks/profile_host.py). Not for anything that takes tensors from users: a
    wrong shape or a slot past the cache here is an out-of-bounds access (qk_norm_rope's kernel
    writes K / V at any slot >= 0 it is given), not a ValueError.
    """
    token = _TRUSTED.set(True)
    try:
        yield
    finally:
        _TRUSTED.reset(token)


def _fail(op: str, msg: str):
    raise ValueError(f"qwen3_kernels.{op}: {msg}")


def _check_tensor(op, name, t, *, ndim=None, dtype=None, dtypes=None, device=None, last_contig=True):
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        _fail(op, f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        _fail(op, f"{name} must be {dtype}, got {t.dtype}")
    if dtypes is not None and t.dtype not in dtypes:
        _fail(op, f"{name} must be one of {dtypes}, got {t.dtype}")
    if device is not None and t.device != device:
        _fail(op, f"{name} is on {t.device}, expected {device} like the other inputs")
    if last_contig and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        _fail(op, f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def _check_shape(op, name, t, shape):
    if tuple(t.shape) != tuple(shape):
        _fail(op, f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _check_contiguous(op, name, t):
    if not t.is_contiguous():
        _fail(op, f"{name} must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")


def _check_aligned16(op: str, **tensors):
    """CUDA tensors the kernels read or write with 16-byte accesses (cp.async, vector loads and
    stores, TMA) must start 16-byte aligned: only a view at an odd storage offset fails this (it
    would fault on the device, a sticky error that ends the process's CUDA context). Not while
    torch.compile traces: the tensors have no address then."""
    if torch.compiler.is_compiling():
        return
    bad = [name for name, t in tensors.items() if t.is_cuda and t.data_ptr() % 16]
    if bad:
        _fail(op, f"{', '.join(tensors)} must start 16-byte aligned (the kernels' 16-byte "
                  f"accesses and TMA); {', '.join(bad)} is a view at an odd offset")


def _runs_kernel(t: torch.Tensor, kernel_ok: bool) -> bool:
    """Whether an op on ``t`` runs our CUDA kernel, so its wrapper checks the index values before
    the launch (else the reference runs, and checks them itself)."""
    return _HAS_CUDA_KERNELS and t.is_cuda and kernel_ok


def _run(name: str, kernel_ok: bool, *args):
    """Call the op through the dispatcher, or its reference where the CUDA kernel does not cover
    the case (fp32, head_dim != 128): documented fallbacks, never a silent wrong answer."""
    if _HAS_CUDA_KERNELS and args[0].is_cuda and not kernel_ok:
        _REFERENCE_IMPLS[name](*args)
    else:
        getattr(_OPS, name)(*args)


_KERNEL_DTYPES = (torch.float16, torch.bfloat16)

_CAPABILITY: dict[int, tuple[int, int]] = {}


# (a constant to torch.compile too: traced once, not a guard on a global dict)
@torch.compiler.assume_constant_result
def _capability(index: int) -> tuple[int, int]:
    """CUDA device ``index``'s compute capability, asked of the driver once: the kernel choice of
    the fp8 paths reads it on every op call."""
    cap = _CAPABILITY.get(index)
    if cap is None:
        cap = _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return cap


# ----------------------------------------------------------------------------------------------
# Elementwise / normalisation
# ----------------------------------------------------------------------------------------------


def _gate_up_width(op, x, checked) -> int:
    """I of a gate | up activation x [T, 2I] (checked: a float matrix with an even width)."""
    if checked:
        _check_tensor(op, "x", x, ndim=2, dtypes=_FLOAT_DTYPES)
    if x.shape[1] % 2:
        _fail(op, f"x's last dim must be even (2 * intermediate), got {x.shape[1]}")
    return x.shape[1] // 2


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2I] -> out [T, I] = silu(x[:, :I]) * x[:, I:]. Rows of x and out may be strided."""
    op = "silu_and_mul"
    checked = not _trusted()
    _gate_up_width(op, x, checked)
    if out is None:
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
    if checked:
        _check_tensor(op, "out", out, ndim=2, dtype=x.dtype, device=x.device)
        _check_shape(op, "out", out, (x.shape[0], x.shape[1] // 2))
    _run(op, x.dtype in _KERNEL_DTYPES, out, x)
    return out


def _check_norm(op, x, weight, eps):
    _check_tensor(op, "x", x, ndim=2, dtypes=_FLOAT_DTYPES)
    _check_tensor(op, "weight", weight, ndim=1, dtype=x.dtype, device=x.device)
    _check_shape(op, "weight", weight, (x.shape[1],))
    if not (isinstance(eps, (int, float)) and eps > 0):
        _fail(op, f"eps must be a positive float, got {eps!r}")


def _check_add_norm(op, x, residual, weight, eps):
    _check_norm(op, x, weight, eps)
    _check_tensor(op, "residual", residual, ndim=2, dtype=x.dtype, device=x.device)
    _check_shape(op, "residual", residual, x.shape)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None, *,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """x [T, H], weight [H] -> out [T, H]. Rows of x and out may be strided."""
    op = "rms_norm"
    checked = not _trusted()
    if checked:
        _check_norm(op, x, weight, eps)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if checked:
        _check_tensor(op, "out", out, ndim=2, dtype=x.dtype, device=x.device)
        _check_shape(op, "out", out, x.shape)
    _run(op, x.dtype in _KERNEL_DTYPES, out, x, weight, float(eps), bool(batch_invariant))
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual += x; x = rms_norm(residual). x, residual [T, H]; weight [H]."""
    op = "fused_add_rms_norm"
    if not _trusted():
        _check_add_norm(op, x, residual, weight, eps)
    _run(op, x.dtype in _KERNEL_DTYPES, x, residual, weight, float(eps), bool(batch_invariant))
    return x, residual


# ----------------------------------------------------------------------------------------------
# qk_norm_rope
# ----------------------------------------------------------------------------------------------


KV_CACHE_FP8 = ref.KV_CACHE_FP8  # the fp8 cache's dtype (reference.quantize_kv has the format)


def _check_kv_cache(op, k_cache, v_cache, dtype, device, like):
    """Caches in ``dtype`` (that of the tensor named ``like``) or both float8_e4m3fn."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(op, name, c, ndim=4, device=device)
        if c.dtype not in (dtype, KV_CACHE_FP8):
            _fail(op, f"{name} must be {dtype} ({like}'s dtype) or {KV_CACHE_FP8} (an fp8 "
                      f"cache), got {c.dtype}")
    if v_cache.dtype != k_cache.dtype:
        _fail(op, f"k_cache and v_cache must have one dtype, got {k_cache.dtype} and "
                  f"{v_cache.dtype}")
    _check_contiguous(op, "k_cache", k_cache)
    _check_contiguous(op, "v_cache", v_cache)
    _check_shape(op, "v_cache", v_cache, k_cache.shape)
    if k_cache.shape[1] not in (16, 32, 64, 128, 256):
        _fail(op, f"block_size (k_cache.shape[1]) must be one of 16..256 (powers of 2), got {k_cache.shape[1]}")


def _check_kv_scales(op, cache_dtype, k_scale, v_scale):
    """Scalar checks, kept under trusted_inputs: a bad scale is a silently wrong cache.
    ``0 < s < inf`` rather than math.isfinite: NaN compares False all the same, and comparisons
    also trace on the symbolic floats torch.compile makes of scales that change between calls."""
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not (isinstance(s, (int, float)) and 0 < s < math.inf):
            _fail(op, f"{name} must be a finite float > 0, got {s!r}")
        if cache_dtype != KV_CACHE_FP8 and s != 1.0:
            _fail(op, f"{name} must be 1.0 for a {cache_dtype} cache (k_scale / v_scale apply to "
                      f"a {KV_CACHE_FP8} cache only), got {s!r}")


def _kv_kernel_ok(dtype, head_dim, cache_dtype, device) -> bool:
    """Whether the CUDA kernels of qk_norm_rope and paged attention cover the case: bf16 / fp16
    at Qwen3's head_dim 128, and for an fp8 cache a device of compute capability >= 9.0 (what
    the kernels' e4m3 paths are written for). Elsewhere the reference runs."""
    if dtype not in _KERNEL_DTYPES or head_dim != 128:
        return False
    return cache_dtype != KV_CACHE_FP8 or (device.type == "cuda"
                                           and _capability(device.index) >= (9, 0))


def qk_norm_rope(
    qkv: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    eps: float,
    q_out: torch.Tensor | None = None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Per-head RMSNorm of q and k, neox RoPE, K/V written into the paged cache.

    qkv            [T, (Hq + 2*Hkv) * D]   packed output of the QKV projection (rows may be strided)
    q_norm_weight  [D], k_norm_weight [D]  same dtype as qkv
    cos_sin_cache  [max_position, D] fp32  cos | sin halves (``reference.rope_cos_sin_cache``)
    positions      [T] int64               each < max_position
    k_cache        [num_blocks, block_size, Hkv, D] (written), v_cache likewise: qkv's dtype, or
                   both float8_e4m3fn (an fp8 cache: K and V stored by ``reference.quantize_kv``,
                   times the fp32 reciprocal of k_scale / v_scale, saturated to +-448)
    slot_mapping   [T] int32               block * block_size + offset; -1 = do not write
    k_scale, v_scale  finite floats > 0: the layer's fp8 scales; exactly 1.0 for a cache in
                   qkv's dtype
    returns q_out  [T, Hq, D]
    """
    op = "qk_norm_rope"
    checked = not _trusted()
    if checked:
        _check_tensor(op, "qkv", qkv, ndim=2, dtypes=_FLOAT_DTYPES)
    dev, dt = qkv.device, qkv.dtype
    if checked:
        _check_kv_cache(op, k_cache, v_cache, dt, dev, "qkv")
    _check_kv_scales(op, k_cache.dtype, k_scale, v_scale)
    d = k_cache.shape[3]
    if k_cache.shape[2] != num_kv_heads:
        _fail(op, f"k_cache has {k_cache.shape[2]} kv heads, num_kv_heads is {num_kv_heads}")
    if num_kv_heads < 1 or num_q_heads < 1 or num_q_heads % num_kv_heads:
        _fail(op, f"num_q_heads ({num_q_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    if d % 2:
        _fail(op, f"head_dim must be even for rope, got {d}")
    t = qkv.shape[0]
    if checked:
        _check_shape(op, "qkv", qkv, (t, (num_q_heads + 2 * num_kv_heads) * d))
        for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
            _check_tensor(op, name, w, ndim=1, dtype=dt, device=dev)
            _check_shape(op, name, w, (d,))
        _check_tensor(op, "cos_sin_cache", cos_sin_cache, ndim=2, dtype=torch.float32, device=dev)
        _check_contiguous(op, "cos_sin_cache", cos_sin_cache)
    if cos_sin_cache.shape[1] != d:
        _fail(op, f"cos_sin_cache must be [max_position, {d}], got {tuple(cos_sin_cache.shape)}")
    if checked:
        _check_tensor(op, "positions", positions, ndim=1, dtype=torch.int64, device=dev)
        _check_shape(op, "positions", positions, (t,))
        _check_tensor(op, "slot_mapping", slot_mapping, ndim=1, dtype=torch.int32, device=dev)
        _check_shape(op, "slot_mapping", slot_mapping, (t,))
    if not (isinstance(eps, (int, float)) and eps > 0):
        _fail(op, f"eps must be a positive float, got {eps!r}")
    if q_out is None:
        q_out = torch.empty(t, num_q_heads, d, dtype=dt, device=dev)
    if checked:
        _check_tensor(op, "q_out", q_out, ndim=3, dtype=dt, device=dev)
        _check_contiguous(op, "q_out", q_out)
        _check_shape(op, "q_out", q_out, (t, num_q_heads, d))
    kernel_ok = _kv_kernel_ok(dt, d, k_cache.dtype, dev)
    if checked and _runs_kernel(qkv, kernel_ok):
        index_checks.qk_norm_rope(op, positions, slot_mapping, cos_sin_cache.shape[0],
                                  k_cache.shape[0], k_cache.shape[1])
    _run(
        op, kernel_ok, q_out, qkv, q_norm_weight, k_norm_weight, cos_sin_cache, positions,
        k_cache, v_cache, slot_mapping, int(num_q_heads), int(num_kv_heads), float(eps),
        float(k_scale), float(v_scale),
    )
    return q_out


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------

# Split-KV decode keeps per-split partial outputs and log-sum-exps here: fp32
# [B, Hq, MAX_DECODE_SPLITS, D + 1]. Allocate once per batch size and pass it in (CUDA graphs).
MAX_DECODE_SPLITS = 64
# batch_invariant decode / prefill: splits of a fixed 2048 keys from key 0 (launchers.h), and a
# sequence may hold at most Qwen3's max_position_embeddings keys (20 splits)
BATCH_INVARIANT_SPLIT_KEYS = 2048
BATCH_INVARIANT_MAX_CONTEXT = 20 * BATCH_INVARIANT_SPLIT_KEYS  # 40960


def _check_invariant_context(op: str, name: str, lens: torch.Tensor):
    """batch_invariant attention: every length within BATCH_INVARIANT_MAX_CONTEXT (one sync;
    none while torch.compile traces or a CUDA graph is captured, as for the index checks)."""
    if index_checks.skipped(lens):
        return
    if lens.numel() and int(lens.max()) > BATCH_INVARIANT_MAX_CONTEXT:
        _fail(op, f"batch_invariant=True covers sequences of at most {BATCH_INVARIANT_MAX_CONTEXT} "
                  f"keys, {name} holds {int(lens.max())}")


def _check_invariant_kernel(op: str, t: torch.Tensor, kernel_ok: bool):
    """batch_invariant on CUDA runs the sm_90 kernels (or the reference for what they do not
    cover, e.g. fp32): on another GPU there is no batch-invariant kernel to run."""
    if _HAS_CUDA_KERNELS and t.is_cuda and kernel_ok and _capability(t.device.index) != (9, 0):
        _fail(op, f"batch_invariant=True needs a compute capability 9.0 GPU (Hopper) on CUDA, "
                  f"got {_capability(t.device.index)} on {t.device}")


def decode_workspace(batch: int, num_q_heads: int, head_dim: int, device) -> torch.Tensor:
    """The split-KV scratch buffer ``paged_attention_decode`` needs: [B, Hq, splits, D + 1] fp32."""
    return torch.empty(batch, num_q_heads, MAX_DECODE_SPLITS, head_dim + 1,
                       dtype=torch.float32, device=device)


def _check_attention_common(op, q, k_cache, v_cache, block_tables, nseq):
    _check_tensor(op, "q", q, ndim=3, dtypes=_FLOAT_DTYPES)
    dev, dt = q.device, q.dtype
    _check_kv_cache(op, k_cache, v_cache, dt, dev, "q")
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d:
        _fail(op, f"head_dim of q ({d}) and of k_cache ({k_cache.shape[3]}) differ")
    if hq % hkv:
        _fail(op, f"q heads ({hq}) must be a multiple of kv heads ({hkv})")
    _check_tensor(op, "block_tables", block_tables, ndim=2, dtype=torch.int32, device=dev)
    _check_contiguous(op, "block_tables", block_tables)  # the kernels step rows by max_blocks
    if block_tables.shape[0] != nseq:
        _fail(op, f"block_tables must have {nseq} rows (one per sequence), got {block_tables.shape[0]}")


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """One query token per sequence over its paged context (GQA, split-KV on CUDA).

    q             [B, Hq, D]
    k_cache       [num_blocks, block_size, Hkv, D], v_cache likewise: q's dtype, or both
                  float8_e4m3fn (an fp8 cache, read as e4m3 * k_scale / * v_scale in fp32)
    block_tables  [B, max_blocks] int32
    seq_lens      [B] int32, each in [1, max_blocks * block_size]
    workspace     [B, Hq, MAX_DECODE_SPLITS, D + 1] fp32 (``decode_workspace``), or None to allocate
    k_scale, v_scale  finite floats > 0, the ones qk_norm_rope wrote with; 1.0 for a cache in
                  q's dtype
    batch_invariant  splits at fixed key positions: a row's output depends on its own sequence
                  only, and equals paged_attention_prefill's (batch_invariant) for that query
    returns out   [B, Hq, D]
    """
    op = "paged_attention_decode"
    checked = not _trusted()
    b = q.shape[0] if isinstance(q, torch.Tensor) else 0
    if checked:
        _check_attention_common(op, q, k_cache, v_cache, block_tables, b)
        _check_contiguous(op, "q", q)
        _check_tensor(op, "seq_lens", seq_lens, ndim=1, dtype=torch.int32, device=q.device)
        _check_shape(op, "seq_lens", seq_lens, (b,))
    _check_kv_scales(op, k_cache.dtype, k_scale, v_scale)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if checked:
        _check_tensor(op, "out", out, ndim=3, dtype=q.dtype, device=q.device)
        _check_contiguous(op, "out", out)
        _check_shape(op, "out", out, q.shape)
    if workspace is None:
        workspace = decode_workspace(b, q.shape[1], q.shape[2], q.device)
    if checked:
        _check_tensor(op, "workspace", workspace, ndim=4, dtype=torch.float32, device=q.device)
        _check_contiguous(op, "workspace", workspace)
        _check_shape(op, "workspace", workspace, (b, q.shape[1], MAX_DECODE_SPLITS, q.shape[2] + 1))
    kernel_ok = _kv_kernel_ok(q.dtype, q.shape[2], k_cache.dtype, q.device)
    if batch_invariant:
        _check_invariant_kernel(op, q, kernel_ok)
        if checked:
            _check_invariant_context(op, "seq_lens", seq_lens)
    if checked and _runs_kernel(q, kernel_ok):
        _check_aligned16(op, q=q, k_cache=k_cache, v_cache=v_cache, out=out, workspace=workspace)
        index_checks.paged_attention_decode(op, block_tables, seq_lens, k_cache.shape[0],
                                            k_cache.shape[1])
    _run(op, kernel_ok, out, q, k_cache, v_cache, block_tables, seq_lens, float(scale), workspace,
         float(k_scale), float(v_scale), bool(batch_invariant))
    return out


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Varlen causal attention over paged keys, queries aligned to the end of each key sequence.

    q             [Tq, Hq, D]
    k_cache       [num_blocks, block_size, Hkv, D], v_cache likewise, already holding this chunk's
                  K/V: q's dtype, or both float8_e4m3fn (an fp8 cache, as in paged_attention_decode)
    cu_seqlens_q  [B + 1] int32, cu_seqlens_q[0] = 0, cu_seqlens_q[B] = Tq
    seq_lens_k    [B] int32, seq_lens_k[b] >= cu_seqlens_q[b+1] - cu_seqlens_q[b]
    block_tables  [B, max_blocks] int32
    max_seqlen_q  the largest query count of any sequence (sizes the grid without a host sync)
    k_scale, v_scale  as in paged_attention_decode
    batch_invariant  each query computed as paged_attention_decode (batch_invariant) computes the
                  query at that position: independent of the batch, the chunking and the prefix
                  cache (on CUDA it runs the decode kernel, one query a sequence)
    returns out   [Tq, Hq, D]
    """
    op = "paged_attention_prefill"
    checked = not _trusted()
    if checked:
        _check_tensor(op, "cu_seqlens_q", cu_seqlens_q, ndim=1, dtype=torch.int32)
    nseq = cu_seqlens_q.shape[0] - 1
    if nseq < 0:
        _fail(op, "cu_seqlens_q must hold B + 1 >= 1 offsets")
    if checked:
        _check_attention_common(op, q, k_cache, v_cache, block_tables, nseq)
        _check_contiguous(op, "q", q)
    if cu_seqlens_q.device != q.device:
        _fail(op, f"cu_seqlens_q is on {cu_seqlens_q.device}, expected {q.device}")
    if checked:
        _check_tensor(op, "seq_lens_k", seq_lens_k, ndim=1, dtype=torch.int32, device=q.device)
        _check_shape(op, "seq_lens_k", seq_lens_k, (nseq,))
    if not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
        _fail(op, f"max_seqlen_q must be a non-negative int, got {max_seqlen_q!r}")
    _check_kv_scales(op, k_cache.dtype, k_scale, v_scale)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if checked:
        _check_tensor(op, "out", out, ndim=3, dtype=q.dtype, device=q.device)
        _check_contiguous(op, "out", out)
        _check_shape(op, "out", out, q.shape)
    kernel_ok = _kv_kernel_ok(q.dtype, q.shape[2], k_cache.dtype, q.device)
    if batch_invariant:
        _check_invariant_kernel(op, q, kernel_ok)
        if checked:
            _check_invariant_context(op, "seq_lens_k", seq_lens_k)
    if checked and _runs_kernel(q, kernel_ok):
        _check_aligned16(op, q=q, k_cache=k_cache, v_cache=v_cache, out=out)
        index_checks.paged_attention_prefill(op, cu_seqlens_q, seq_lens_k, block_tables,
                                             q.shape[0], max_seqlen_q, k_cache.shape[0],
                                             k_cache.shape[1])
    _run(op, kernel_ok, out, q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables,
         int(max_seqlen_q), float(scale), float(k_scale), float(v_scale), bool(batch_invariant))
    return out


# ----------------------------------------------------------------------------------------------
# GEMM
# ----------------------------------------------------------------------------------------------


def _gemm_out(op: str, x, weight, out, rows: str, out_cols) -> torch.Tensor:
    """The checks linear and linear_silu_and_mul share: x [T, K] and weight [N, K] contiguous,
    one dtype and device, K and N multiples of 8; out [T, out_cols(N)] contiguous (allocated when
    None). ``rows`` names N in the messages."""
    checked = not _trusted()
    if checked:
        _check_tensor(op, "x", x, ndim=2, dtypes=_FLOAT_DTYPES)
        _check_tensor(op, "weight", weight, ndim=2, dtype=x.dtype, device=x.device)
        _check_contiguous(op, "x", x)
        _check_contiguous(op, "weight", weight)
    n, k = weight.shape
    if x.shape[1] != k:
        _fail(op, f"x is [T, {x.shape[1]}] but weight is [{rows}, {k}]: inner dims differ")
    if k % 8 or n % 8:
        _fail(op, f"K ({k}) and {rows} ({n}) must be multiples of 8 (16-byte aligned rows)")
    cols = out_cols(n)
    if out is None:
        out = torch.empty(x.shape[0], cols, dtype=x.dtype, device=x.device)
    if checked:
        _check_tensor(op, "out", out, ndim=2, dtype=x.dtype, device=x.device)
        _check_contiguous(op, "out", out)
        _check_shape(op, "out", out, (x.shape[0], cols))
        _check_aligned16(op, x=x, weight=weight, out=out)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, *,
           batch_invariant: bool = False) -> torch.Tensor:
    """x [T, K] @ weight[N, K]^T -> out [T, N]; K and N multiples of 8.

    batch_invariant: each row's sums in an order that does not depend on T (on CUDA one CUTLASS
    configuration for every T, sm_90 only; slower than the default choice at small T)."""
    op = "linear"
    out = _gemm_out(op, x, weight, out, "N", lambda n: n)
    kernel_ok = x.dtype in _KERNEL_DTYPES
    if batch_invariant:
        _check_invariant_kernel(op, x, kernel_ok)
    _run(op, kernel_ok, out, x, weight, bool(batch_invariant))
    return out


def linear_silu_and_mul(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, K], weight [2I, K] (gate rows, then up rows) -> out [T, I] = silu_and_mul(x @ weight^T).

    The MLP's gate_up projection and its activation. On CUDA one token runs one weight-streaming
    pass that never writes the [1, 2I] product; more tokens run cuBLAS and then silu_and_mul.
    K and 2I multiples of 8.
    """
    op = "linear_silu_and_mul"
    out = _gemm_out(op, x, weight, out, "2I", lambda two_i: two_i // 2)
    _run(op, x.dtype in _KERNEL_DTYPES, out, x, weight)
    return out


# ----------------------------------------------------------------------------------------------
# FP8 (e4m3) block-scaled projections: Qwen3-*-FP8 checkpoints (reference.py has the format)
# ----------------------------------------------------------------------------------------------

FP8_GROUP = ref.FP8_GROUP


def _fp8_kernel_ok(t: torch.Tensor) -> bool:
    """The FP8 kernels run bf16 activations on Hopper (sm_90); elsewhere the reference runs."""
    return t.dtype == torch.bfloat16 and t.is_cuda and _capability(t.device.index) == (9, 0)


def fp8_scales_buffer(t: int, k: int, device) -> torch.Tensor:
    """An x_scales for quantize_fp8 in the layout the FP8 GEMM reads: a [T, ceil(K/128)] view,
    token-contiguous (strides (1, T rounded up to 4))."""
    groups = -(-k // FP8_GROUP)
    stride = -(-t // 4) * 4
    return torch.empty(groups, stride, dtype=torch.float32, device=device).t()[:t]


def quantize_fp8(x: torch.Tensor, out: torch.Tensor | None = None,
                 x_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (rows may be strided) -> (out [T, K] float8_e4m3fn, x_scales [T, ceil(K/128)]
    fp32): per token per 128-wide group, scale = max(|group|, 1e-10) / 448 and out = x / scale
    rounded to e4m3 (reference.quantize_fp8). x_scales may have any strides
    (``fp8_scales_buffer`` gives the token-contiguous one the GEMM reads)."""
    op = "quantize_fp8"
    checked = not _trusted()
    if checked:
        _check_tensor(op, "x", x, ndim=2, dtypes=_FLOAT_DTYPES)
    t, k = x.shape
    if out is None:
        out = torch.empty(t, k, dtype=torch.float8_e4m3fn, device=x.device)
    if x_scales is None:
        x_scales = fp8_scales_buffer(t, k, x.device)
    if checked:
        _check_tensor(op, "out", out, ndim=2, dtype=torch.float8_e4m3fn, device=x.device)
        _check_contiguous(op, "out", out)
        _check_shape(op, "out", out, (t, k))
        _check_tensor(op, "x_scales", x_scales, ndim=2, dtype=torch.float32, device=x.device,
                      last_contig=False)
        _check_shape(op, "x_scales", x_scales, (t, -(-k // FP8_GROUP)))
        if k % 16:
            _fail(op, f"K ({k}) must be a multiple of 16 (16-byte rows of e4m3)")
        if x.is_cuda and (x.data_ptr() % 16 or out.data_ptr() % 16 or x.stride(0) % 8):
            _fail(op, "x and out must start 16-byte aligned and x's row stride must be a "
                      f"multiple of 8 elements; got row stride {x.stride(0)}")
    _run(op, x.dtype in _KERNEL_DTYPES, out, x_scales, x)
    return out, x_scales


def _check_x_scales(op, x_scales, t, k, device):
    """fp32 scales [T, ceil(K/128)] on x's device, one per token per 128-group (any strides:
    the producers write through both, the GEMM's reader checks its own layout)."""
    _check_tensor(op, "x_scales", x_scales, ndim=2, dtype=torch.float32, device=device,
                  last_contig=False)
    _check_shape(op, "x_scales", x_scales, (t, -(-k // FP8_GROUP)))


def _check_quantized_x(op, xq, x_scales):
    """An activation quantized for the FP8 projections: e4m3 [T, K] (contiguous, K % 16 == 0)
    and fp32 scales [T, ceil(K/128)] in the GEMM's token-contiguous layout
    (``fp8_scales_buffer``: strides (1, s), s >= T a multiple of 4)."""
    _check_tensor(op, "x", xq, ndim=2, dtype=torch.float8_e4m3fn)
    _check_contiguous(op, "x", xq)
    t, k = xq.shape
    _check_x_scales(op, x_scales, t, k, xq.device)
    if t > 0 and (x_scales.stride(0) != 1 or x_scales.stride(1) < t or x_scales.stride(1) % 4):
        _fail(op, "x_scales must be token-contiguous with a column stride >= T and a multiple "
                  f"of 4 (fp8_scales_buffer's layout), got strides {x_scales.stride()}")


def _check_fp8_weight(op, checked, x, weight, weight_scale_inv, rows: str,
                      rows_multiple: int) -> tuple[int, int]:
    """The checks linear_fp8 and linear_fp8_silu_and_mul share: weight [N, K] float8_e4m3fn and
    its fp32 block scales [ceil(N/128), ceil(K/128)], contiguous, on x's device; K of x; K a
    multiple of 16 and N of ``rows_multiple``. ``rows`` names N in the messages. -> (N, K)."""
    if checked:
        _check_tensor(op, "weight", weight, ndim=2, dtype=torch.float8_e4m3fn, device=x.device)
        _check_tensor(op, "weight_scale_inv", weight_scale_inv, ndim=2, dtype=torch.float32,
                      device=x.device)
        _check_contiguous(op, "weight", weight)
        _check_contiguous(op, "weight_scale_inv", weight_scale_inv)
    n, k = weight.shape
    if x.shape[1] != k:
        _fail(op, f"x is [T, {x.shape[1]}] but weight is [{rows}, {k}]: inner dims differ")
    if k % 16 or n % rows_multiple:
        _fail(op, f"K ({k}) must be a multiple of 16 and {rows} ({n}) of {rows_multiple} "
                  "(16-byte aligned rows)")
    blocks = (-(-n // FP8_GROUP), -(-k // FP8_GROUP))
    if tuple(weight_scale_inv.shape) != blocks:
        _fail(op, f"weight_scale_inv must have shape {blocks} (one scale per 128 x 128 block of "
                  f"the [{n}, {k}] weight), got {tuple(weight_scale_inv.shape)}")
    return n, k


def linear_fp8(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
               out: torch.Tensor | None = None,
               x_scales: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ dequant(weight [N, K] float8_e4m3fn, weight_scale_inv [ceil(N/128),
    ceil(K/128)] fp32)^T -> out [T, N] in x's dtype, with x quantized per token per 128-group
    first (reference.linear_fp8). K a multiple of 16, N of 8. On Hopper with bf16 x the kernel
    csrc/kernels/gemm/linear_fp8.cu picks runs (the FP8 GEMV at one token, the same
    weight-streaming pass over a few tokens, the CUTLASS block-scaled GEMM above); other dtypes
    and GPUs run the reference.

    With ``x_scales``, x is already quantized (float8_e4m3fn [T, K] and its scales
    [T, ceil(K/128)] in ``fp8_scales_buffer``'s layout, as rms_norm_fp8,
    fused_add_rms_norm_fp8 and silu_and_mul_fp8 give them; reference.linear_fp8_quantized); out
    is then bf16 unless given (the kernel writes bf16, the reference any float dtype)."""
    op = "linear_fp8"
    checked = not _trusted()
    quantized = x_scales is not None
    if checked:
        if quantized:
            _check_quantized_x(op, x, x_scales)
        else:
            _check_tensor(op, "x", x, ndim=2, dtypes=_FLOAT_DTYPES)
            _check_contiguous(op, "x", x)
    n, k = _check_fp8_weight(op, checked, x, weight, weight_scale_inv, "N", 8)
    if out is None:
        out = torch.empty(x.shape[0], n, dtype=torch.bfloat16 if quantized else x.dtype,
                          device=x.device)
    if checked:
        if quantized:
            _check_tensor(op, "out", out, ndim=2, dtypes=_FLOAT_DTYPES, device=x.device)
        else:
            _check_tensor(op, "out", out, ndim=2, dtype=x.dtype, device=x.device)
        _check_contiguous(op, "out", out)
        _check_shape(op, "out", out, (x.shape[0], n))
        _check_aligned16(op, x=x, weight=weight, weight_scale_inv=weight_scale_inv, out=out)
    if quantized:
        ok = (x.is_cuda and out.dtype == torch.bfloat16
              and _capability(x.device.index) == (9, 0))
        _run(op, ok, out, x, weight, weight_scale_inv, x_scales)
    else:
        _run(op, _fp8_kernel_ok(x), out, x, weight, weight_scale_inv)
    return out


def linear_fp8_silu_and_mul(x: torch.Tensor, weight: torch.Tensor,
                            weight_scale_inv: torch.Tensor,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K], weight [2I, K] float8_e4m3fn (gate rows, then up rows) with weight_scale_inv
    [ceil(2I/128), ceil(K/128)] -> out [T, I] = silu_and_mul(linear_fp8(x, weight,
    weight_scale_inv)) in x's dtype (reference.linear_fp8_silu_and_mul). The FP8 MLP's gate_up
    projection and its activation: on Hopper with bf16 x one token runs one pass of the FP8 GEMV
    that never writes the [1, 2I] product; more tokens run linear_fp8 and then silu_and_mul.
    K a multiple of 16, 2I of 16."""
    op = "linear_fp8_silu_and_mul"
    checked = not _trusted()
    if checked:
        _check_tensor(op, "x", x, ndim=2, dtypes=_FLOAT_DTYPES)
        _check_contiguous(op, "x", x)
    two_i, _ = _check_fp8_weight(op, checked, x, weight, weight_scale_inv, "2I", 16)
    if out is None:
        out = torch.empty(x.shape[0], two_i // 2, dtype=x.dtype, device=x.device)
    if checked:
        _check_tensor(op, "out", out, ndim=2, dtype=x.dtype, device=x.device)
        _check_contiguous(op, "out", out)
        _check_shape(op, "out", out, (x.shape[0], two_i // 2))
        _check_aligned16(op, x=x, weight=weight, weight_scale_inv=weight_scale_inv, out=out)
    _run(op, _fp8_kernel_ok(x), out, x, weight, weight_scale_inv)
    return out


def _quantized_out(op, checked, t, k, device, out, x_scales):
    """The (out, x_scales) pair an FP8-producing op writes: allocated where not given (x_scales
    in ``fp8_scales_buffer``'s layout), checked where given."""
    if out is None:
        out = torch.empty(t, k, dtype=torch.float8_e4m3fn, device=device)
    if x_scales is None:
        x_scales = fp8_scales_buffer(t, k, device)
    if checked:
        _check_tensor(op, "out", out, ndim=2, dtype=torch.float8_e4m3fn, device=device)
        _check_contiguous(op, "out", out)
        _check_shape(op, "out", out, (t, k))
        _check_x_scales(op, x_scales, t, k, device)
    return out, x_scales


def _fp8_producer_ok(x: torch.Tensor, k: int, *tensors: torch.Tensor) -> bool:
    """Whether the fused FP8 producers' kernels cover the case (else the reference runs): a CUDA
    16-bit x, K a multiple of 128 (whole groups), 16-byte aligned rows and tensors (addresses
    unknown while torch.compile traces: the launcher refuses a misaligned one at run time)."""
    if not (x.is_cuda and x.dtype in _KERNEL_DTYPES and k % FP8_GROUP == 0):
        return False
    rows = (x, *(t for t in tensors if t.dim() == 2))
    if any(t.stride(0) % 8 or t.stride(-1) != 1 for t in rows):
        return False
    return torch.compiler.is_compiling() or all(t.data_ptr() % 16 == 0 for t in (x, *tensors))


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None,
                 x_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], weight [H] -> (out [T, H] float8_e4m3fn, x_scales [T, ceil(H/128)]):
    quantize_fp8(rms_norm(x)) in one pass, the FP8 projections' input (``linear_fp8(out, ...,
    x_scales=x_scales)``). Rows of x may be strided."""
    op = "rms_norm_fp8"
    checked = not _trusted()
    if checked:
        _check_norm(op, x, weight, eps)
    out, x_scales = _quantized_out(op, checked, x.shape[0], x.shape[1], x.device, out, x_scales)
    _run(op, _fp8_producer_ok(x, x.shape[1], weight, out), out, x_scales, x, weight, float(eps))
    return out, x_scales


def fused_add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    out: torch.Tensor | None = None, x_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (in place; x is left as it is), then (out, x_scales) =
    quantize_fp8(rms_norm(residual)): fused_add_rms_norm with its normalised rows quantized for
    the FP8 projections instead of written back. x, residual [T, H]; weight [H]."""
    op = "fused_add_rms_norm_fp8"
    checked = not _trusted()
    if checked:
        _check_add_norm(op, x, residual, weight, eps)
    out, x_scales = _quantized_out(op, checked, x.shape[0], x.shape[1], x.device, out, x_scales)
    ok = _fp8_producer_ok(x, x.shape[1], weight, out, residual)
    _run(op, ok, out, x_scales, x, residual, weight, float(eps))
    return out, x_scales


def silu_and_mul_fp8(x: torch.Tensor, out: torch.Tensor | None = None,
                     x_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, 2I] -> (out [T, I] float8_e4m3fn, x_scales [T, ceil(I/128)]):
    quantize_fp8(silu_and_mul(x)) in one pass, the FP8 down projection's input. Rows of x may
    be strided."""
    op = "silu_and_mul_fp8"
    checked = not _trusted()
    i = _gate_up_width(op, x, checked)
    out, x_scales = _quantized_out(op, checked, x.shape[0], i, x.device, out, x_scales)
    _run(op, _fp8_producer_ok(x, i, out), out, x_scales, x)
    return out, x_scales


# ----------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------


def sample_tokens(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    seed_keys: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row of logits [N, V] -> out [N] int64, in one pass over the logits.

    temperatures [N] fp32, finite: T > 0 samples from softmax(logits / T), T <= 0 is greedy.
    seed_keys [N, 3] int64, each in [0, 2^32): seed lo 32 bits, seed hi 32 bits, counter. The noise
    is a hash of (seed_keys[r], token id) (``reference.seeded_exponential``): equal keys give equal
    tokens whatever the other rows are; the caller varies the counter (or the seed) per step.
    Rows of logits may be strided. Ties go to the lowest token id, as torch.argmax.
    """
    op = "sample_tokens"
    checked = not _trusted()
    if checked:
        _check_tensor(op, "logits", logits, ndim=2, dtypes=_FLOAT_DTYPES)
    n, v = logits.shape
    if not 1 <= v <= 2**30:
        _fail(op, f"logits' vocab dim must be in [1, 2^30], got shape {tuple(logits.shape)}")
    if checked:
        _check_tensor(op, "temperatures", temperatures, ndim=1, dtype=torch.float32,
                      device=logits.device)
        _check_shape(op, "temperatures", temperatures, (n,))
        _check_contiguous(op, "temperatures", temperatures)
        _check_tensor(op, "seed_keys", seed_keys, ndim=2, dtype=torch.int64, device=logits.device)
        _check_shape(op, "seed_keys", seed_keys, (n, 3))
        _check_contiguous(op, "seed_keys", seed_keys)
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if checked:
        _check_tensor(op, "out", out, ndim=1, dtype=torch.int64, device=logits.device)
        _check_shape(op, "out", out, (n,))
        _check_contiguous(op, "out", out)
    if checked and _runs_kernel(logits, True):
        index_checks.sample_tokens(op, temperatures)
    _run(op, True, out, logits, temperatures, seed_keys)
    return out


# ----------------------------------------------------------------------------------------------
# Tensor-parallel all-reduce (+ residual add + RMSNorm) over peer memory
# ----------------------------------------------------------------------------------------------

# Bytes of one (half, rank) slot of a receive buffer per row of H 16-bit elements: the kernel
# sends 2 elements per 8-byte packet (4 data bytes + a 4-byte flag).
def tp_all_reduce_buffer_bytes(max_rows: int, hidden: int, world: int) -> int:
    """Size of the receive buffer (uint8) each rank needs for rows of up to [max_rows, hidden]
    at world size ``world``: 2 halves (call parity) x world slots x max_rows * hidden * 4 bytes."""
    return 2 * world * max_rows * hidden * 4


def _check_tp_all_reduce(op, x, buffer, peer_ptrs, counters, abort_flag, rank, pushed=False,
                         checked=True):
    """The tensor checks when ``checked`` (not in trusted_inputs); the scalar ones always."""
    if checked:
        _check_tensor(op, "x", x, ndim=2, dtypes=_FLOAT_DTYPES)
    if pushed and x.shape[0] != 1:
        _fail(op, f"pushed=True needs the one row tp_gemv_push sent, got x {list(x.shape)}")
    if not (_HAS_CUDA_KERNELS and x.is_cuda and x.dtype in _KERNEL_DTYPES):
        _fail(op, "runs only as the CUDA kernel: x must be a float16 / bfloat16 CUDA tensor and the "
                  f"extension built (got {x.dtype} on {x.device}; extension built: {_HAS_CUDA_KERNELS}); "
                  "off CUDA use all_reduce + fused_add_rms_norm")
    if checked:
        _check_contiguous(op, "x", x)
    t, h = x.shape
    if h % 8 or not 0 < h <= 32768:
        _fail(op, f"x's hidden size must be a positive multiple of 8 up to 32768, got {h}")
    if checked:
        _check_tensor(op, "peer_ptrs", peer_ptrs, ndim=1, dtype=torch.int64, device=x.device)
    world = peer_ptrs.shape[0]
    if not 2 <= world <= 8:
        _fail(op, f"peer_ptrs must hold one buffer address per rank, 2..8 ranks, got {world}")
    if not (isinstance(rank, int) and 0 <= rank < world):
        _fail(op, f"rank must be an int in [0, {world}), got {rank!r}")
    if checked:
        _check_tensor(op, "counters", counters, ndim=1, dtype=torch.int32, device=x.device)
        _check_shape(op, "counters", counters, (2,))
    if abort_flag is not None:  # (None: tp_gemv_push, which never waits)
        if checked:
            _check_tensor(op, "abort_flag", abort_flag, ndim=1, dtype=torch.int32,
                          device=torch.device("cpu"))
            _check_shape(op, "abort_flag", abort_flag, (1,))
        if not abort_flag.is_pinned():
            _fail(op, "abort_flag must be in pinned memory (torch.zeros(1, dtype=torch.int32, "
                      "pin_memory=True)): the kernel reads it while it waits")
    if checked:
        _check_tensor(op, "buffer", buffer, ndim=1, dtype=torch.uint8, device=x.device)
    need = tp_all_reduce_buffer_bytes(t, h, world)
    if buffer.numel() < need:
        _fail(op, f"x [{t}, {h}] needs a receive buffer of {need} bytes at world size {world}, "
                  f"got {buffer.numel()} (set up for fewer rows or another hidden size)")


def tp_all_reduce(x: torch.Tensor, buffer: torch.Tensor, peer_ptrs: torch.Tensor,
                  counters: torch.Tensor, abort_flag: torch.Tensor, rank: int,
                  pushed: bool = False) -> torch.Tensor:
    """In place: x = sum of x over the tensor-parallel ranks (rank order, fp32, rounded to x's
    dtype); every rank gets bit-identical x. A collective: every rank calls it with its x.

    x          [T, H] float16 / bfloat16, contiguous: this rank's partial sum
    buffer     [bytes] uint8: this rank's peer-writable receive buffer (torch symmetric memory),
               at least ``tp_all_reduce_buffer_bytes(T, H, world)``
    peer_ptrs  [world] int64 (device): every rank's buffer address as mapped in this process
    counters   [2] int32 (device, zeroed once): the call count the kernel keeps (CUDA graphs)
    abort_flag [1] int32 in pinned host memory, 0 while all is well: set it to nonzero when a
               peer has died, and this call (and every later one) stops waiting for it and
               returns meaningless sums instead of spinning (or trapping after ~2^26 polls)
    pushed     True when x [1, H] is the output of ``tp_gemv_push`` with the same buffers, called
               right before on every rank: the row was sent already, this call only waits and
               adds. Must be True exactly then (on every rank alike): a pushed call after a plain
               GEMV waits for rows nobody sends.
    """
    op = "tp_all_reduce"
    _check_tp_all_reduce(op, x, buffer, peer_ptrs, counters, abort_flag, rank, pushed,
                         not _trusted())
    _OPS.tp_all_reduce(x, buffer, peer_ptrs, counters, abort_flag, int(rank), bool(pushed))
    return x


def tp_all_reduce_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    buffer: torch.Tensor, peer_ptrs: torch.Tensor, counters: torch.Tensor,
    abort_flag: torch.Tensor, rank: int, pushed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, one kernel: s = the sum of x over the ranks (as ``tp_all_reduce``, ``pushed``
    included); residual += s; x = rms_norm(residual) * weight. residual [T, H] contiguous, weight
    [H]."""
    op = "tp_all_reduce_add_rms_norm"
    checked = not _trusted()
    if checked:
        _check_norm(op, x, weight, eps)
        _check_tensor(op, "residual", residual, ndim=2, dtype=x.dtype, device=x.device)
        _check_shape(op, "residual", residual, x.shape)
        _check_contiguous(op, "residual", residual)
    _check_tp_all_reduce(op, x, buffer, peer_ptrs, counters, abort_flag, rank, pushed, checked)
    _OPS.tp_all_reduce_add_rms_norm(x, residual, weight, float(eps), buffer, peer_ptrs, counters,
                                    abort_flag, int(rank), bool(pushed))
    return x, residual


def tp_gemv_push(x: torch.Tensor, weight: torch.Tensor, buffer: torch.Tensor,
                 peer_ptrs: torch.Tensor, counters: torch.Tensor, rank: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """A row-parallel projection at one token: out [1, N] = x [1, K] @ weight [N, K]^T (the GEMV
    of ``linear``), and out's row also sent into slot ``rank`` of every peer's receive buffer
    for the next ``tp_all_reduce(_add_rms_norm)`` call on these buffers, which must follow with
    ``pushed=True`` on every rank (N is then its H). Each warp sends its outputs as soon as it has
    them, so the row's trip over NVLink overlaps the GEMV's tail. CUDA only (peer memory)."""
    op = "tp_gemv_push"
    out = _gemm_out(op, x, weight, out, "N", lambda n: n)
    if x.shape[0] != 1:
        _fail(op, f"x must be one token [1, K], got {list(x.shape)}")
    _check_tp_all_reduce(op, out, buffer, peer_ptrs, counters, None, rank, checked=not _trusted())
    _OPS.tp_gemv_push(out, x, weight, buffer, peer_ptrs, counters, int(rank))
    return out


# ----------------------------------------------------------------------------------------------
# Reference implementations for the dispatcher (CPU always; every device without the extension)
# and fake impls for tracing.
# ----------------------------------------------------------------------------------------------


def _ref_silu_and_mul(out, x):
    out.copy_(ref.silu_and_mul(x))


def _ref_rms_norm(out, x, weight, eps, batch_invariant=False):  # per row already
    out.copy_(ref.rms_norm(x, weight, eps))


def _ref_fused_add_rms_norm(x, residual, weight, eps, batch_invariant=False):
    normed, new_res = ref.fused_add_rms_norm(x, residual, weight, eps)
    residual.copy_(new_res)
    x.copy_(normed)


# (the dispatcher passes a Python impl only the arguments its caller gave: the schema's defaults
# are repeated here)
def _ref_qk_norm_rope(q_out, qkv, qw, kw, cos_sin, positions, k_cache, v_cache, slots, hq, hkv, eps,
                      k_scale=1.0, v_scale=1.0):
    q_out.copy_(ref.qk_norm_rope(qkv, qw, kw, cos_sin, positions, k_cache, v_cache, slots, hq, hkv,
                                 eps, k_scale, v_scale))


def _ref_paged_attention_decode(out, q, k_cache, v_cache, block_tables, seq_lens, scale, workspace,
                                k_scale=1.0, v_scale=1.0, batch_invariant=False):
    out.copy_(ref.paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                         k_scale, v_scale, batch_invariant=batch_invariant))


def _ref_paged_attention_prefill(out, q, k_cache, v_cache, cu_q, lens_k, block_tables, max_q, scale,
                                 k_scale=1.0, v_scale=1.0, batch_invariant=False):
    out.copy_(ref.paged_attention_prefill(q, k_cache, v_cache, cu_q, lens_k, block_tables, scale,
                                          max_seqlen_q=max_q, k_scale=k_scale, v_scale=v_scale,
                                          batch_invariant=batch_invariant))


def _ref_linear(out, x, weight, batch_invariant=False):
    out.copy_(ref.linear(x, weight, batch_invariant=batch_invariant))


def _ref_linear_silu_and_mul(out, x, weight):
    out.copy_(ref.linear_silu_and_mul(x, weight))


def _ref_quantize_fp8(out, x_scales, x):
    q, scales = ref.quantize_fp8(x)
    out.copy_(q)
    x_scales.copy_(scales)


def _ref_linear_fp8(out, x, weight, weight_scale_inv, x_scales=None):
    if x_scales is None:
        out.copy_(ref.linear_fp8(x, weight, weight_scale_inv))
    else:
        out.copy_(ref.linear_fp8_quantized(x, x_scales, weight, weight_scale_inv))


def _ref_linear_fp8_silu_and_mul(out, x, weight, weight_scale_inv):
    out.copy_(ref.linear_fp8_silu_and_mul(x, weight, weight_scale_inv))


def _ref_rms_norm_fp8(out, x_scales, x, weight, eps):
    q, scales = ref.rms_norm_fp8(x, weight, eps)
    out.copy_(q)
    x_scales.copy_(scales)


def _ref_fused_add_rms_norm_fp8(out, x_scales, x, residual, weight, eps):
    q, scales, new_residual = ref.fused_add_rms_norm_fp8(x, residual, weight, eps)
    out.copy_(q)
    x_scales.copy_(scales)
    residual.copy_(new_residual)


def _ref_silu_and_mul_fp8(out, x_scales, x):
    q, scales = ref.silu_and_mul_fp8(x)
    out.copy_(q)
    x_scales.copy_(scales)


def _ref_sample_tokens(out, logits, temperatures, seed_keys):
    out.copy_(ref.sample_tokens(logits, temperatures, seed_keys))


def _no_peers(*args):
    # No peer memory off CUDA: the op's math is reference.tp_all_reduce(_add_rms_norm) over the
    # stacked partial sums, which one process cannot see. Raised for torch.ops.* called directly.
    raise RuntimeError("qwen3_kernels.tp_all_reduce*: needs the CUDA extension and CUDA peers")


_REFERENCE_IMPLS = {
    "silu_and_mul": _ref_silu_and_mul,
    "rms_norm": _ref_rms_norm,
    "fused_add_rms_norm": _ref_fused_add_rms_norm,
    "qk_norm_rope": _ref_qk_norm_rope,
    "paged_attention_decode": _ref_paged_attention_decode,
    "paged_attention_prefill": _ref_paged_attention_prefill,
    "linear": _ref_linear,
    "linear_silu_and_mul": _ref_linear_silu_and_mul,
    "quantize_fp8": _ref_quantize_fp8,
    "linear_fp8": _ref_linear_fp8,
    "linear_fp8_silu_and_mul": _ref_linear_fp8_silu_and_mul,
    "rms_norm_fp8": _ref_rms_norm_fp8,
    "fused_add_rms_norm_fp8": _ref_fused_add_rms_norm_fp8,
    "silu_and_mul_fp8": _ref_silu_and_mul_fp8,
    "sample_tokens": _ref_sample_tokens,
    "tp_all_reduce": _no_peers,
    "tp_all_reduce_add_rms_norm": _no_peers,
    "tp_gemv_push": _no_peers,
}

_lib_impl = torch.library.Library("qwen3_kernels", "IMPL")
for _name, _fn in _REFERENCE_IMPLS.items():
    _lib_impl.impl(_name, _fn, "CPU")
    if not _HAS_CUDA_KERNELS:
        _lib_impl.impl(_name, _fn, "CUDA")


def _fake(*args, **kwargs):  # every op is an out-variant: nothing to allocate while tracing
    return None


for _name in SCHEMAS:
    torch.library.register_fake(f"qwen3_kernels::{_name}", _fake)
