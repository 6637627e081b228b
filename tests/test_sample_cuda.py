"""CUDA: sample_tokens vs the fp32 reference (skips without a GPU).

The kernel computes the reference's scores (logits / T - log E, the same hash for E) with fast
logarithms, so a sampled token may differ from the reference's where two scores are within
rounding; the check is that the kernel's token scores within TOL of the reference's best. Greedy
rows must equal the reference exactly (ties: the lowest id), and so must every row whose best
score is clear of the runner-up."""

import pytest
import torch

import qwen3_kernels
from qwen3_kernels import reference as ref
from tests.helpers import requires_cuda

pytestmark = requires_cuda

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def keys_for(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << 32, (n, 3), generator=g, dtype=torch.int64).cuda()


def check(logits, temps, keys):
    out = torch.full((logits.shape[0],), -7, dtype=torch.int64, device="cuda")  # poisoned
    qwen3_kernels.sample_tokens(logits, temps, keys, out=out)
    return verify(out, logits, temps, keys)


def verify(out, logits, temps, keys):
    scores = ref.sample_scores(logits, temps, keys)
    best, want = scores.max(dim=-1)
    assert (out >= 0).all() and (out < logits.shape[1]).all()
    got = scores.gather(1, out.unsqueeze(1)).squeeze(1)
    tol = 1e-4 * (1 + best.abs())
    assert (got >= best - tol).all(), (got - best).min()
    greedy = temps <= 0
    assert torch.equal(out[greedy], logits[greedy].float().argmax(-1))
    # rows with a clear winner: the very same token
    second = scores.topk(2, dim=-1).values[:, 1] if logits.shape[1] > 1 else best - 1
    clear = (best - second) > 2 * tol
    assert torch.equal(out[clear], want[clear])
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3, 64, 257])
@pytest.mark.parametrize("vocab", [151936, 151937, 1000, 7])
def test_matches_reference(n, vocab, dtype):
    if n * vocab > 64 * 151937:
        n = 64 * 151937 // vocab  # keeps the fp32 reference's memory small
    logits = (torch.randn(n, vocab, device="cuda") * 4).to(dtype)
    temps = torch.rand(n, device="cuda") * 1.5 + 0.05
    temps[::3] = 0.0  # greedy rows in between
    check(logits, temps, keys_for(n, seed=n + vocab))


@pytest.mark.parametrize("temperature", [1e-5, 1e-3, 0.6, 50.0, 2e4])
@pytest.mark.parametrize("scale", [0.01, 100.0])
def test_extreme_temperatures_and_logits(temperature, scale):
    # the kernel skips tokens whose cheap bound is below the running best: the bound's margin must
    # hold for tiny and huge x / T, and the skip is off outside T in [1e-4, 1e4]
    logits = torch.randn(8, 151936, device="cuda") * scale
    logits[3, 7] = float("inf")
    logits[4, 1000:] = float("nan")
    temps = torch.full((8,), temperature, device="cuda")
    out = torch.full((8,), -7, dtype=torch.int64, device="cuda")
    keys = keys_for(8, seed=int(temperature * 1000) + int(scale))
    qwen3_kernels.sample_tokens(logits, temps, keys, out=out)
    assert out[3].item() == 7  # +inf beats every finite score
    assert 0 <= out[4].item() < 1000  # a NaN score never wins
    finite = [0, 1, 2, 5, 6, 7]
    verify(out[finite], logits[finite], temps[finite], keys[finite])


def test_strided_rows_and_a_misaligned_view():
    wide = torch.randn(16, 50000, device="cuda", dtype=torch.bfloat16) * 3
    temps = torch.full((16,), 0.9, device="cuda")
    check(wide[:, :49992], temps, keys_for(16))      # row stride 50000: the vector path
    check(wide[:, 3:40003], temps, keys_for(16, 1))  # rows start 6 bytes in: the scalar path


def test_banned_and_all_minus_inf_rows():
    logits = torch.randn(4, 4096, device="cuda")
    logits[0, :] = float("-inf")  # nothing allowed: torch.argmax's answer, 0
    logits[1, 100:] = float("-inf")
    temps = torch.tensor([1.0, 1.0, 0.0, 0.5], device="cuda")
    out = check(logits, temps, keys_for(4))
    assert out[0].item() == 0 and out[1].item() < 100


