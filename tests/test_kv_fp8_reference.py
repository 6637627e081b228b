"""CPU: the FP8 (e4m3) KV cache's spec and its checked API.

- ``reference.quantize_kv`` against the rule written out without torch's fp8 cast (``e4m3_rule``);
- qk_norm_rope writing an fp8 cache by that rule (saturation, NaN, slot -1, odd token counts);
- paged attention over an fp8 cache = the fp32 attention over the dequantized cache, and within
  FP8_VS_BF16_BOUND of the same attention over a bf16 cache;
- the wrappers' k_scale / v_scale and cache dtype checks, opcheck, torch.compile, and the kernel
  choice (capability asked once per device).

The CUDA kernels are compared with these references in the *_cuda tests.
"""

from __future__ import annotations

import math

import pytest
import torch

import qwen3_kernels
from qwen3_kernels import ops, reference as ref
from tests.helpers import one_thread, rel_err  # noqa: F401  (autouse)
from tests.test_attention_reference import make_paged_kv, sdpa_decode, sdpa_prefill
from tests.test_qk_norm_rope import call as rope_call, make_case as rope_case

E4M3 = torch.float8_e4m3fn
D = 128

# Attention over an fp8 cache vs over a bf16 cache, normal random K / V, unit or calibrated
# scales: e4m3 keeps 3 mantissa bits, so each stored value moves by up to 2^-4 of itself (~2.7%
# RMS over normal data), and the output by about as much, the rounding of K (through the softmax)
# and of V together. Measured over seeds 0-9 (the test prints its own): decode 2.6-3.0%, prefill
# 3.2-3.4% (its queries that see few keys feel K's rounding more). The bound leaves a third of
# margin; the floor shows the cache really was rounded to e4m3.
FP8_VS_BF16_BOUND = 0.045
FP8_VS_BF16_FLOOR = 0.01


def e4m3_rule(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The spec's stored value, as float64, without torch's fp8 cast: x * (1 / scale) in fp32 (the
    reciprocal rounded to fp32 once), saturated at +-448, rounded half to even on e4m3's grid (3
    mantissa bits, so a step of 2^(e-3) in [2^e, 2^(e+1)); below 2^-6 the subnormals' 2^-9); NaN
    stays NaN."""
    inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32)
    y = (x.float() * inv).double()
    a = y.abs().clamp(max=448.0)
    e = torch.floor(torch.log2(a)).clamp(min=-6)  # log2(0) = -inf: 0 takes the subnormal step
    step = torch.exp2(e - 3)
    r = torch.round(a / step) * step  # torch.round: half to even
    return torch.where(y.isnan(), y, torch.copysign(r, y))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal as numbers, NaN where the other is NaN."""
    a, b = a.double(), b.double()
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


# ----------------------------------------------------------------------------------------------
# quantize_kv / dequantize_kv
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1.0, 0.25, 0.0123, 3.7])
def test_quantize_kv_is_the_rule(scale):
    g = torch.Generator().manual_seed(0)
    n = 4099
    # magnitudes from e4m3's subnormals to well past 448 once divided by the scale
    x = torch.randn(n, generator=g) * 10 ** (torch.rand(n, generator=g) * 7 - 4) * scale
    # ties (with scale 1 / 0.25 exact): 1.0625 -> 1, 1.1875 -> 1.25, 17 -> 16, 19 -> 20,
    # 2^-10 -> 0, 3 * 2^-10 -> 2^-8; then the saturation edges, inf, NaN, signed zeros
    special = torch.tensor([1.0625, 1.1875, 17.0, 19.0, -17.0, 2.0 ** -10, 3 * 2.0 ** -10,
                            448.0, 449.0, 464.0, 480.0, 1e6, -1e30, float("inf"), float("-inf"),
                            float("nan"), 0.0, -0.0])
    x = torch.cat([x, special * scale])
    q = ref.quantize_kv(x, scale, E4M3)
    assert q.dtype == E4M3
    want = e4m3_rule(x, scale)
    assert same(q.float(), want)
    assert (want.abs() == 448).sum() >= 8 and ((want != 0) & (want.abs() < 2.0 ** -6)).any()
    # read back: e4m3 * the fp32 scale
    assert torch.equal(ref.dequantize_kv(q, scale).nan_to_num(7.0),
                       (q.float() * torch.tensor(scale)).nan_to_num(7.0))


