"""CPU: the qk_norm_rope reference vs a naive per-token / per-head loop, the cos/sin table vs its
formula, the slot -1 contract, the wrapper's input checks, opcheck and torch.compile.

``make_case`` / ``reference_fp32`` / ``untouched_slots`` are shared with test_qk_norm_rope_cuda.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import qwen3_kernels
from qwen3_kernels import reference as ref

EPS = 1e-6
ROPE_THETA = 1e6
MAX_POSITION = 40960  # Qwen3's max_position_embeddings


def make_case(t, hq, hkv, block_size=16, dtype=torch.bfloat16, device="cpu", d=128,
              max_position=MAX_POSITION, pad_frac=0.15, qkv_row_pad=0, seed=0, cos_sin=None):
    """Random inputs of one qk_norm_rope call.

    qkv [t, (hq + 2*hkv) * d] (a view of a wider [t, width + qkv_row_pad] buffer when
    qkv_row_pad > 0); caches [num_blocks, block_size, hkv, d] filled with NaN (poison) and holding
    ~25% more slots than tokens; slot_mapping a shuffled subset of them with ~pad_frac of -1.
    """
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    width = (hq + 2 * hkv) * d
    buf = torch.randn(t, width + qkv_row_pad, generator=g, device=dev) * 2.0
    # Per-head scales: the norm must not depend on inputs already being unit-sized.
    scale = torch.rand(hq + 2 * hkv, generator=g, device=dev).repeat_interleave(d) * 4 + 0.1
    buf[:, :width] *= scale
    qkv = buf.to(dtype)[:, :width]
    q_w = (1 + 0.5 * torch.randn(d, generator=g, device=dev)).to(dtype)
    k_w = (1 + 0.5 * torch.randn(d, generator=g, device=dev)).to(dtype)
    if cos_sin is None:
        cos_sin = ref.rope_cos_sin_cache(d, max_position, ROPE_THETA, device=dev)
    positions = torch.randint(0, cos_sin.shape[0], (t,), generator=g, device=dev)
    positions[: min(t, 2)] = cos_sin.shape[0] - 1  # the last row: catches an off-by-one table
    num_blocks = max(1, -(-(t + t // 4 + 1) // block_size))
    slots = torch.randperm(num_blocks * block_size, generator=g, device=dev)[:t].to(torch.int32)
    slots[torch.rand(t, generator=g, device=dev) < pad_frac] = -1
    k_cache = torch.full((num_blocks, block_size, hkv, d), float("nan"), dtype=dtype, device=dev)
    return dict(
        qkv=qkv, q_norm_weight=q_w, k_norm_weight=k_w, cos_sin_cache=cos_sin,
        positions=positions, k_cache=k_cache, v_cache=k_cache.clone(), slot_mapping=slots,
        num_q_heads=hq, num_kv_heads=hkv, eps=EPS,
    )


def call(case, fn=None, **kw):
    """Runs ``fn`` (default: the wrapper) on ``case``'s tensors in the op's argument order."""
    fn = fn or qwen3_kernels.qk_norm_rope
    keys = ("qkv", "q_norm_weight", "k_norm_weight", "cos_sin_cache", "positions", "k_cache",
            "v_cache", "slot_mapping", "num_q_heads", "num_kv_heads", "eps")
    return fn(*(case[k] for k in keys), **kw)


def reference_fp32(case):
    """(q [T, Hq, D], k_cache, v_cache) in fp32 from the same low-precision inputs, never rounded."""
    c = dict(case)
    for k in ("qkv", "q_norm_weight", "k_norm_weight"):
        c[k] = case[k].float()
    c["k_cache"] = case["k_cache"].float()
    c["v_cache"] = case["v_cache"].float()
    q = call(c, ref.qk_norm_rope)
    return q, c["k_cache"], c["v_cache"]


def untouched_slots(case):
    """Flat slot indices the op must leave alone: every slot that no token with slot >= 0 names."""
    kc = case["k_cache"]
    used = torch.zeros(kc.shape[0] * kc.shape[1], dtype=torch.bool, device=kc.device)
    s = case["slot_mapping"]
    used[s[s >= 0].long()] = True
    return (~used).nonzero().flatten()


def _naive(case):
    """Per token, per head, per element: the formula written out with Python floats."""
    qkv = case["qkv"].double()
    hq, hkv = case["num_q_heads"], case["num_kv_heads"]
    d = case["k_cache"].shape[-1]
    cs = case["cos_sin_cache"].double()
    qw, kw = case["q_norm_weight"].double(), case["k_norm_weight"].double()
    q = torch.empty(qkv.shape[0], hq, d, dtype=torch.float64)
    k = torch.empty(qkv.shape[0], hkv, d, dtype=torch.float64)
    for t in range(qkv.shape[0]):
        pos = int(case["positions"][t])
        for h in range(hq + hkv):
            x = qkv[t, h * d:(h + 1) * d].tolist()
            w = (qw if h < hq else kw).tolist()
            inv = 1.0 / math.sqrt(sum(v * v for v in x) / d + case["eps"])
            y = [x[i] * inv * w[i] for i in range(d)]
            out = [0.0] * d
            for i in range(d // 2):
                c, s = float(cs[pos, i]), float(cs[pos, d // 2 + i])
                out[i] = y[i] * c - y[i + d // 2] * s
                out[i + d // 2] = y[i + d // 2] * c + y[i] * s
            if h < hq:
                q[t, h] = torch.tensor(out, dtype=torch.float64)
            else:
                k[t, h - hq] = torch.tensor(out, dtype=torch.float64)
    v = qkv[:, (hq + hkv) * d:].reshape(qkv.shape[0], hkv, d)
    return q, k, v


@pytest.mark.parametrize("d", [128, 16])
def test_reference_vs_naive_loop(d):
    case = make_case(5, 4, 2, block_size=16, dtype=torch.float32, d=d, max_position=64,
                     pad_frac=0.0, seed=1)
    q_naive, k_naive, v_naive = _naive(case)
    q = call(case, ref.qk_norm_rope)
    assert torch.allclose(q.double(), q_naive, rtol=1e-5, atol=1e-5)
    slots = case["slot_mapping"].long()
    kc = case["k_cache"].view(-1, 2, d)
    vc = case["v_cache"].view(-1, 2, d)
    assert torch.allclose(kc[slots].double(), k_naive, rtol=1e-5, atol=1e-5)
    assert torch.equal(vc[slots].double(), v_naive)


def test_cos_sin_cache_vs_formula():
    d, theta = 128, ROPE_THETA
    table = ref.rope_cos_sin_cache(d, MAX_POSITION, theta)
    assert table.shape == (MAX_POSITION, d) and table.dtype == torch.float32
    for pos in (0, 1, 7, 1000, MAX_POSITION - 1):
        for i in (0, 1, 31, 63):
            angle = pos * theta ** (-2 * i / d)
            # fp32 pos * inv_freq: the angle carries ~pos * 6e-8 rad of rounding.
            tol = 1e-6 + 1.2e-7 * pos
            assert abs(table[pos, i].item() - math.cos(angle)) <= tol
            assert abs(table[pos, d // 2 + i].item() - math.sin(angle)) <= tol


def test_slot_minus_one_leaves_the_cache_alone_but_q_is_written():
    case = make_case(40, 4, 2, block_size=16, dtype=torch.bfloat16, pad_frac=0.3, seed=2)
    assert (case["slot_mapping"] < 0).any() and (case["slot_mapping"] >= 0).any()
    q_out = torch.full((40, 4, 128), float("nan"), dtype=torch.bfloat16)
    call(case, q_out=q_out)
    assert torch.isfinite(q_out).all()  # q of padded tokens too
    free = untouched_slots(case)
    for cache in (case["k_cache"], case["v_cache"]):
        flat = cache.view(-1, 2, 128)
        assert torch.isnan(flat[free]).all()  # the poison survives
        s = case["slot_mapping"]
        assert torch.isfinite(flat[s[s >= 0].long()]).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_wrapper_on_cpu_matches_reference(dtype):
    case = make_case(9, 4, 2, block_size=16, dtype=dtype, qkv_row_pad=24, seed=3)
    assert not case["qkv"].is_contiguous()  # strided rows
    want = dict(case, k_cache=case["k_cache"].clone(), v_cache=case["v_cache"].clone())
    q_want = call(want, ref.qk_norm_rope)
    q = call(case)
    assert q.shape == (9, 4, 128) and q.dtype == dtype
    assert torch.equal(q, q_want)
    assert torch.equal(case["k_cache"].nan_to_num(7.0), want["k_cache"].nan_to_num(7.0))
    assert torch.equal(case["v_cache"].nan_to_num(7.0), want["v_cache"].nan_to_num(7.0))


def _bad(**changes):
    case = make_case(3, 4, 2, block_size=16, dtype=torch.bfloat16, seed=4)
    q_out = changes.pop("q_out", None)
    case.update(changes)
    return lambda: call(case, q_out=q_out)


_BF = torch.bfloat16


@pytest.mark.parametrize(
    "bad,match",
    [
        (_bad(qkv=torch.randint(0, 3, (3, 1024))), "qkv must be one of"),
        (_bad(qkv=torch.randn(3, 1000, dtype=_BF)), r"qkv must have shape \(3, 1024\)"),
        (_bad(qkv=torch.randn(1024, 3, dtype=_BF).t()), "contiguous in its last dim"),
        (_bad(q_norm_weight=torch.randn(128)), "q_norm_weight must be torch.bfloat16"),
        (_bad(k_norm_weight=torch.randn(64, dtype=_BF)), r"k_norm_weight must have shape \(128,\)"),
        (_bad(cos_sin_cache=torch.randn(100, 128, dtype=_BF)), "cos_sin_cache must be torch.float32"),
        (_bad(cos_sin_cache=torch.randn(100, 64)), r"cos_sin_cache must be \[max_position, 128\]"),
        (_bad(cos_sin_cache=torch.randn(128, 100).t()), "contiguous"),
        (_bad(positions=torch.zeros(3, dtype=torch.int32)), "positions must be torch.int64"),
        (_bad(positions=torch.zeros(4, dtype=torch.int64)), r"positions must have shape \(3,\)"),
        (_bad(slot_mapping=torch.zeros(3, dtype=torch.int64)), "slot_mapping must be torch.int32"),
        (_bad(k_cache=torch.zeros(2, 16, 3, 128, dtype=_BF)), "kv heads|shape"),
        (_bad(v_cache=torch.zeros(2, 16, 2, 128)), "v_cache"),
        (_bad(num_q_heads=3), "multiple of num_kv_heads"),
        (_bad(eps=0.0), "eps"),
        (_bad(q_out=torch.empty(3, 4, 64, dtype=_BF)), r"q_out must have shape \(3, 4, 128\)"),
        (_bad(q_out=torch.empty(3, 4, 128)), "q_out must be torch.bfloat16"),
        (_bad(q_out=torch.empty(3, 128, 4, dtype=_BF).transpose(1, 2)), "q_out"),
        (_bad(cos_sin_cache=torch.randn(100, 128, device="meta")), "meta"),
    ],
)
def test_input_checks_raise_clear_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_head_dim_64_runs_the_reference():
    case = make_case(4, 2, 1, block_size=16, dtype=torch.bfloat16, d=64, max_position=512, seed=5)
    want = dict(case, k_cache=case["k_cache"].clone(), v_cache=case["v_cache"].clone())
    assert torch.equal(call(case), call(want, ref.qk_norm_rope))


def _op_args(case, q_out):
    keys = ("qkv", "q_norm_weight", "k_norm_weight", "cos_sin_cache", "positions", "k_cache",
            "v_cache", "slot_mapping", "num_q_heads", "num_kv_heads", "eps")
    return (q_out,) + tuple(case[k] for k in keys)


def test_opcheck_on_cpu():
    case = make_case(6, 4, 2, block_size=16, dtype=torch.bfloat16, max_position=256, seed=6)
    # NaN poison would make opcheck's output comparisons fail on untouched slots (NaN != NaN).
    case["k_cache"].zero_()
    case["v_cache"].zero_()
    q_out = torch.empty(6, 4, 128, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.qwen3_kernels.qk_norm_rope.default, _op_args(case, q_out))


def test_torch_compile_fullgraph_on_cpu():
    case = make_case(5, 4, 2, block_size=16, dtype=torch.bfloat16, max_position=256, seed=7)
    want = dict(case, k_cache=case["k_cache"].clone(), v_cache=case["v_cache"].clone())
    q_want = call(want, ref.qk_norm_rope)
    # aot_eager: traces through dynamo and AOTAutograd (the fake impl) without a C++ toolchain.
    compiled = torch.compile(qwen3_kernels.qk_norm_rope, fullgraph=True, backend="aot_eager")
    q = call(case, compiled)
    assert torch.equal(q, q_want)
    assert torch.equal(case["k_cache"].nan_to_num(7.0), want["k_cache"].nan_to_num(7.0))
