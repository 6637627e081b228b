"""Pure-PyTorch reference of every op: the spec.

Each function computes in fp32 and returns its result in the input dtype. Tests compare the CUDA
kernels against these, benchmarks use them as the eager / ``torch.compile`` baseline, and the
package falls back to them on CPU (or for shapes a kernel does not cover).

Names match the schemas in ``ops.py`` and the kernels in ``csrc/kernels/``.
Shapes, dtypes and devices are checked by ``qwen3_kernels.ops``, once, for every path. The index
values a function reads (positions, slots, block ids, offsets, lengths) and the temperatures it
divides by are checked here, on every call (``index_checks``: cheap, one host sync): a bad one is
a ValueError, never a wrapped negative index or a silent wrong answer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import index_checks


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] -> [T, I] = silu(x[:, :I]) * x[:, I:]."""
    i = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :i]) * xf[..., i:]).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H], weight [H] -> [T, H]; normalised over the last dim."""
    xf = x.float()
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    return (xf * torch.rsqrt(var + eps) * weight.float()).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, H] -> (rms_norm(x + residual), x + residual).

    The kernel writes the sum into ``residual`` and the normalised sum into ``x``. The sum is
    rounded to the storage dtype before it is normalised, exactly as it is stored.
    """
    new_residual = (x.float() + residual.float()).to(residual.dtype)
    return rms_norm(new_residual, weight, eps).to(x.dtype), new_residual


def tp_all_reduce(parts: torch.Tensor) -> torch.Tensor:
    """parts [world, T, H]: every rank's partial sum -> [T, H], added in rank order in fp32 and
    rounded once to the dtype (the all-reduce's output, identical on every rank)."""
    acc = parts[0].float()
    for r in range(1, parts.shape[0]):
        acc = acc + parts[r].float()
    return acc.to(parts.dtype)


