"""Batched token sampling on the device: greedy, temperature, top-k, top-p, min-p, per-request
seeds.

Everything is tensor work over the whole batch; the only host sync is the caller reading the
sampled ids once per step. Which filters run is decided on the host from the requests' settings
(``SamplingBatch`` flags), so a batch that needs no top-k / top-p pays for no sort.

Sampling is an exponential race: token = argmax(p_i / E_i) with E_i ~ Exp(1) independent, which
picks token i with probability p_i / sum(p) and needs no normalisation, no cumsum and no
``multinomial`` (which syncs). For a request with a seed, E_i comes from a counter-based hash of
(seed, output position, token id) computed on the device: the same seed gives the same tokens
whatever else is in the batch, and after a preemption. Rows that filter nothing (temperature only,
the common case) take the race in log space in one kernel, ``qwen3_kernels.sample_tokens``:
argmax(logits / T - log E_i), one read of the logits, no softmax; the other rows use the tensor
path (sort, softmax, the same seeded noise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import qwen3_kernels
from qwen3_kernels.reference import seeded_exponential
from qwen3_model.sampling_params import GREEDY_TEMPERATURE, SamplingParams

_M32 = 0xFFFFFFFF


_SCALARS: dict[tuple[str, float], torch.Tensor] = {}


def _device_scalar(value: float, device) -> torch.Tensor:
    """A 0-dim fp32 tensor holding ``value`` on ``device``, made once per value and device."""
    key = (str(device), value)
    t = _SCALARS.get(key)
    if t is None:
        if len(_SCALARS) >= 256:
            _SCALARS.clear()
        with torch.inference_mode(False):  # a normal tensor: usable in and out of that mode
            t = _SCALARS[key] = torch.tensor(value, dtype=torch.float32, device=device)
    return t


@dataclass
class SamplingBatch:
    """The sampling settings of the rows of one step's logits, as device tensors plus host flags."""

    # [N] fp32, greedy rows (temperature below GREEDY_TEMPERATURE) set to 1 (unused there); or a
    # 0-dim fp32 tensor when every row has the same temperature (the common case: cached on the
    # device, no copy per step)
    temperatures: torch.Tensor | None
    greedy_mask: torch.Tensor | None  # [N] bool, None when no row is greedy
    top_k: torch.Tensor | None  # [N] int64 in [1, V], None when no row filters by k
    top_p: torch.Tensor | None  # [N] fp32, None when no row filters by p
    min_p: torch.Tensor | None  # [N] fp32, None when no row filters by min-p
    seeded_rows: torch.Tensor | None  # [R] int64 rows that have a seed
    # [R, 3] int64: seed lo 32 bits, seed hi 32 bits, output position
    seed_keys: torch.Tensor | None
    banned_rows: torch.Tensor | None  # [K] int64, with banned_ids: logits set to -inf
    banned_ids: torch.Tensor | None  # [K] int64
    all_greedy: bool = False
    # logit_bias: logits[bias_rows[j], bias_ids[j]] += bias_values[j] (in fp32), before the bans
    bias_rows: torch.Tensor | None = None  # [B] int64
    bias_ids: torch.Tensor | None = None  # [B] int64
    bias_values: torch.Tensor | None = None  # [B] fp32
    # penalties, one entry per (row, token id in its history): logits[pen_rows, pen_ids] become
    # (x / r if x > 0 else x * r) - frequency * count - presence * (count > 0), after the bias
    pen_rows: torch.Tensor | None = None  # [P] int64
    pen_ids: torch.Tensor | None = None  # [P] int64
    pen_counts: torch.Tensor | None = None  # [P] fp32: the id's count in the row's output
    pen_presence: torch.Tensor | None = None  # [P] fp32: the row's presence_penalty
    pen_frequency: torch.Tensor | None = None  # [P] fp32: the row's frequency_penalty
    pen_repetition: torch.Tensor | None = None  # [P] fp32: the row's repetition_penalty

    @staticmethod
    def build(
        params: list[SamplingParams],
        positions: list[int] | None,
        banned: list | None,
        vocab_size: int,
        device: torch.device | str,
        history: list | None = None,
    ) -> "SamplingBatch":
        """params / positions (output index of the token to sample; needed for seeded rows) /
        banned ids, one per row (None: no row bans any id) / history, one per row: None, or
        for a penalized row (its output's token counts {id: n}, its prompt's ids) (None: no row
        is penalized).

        Host cost matters here (it runs every step over every sampled row): one pass over the
        params per setting, and a tensor (one copy to the device) only for a setting some row
        actually uses.
        """
        pin = torch.device(device).type == "cuda"

        def to_dev(data, dtype):
            t = torch.tensor(data, dtype=dtype, pin_memory=pin)
            return t.to(device, non_blocking=True)

        banned_rows = banned_ids = None
        if banned is not None and any(banned):
            rows = [r for r, b in enumerate(banned) for _ in b]
            ids = [i for b in banned for i in b]
            banned_rows = to_dev(rows, torch.int64)
            banned_ids = to_dev(ids, torch.int64)
        extra = {}  # the logit_bias and penalty fields some row uses
        if [p.logit_bias for p in params].count(None) != len(params):
            biased = [(r, t, b) for r, p in enumerate(params) if p.logit_bias
                      for t, b in p.logit_bias.items()]
            if biased:
                rows, ids, values = zip(*biased)
                extra.update(bias_rows=to_dev(rows, torch.int64),
                             bias_ids=to_dev(ids, torch.int64),
                             bias_values=to_dev(values, torch.float32))
        if history is not None:
            entries = []  # (row, id, count, presence, frequency, repetition)
            for r, (p, h) in enumerate(zip(params, history)):
                if h is None:
                    continue
                counts, prompt_ids = h
                ids = counts.keys() | prompt_ids if p.repetition_penalty != 1 else counts.keys()
                pr, fr, rp = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
                entries += [(r, t, counts.get(t, 0), pr, fr, rp) for t in ids]
            if entries:
                rows, ids, cnt, pr, fr, rp = zip(*entries)
                extra.update(pen_rows=to_dev(rows, torch.int64), pen_ids=to_dev(ids, torch.int64),
                             pen_counts=to_dev(cnt, torch.float32),
                             pen_presence=to_dev(pr, torch.float32),
                             pen_frequency=to_dev(fr, torch.float32),
                             pen_repetition=to_dev(rp, torch.float32))
        temps = [p.temperature for p in params]
        greedy = None  # a temperature below GREEDY_TEMPERATURE is greedy (SamplingParams.greedy)
        num_greedy = 0
        if min(temps) < GREEDY_TEMPERATURE:
            greedy = [t < GREEDY_TEMPERATURE for t in temps]
            num_greedy = greedy.count(True)
            if num_greedy == len(temps):
                return SamplingBatch(None, None, None, None, None, None, None,
                                     banned_rows, banned_ids, all_greedy=True, **extra)
        sampled = [p for p, g in zip(params, greedy) if not g] if num_greedy else params
        top_k = top_p = min_p = None
        # each setting's distinct values (set comprehensions: cheaper than a generator per row)
        if any(k != -1 and k < vocab_size for k in {p.top_k for p in sampled}):
            top_k = to_dev([vocab_size if p.top_k == -1 else min(p.top_k, vocab_size)
                            for p in params], torch.int64)
        if min({p.top_p for p in sampled}) < 1:
            top_p = to_dev([p.top_p for p in params], torch.float32)
        if max({p.min_p for p in sampled}) > 0:
            min_p = to_dev([p.min_p for p in params], torch.float32)
        seeded_rows = seed_keys = None
        if {p.seed for p in sampled} != {None}:
            seeded = [r for r, p in enumerate(params)
                      if p.seed is not None and p.temperature >= GREEDY_TEMPERATURE]
            if positions is None:
                raise ValueError("SamplingBatch.build: seeded rows need their output positions")
            seeded_rows = to_dev(seeded, torch.int64)
            keys = []
            for r in seeded:
                s = params[r].seed & 0xFFFFFFFFFFFFFFFF  # negative seeds too
                keys.append([s & _M32, s >> 32, positions[r] & _M32])
            seed_keys = to_dev(keys, torch.int64)
        if num_greedy == 0 and temps.count(temps[0]) == len(temps):
            temperatures = _device_scalar(float(temps[0]), device)  # one value for the batch
        else:
            temperatures = to_dev([t if t >= GREEDY_TEMPERATURE else 1.0 for t in temps],
                                  torch.float32)
        return SamplingBatch(
            temperatures=temperatures,
            greedy_mask=to_dev(greedy, torch.bool) if greedy is not None else None,
            top_k=top_k, top_p=top_p, min_p=min_p,
            seeded_rows=seeded_rows, seed_keys=seed_keys,
            banned_rows=banned_rows, banned_ids=banned_ids, **extra,
        )