def test_a_cache_in_the_model_dtype_holds_the_values_themselves():
    x = torch.randn(5, 2, D) * 300
    q = ref.quantize_kv(x, 1.0, torch.bfloat16)
    assert q.dtype == torch.bfloat16 and torch.equal(q, x.bfloat16())
    assert torch.equal(ref.dequantize_kv(q, 1.0), q.float())


# ----------------------------------------------------------------------------------------------
# qk_norm_rope writing an fp8 cache
# ----------------------------------------------------------------------------------------------

POISON = 7.0  # exact in e4m3; a slot still holding it everywhere was not written


@pytest.mark.parametrize("t", [1, 7, 33])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.01, 0.05)])
def test_qk_norm_rope_writes_the_fp8_cache_by_the_rule(t, k_scale, v_scale):
    hq, hkv = 4, 2
    case = rope_case(t, hq, hkv, block_size=16, dtype=torch.bfloat16, pad_frac=0.3, seed=t)
    slots = case["slot_mapping"]
    slots[slots == 3] = -1  # (slots stay unique)
    slots[t // 2] = 3  # a written token ...
    if t > 1:
        slots[t // 2 + 1] = -1  # ... and one that is not
    v0 = (hq + hkv) * D  # where v starts in a qkv row
    case["qkv"][t // 2, v0 + D + 77] = float("nan")
    case["qkv"][t // 2, v0 + 5] = -3000.0  # past 448 * v_scale: saturates
    # fp32 K (normed, rotated) and V per token, from the reference with an fp32 cache
    f32 = dict(case, k_cache=case["k_cache"].float(), v_cache=case["v_cache"].float())
    q_want = rope_call(f32, ref.qk_norm_rope).to(torch.bfloat16)
    case["k_cache"] = torch.full(case["k_cache"].shape, POISON, dtype=E4M3)
    case["v_cache"] = torch.full(case["v_cache"].shape, POISON, dtype=E4M3)

    q = rope_call(case, k_scale=k_scale, v_scale=v_scale)  # the wrapper: the reference on CPU

    assert torch.equal(q, q_want)
    keep = slots >= 0
    for name, scale in (("k_cache", k_scale), ("v_cache", v_scale)):
        want = torch.full(case[name].shape, POISON, dtype=torch.float64).view(-1, hkv, D)
        written = f32[name].view(-1, hkv, D)[slots[keep].long()]
        want[slots[keep].long()] = e4m3_rule(written, scale)
        assert same(case[name].float().view(-1, hkv, D), want), name
    v = case["v_cache"].float().view(-1, hkv, D)
    assert v.isnan().sum() == 1 and v[3, 1, 77].isnan()  # qkv's one NaN, nothing else
    assert v[3, 0, 5] == -448  # saturated, not NaN


# ----------------------------------------------------------------------------------------------
# paged attention reading an fp8 cache
# ----------------------------------------------------------------------------------------------


def fp8_paged_kv(lens, hkv, block_size, k_scale, v_scale, seed=0):
    """``make_paged_kv`` (bf16 K / V, NaN in every slot no sequence owns) quantized into fp8
    caches; the NaN stays NaN, so a read of an unowned slot still shows. Adds k8_cache /
    v8_cache and the dense dequantized K / V per sequence (kd, vd, fp32)."""
    case = make_paged_kv(lens, hkv, block_size, dtype=torch.bfloat16, seed=seed)
    case["k8_cache"] = ref.quantize_kv(case["k_cache"].float(), k_scale, E4M3)
    case["v8_cache"] = ref.quantize_kv(case["v_cache"].float(), v_scale, E4M3)
    case["kd"] = [ref.dequantize_kv(ref.quantize_kv(k.float(), k_scale, E4M3), k_scale)
                  for k in case["k"]]
    case["vd"] = [ref.dequantize_kv(ref.quantize_kv(v.float(), v_scale, E4M3), v_scale)
                  for v in case["v"]]
    return case


def _calibrated(case):
    """Per-tensor scales amax / 448, as an FP8-KV checkpoint's calibration gives."""
    return tuple(max(x.float().abs().max().item() for x in case[n]) / 448 for n in ("k", "v"))


SCALES = [(1.0, 1.0), (0.05, 0.2)]  # K and V apart: a swapped or missing scale shows


@pytest.mark.parametrize("hq,hkv", [(8, 2), (10, 2)])
@pytest.mark.parametrize("k_scale,v_scale", SCALES)
def test_decode_fp8_is_the_attention_over_the_dequantized_cache(hq, hkv, k_scale, v_scale):
    lens = [1, 15, 16, 17, 53]
    case = fp8_paged_kv(lens, hkv, 16, k_scale, v_scale, seed=hq)
    q = torch.randn(len(lens), hq, D, generator=torch.Generator().manual_seed(1))
    scale = 1 / math.sqrt(D)
    got = ref.paged_attention_decode(q, case["k8_cache"], case["v8_cache"], case["block_tables"],
                                     case["seq_lens"], scale, k_scale, v_scale)
    assert torch.isfinite(got).all(), "read an unowned (NaN) slot"
    # exactly the fp32 attention over an fp32 cache holding the dequantized values
    fp32 = ref.paged_attention_decode(q, ref.dequantize_kv(case["k8_cache"], k_scale),
                                      ref.dequantize_kv(case["v8_cache"], v_scale),
                                      case["block_tables"], case["seq_lens"], scale)
    assert torch.equal(got, fp32)
    assert rel_err(got, sdpa_decode(q, case["kd"], case["vd"], scale)) < 1e-6
    # the wrapper (the reference on CPU) passes the scales through, bf16 q
    qb = q.bfloat16()
    out = qwen3_kernels.paged_attention_decode(qb, case["k8_cache"], case["v8_cache"],
                                               case["block_tables"], case["seq_lens"], scale,
                                               k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(out, ref.paged_attention_decode(
        qb, case["k8_cache"], case["v8_cache"], case["block_tables"], case["seq_lens"], scale,
        k_scale, v_scale))


def _prefill_layout(pairs):
    """(query tokens, keys) per sequence -> (lens_k, cu_seqlens_q, max_seqlen_q)."""
    cu = torch.tensor([0] + torch.tensor([lq for lq, _ in pairs]).cumsum(0).tolist(),
                      dtype=torch.int32)
    return [lk for _, lk in pairs], cu, max(lq for lq, _ in pairs)


@pytest.mark.parametrize("k_scale,v_scale", SCALES)
def test_prefill_fp8_is_the_attention_over_the_dequantized_cache(k_scale, v_scale):
    lens, cu, max_q = _prefill_layout([(7, 7), (5, 21), (0, 9), (1, 1), (17, 40)])
    case = fp8_paged_kv(lens, 2, 16, k_scale, v_scale, seed=5)
    q = torch.randn(int(cu[-1]), 8, D, generator=torch.Generator().manual_seed(6))
    scale = 0.09
    args = (cu, case["seq_lens"], case["block_tables"], scale)
    got = ref.paged_attention_prefill(q, case["k8_cache"], case["v8_cache"], *args,
                                      k_scale=k_scale, v_scale=v_scale)
    assert torch.isfinite(got).all()
    fp32 = ref.paged_attention_prefill(q, ref.dequantize_kv(case["k8_cache"], k_scale),
                                       ref.dequantize_kv(case["v8_cache"], v_scale), *args)
    assert torch.equal(got, fp32)
    assert rel_err(got, sdpa_prefill(q, cu, case["kd"], case["vd"], scale)) < 1e-6
    qb = q.bfloat16()
    out = qwen3_kernels.paged_attention_prefill(qb, case["k8_cache"], case["v8_cache"], cu,
                                                case["seq_lens"], case["block_tables"], max_q,
                                                scale, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(out, ref.paged_attention_prefill(
        qb, case["k8_cache"], case["v8_cache"], *args, k_scale=k_scale, v_scale=v_scale))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("calibrated", [False, True])
def test_fp8_cache_attention_is_within_the_bound_of_the_bf16_cache(seed, calibrated):
    lens = [1, 17, 64, 200, 333]
    scales = _calibrated(make_paged_kv(lens, 2, 16, dtype=torch.bfloat16, seed=seed)) \
        if calibrated else (1.0, 1.0)
    case = fp8_paged_kv(lens, 2, 16, *scales, seed=seed)
    g = torch.Generator().manual_seed(seed + 10)
    scale = 1 / math.sqrt(D)
    q = torch.randn(len(lens), 8, D, generator=g).bfloat16()
    bf16 = ref.paged_attention_decode(q, case["k_cache"], case["v_cache"], case["block_tables"],
                                      case["seq_lens"], scale)
    fp8 = ref.paged_attention_decode(q, case["k8_cache"], case["v8_cache"], case["block_tables"],
                                     case["seq_lens"], scale, *scales)
    err_decode = rel_err(fp8.float(), bf16.float())
    # prefill: the last 40 keys of each sequence (or all) are this chunk's queries
    lens_k, cu, _ = _prefill_layout([(min(40, n), n) for n in lens])
    qp = torch.randn(int(cu[-1]), 8, D, generator=g).bfloat16()
    args = (cu, case["seq_lens"], case["block_tables"], scale)
    bf16 = ref.paged_attention_prefill(qp, case["k_cache"], case["v_cache"], *args)
    fp8 = ref.paged_attention_prefill(qp, case["k8_cache"], case["v8_cache"], *args,
                                      k_scale=scales[0], v_scale=scales[1])
    err_prefill = rel_err(fp8.float(), bf16.float())
    print(f"fp8 vs bf16 cache, scales {scales[0]:.4g} / {scales[1]:.4g}: decode rel err "
          f"{err_decode:.4f}, prefill {err_prefill:.4f} (bound {FP8_VS_BF16_BOUND})")
    for err in (err_decode, err_prefill):
        assert FP8_VS_BF16_FLOOR < err < FP8_VS_BF16_BOUND


# ----------------------------------------------------------------------------------------------
# the checked wrappers: what they accept and refuse
# ----------------------------------------------------------------------------------------------


def _rope_args(cache_dtype=E4M3, q_dtype=torch.bfloat16):
    c = rope_case(5, 4, 2, block_size=16, dtype=q_dtype, seed=11)
    c["k_cache"] = c["k_cache"].zero_().to(cache_dtype)
    c["v_cache"] = c["v_cache"].zero_().to(cache_dtype)
    return qwen3_kernels.qk_norm_rope, c


def _decode_args(cache_dtype=E4M3, q_dtype=torch.bfloat16):
    case = make_paged_kv([5, 20], 2, 16, dtype=torch.bfloat16)
    return qwen3_kernels.paged_attention_decode, dict(
        q=torch.randn(2, 4, D).to(q_dtype), k_cache=case["k_cache"].to(cache_dtype),
        v_cache=case["v_cache"].to(cache_dtype), block_tables=case["block_tables"],
        seq_lens=case["seq_lens"], scale=0.1)


def _prefill_args(cache_dtype=E4M3, q_dtype=torch.bfloat16):
    case = make_paged_kv([5, 20], 2, 16, dtype=torch.bfloat16)
    return qwen3_kernels.paged_attention_prefill, dict(
        q=torch.randn(9, 4, D).to(q_dtype), k_cache=case["k_cache"].to(cache_dtype),
        v_cache=case["v_cache"].to(cache_dtype),
        cu_seqlens_q=torch.tensor([0, 4, 9], dtype=torch.int32), seq_lens_k=case["seq_lens"],
        block_tables=case["block_tables"], max_seqlen_q=5, scale=0.1)


OPS = {"qk_norm_rope": _rope_args, "paged_attention_decode": _decode_args,
       "paged_attention_prefill": _prefill_args}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_wrappers_accept_an_fp8_cache_with_any_model_dtype(op, q_dtype):
    # (fp32 q with an fp8 cache is legal: the CUDA kernels leave it to the reference)
    fn, args = OPS[op](E4M3, q_dtype)
    out = fn(**args, k_scale=0.5, v_scale=2.0)
    assert out.dtype == q_dtype and torch.isfinite(out).all()
    if op == "qk_norm_rope":
        assert args["k_cache"].float().abs().sum() > 0  # written


_BAD = [
    (dict(k_scale=0.0), r"k_scale must be a finite float > 0, got 0\.0"),
    (dict(v_scale=-1.0), r"v_scale must be a finite float > 0, got -1\.0"),
    (dict(k_scale=float("nan")), "k_scale must be a finite float > 0, got nan"),
    (dict(v_scale=float("inf")), "v_scale must be a finite float > 0, got inf"),
    (dict(k_scale=torch.tensor(0.5)), r"k_scale must be a finite float > 0, got tensor"),
    (dict(k_scale=0.5, cache=torch.bfloat16),
     r"k_scale must be 1\.0 for a torch\.bfloat16 cache \(k_scale / v_scale apply to a "
     r"torch\.float8_e4m3fn cache only\), got 0\.5"),
    (dict(v_scale=2, cache=torch.bfloat16), r"v_scale must be 1\.0 for a torch\.bfloat16 cache"),
    (dict(v_cache=torch.bfloat16),
     "k_cache and v_cache must have one dtype, got torch.float8_e4m3fn and torch.bfloat16"),
    (dict(cache=torch.float8_e5m2),
     r"k_cache must be torch\.bfloat16 \((q|qkv)'s dtype\) or torch\.float8_e4m3fn \(an fp8 "
     r"cache\), got torch\.float8_e5m2"),
    (dict(q_dtype=torch.float16, cache=torch.bfloat16),
     r"k_cache must be torch\.float16 \((q|qkv)'s dtype\) or torch\.float8_e4m3fn"),
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bad,match", _BAD)
def test_wrappers_refuse_bad_scales_and_cache_dtypes(op, bad, match):
    bad = dict(bad)
    fn, args = OPS[op](bad.pop("cache", E4M3), bad.pop("q_dtype", torch.bfloat16))
    if "v_cache" in bad:
        args["v_cache"] = args["v_cache"].to(bad.pop("v_cache"))
    before = args["k_cache"].float().clone()
    with pytest.raises(ValueError, match=f"qwen3_kernels.{op}: {match}"):
        fn(**args, **bad)
    assert same(args["k_cache"].float(), before)  # refused before anything was written


def test_scale_checks_stay_under_trusted_inputs():
    fn, args = _decode_args()
    with qwen3_kernels.trusted_inputs(), pytest.raises(ValueError, match="k_scale"):
        fn(**args, k_scale=0.0)


def test_raw_ops_default_the_scales_to_one():
    # torch.ops.* without the trailing scales: the dispatcher gives the impl only the arguments
    # passed, so the reference impls default them as the schema does
    _, c = _decode_args()
    q8 = c["q"]
    out, ws = torch.empty_like(q8), torch.empty(0)
    torch.ops.qwen3_kernels.paged_attention_decode(out, q8, c["k_cache"], c["v_cache"],
                                                   c["block_tables"], c["seq_lens"], 0.1, ws)
    assert torch.equal(out, ref.paged_attention_decode(q8, c["k_cache"], c["v_cache"],
                                                       c["block_tables"], c["seq_lens"], 0.1))
    torch.ops.qwen3_kernels.paged_attention_decode(out, q8, c["k_cache"], c["v_cache"],
                                                   c["block_tables"], c["seq_lens"], 0.1, ws,
                                                   0.5, 2.0)
    assert torch.equal(out, ref.paged_attention_decode(q8, c["k_cache"], c["v_cache"],
                                                       c["block_tables"], c["seq_lens"], 0.1,
                                                       0.5, 2.0))


def test_opcheck_with_an_fp8_cache():
    utils = ("test_faketensor", "test_autograd_registration")  # test_schema cannot compare fp8
    _, c = _rope_args()
    keys = ("qkv", "q_norm_weight", "k_norm_weight", "cos_sin_cache", "positions", "k_cache",
            "v_cache", "slot_mapping", "num_q_heads", "num_kv_heads", "eps")
    q_out = torch.empty(5, 4, D, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.qwen3_kernels.qk_norm_rope.default,
                          (q_out, *(c[k] for k in keys), 0.5, 2.0), test_utils=utils)
    _, c = _decode_args()
    torch.library.opcheck(
        torch.ops.qwen3_kernels.paged_attention_decode.default,
        (torch.empty_like(c["q"]), c["q"], c["k_cache"], c["v_cache"], c["block_tables"],
         c["seq_lens"], 0.1, ops.decode_workspace(2, 4, D, "cpu"), 0.5, 2.0), test_utils=utils)
    _, c = _prefill_args()
    torch.library.opcheck(
        torch.ops.qwen3_kernels.paged_attention_prefill.default,
        (torch.empty_like(c["q"]), c["q"], c["k_cache"], c["v_cache"], c["cu_seqlens_q"],
         c["seq_lens_k"], c["block_tables"], 5, 0.1, 0.5, 2.0), test_utils=utils)


def test_torch_compile_fullgraph_with_an_fp8_cache():
    compiled = torch.compile(qwen3_kernels.qk_norm_rope, fullgraph=True, backend="aot_eager")
    # the second pair of scales recompiles them as symbolic floats (dynamo's automatic dynamic):
    # the scale checks must trace on those too, as every layer of a model has its own scales
    for k_scale, v_scale in ((0.5, 2.0), (0.25, 4.0), (0.125, 3.0)):
        _, c = _rope_args()
        want = dict(c, k_cache=c["k_cache"].clone(), v_cache=c["v_cache"].clone())
        q_want = rope_call(want, ref.qk_norm_rope, k_scale=k_scale, v_scale=v_scale)
        q = rope_call(c, compiled, k_scale=k_scale, v_scale=v_scale)
        assert torch.equal(q, q_want)
        for name in ("k_cache", "v_cache"):
            assert torch.equal(c[name].view(torch.uint8), want[name].view(torch.uint8))


# ----------------------------------------------------------------------------------------------
# kernel choice
# ----------------------------------------------------------------------------------------------


def test_kernel_choice_asks_the_capability_once_per_device(monkeypatch):
    asked = []
    caps = {0: (9, 0), 1: (8, 9)}

    def capability(index):
        asked.append(index)
        return caps[index]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(ops, "_CAPABILITY", {})
    bf16, cuda0, cuda1 = torch.bfloat16, torch.device("cuda", 0), torch.device("cuda", 1)
    for _ in range(3):
        assert ops._kv_kernel_ok(bf16, D, E4M3, cuda0)
        assert ops._kv_kernel_ok(torch.float16, D, E4M3, cuda0)
        assert not ops._kv_kernel_ok(bf16, D, E4M3, cuda1)  # fp8 cache: sm_90+ only
        assert ops._kv_kernel_ok(bf16, D, bf16, cuda1)  # a bf16 cache runs anywhere
        assert not ops._kv_kernel_ok(torch.float32, D, E4M3, cuda0)  # fp32: the reference
        assert not ops._kv_kernel_ok(bf16, 64, E4M3, cuda0)  # head_dim 128 only
        assert not ops._kv_kernel_ok(bf16, D, E4M3, torch.device("cpu"))
    assert sorted(asked) == [0, 1]  # once per device, not per call
