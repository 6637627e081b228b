"""Per-request sampling settings, vLLM's names and defaults.

    SamplingParams(temperature=0.0, max_tokens=64)                 # greedy
    SamplingParams(temperature=0.7, top_p=0.9, seed=1, stop=["\\n\\n"])
    SamplingParams(temperature=0.0, logprobs=5, prompt_logprobs=0)  # + logprobs (sequence.py)
    SamplingParams(logit_bias={9707: 5.0, 151643: -100.0})          # added to those logits
    SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1)

Every field is checked when the object is built (and again by ``LLM.generate``, in case a field
was changed afterwards); a bad value or an unknown keyword raises ``ValueError`` saying what was
expected.

Float fields are checked as the sampler sees them, in fp32: inf and NaN are refused everywhere;
top_p must be at least fp32's smallest normal number (``FP32_TINY``; anything smaller becomes 0 or a
denormal that the GPU flushes to 0, which would keep no token at all), and a non-zero min_p too.
A temperature below ``GREEDY_TEMPERATURE`` (vLLM's floor, 1e-5) samples greedily: the field keeps
the value given, ``greedy`` is True, and top-k / top-p / min-p / seed change nothing (dividing the
logits by such a temperature overflows fp32).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field, fields

MAX_LOGPROBS = 20  # the most top tokens a request may ask for (logprobs / prompt_logprobs)
MAX_LOGIT_BIAS = 100.0  # |bias| at most (OpenAI's range: -100 bans a token, 100 forces it)
# tokens a request may bias at most: each is a host-side entry in every step's sampling inputs,
# so one request must not be able to slow every step of the batch
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| at most (OpenAI's range)
GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)
FP32_TINY = 1.1754943508222875e-38  # the smallest normal fp32 number: top_p (and min_p > 0) floor


def as_fp32(value: float) -> float:
    """``value`` rounded to fp32 as the sampler's tensors hold it; inf where it overflows."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.inf