def tp_all_reduce_add_rms_norm(
    parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """parts [world, T, H], residual [T, H] -> (rms_norm(s + residual), s + residual) with
    s = tp_all_reduce(parts): the all-reduce's output, then exactly fused_add_rms_norm."""
    return fused_add_rms_norm(tp_all_reduce(parts), residual, weight, eps)


def rope_cos_sin_cache(
    head_dim: int, max_position: int, rope_theta: float, device=None
) -> torch.Tensor:
    """The cos/sin table every rope op reads: [max_position, head_dim] fp32, cos | sin halves.

    Neox style (Qwen3, HF ``rotate_half``): frequency i in [0, head_dim/2) rotates the pair
    (x[i], x[i + head_dim/2]).
    """
    inv_freq = 1.0 / (
        rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    )
    t = torch.arange(max_position, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)  # [max_position, head_dim/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] fp32, cos_sin [T, D] fp32 (cos | sin) -> x rotated, neox style."""
    d2 = x.shape[-1] // 2
    cos = cos_sin[:, None, :d2]
    sin = cos_sin[:, None, d2:]
    x1, x2 = x[..., :d2], x[..., d2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H, D] fp32 -> normalised over D, fp32 (no rounding: rope follows)."""
    var = x.pow(2).mean(dim=-1, keepdim=True)
    return x * torch.rsqrt(var + eps) * weight.float()


# ---- KV cache: the model dtype, or FP8 (e4m3) with one fp32 scale per layer for K and for V ----
#
# An fp8 cache (float8_e4m3fn) stores round_to_e4m3(clamp(x * (1 / scale), -448, 448)), reads back
# e4m3 * scale: half the bytes of a bf16 cache, so twice the tokens in the same memory and half
# the bytes attention streams. The scales are the checkpoint's per-layer k_scale / v_scale (1.0
# when it has none). A cache in the model dtype holds the values themselves; its scales are 1.0
# (ops.py refuses others), so both helpers leave it alone.

KV_CACHE_FP8 = torch.float8_e4m3fn


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x [...] (fp32) -> the values a cache of ``dtype`` stores. For an fp8 cache: x * (1 / scale)
    in fp32, the reciprocal rounded to fp32 once (a multiply per element, as the kernel does, not
    a division), saturated to +-448 (FP8_MAX, below), rounded to nearest even; NaN stays NaN. The
    clamp is explicit because e4m3 has no inf: a plain cast past 448 gives NaN in older torch and
    in CUDA's non-satfinite conversion. Other dtypes: x rounded to the dtype."""
    if dtype != KV_CACHE_FP8:
        return x.to(dtype)
    inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32)
    return (x.float() * inv.to(x.device)).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize_kv(cache: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache values [...] -> fp32: e4m3 * scale for an fp8 cache, the values themselves else."""
    if cache.dtype != KV_CACHE_FP8:
        return cache.float()
    return cache.float() * scale


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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Qwen3's q_norm / k_norm + neox RoPE on the packed QKV, K/V written into the paged cache.

    qkv            [T, (Hq + 2*Hkv) * D]   q heads, then k heads, then v heads
    q_norm_weight  [D], k_norm_weight [D]
    cos_sin_cache  [max_position, D] fp32  (see ``rope_cos_sin_cache``)
    positions      [T] int64
    k_cache        [num_blocks, block_size, Hkv, D]  (mutated) qkv's dtype or float8_e4m3fn
    v_cache        [num_blocks, block_size, Hkv, D]  (mutated) k_cache's dtype
    slot_mapping   [T] int32: flat slot = block * block_size + offset; -1 skips the token
    k_scale, v_scale  fp8 cache: K (normed, rotated, fp32) and V (fp32) are stored by
                      ``quantize_kv``; 1.0 for a cache in qkv's dtype
    returns q      [T, Hq, D]
    """
    index_checks.qk_norm_rope("qk_norm_rope", positions, slot_mapping, cos_sin_cache.shape[0],
                              k_cache.shape[0], k_cache.shape[1])
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    qkv3 = qkv.reshape(t, num_q_heads + 2 * num_kv_heads, d).float()
    q = qkv3[:, :num_q_heads]
    k = qkv3[:, num_q_heads : num_q_heads + num_kv_heads]
    v = qkv3[:, num_q_heads + num_kv_heads :]
    cos_sin = cos_sin_cache[positions.long()].float()
    q = apply_rope(_head_rms_norm(q, q_norm_weight, eps), cos_sin)
    k = apply_rope(_head_rms_norm(k, k_norm_weight, eps), cos_sin)

    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, num_kv_heads, d)[slots] = quantize_kv(k[keep], k_scale, k_cache.dtype)
    v_cache.view(-1, num_kv_heads, d)[slots] = quantize_kv(v[keep], v_scale, v_cache.dtype)
    return q.to(qkv.dtype)


def _gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """cache [num_blocks, block_size, Hkv, D], block_table [max_blocks] -> [seq_len, Hkv, D]."""
    block_size = cache.shape[1]
    n_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:n_blocks].long()
    return cache[blocks].reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]


