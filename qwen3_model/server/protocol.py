"""The OpenAI API's request fields -> the engine's requests, and the engine's outputs -> the API's
response objects. Pure functions over dicts (no web framework here), so every rule is testable on
its own.

Requests are read field by field: a known field with a wrong type or value is an ``APIError``
(HTTP 400) naming it; unknown fields are ignored (clients send fields this engine has no use for,
e.g. ``user``). Logprobs are the raw model's (before temperature and filters), as vLLM's server
returns them by default.
"""

from __future__ import annotations

import copy
import re
import time
import uuid
from dataclasses import dataclass

from qwen3_model.engine.sequence import TokenLogprobs
from qwen3_model.sampling_params import SamplingParams

MAX_LOGPROBS = 20
MAX_N = 128  # choices a prompt (OpenAI's bound for chat)


class APIError(Exception):
    """An error response: HTTP ``status`` and the OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (status, message, param,
                                                                       type_, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(param: str | None, message: str) -> APIError:
    return APIError(400, message, param)


# ---- reading fields ------------------------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_KINDS = {
    "int": (_is_int, "an integer"),
    "number": (_is_num, "a number"),
    "bool": (lambda v: isinstance(v, bool), "a boolean"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "dict": (lambda v: isinstance(v, dict), "an object"),
}


def get(body: dict, name: str, kind: str, default=None):
    """``body[name]`` checked to be of ``kind`` (null = absent = ``default``)."""
    v = body.get(name)
    if v is None:
        return default
    ok, expected = _KINDS[kind]
    if not ok(v):
        raise bad(name, f"'{name}' must be {expected}, got {type(v).__name__} {v!r:.80}")
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return v
    raise bad("stop", f"'stop' must be a string or a list of strings, got {v!r:.80}")


def _int_list(body: dict, name: str) -> list[int]:
    v = body.get(name)
    if v is None:
        return []
    if isinstance(v, list) and all(_is_int(t) for t in v):
        return v
    raise bad(name, f"'{name}' must be a list of integers, got {v!r:.80}")


def _logit_bias(body: dict) -> dict[int, float] | None:
    """'logit_bias': {"token id": bias} (JSON keys are strings) -> {int: number}; the range of
    each bias is SamplingParams' to check."""
    v = get(body, "logit_bias", "dict")
    if not v:
        return None
    out = {}
    for key, b in v.items():
        t = int(key) if isinstance(key, str) and re.fullmatch(r"\d{1,12}", key) else None
        if t is None or not _is_num(b):
            raise bad("logit_bias", "'logit_bias' must map token ids (\"123\") to numbers, got "
                                    f"{key!r:.40}: {b!r:.40}")
        out[t] = b
    return out


def _unsupported(body: dict) -> None:
    """Fields whose only value this engine runs is the neutral one."""
    n = get(body, "n", "int", 1)
    best_of = get(body, "best_of", "int", n)
    if best_of != n:  # (more candidates than choices, ranked: not supported)
        raise bad("best_of", f"'best_of' must equal 'n' ({n}), got {best_of}")
    if body.get("suffix"):
        raise bad("suffix", "'suffix' is not supported")


def sampling_params(body: dict, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The sampling fields common to both endpoints (plus vLLM's extras: ignore_eos, min_tokens,
    stop_token_ids); ``max_tokens`` / logprobs as the endpoint read them."""
    _unsupported(body)
    kw = dict(
        temperature=get(body, "temperature", "number", 1.0),
        top_p=get(body, "top_p", "number", 1.0),
        top_k=get(body, "top_k", "int", -1),
        min_p=get(body, "min_p", "number", 0.0),
        seed=get(body, "seed", "int"),
        max_tokens=max_tokens,
        min_tokens=get(body, "min_tokens", "int", 0),
        ignore_eos=get(body, "ignore_eos", "bool", False),
        stop=_stop(body),
        stop_token_ids=_int_list(body, "stop_token_ids"),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=_logit_bias(body),
        presence_penalty=get(body, "presence_penalty", "number", 0.0),
        frequency_penalty=get(body, "frequency_penalty", "number", 0.0),
        repetition_penalty=get(body, "repetition_penalty", "number", 1.0),
    )
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        m = re.search(r"SamplingParams\.(\w+)", str(e))
        field = m.group(1) if m else None
        raise bad({"prompt_logprobs": "logprobs"}.get(field, field),
                  str(e).replace("SamplingParams.", "")) from None


def choices_per_prompt(body: dict) -> int:
    n = get(body, "n", "int", 1)
    if not 1 <= n <= MAX_N:
        raise bad("n", f"'n' must be in [1, {MAX_N}] (choices per prompt), got {n}")
    return n


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling params of a prompt's n choices: choice j samples with seed + j (a seeded
    request stays reproducible, and its choices differ); unseeded ones share ``params``."""
    if params.seed is None:
        return [params] * n
    out = [params]
    for j in range(1, n):
        sp = copy.copy(params)
        sp.seed = params.seed + j
        out.append(sp)
    return out


def _logprobs_count(body: dict, name: str) -> int | None:
    n = get(body, name, "int")
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise bad(name, f"'{name}' must be in [0, {MAX_LOGPROBS}], got {n}")
    return n


def stream_options(body: dict) -> None:
    opts = get(body, "stream_options", "dict")
    if opts is not None and not isinstance(opts.get("include_usage", False), bool):
        raise bad("stream_options", "'stream_options.include_usage' must be a boolean")


@dataclass
class CompletionRequest:
    prompts: list  # each a string or a list of token ids
    params: SamplingParams
    stream: bool
    echo: bool
    logprobs: int | None
    n: int  # choices per prompt: choice index = prompt index * n + j


def completion_request(body: dict) -> CompletionRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_int(prompt[0])):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise bad("prompt", "'prompt' must be a string, a list of token ids, or a non-empty list "
                            f"of those; got {prompt!r:.80}")
    for p in prompts:
        if isinstance(p, str):
            continue
        if not (isinstance(p, list) and p and all(_is_int(t) for t in p)):
            raise bad("prompt", "each prompt must be a string or a non-empty list of integer "
                                f"token ids, got {p!r:.80}")
    max_tokens = get(body, "max_tokens", "int", 16)
    logprobs = _logprobs_count(body, "logprobs")
    echo = get(body, "echo", "bool", False)
    stream = get(body, "stream", "bool", False)
    stream_options(body)
    n = choices_per_prompt(body)
    params = sampling_params(body, max_tokens, logprobs,
                             prompt_logprobs=logprobs if echo and logprobs is not None else None)
    return CompletionRequest(prompts, params, stream, echo, logprobs, n)