def test_follows_the_softmax_on_the_gpu():
    x = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5, 0.2], device="cuda")
    n = 50000
    keys = keys_for(n, seed=11)
    out = qwen3_kernels.sample_tokens(x.expand(n, -1).contiguous(), torch.full((n,), 0.7, device="cuda"), keys)
    counts = torch.bincount(out, minlength=x.numel()).double()
    expect = torch.softmax(x.double() / 0.7, 0) * n
    chi2 = (((counts - expect) ** 2) / expect).sum().item()
    assert chi2 < 45.0, (chi2, counts.tolist(), expect.tolist())


def test_cuda_graph_replay_with_new_keys():
    logits = torch.randn(32, 151936, device="cuda", dtype=torch.bfloat16) * 3
    temps = torch.full((32,), 1.0, device="cuda")
    keys = keys_for(32)
    out = torch.empty(32, dtype=torch.int64, device="cuda")
    qwen3_kernels.sample_tokens(logits, temps, keys, out=out)  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch.ops.qwen3_kernels.sample_tokens(out, logits, temps, keys)
    first = out.clone()
    keys.copy_(keys_for(32, seed=5))
    out.fill_(-7)
    g.replay()
    torch.cuda.synchronize()
    verify(out, logits, temps, keys)  # the replay read the new keys
    assert not torch.equal(out, first)


def test_errors_and_opcheck():
    # The checked API raises ValueError; the raw torch.ops call is an unchecked launch.
    logits = torch.randn(4, 64, device="cuda")
    temps = torch.ones(4, device="cuda")
    keys = keys_for(4)
    out = torch.empty(4, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="temperatures must be"):
        qwen3_kernels.sample_tokens(logits, temps.double(), keys, out=out)
    with pytest.raises(ValueError, match="seed_keys must have shape"):
        qwen3_kernels.sample_tokens(logits, temps, keys[:, :2].contiguous(), out=out)
    with pytest.raises(ValueError, match="temperatures is on cpu"):
        qwen3_kernels.sample_tokens(logits, temps.cpu(), keys, out=out)
    torch.library.opcheck(torch.ops.qwen3_kernels.sample_tokens.default, (out, logits, temps, keys))


def test_sampler_bias_and_penalties_on_the_gpu_match_the_cpu():
    """The Sampler's logit_bias and penalty path (torch ops on the device) gives on CUDA the
    logits it gives on the CPU, and the same greedy tokens."""
    from collections import Counter

    from qwen3_model.layers.sampler import Sampler, SamplingBatch
    from qwen3_model.sampling_params import SamplingParams

    V, n = 1003, 6
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(n, V, generator=g) * 3).to(torch.bfloat16)
    outputs = [torch.randint(0, V, (k,), generator=g).tolist() for k in (0, 5, 40, 200, 9, 3)]
    prompts = [torch.randint(0, V, (k,), generator=g).tolist() for k in (7, 300, 1, 50, 12, 0)]
    params = [
        SamplingParams(temperature=0, presence_penalty=1.5, logit_bias={3: 5.0, 900: -2.5}),
        SamplingParams(temperature=0, frequency_penalty=2.0),
        SamplingParams(temperature=0, repetition_penalty=1.7, logit_bias={17: 100}),
        SamplingParams(temperature=0, presence_penalty=-0.5, frequency_penalty=0.7,
                       repetition_penalty=0.6),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, repetition_penalty=1.2, logit_bias={0: -100, 1: 0.07}),
    ]
    history = [(Counter(o), set(p)) if sp.penalized else None
               for o, p, sp in zip(outputs, prompts, params)]
    captured = {}

    class Spy(Sampler):
        def _race(self, x, b):
            captured.setdefault(x.device.type, x.cpu())
            return super()._race(x, b)

    tokens = {}
    for dev in ("cpu", "cuda"):
        batch = SamplingBatch.build(params, [0] * n, [[] for _ in range(n)], V, dev, history)
        tokens[dev] = Sampler()(logits.to(dev), batch).cpu()
        # a sampled batch shows the logits the race sees
        hot = [SamplingParams(temperature=1.0, seed=r, presence_penalty=p.presence_penalty,
                              frequency_penalty=p.frequency_penalty,
                              repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias)
               for r, p in enumerate(params)]
        hist = [(Counter(o), set(p)) if sp.penalized else None
                for o, p, sp in zip(outputs, prompts, hot)]
        Spy()(logits.to(dev), SamplingBatch.build(hot, [0] * n, [[] for _ in range(n)], V, dev,
                                                  hist))
    assert torch.equal(tokens["cpu"], tokens["cuda"])
    assert torch.allclose(captured["cpu"], captured["cuda"], rtol=1e-6, atol=1e-6)
    assert tokens["cuda"][2].item() == 17  # +100 wins
