"""Hostile requests (issue #42): sampling values as the sampler sees them (fp32), every prompt
checked against the model's vocabulary before any work, ids the tokenizer has no entry for decode
to "" on every detokenizer path."""

from __future__ import annotations

import pytest
import torch

from qwen3_model.engine.detokenizer import Detokenizer, DetokState
from qwen3_model.engine.sequence import Sequence
from qwen3_model.layers.sampler import Sampler, SamplingBatch
from qwen3_model.random_checkpoint import char_tokenizer, write_random_checkpoint
from qwen3_model.sampling_params import FP32_TINY, GREEDY_TEMPERATURE, SamplingParams
from tests.helpers import one_thread  # noqa: F401

# ---- SamplingParams: fp32 ----------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    (dict(top_p=1e-50), "top_p"),  # 0.0 in fp32: kept no token, token 0 forever
    (dict(top_p=1e-39), "top_p"),  # an fp32 denormal: 0 where the GPU flushes them
    (dict(top_p=float("nan")), "top_p"),
    (dict(min_p=1e-50), "min_p"),
    (dict(min_p=float("nan")), "min_p"),
    (dict(min_p=float("inf")), "min_p"),
    (dict(temperature=float("inf")), "temperature"),  # was uniform sampling
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=1e39), "temperature"),  # inf in fp32
    (dict(temperature=10**400), "temperature"),  # an int too large for a float
    (dict(top_p=float("-inf")), "top_p"),
])
def test_values_that_the_fp32_sampler_cannot_hold_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_edge_values_that_fp32_holds_are_accepted():
    SamplingParams(top_p=FP32_TINY)
    SamplingParams(top_p=1.17549435e-38)  # just below FP32_TINY in float64, FP32_TINY in fp32
    SamplingParams(min_p=FP32_TINY)
    SamplingParams(min_p=0)
    SamplingParams(temperature=3e38)


def test_a_temperature_below_the_floor_is_greedy_and_keeps_its_value():
    for t in (1e-40, 5e-324, GREEDY_TEMPERATURE / 2):
        sp = SamplingParams(temperature=t)
        assert sp.greedy and sp.temperature == t
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy


# ---- the sampler with extreme but valid values ---------------------------------------------------

V = 97


def logits_rows(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g) * 3


def sample(logits, params):
    n = logits.shape[0]
    batch = SamplingBatch.build(params, [0] * n, [[] for _ in range(n)], V, "cpu")
    return Sampler()(logits, batch)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=1e-40),
    dict(temperature=1e-40, top_k=5),
    dict(temperature=1e-40, top_p=0.5),
    dict(temperature=1e-40, min_p=0.1),
    dict(temperature=1e-40, seed=3),
    dict(temperature=1e-4, top_p=1e-30),
    dict(temperature=1e-4, top_k=1),
    dict(temperature=1e-4, min_p=0.5),
    dict(temperature=1e-4, top_p=FP32_TINY, top_k=1, min_p=1.0),
    dict(temperature=GREEDY_TEMPERATURE, top_p=1e-30),
    dict(temperature=1.0, top_p=FP32_TINY),
    dict(temperature=3e38, top_k=1),
])
def test_extreme_valid_values_give_the_most_likely_token(kwargs):
    """Each of these leaves one candidate (or is greedy): the argmax, row by row, never token 0
    of a row of NaNs."""
    logits = logits_rows(16)
    want = logits.argmax(-1)
    assert torch.equal(sample(logits, [SamplingParams(**kwargs)] * 16), want)
    # next to ordinary sampled rows, and next to greedy rows
    params = [SamplingParams(**kwargs) if i % 2 else SamplingParams(temperature=0.8)
              for i in range(16)]
    assert torch.equal(sample(logits, params)[1::2], want[1::2])
    params = [SamplingParams(**kwargs) if i % 2 else SamplingParams(temperature=0)
              for i in range(16)]
    assert torch.equal(sample(logits, params), want)


def test_a_tiny_temperature_alone_is_greedy_in_the_race_kernel_path():
    """No filters: the one-kernel race; before the floor, logits / 1e-40 was +-inf (garbage)."""
    logits = logits_rows(16, seed=1)
    params = [SamplingParams(temperature=1e-40 if i % 3 else 0.9) for i in range(16)]
    out = sample(logits, params)
    greedy = [i for i in range(16) if i % 3]
    assert torch.equal(out[greedy], logits.argmax(-1)[greedy])


# ---- the engine: tiny temperatures, prompts vs the model's vocabulary, undecodable ids -----------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("demo")
    write_random_checkpoint(path, "demo", num_hidden_layers=1)
    return str(path)


def make_llm(path, **kw):
    from qwen3_model.llm import LLM

    return LLM(path, device="cpu", kvcache_block_size=16, max_model_len=128, **kw)