class Sampler(nn.Module):
    """Greedy rows: argmax. Rows with temperature only (the common case): one pass of the
    ``sample_tokens`` kernel over the logits (score = logits / T - log(E), E ~ Exp(1) hashed from a
    per-row key). Rows with top-k / top-p / min-p: the tensor path below (sort, softmax). Any
    row's logit_bias is added first, then its penalties (the batch's logits then in fp32, which
    samples every other row as its own dtype does), then the min_tokens bans."""

    def __init__(self):
        super().__init__()
        # An unseeded row's key is (base, step, row): a random base per sampler, drawn from torch's
        # default generator (torch.manual_seed makes a run repeatable), and a step count bumped on
        # every call, written into a device buffer with one fill (no host-to-device copy).
        self._base = int(torch.randint(0, 1 << 32, (1,)).item())
        self._step = 0
        self._keys: torch.Tensor | None = None  # [cap, 3] int64 (base, step, row)

    def _row_keys(self, n: int, device) -> torch.Tensor:
        """[n, 3] int64 keys for this call's unseeded rows (fresh noise on every call)."""
        keys = self._keys
        if keys is None or keys.shape[0] < n or keys.device != torch.device(device):
            with torch.inference_mode(False):  # a normal tensor: updated in and out of that mode
                keys = torch.zeros(max(n, 256), 3, dtype=torch.int64, device=device)
                keys[:, 0] = self._base
                keys[:, 2] = torch.arange(keys.shape[0], device=device)
            self._keys = keys
        self._step = (self._step + 1) & _M32
        keys[:, 1].fill_(self._step)
        return keys[:n]

    @torch.no_grad()
    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits [N, V] -> token ids [N] int64."""
        if batch.bias_rows is not None or batch.pen_rows is not None:
            # in fp32 (a new tensor: the caller's logits stay raw)
            logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
            if batch.bias_rows is not None:
                logits.index_put_((batch.bias_rows, batch.bias_ids), batch.bias_values,
                                  accumulate=True)
            if batch.pen_rows is not None:
                at = (batch.pen_rows, batch.pen_ids)
                x, r, n = logits[at], batch.pen_repetition, batch.pen_counts
                x = torch.where(x > 0, x / r, x * r)
                logits[at] = x - batch.pen_frequency * n - batch.pen_presence * (n > 0)
        elif batch.banned_rows is not None:
            logits = logits.clone()
        if batch.banned_rows is not None:
            # a Python scalar value: no host-to-device copy (and no sync) for it
            logits[batch.banned_rows, batch.banned_ids] = float("-inf")
        if batch.all_greedy:
            return logits.argmax(dim=-1)  # in the logits' dtype: the fp32 copy would change nothing
        if batch.top_k is None and batch.top_p is None and batch.min_p is None:
            return self._race(logits, batch)
        logits = logits.float()
        temps = batch.temperatures
        # a true division either way (a Python float divisor would become a multiplication by
        # its reciprocal on CUDA, and a seeded row's tokens would then depend on its neighbours)
        x = logits / (temps if temps.dim() == 0 else temps.unsqueeze(1))
        if batch.top_k is not None or batch.top_p is not None:
            x = self._top_k_top_p(x, batch.top_k, batch.top_p)
        probs = torch.softmax(x, dim=-1)
        if batch.min_p is not None:
            floor = batch.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < floor, 0.0)
        noise = torch.empty_like(probs).exponential_()
        if batch.seeded_rows is not None:
            noise[batch.seeded_rows] = seeded_exponential(batch.seed_keys, probs.shape[1])
        tokens = (probs / noise).argmax(dim=-1)
        if batch.greedy_mask is not None:
            tokens = torch.where(batch.greedy_mask, logits.argmax(dim=-1), tokens)
        return tokens

    def _race(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The exponential race in one kernel: greedy rows get temperature 0, seeded rows their
        (seed, output position) key, the others (base, step, row)."""
        n = logits.shape[0]
        temps = batch.temperatures
        temps = temps.expand(n).contiguous() if temps.dim() == 0 else temps
        if batch.greedy_mask is not None:
            temps = temps.masked_fill(batch.greedy_mask, 0.0)
        keys = self._row_keys(n, logits.device)
        if batch.seeded_rows is not None:
            keys = keys.clone()
            keys[batch.seeded_rows] = batch.seed_keys
        return qwen3_kernels.sample_tokens(logits, temps, keys)

    @staticmethod
    def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None):
        """Set the logits outside each row's top-k and top-p set to -inf. x [N, V] fp32."""
        sorted_x, order = x.sort(dim=-1, descending=True)
        if top_k is not None:
            rank = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            sorted_x = sorted_x.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))
        if top_p is not None:
            p = torch.softmax(sorted_x, dim=-1)
            before = torch.cumsum(p, dim=-1) - p  # probability of the strictly more likely tokens
            # the most likely token always stays (before == 0 < top_p)
            sorted_x = sorted_x.masked_fill(before >= top_p.unsqueeze(1), float("-inf"))
        return torch.full_like(x, float("-inf")).scatter(1, order, sorted_x)
