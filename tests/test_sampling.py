"""SamplingParams validation and the batched Sampler (greedy, top-k, top-p, min-p, seeds, bans,
logit_bias)."""

from __future__ import annotations

import pytest
import torch

from qwen3_model.layers.sampler import Sampler, SamplingBatch, seeded_exponential
from qwen3_model.sampling_params import SamplingParams

V = 97


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=1.5), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2.0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(seed="x"), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(ignore_eos=1), "ignore_eos"),
    (dict(logit_bias={3: 100.5}), "logit_bias"),
    (dict(logit_bias={3: float("nan")}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"3": 1.0}), "logit_bias"),
    (dict(logit_bias={True: 1.0}), "logit_bias"),
    (dict(logit_bias=[(3, 1.0)]), "logit_bias"),
    (dict(logit_bias={t: 1.0 for t in range(1025)}), "logit_bias"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(frequency_penalty="a"), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
])
def test_bad_sampling_params_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_unknown_keyword_is_a_value_error():
    with pytest.raises(ValueError, match="unknown argument.*'temprature'"):
        SamplingParams(temprature=0.5)


def test_validate_catches_fields_changed_after_construction():
    sp = SamplingParams()
    sp.top_p = 2.0
    with pytest.raises(ValueError, match="top_p"):
        sp.validate()


def test_defaults_and_stop_string_normalisation():
    sp = SamplingParams(stop="END")
    assert sp.stop == ["END"] and sp.temperature == 1.0 and sp.top_k == -1 and not sp.greedy
    assert SamplingParams(temperature=0).greedy


def logits_batch(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g) * 3


def sample(logits, params, positions=None, banned=None, history=None):
    n = logits.shape[0]
    batch = SamplingBatch.build(params, positions or [0] * n, banned or [[] for _ in range(n)],
                                V, "cpu", history)
    return Sampler()(logits, batch)


def test_greedy_is_argmax_and_top_k_1_equals_greedy():
    logits = logits_batch(16)
    assert torch.equal(sample(logits, [SamplingParams(temperature=0)] * 16), logits.argmax(-1))
    assert torch.equal(sample(logits, [SamplingParams(temperature=0.8, top_k=1)] * 16),
                       logits.argmax(-1))
    # mixed batch: greedy rows stay greedy next to sampled rows
    params = [SamplingParams(temperature=0 if i % 2 else 1.0) for i in range(16)]
    out = sample(logits, params)
    assert torch.equal(out[1::2], logits.argmax(-1)[1::2])


def test_sampled_tokens_follow_the_softmax():
    torch.manual_seed(0)
    row = torch.randn(V) * 1.5
    n = 20000
    logits = row.expand(n, V).contiguous()
    out = sample(logits, [SamplingParams(temperature=0.7)] * n)
    freq = torch.bincount(out, minlength=V).float() / n
    p = torch.softmax(row / 0.7, -1)
    # every frequency within 5 standard errors of its probability
    tol = 5 * (p * (1 - p) / n).sqrt() + 1e-3
    assert ((freq - p).abs() <= tol).all(), (freq - p).abs().max()


def test_top_k_top_p_min_p_restrict_the_support():
    torch.manual_seed(1)
    row = torch.randn(V) * 2
    n = 4000
    logits = row.expand(n, V).contiguous()
    order = row.argsort(descending=True)
    p = torch.softmax(row, -1)

    out = sample(logits, [SamplingParams(top_k=5)] * n)
    assert set(out.tolist()) <= set(order[:5].tolist())
    assert len(set(out.tolist())) == 5

    # nucleus: the smallest prefix of the sorted tokens whose mass reaches top_p
    cum = p[order].cumsum(0)
    k = int((cum < 0.6).sum()) + 1
    out = sample(logits, [SamplingParams(top_p=0.6)] * n)
    assert set(out.tolist()) == set(order[:k].tolist())

    out = sample(logits, [SamplingParams(min_p=0.3)] * n)
    assert set(out.tolist()) == set(torch.nonzero(p >= 0.3 * p.max()).flatten().tolist())

    # per-row settings in one batch
    params = [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(top_k=3)] * 50
    out = sample(logits[:150], params)
    assert (out[0::3] == order[0]).all() and (out[1::3] == order[0]).all()
    assert set(out[2::3].tolist()) <= set(order[:3].tolist())


def test_banned_ids_are_never_sampled():
    logits = logits_batch(8)
    top = logits.argmax(-1)
    banned = [[int(t)] for t in top]
    out = sample(logits, [SamplingParams(temperature=0)] * 8, banned=banned)
    assert (out != top).all()
    out = sample(logits, [SamplingParams(top_k=1)] * 8, banned=banned)
    assert (out != top).all()


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    logits = logits_batch(6)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [sample(logits[2:3], [seeded], positions=[k]).item() for k in range(30)]
    for k in range(30):
        # same request at row 2 of a batch of unseeded and differently seeded neighbours
        params = [SamplingParams(), SamplingParams(seed=7), seeded, SamplingParams(),
                  SamplingParams(temperature=0), SamplingParams(seed=-3)]
        out = sample(logits, params, positions=[k] * 6)
        assert out[2].item() == alone[k]
    # different positions give different draws, and a different seed another sequence
    assert len(set(alone)) > 5
    other = [sample(logits[2:3], [SamplingParams(seed=1235)], positions=[k]).item()
             for k in range(30)]
    assert other != alone