def _attention_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [Lq, Hq, D], k/v [Lk, Hkv, D] (Lk >= Lq) -> [Lq, Hq, D] fp32.

    Causal with the query block aligned to the end of the keys: query i sits at absolute
    position Lk - Lq + i and sees keys 0 ..= Lk - Lq + i.
    """
    lq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    group = hq // hkv
    qf = q.float().transpose(0, 1)  # [Hq, Lq, D]
    kf = k.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, Lk, D]
    vf = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [Hq, Lq, Lk]
    qpos = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
    kpos = torch.arange(lk, device=q.device)[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), vf).transpose(0, 1)


def _attention_invariant(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """``_attention_one`` one query at a time over exactly the keys it sees (copied out): a
    query's output depends only on its own position's q, k, v, not on the chunk it came in
    (decode, a whole prompt, or a chunk after cached blocks). The batched [Lq, Lk] matmuls and
    the masked softmax over all Lk keys of ``_attention_one`` round differently as Lq, Lk vary."""
    lq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    group = hq // hkv
    kf = k.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, Lk, D]
    vf = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
    rows = []
    for i in range(lq):
        n = lk - lq + i + 1  # keys 0 .. position
        qi = q[i].float().unsqueeze(1).clone()  # [Hq, 1, D]
        ki, vi = kf[:, :n].clone(), vf[:, :n].clone()
        probs = torch.softmax(torch.matmul(qi, ki.transpose(1, 2)) * scale, dim=-1)
        rows.append(torch.matmul(probs, vi).transpose(0, 1))  # [1, Hq, D]
    return torch.cat(rows)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """One new query token per sequence over its whole paged context (GQA).

    q             [B, Hq, D]
    k_cache       [num_blocks, block_size, Hkv, D] q's dtype or float8_e4m3fn, v_cache likewise
    block_tables  [B, max_blocks] int32
    seq_lens      [B] int32 (>= 1): keys 0 .. seq_lens[b]-1, the new token's included
    k_scale, v_scale  an fp8 cache's K / V read as ``dequantize_kv`` (fp32), then the same fp32
                      attention; 1.0 for a cache in q's dtype
    batch_invariant   each query alone over exactly its keys (``_attention_invariant``): equal,
                      bit for bit, to paged_attention_prefill's for the query at that position
    returns       [B, Hq, D]
    """
    index_checks.paged_attention_decode("paged_attention_decode", block_tables, seq_lens,
                                        k_cache.shape[0], k_cache.shape[1])
    out = torch.empty_like(q)
    lens = seq_lens.tolist()
    attend = _attention_invariant if batch_invariant else _attention_one
    for b, n in enumerate(lens):
        k = dequantize_kv(_gather_kv(k_cache, block_tables[b], n), k_scale)
        v = dequantize_kv(_gather_kv(v_cache, block_tables[b], n), v_scale)
        out[b] = attend(q[b : b + 1], k, v, scale)[0].to(q.dtype)
    return out


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seqlen_q: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Varlen causal attention of new query tokens over paged keys (cached prefix + chunk).

    q             [Tq, Hq, D]   the query tokens of B sequences, packed
    cu_seqlens_q  [B + 1] int32 offsets of each sequence's queries in q: 0 first, Tq last
    seq_lens_k    [B] int32     keys per sequence (>= its query count): prefix + this chunk
    block_tables  [B, max_blocks] int32
    max_seqlen_q  the op's grid size (not used here), checked to cover every query count if given
    k_cache, v_cache, k_scale, v_scale, batch_invariant  as in ``paged_attention_decode``
    returns       [Tq, Hq, D]
    """
    index_checks.paged_attention_prefill(
        "paged_attention_prefill", cu_seqlens_q, seq_lens_k, block_tables, q.shape[0],
        max_seqlen_q, k_cache.shape[0], k_cache.shape[1])
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens_k.tolist()
    attend = _attention_invariant if batch_invariant else _attention_one
    for b, n in enumerate(lens):
        s, e = cu[b], cu[b + 1]
        if e == s:
            continue
        k = dequantize_kv(_gather_kv(k_cache, block_tables[b], n), k_scale)
        v = dequantize_kv(_gather_kv(v_cache, block_tables[b], n), v_scale)
        out[s:e] = attend(q[s:e], k, v, scale).to(q.dtype)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """x [T, K] @ weight[N, K]^T -> [T, N], fp32 accumulate. batch_invariant: one row at a time,
    each a fresh [1, K] matmul (a BLAS GEMM rounds a row differently at different T)."""
    if batch_invariant and x.dim() == 2 and x.shape[0] > 1:
        w = weight.float().t()
        return torch.cat([torch.matmul(x[i : i + 1].float().clone(), w)
                          for i in range(x.shape[0])]).to(x.dtype)
    return torch.matmul(x.float(), weight.float().t()).to(x.dtype)