_ROLES = ("system", "user", "assistant")


def chat_messages(body: dict) -> list[dict]:
    """``messages`` checked and flattened to {role, content: str} (text parts joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "'messages' must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise bad("messages", f"messages[{i}] must be an object with a role in {_ROLES}, "
                                  f"got {m!r:.80}")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise bad("messages", f"messages[{i}].content: only text parts "
                                          f"({{'type': 'text', 'text': ...}}) are supported")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None and m["role"] == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad("messages", f"messages[{i}].content must be a string or a list of text "
                                  f"parts, got {content!r:.80}")
        out.append({"role": m["role"], "content": content})
    return out


@dataclass
class ChatRequest:
    messages: list[dict]
    max_tokens: int | None  # None: up to the context length
    logprobs: int | None  # top_logprobs when logprobs is true, else None
    stream: bool
    template_kwargs: dict
    n: int  # choices


def chat_request(body: dict) -> ChatRequest:
    messages = chat_messages(body)
    max_tokens = get(body, "max_completion_tokens", "int")
    max_tokens = get(body, "max_tokens", "int", max_tokens)
    want = get(body, "logprobs", "bool", False)
    top = _logprobs_count(body, "top_logprobs")
    if top is not None and not want:
        raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    stream = get(body, "stream", "bool", False)
    stream_options(body)
    return ChatRequest(messages, max_tokens, (top or 0) if want else None, stream,
                       get(body, "chat_template_kwargs", "dict", {}), choices_per_prompt(body))


def engine_error(e: ValueError) -> APIError:
    """A request the engine refused (``LLMEngine.validate_requests``) -> a 400 naming the field."""
    msg = re.sub(r"^request \d+: ", "", str(e))
    param = next((p for p in ("logit_bias", "max_tokens") if p in msg), "prompt")
    return bad(param, msg)


# ---- responses -----------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(id_: str, object_: str, model: str, choices: list, created: int | None = None,
             **extra) -> dict:
    return {"id": id_, "object": object_, "created": created or int(time.time()), "model": model,
            "choices": choices, **extra}


class TokenText:
    """Token ids -> their text for logprobs (memoised: the same ids recur)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.num_entries = len(tokenizer) if tokenizer is not None else 0
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self.cache.get(token_id)
        if s is None:
            if token_id >= self.num_entries:  # no text (Qwen3's vocab is larger than its table)
                s = "" if self.tokenizer is not None else f"<{token_id}>"
            else:
                s = self.tokenizer.decode([token_id])
            if len(self.cache) < 200_000:
                self.cache[token_id] = s
        return s


def completion_logprobs(entries: list[TokenLogprobs | None], token_ids: list[int],
                        text_of: TokenText, offset: int) -> dict:
    """The completions API's logprobs object for tokens ``token_ids`` (their ``entries``; an
    entry None, the first prompt token's, gives null)."""
    tokens, lps, tops, offsets = [], [], [], []
    for tid, e in zip(token_ids, entries):
        s = text_of(tid)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if e is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(e.logprob)
        top = {text_of(t): lp for t, lp in e.top}
        top.setdefault(s, e.logprob)  # the chosen token is always listed, as OpenAI does
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprobs], token_ids: list[int], text_of: TokenText) -> dict:
    def item(t: int, lp: float) -> dict:
        s = text_of(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [dict(item(t, e.logprob), top_logprobs=[item(i, lp) for i, lp in e.top])
                        for t, e in zip(token_ids, entries)]}