def test_seeded_noise_is_exponential():
    keys = torch.tensor([[5, 0, 0], [5, 0, 1], [6, 0, 0], [2**32 - 1, 2**31, 77]])
    e = seeded_exponential(keys, 20000)
    assert e.shape == (4, 20000) and torch.isfinite(e).all() and (e > 0).all()
    assert abs(e.mean().item() - 1) < 0.03 and abs(e.var().item() - 1) < 0.08
    # rows with different keys are not copies of each other
    assert not torch.equal(e[0], e[1]) and not torch.equal(e[0], e[2])
    assert torch.equal(seeded_exponential(keys[:1], 20000), e[:1])


def test_logit_bias_adds_to_each_rows_logits_before_sampling():
    logits = logits_batch(6).to(torch.bfloat16)
    top = logits.float().argmax(-1)
    low = logits.float().argmin(-1)
    # -100 on the best token moves greedy to the second best; +100 on the worst forces it
    ban = [SamplingParams(temperature=0, logit_bias={int(top[r]): -100}) for r in range(6)]
    second = logits.float().scatter(1, top.unsqueeze(1), float("-inf")).argmax(-1)
    assert torch.equal(sample(logits, ban), second)
    force = [SamplingParams(temperature=0.7, top_p=0.9, logit_bias={int(low[r]): 100})
             for r in range(6)]
    assert torch.equal(sample(logits, force), low)
    # the bias is added in fp32: 8 + 0.07 beats 8.0625 (in bf16 it would round to a tie that
    # the lower id wins)
    row = torch.zeros(1, V, dtype=torch.bfloat16)
    row[0, 5], row[0, 9] = 8.0625, 8.0
    assert sample(row, [SamplingParams(temperature=0, logit_bias={9: 0.07})]).item() == 9
    assert sample(row, [SamplingParams(temperature=0)]).item() == 5
    # other rows sample as without the biased neighbour (seeded: the same draws)
    seeded = [SamplingParams(temperature=1.0, seed=s) for s in range(5)]
    alone = sample(logits[:5], seeded, positions=[3] * 5)
    mixed = sample(logits, seeded + [SamplingParams(temperature=1.0, logit_bias={1: 2.5})],
                   positions=[3] * 6)
    assert torch.equal(mixed[:5], alone)


def penalized_reference(row, params, output, prompt):
    """One row's logits after the penalties, written out token by token (vLLM's meaning)."""
    x = row.float().clone()
    for t in range(V):
        n = output.count(t)
        if (t in output or t in prompt) and x[t] != 0:
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
        x[t] -= params.frequency_penalty * n + params.presence_penalty * (n > 0)
    return x


def test_penalties_match_their_definition_per_row():
    from collections import Counter

    logits = logits_batch(5)
    g = torch.Generator().manual_seed(4)
    outputs = [torch.randint(0, V, (k,), generator=g).tolist() for k in (0, 3, 12, 40, 7)]
    prompts = [torch.randint(0, V, (6,), generator=g).tolist() for _ in range(5)]
    params = [SamplingParams(temperature=0, presence_penalty=1.5),
              SamplingParams(temperature=0, frequency_penalty=2.0),
              SamplingParams(temperature=0, repetition_penalty=1.7),
              SamplingParams(temperature=0, presence_penalty=-0.5, frequency_penalty=0.7,
                             repetition_penalty=0.6),
              SamplingParams(temperature=0)]
    history = [(Counter(o), set(p)) if sp.penalized else None
               for o, p, sp in zip(outputs, prompts, params)]
    batch = SamplingBatch.build(params, [0] * 5, [[] for _ in range(5)], V, "cpu", history)
    captured = {}

    class Spy(Sampler):
        def _race(self, x, b):
            captured["x"] = x
            return super()._race(x, b)

    # greedy rows go to argmax: check the penalised logits through a sampled (race) batch too
    out = sample(logits, params, history=history)
    for r in range(5):
        want = penalized_reference(logits[r], params[r], outputs[r], prompts[r])
        assert out[r].item() == int(want.argmax()), r
    hot = [SamplingParams(temperature=1.0, seed=r, presence_penalty=1.5 if r % 2 else 0.0,
                          repetition_penalty=1.3) for r in range(5)]
    hist = [(Counter(o), set(p)) for o, p in zip(outputs, prompts)]
    spy = Spy()
    spy(logits, SamplingBatch.build(hot, [0] * 5, [[] for _ in range(5)], V, "cpu", hist))
    for r in range(5):
        want = penalized_reference(logits[r], hot[r], outputs[r], prompts[r])
        assert torch.allclose(captured["x"][r], want, rtol=0, atol=1e-6), r
    assert batch.pen_rows is not None and 4 not in batch.pen_rows.tolist()