@dataclass(slots=True, init=False)
class SamplingParams:
    temperature: float = 1.0  # 0 (or anything below GREEDY_TEMPERATURE) = greedy (argmax)
    top_k: int = -1  # keep the k most likely tokens; -1 = all
    # keep the smallest set whose probability reaches top_p; in (0, 1] and >= FP32_TINY in fp32
    top_p: float = 1.0
    # drop tokens less likely than min_p * the most likely one; 0, or as top_p
    min_p: float = 0.0
    seed: int | None = None  # per request: the same seed gives the same tokens, whatever the batch
    max_tokens: int = 16  # new tokens at most
    min_tokens: int = 0  # EOS and stop_token_ids are suppressed until this many tokens exist
    ignore_eos: bool = False  # keep going past EOS (stop_token_ids and stop still apply)
    stop: list[str] = field(default_factory=list)  # strings that end the output (not included)
    stop_token_ids: list[int] = field(default_factory=list)  # ids that end the output
    # per generated token: its logprob, its rank and the top-N; None = not computed. Taken from
    # the RAW logits (fp32 log_softmax of the LM head), before temperature, top-k / top-p / min-p
    # and the min_tokens bans (vLLM's default "raw_logprobs")
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same per prompt token (the first has none)
    # token id -> a number in [-100, 100] added to that token's logit (in fp32) before sampling
    # (before temperature and the filters; the logprobs stay raw, as above), for at most
    # MAX_LOGIT_BIAS_TOKENS ids; None = no bias
    logit_bias: dict[int, float] | None = None
    # Penalties on what the request has generated so far (vLLM's / OpenAI's meaning), applied to
    # the logits after logit_bias, before temperature: logit -= presence_penalty (if the token
    # occurs in the output) + frequency_penalty * (its count there); repetition_penalty r (> 0)
    # divides a positive logit by r and multiplies a negative one by r for every token in the
    # prompt or the output. A request with any of them waits for each token before its next
    # step is scheduled (the counts need its value), as one with stop ids does, and its step's
    # sampling inputs are built on the host from its distinct tokens (repetition_penalty over a
    # prompt of 12K distinct ids: ~6 ms a step; presence / frequency over 1K output ids: ~0.5 ms).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    # Keyword-only and explicit, so an unknown keyword is a ValueError (as the API promises)
    # rather than the TypeError a generated dataclass __init__ would raise.
    def __init__(
        self,
        *,
        temperature: float = 1.0,
        top_k: int = -1,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
        max_tokens: int = 16,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        logit_bias: dict[int, float] | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        **unknown,
    ):
        if unknown:
            known = ", ".join(f.name for f in fields(SamplingParams))
            raise ValueError(
                f"SamplingParams: unknown argument(s) {sorted(unknown)}; expected some of: {known}"
            )
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.min_p = min_p
        self.seed = seed
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.ignore_eos = ignore_eos
        self.stop = [stop] if isinstance(stop, str) else list(stop or [])
        self.stop_token_ids = list(stop_token_ids or [])
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs
        self.logit_bias = dict(logit_bias) if isinstance(logit_bias, dict) else logit_bias
        self.presence_penalty = presence_penalty
        self.frequency_penalty = frequency_penalty
        self.repetition_penalty = repetition_penalty
        self.__post_init__()

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field. Also called by LLM.generate."""

        def bad(name, expected):
            raise ValueError(
                f"SamplingParams.{name} must be {expected}, got {getattr(self, name)!r}"
            )

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):  # a finite int or float (a huge int overflows to inf in float())
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                return False
            try:
                return math.isfinite(v)
            except OverflowError:
                return False

        if not is_num(self.temperature) or not (
                self.temperature >= 0 and math.isfinite(as_fp32(self.temperature))):
            bad("temperature", f"a finite number >= 0 that fits fp32 (below "
                               f"{GREEDY_TEMPERATURE:g}: greedy)")
        if not is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            bad("top_k", "-1 (all tokens) or an integer >= 1")
        if not is_num(self.top_p) or not (0 < self.top_p <= 1
                                           and as_fp32(self.top_p) >= FP32_TINY):
            bad("top_p", f"in [{FP32_TINY:.8g}, 1] (fp32's smallest normal number: a smaller "
                         "top_p is 0 to the sampler and would keep no token)")
        if not is_num(self.min_p) or not (
                self.min_p == 0 or (0 < self.min_p <= 1 and as_fp32(self.min_p) >= FP32_TINY)):
            bad("min_p", f"0 or in [{FP32_TINY:.8g}, 1] (fp32's smallest normal number)")
        if self.seed is not None and not is_int(self.seed):
            bad("seed", "None or an integer")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "an integer >= 1")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"an integer in [0, max_tokens={self.max_tokens}]")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "a bool")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(
            is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            bad("stop_token_ids", "a list of non-negative token ids")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                bad(name, f"None or an integer in [0, {MAX_LOGPROBS}] (how many top tokens)")
        if self.logit_bias is not None and not (
            isinstance(self.logit_bias, dict)
            and len(self.logit_bias) <= MAX_LOGIT_BIAS_TOKENS
            and all(is_int(t) and t >= 0 and is_num(b) and abs(b) <= MAX_LOGIT_BIAS
                    for t, b in self.logit_bias.items())
        ):
            bad("logit_bias", f"None or a dict of at most {MAX_LOGIT_BIAS_TOKENS} token ids "
                              f"(int >= 0) -> number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or abs(v) > MAX_PENALTY:
                bad(name, f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        r = self.repetition_penalty
        if not is_num(r) or not (r > 0 and as_fp32(r) >= FP32_TINY
                                 and math.isfinite(as_fp32(r))):
            bad("repetition_penalty", "a number > 0 that fits fp32 (1: none)")

    @property
    def penalized(self) -> bool:
        """Whether a penalty applies (then sampling reads the request's token history)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        """Argmax sampling: temperature below GREEDY_TEMPERATURE (0 included)."""
        return self.temperature < GREEDY_TEMPERATURE