def test_engine_tiny_temperature_equals_greedy(ckpt):
    llm = make_llm(ckpt)
    prompts = [[5, 6, 7], [40, 41, 42, 43]]
    want = [o.token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)]
    for kw in [dict(), dict(top_k=5), dict(top_p=0.9), dict(min_p=0.2), dict(seed=1)]:
        sp = SamplingParams(temperature=1e-40, max_tokens=8, ignore_eos=True, **kw)
        got = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert got == want, kw


def test_text_prompt_outside_the_models_vocab_is_refused_before_any_work(tmp_path):
    """A tokenizer with more entries (512) than the model has rows (64): was an IndexError mid-step
    (on the GPU a device-side assert)."""
    write_random_checkpoint(tmp_path, "demo", num_hidden_layers=1, vocab_size=64,
                            tokenizer=False, eos_token_id=2)
    tok = char_tokenizer(512)
    tok.save_pretrained(tmp_path)
    llm = make_llm(str(tmp_path))
    prompt = "ab~"  # '~' is past id 64 in the char tokenizer
    ids = tok(prompt)["input_ids"]
    bad = next(j for j, t in enumerate(ids) if t >= 64)
    with pytest.raises(ValueError, match=rf"request 1: .*token id {ids[bad]} at position {bad}.*"
                                         r"\[0, 64\)"):
        llm.generate(["0123", prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.scheduler.is_finished()  # nothing was queued
    ok = [t for t in ids if t < 64]
    assert len(llm.generate([ok], SamplingParams(max_tokens=2, ignore_eos=True),
                            use_tqdm=False)[0].token_ids) == 2


class RaisingTokenizer:
    """A slow-tokenizer stand-in: ``decode`` raises on an id it has no entry for (sentencepiece's
    "piece id is out of range"), and no spaces are cleaned up (the window decode path)."""

    clean_up_tokenization_spaces = True

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def decode(self, ids, skip_special_tokens=False):
        for t in ids:
            if not 0 <= t < self.n:
                raise IndexError(f"piece id {t} is out of range")
        return "".join(chr(ord("a") + t % 26) for t in ids)


def fed(detok, ids, want_text=True):
    """Feed ``ids`` one step at a time, as the engine does; -> the detok state."""
    seq = Sequence([1, 2, 3], SamplingParams(max_tokens=64, ignore_eos=True))
    state = DetokState()
    for t in ids:
        seq.token_ids.append(t)
        detok.step(seq, state, want_text)
    return state


@pytest.mark.parametrize("path", ["decode_stream", "window"])
def test_ids_past_the_tokenizers_table_decode_to_nothing(path):
    """Both detokenizer paths and the final decode: an id with no entry is "", never an error."""
    if path == "decode_stream":
        tok = char_tokenizer(200)
        tok.clean_up_tokenization_spaces = False
        detok = Detokenizer(tok, (2,), lambda *a: None)
        assert detok._backend is not None
        pieces = {t: tok.decode([t]) for t in (50, 51, 52)}
    else:
        tok = RaisingTokenizer(200)
        detok = Detokenizer(tok, (2,), lambda *a: None)
        assert detok._backend is None
        pieces = {t: tok.decode([t]) for t in (50, 51, 52)}
    ids = [50, 300, 51, 199 + 1, 10**6, 52]
    state = fed(detok, ids)
    want = pieces[50] + pieces[51] + pieces[52]
    assert state.text == want
    assert state.num_fed == len(ids)
    assert detok.decode(ids) == want
    assert detok.decode(state.ids) == want
    # without text (generate's fast path): the ids the final decode sees are decodable
    state = fed(detok, ids, want_text=False)
    assert tok.decode(state.ids) == want


def test_engine_output_with_ids_past_the_tokenizer(tmp_path):
    """A model with 512 rows and a tokenizer of 120 entries (the real Qwen3 has 151,936 rows for
    151,669 tokens): every path gives text without the unknown ids, and no exception."""
    write_random_checkpoint(tmp_path, "demo", num_hidden_layers=1, tokenizer=False,
                            eos_token_id=2)
    tok = char_tokenizer(120)
    tok.save_pretrained(tmp_path)
    llm = make_llm(str(tmp_path))
    sp = SamplingParams(temperature=1.0, seed=0, max_tokens=40, ignore_eos=True)
    out = llm.generate([[5, 6, 7]], sp, use_tqdm=False)[0]
    assert any(t >= 120 for t in out.token_ids)  # the random model does sample them
    want = tok.decode([t for t in out.token_ids if t < 120], skip_special_tokens=True)
    assert out.text == want
    streamed = "".join(d.text for d in llm.stream([[5, 6, 7]], sp))
    assert streamed == want
    sp_stop = SamplingParams(temperature=1.0, seed=0, max_tokens=40, ignore_eos=True,
                             stop=["\x00never"])
    assert llm.generate([[5, 6, 7]], sp_stop, use_tqdm=False)[0].text == want