def tp_gemv_push(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [1, K], weight [N, K] -> [1, N]: this rank's output, linear's. What the op also sends
    to the peers is this row; their all-reduce (pushed) then gives tp_all_reduce of the ranks'
    rows, as without the push."""
    return linear(x, weight)


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, K], weight [2I, K] -> [T, I] = silu_and_mul(linear(x, weight)): the product is
    rounded to x's dtype before the activation, as the unfused pair would round it."""
    return silu_and_mul(linear(x, weight))


# ---- FP8 (e4m3) block-scaled projections: Qwen3-*-FP8 checkpoints ------------------------------
#
# Weights: float8_e4m3fn [N, K] with one fp32 ``weight_scale_inv`` per 128 x 128 block
# ([ceil(N/128), ceil(K/128)]): the value is weight * weight_scale_inv (the checkpoint's name; it
# multiplies). Activations are quantized at run time, per token per 128-wide group of K (the
# checkpoint's ``activation_scheme: dynamic``): x_scale = max(|x_group|, FP8_SCALE_FLOOR) / 448.

FP8_GROUP = 128  # the block edge of weight scales and the activation group width
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_SCALE_FLOOR = 1e-10  # an all-zero group gets this amax, not a zero scale (0 / 0)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (x_fp8 [T, K] float8_e4m3fn, x_scales [T, ceil(K/128)] fp32) with
    x ~= x_fp8 * x_scales (each scale repeated over its group): per token per 128-wide group,
    scale = max(|group|, 1e-10) / 448, x_fp8 = round_to_e4m3(x / scale) (saturating). NaN stays
    NaN; an Inf makes its group's scale Inf (and the group NaN), as the kernel."""
    t, k = x.shape
    groups = -(-k // FP8_GROUP)
    xf = torch.zeros(t, groups * FP8_GROUP, dtype=torch.float32, device=x.device)
    xf[:, :k] = x.float()
    g = xf.view(t, groups, FP8_GROUP)
    scales = g.abs().amax(dim=-1).clamp_min(FP8_SCALE_FLOOR) / FP8_MAX  # [T, G]
    q = (g / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    return q.view(t, -1)[:, :k].to(torch.float8_e4m3fn), scales


def dequantize_fp8(x_fp8: torch.Tensor, scales: torch.Tensor, block_rows: int) -> torch.Tensor:
    """x_fp8 [R, K] float8_e4m3fn, scales [ceil(R / block_rows), ceil(K/128)] -> fp32 [R, K]:
    each value times the scale of its block (block_rows = 1 for activations, 128 for weights)."""
    r, k = x_fp8.shape
    s = scales.float().repeat_interleave(block_rows, 0)[:r]
    s = s.repeat_interleave(FP8_GROUP, 1)[:, :k]
    return x_fp8.float() * s


def linear_fp8(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> torch.Tensor:
    """x [T, K] (bf16 / fp16 / fp32), weight [N, K] float8_e4m3fn, weight_scale_inv
    [ceil(N/128), ceil(K/128)] fp32 -> [T, N] in x's dtype: quantize_fp8(x) times the
    block-dequantized weight, accumulated in fp32 (what the FP8 GEMM and GEMV compute)."""
    x_fp8, x_scales = quantize_fp8(x)
    xd = dequantize_fp8(x_fp8, x_scales, 1)
    wd = dequantize_fp8(weight, weight_scale_inv, FP8_GROUP)
    return torch.matmul(xd, wd.t()).to(x.dtype)


def linear_fp8_silu_and_mul(x: torch.Tensor, weight: torch.Tensor,
                            weight_scale_inv: torch.Tensor) -> torch.Tensor:
    """x [T, K], weight [2I, K] float8_e4m3fn (gate rows, then up rows), weight_scale_inv
    [ceil(2I/128), ceil(K/128)] -> [T, I] = silu_and_mul(linear_fp8(x, weight, weight_scale_inv)):
    the product rounded to x's dtype before the activation, as the unfused pair rounds it."""
    return silu_and_mul(linear_fp8(x, weight, weight_scale_inv))


def linear_fp8_quantized(x_fp8: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor,
                         weight_scale_inv: torch.Tensor) -> torch.Tensor:
    """linear_fp8 on an activation quantized already (x_fp8 [T, K] float8_e4m3fn, x_scales
    [T, ceil(K/128)], as quantize_fp8 gives them) -> [T, N] fp32, for the caller to round to its
    output's dtype (linear_fp8 rounds to x's)."""
    xd = dequantize_fp8(x_fp8, x_scales, 1)
    wd = dequantize_fp8(weight, weight_scale_inv, FP8_GROUP)
    return torch.matmul(xd, wd.t())


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8(rms_norm(x, weight, eps)): the norm in x's dtype, then quantized."""
    return quantize_fp8(rms_norm(x, weight, eps))


def fused_add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (x_fp8, x_scales, x + residual): fused_add_rms_norm's normalised sum quantized."""
    normed, new_residual = fused_add_rms_norm(x, residual, weight, eps)
    return (*quantize_fp8(normed), new_residual)


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8(silu_and_mul(x)): the activation in x's dtype, then quantized."""
    return quantize_fp8(silu_and_mul(x))


# ---- sampling ----------------------------------------------------------------------------------

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), without int64 overflow (split c in halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def seeded_exponential(seed_keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise [N, V] fp32, a pure function of seed_keys [N, 3] int64 (seed lo 32 bits,
    seed hi 32 bits, counter; each in [0, 2^32)) and the token id: a counter-based hash, so a row's
    noise does not depend on the other rows. csrc/kernels/sample.cu computes the same hash."""
    seed_lo, seed_hi, counter = seed_keys[:, 0:1], seed_keys[:, 1:2], seed_keys[:, 2:3]
    row = _mix32(seed_lo ^ _mix32(seed_hi ^ _mix32(_mul32(counter, 0x9E3779B1) ^ 0x68E31DA4)))
    col = _mix32(_mul32(torch.arange(vocab_size, device=seed_keys.device), 0x27D4EB2F) ^ 0x165667B1)
    return exponential_of_hash(_mix32(_mix32(row ^ col) ^ (row >> 7)))


def exponential_of_hash(h: torch.Tensor) -> torch.Tensor:
    """Exp(1) from 32 hashed bits h (int64 in [0, 2^32)), fp32, in [2^-24, 16.7]: never 0 or inf.
    23 bits: u = (k + 0.5) / 2^23 is exact in fp32 and strictly inside (0, 1) (with 24 bits the top
    value rounds to 1.0 and gives E = 0: a forced pick once in 2^24 tokens); log1p keeps
    E = -log(1 - u) accurate down to its smallest value."""
    u = ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))
    return -torch.log1p(-u)


def sample_scores(
    logits: torch.Tensor, temperatures: torch.Tensor, seed_keys: torch.Tensor
) -> torch.Tensor:
    """The scores sample_tokens maximises, [N, V] fp32: logits / T - log(E) with E ~ Exp(1) from
    seeded_exponential for rows with T > 0 (an exponential race: argmax p_i / E_i picks token i
    with probability p_i = softmax(logits / T)_i), and the logits themselves where T <= 0."""
    x = logits.float()
    t = temperatures.float().unsqueeze(1)
    greedy = t <= 0
    noise = seeded_exponential(seed_keys, x.shape[1])
    return torch.where(greedy, x, x / torch.where(greedy, 1.0, t) - torch.log(noise))


def sample_tokens(
    logits: torch.Tensor, temperatures: torch.Tensor, seed_keys: torch.Tensor
) -> torch.Tensor:
    """One token per row -> [N] int64.

    logits        [N, V] float
    temperatures  [N] fp32; T <= 0 is greedy (argmax of the logits)
    seed_keys     [N, 3] int64: seed lo 32 bits, seed hi 32 bits, counter (read where T > 0)
    Ties go to the lowest token id (torch.argmax).
    """
    index_checks.sample_tokens("sample_tokens", temperatures)
    return sample_scores(logits, temperatures, seed_keys).argmax(dim=-1)
