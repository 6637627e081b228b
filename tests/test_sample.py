"""sample_tokens on the CPU (the reference, which is also the op's CPU implementation): greedy rows
are argmax, sampled rows follow softmax(logits / T), equal keys give equal tokens whatever the
other rows, and bad inputs raise errors that name the argument."""

import math

import pytest
import torch

import qwen3_kernels
from qwen3_kernels import reference as ref
from tests.helpers import one_thread  # noqa: F401


def keys_for(n, seed=0, counter0=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, 1 << 32, (n, 3), generator=g, dtype=torch.int64)
    keys[:, 2] = torch.arange(counter0, counter0 + n)
    return keys


def test_greedy_rows_are_the_argmax_with_lowest_index_ties():
    logits = torch.randn(6, 50)
    logits[0, 3] = logits[0, 17] = 100.0  # a tie: the lower id wins, as torch.argmax
    temps = torch.tensor([0.0, 0.0, -1.0, 0.0, 0.0, 0.0])
    out = qwen3_kernels.sample_tokens(logits, temps, keys_for(6))
    assert out[0].item() == 3
    assert torch.equal(out, logits.argmax(-1))


def test_sampled_tokens_follow_the_softmax():
    """20,000 rows of the same logits, each its own key: the token counts match softmax(x / T)
    (chi-square at 8 degrees of freedom, p < 1e-6 bound), at two temperatures."""
    x = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5, 0.2])
    n = 20000
    for t in (1.0, 0.5):
        out = qwen3_kernels.sample_tokens(x.expand(n, -1).contiguous(), torch.full((n,), t),
                                          keys_for(n, seed=int(t * 10)))
        counts = torch.bincount(out, minlength=x.numel()).double()
        expect = torch.softmax(x.double() / t, 0) * n
        chi2 = (((counts - expect) ** 2) / expect).sum().item()
        assert chi2 < 45.0, (t, chi2, counts.tolist(), expect.tolist())


def test_equal_keys_give_equal_tokens_whatever_the_other_rows():
    logits = torch.randn(5, 300)
    temps = torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0])
    keys = keys_for(5, seed=3)
    out = qwen3_kernels.sample_tokens(logits, temps, keys)
    alone = qwen3_kernels.sample_tokens(logits[3:4], temps[3:4], keys[3:4])
    assert out[3] == alone[0]
    # another counter: other noise (over 30 rows, the same token every time is ~impossible)
    a = qwen3_kernels.sample_tokens(logits[:1].expand(30, -1), torch.ones(30), keys_for(30, 1, 0))
    b = qwen3_kernels.sample_tokens(logits[:1].expand(30, -1), torch.ones(30), keys_for(30, 1, 30))
    assert not torch.equal(a, b)


def test_noise_is_positive_and_finite_at_the_hash_extremes():
    """The smallest and largest hashes give 0 < E < inf (a 0 would force that token's pick)."""
    h = torch.tensor([0, 1 << 9, (1 << 32) - (1 << 9), (1 << 32) - 1])
    e = ref.exponential_of_hash(h)
    assert torch.isfinite(e).all() and (e > 0).all(), e
    assert e[0] < 1e-6 < 15 < e[-1]


def test_scores_are_the_log_race():
    logits = torch.randn(3, 40, dtype=torch.bfloat16)
    temps = torch.tensor([0.8, 0.0, 1.0])
    keys = keys_for(3)
    s = ref.sample_scores(logits, temps, keys)
    e = ref.seeded_exponential(keys, 40)
    torch.testing.assert_close(s[0], logits[0].float() / 0.8 - e[0].log())
    torch.testing.assert_close(s[1], logits[1].float())
    # the race in probability space picks the same token
    p = torch.softmax(logits[0].float() / 0.8, 0)
    assert (p / e[0]).argmax() == s[0].argmax()


def test_strided_rows_and_fp16():
    wide = torch.randn(4, 130).half()
    logits = wide[:, 1:101]  # a view: row stride 130
    temps = torch.tensor([1.0, 0.0, 0.5, 2.0])
    keys = keys_for(4)
    assert torch.equal(qwen3_kernels.sample_tokens(logits, temps, keys),
                       ref.sample_tokens(logits.contiguous(), temps, keys))


@pytest.mark.parametrize("bad, match", [
    (dict(logits=torch.randn(3)), "logits must have 2 dims"),
    (dict(logits=torch.randint(0, 5, (3, 10))), "logits must be one of"),
    (dict(temperatures=torch.ones(3, dtype=torch.float64)), "temperatures must be torch.float32"),
    (dict(temperatures=torch.ones(4)), r"temperatures must have shape \(3,\)"),
    (dict(seed_keys=torch.zeros(3, 2, dtype=torch.int64)), r"seed_keys must have shape \(3, 3\)"),
    (dict(seed_keys=torch.zeros(3, 3, dtype=torch.int32)), "seed_keys must be torch.int64"),
    (dict(out=torch.empty(3, dtype=torch.int32)), "out must be torch.int64"),
    (dict(out=torch.empty(2, dtype=torch.int64)), r"out must have shape \(3,\)"),
])
def test_bad_inputs_raise_value_errors_naming_the_argument(bad, match):
    args = dict(logits=torch.randn(3, 10), temperatures=torch.ones(3),
                seed_keys=torch.zeros(3, 3, dtype=torch.int64), out=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        qwen3_kernels.sample_tokens(**args)


def test_opcheck_and_compile():
    logits, temps, keys = torch.randn(4, 33), torch.tensor([1.0, 0.0, 0.3, 1.0]), keys_for(4)
    torch.library.opcheck(torch.ops.qwen3_kernels.sample_tokens.default,
                          (torch.empty(4, dtype=torch.int64), logits, temps, keys))

    @torch.compile(fullgraph=True, backend="eager")
    def f(x, t, k):
        out = torch.empty(x.shape[0], dtype=torch.int64)
        torch.ops.qwen3_kernels.sample_tokens(out, x, t, k)
        return out

    assert torch.equal(f(logits, temps, keys), ref.sample_tokens(logits, temps, keys))
    assert math.isfinite(ref.sample_scores(logits, temps, keys)[0].max().item())
