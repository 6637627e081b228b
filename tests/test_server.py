"""The OpenAI-compatible server end to end on CPU: `python -m qwen3_model serve` on the demo
checkpoint as a subprocess on a free local port, driven with the `openai` client and, for what the
client hides (raw SSE lines, malformed JSON, disconnects), with http.client.

Outputs are held to an in-process LLM.generate on the same checkpoint and settings (greedy, or
seeded); errors to OpenAI's body shape; /metrics to the requests made; a client that goes away,
an overloaded server and SIGTERM to the contract (aborted, freed, 503, drained).
"""

from __future__ import annotations

import json
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from qwen3_model import LLM, SamplingParams
from tests.helpers import one_thread  # noqa: F401  (autouse: one intra-op thread)

pytest.register_assert_rewrite("tests.server_fixtures")  # (before its import: a plugin too)
from tests.server_fixtures import (BS, ServerProcess, SSEStream, metric, metrics,  # noqa: E402
                                   post_json, read_sse, request, wait_for, write_demo_checkpoint)

pytest_plugins = ["tests.server_fixtures"]  # a failing test's report shows the servers' logs

MODEL = "tiny-qwen3"
MAX_LEN = 1024
BLOCKS = 256
MAIN_FLAGS = ["--block-size", str(BS), "--max-model-len", str(MAX_LEN), "--num-kvcache-blocks",
              str(BLOCKS), "--max-num-seqs", "64", "--served-model-name", MODEL]
SPECIAL_IDS = {0, 1, 2, 3}  # the char tokenizer's special tokens (decode to "")
C, CH = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("serve_ckpt"))


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("server_logs")


@pytest.fixture(scope="module")
def server(ckpt, logs):
    srv = ServerProcess(ckpt, *MAIN_FLAGS, log_dir=logs, name="server")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def ref(ckpt, server):  # (after the server: its start overlaps this process's model load)
    return LLM(ckpt, device="cpu", kvcache_block_size=BS, max_model_len=MAX_LEN,
               num_kvcache_blocks=BLOCKS, max_num_seqs=64)


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=30)


def offline(ref, prompts, **kw):
    return ref.generate(prompts, SamplingParams(**kw), use_tqdm=False)


def comp(**kw):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **kw}


def chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def samples_idle(srv):
    """The metrics once nothing runs, waits or holds KV blocks; else None."""
    m = metrics(srv)
    busy = (metric(m, "qwen3_requests_running") + metric(m, "qwen3_requests_waiting")
            + metric(m, "qwen3_kv_blocks_used"))
    return m if busy == 0 else None


def finished(m, reason):
    return m.get(("qwen3_requests_finished_total", frozenset({("finish_reason", reason)})), 0.0)


def assert_error(status, body, want_status, param="ANY"):
    assert status == want_status, body
    assert set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    assert isinstance(err["message"], str) and err["message"], err
    if param != "ANY":
        assert err["param"] == param, err
    return err


# ---- basics -----------------------------------------------------------------------------------

def test_health_and_models(server, ckpt):
    status, _, data = request(server, "GET", "/health")
    assert status == 200 and json.loads(data) == {"status": "ok"}
    status, _, data = request(server, "GET", "/v1/models")
    assert status == 200
    body = json.loads(data)
    assert body["object"] == "list" and len(body["data"]) == 1
    m = body["data"][0]
    assert m["id"] == MODEL and m["object"] == "model" and m["owned_by"] == "qwen3-kernels"
    assert isinstance(m["created"], int) and m["max_model_len"] == MAX_LEN


def test_completion_equals_offline(client, ref):
    prompt = "Hello, my name is"
    want = offline(ref, [prompt], temperature=0, max_tokens=12)[0]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    assert isinstance(r.created, int) and len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0 and c.logprobs is None
    assert c.text == want.text and c.finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_stream_equals_non_streaming(client, server, ref):
    prompt = "Streaming is"
    want = offline(ref, [prompt], temperature=0, max_tokens=20, ignore_eos=True)[0]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    with_choice = [c for c in chunks if c.choices]
    assert len(with_choice) >= 2, "the text came in one piece"
    assert not chunks[-1].choices and chunks[-1].usage is not None  # the usage chunk, last
    assert all(c.choices for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "text_completion"
    text = "".join(c.choices[0].text for c in with_choice)
    assert text == whole.choices[0].text == want.text
    reasons = [c.choices[0].finish_reason for c in with_choice]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert whole.usage.completion_tokens == 20

    # raw: the usage chunk comes without stream_options too, then [DONE]
    events = read_sse(server, C, dict(kw.pop("extra_body"), **kw, stream=True))
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 20
    body = [json.loads(e) for e in events[:-2]]
    assert "".join(b["choices"][0]["text"] for b in body) == want.text


def test_chat_equals_offline_and_streams(client, server, ref):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi there"}]
    prompt = ref.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    want = offline(ref, [prompt], temperature=0, max_tokens=10)[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                       temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL and len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0 and c.message.role == "assistant" and c.logprobs is None
    assert c.message.content == want.text and c.finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.token_ids)

    # content as parts, max_completion_tokens: the same request
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]
    r2 = client.chat.completions.create(model=MODEL, messages=parts, max_completion_tokens=10,
                                        temperature=0)
    assert r2.choices[0].message.content == want.text

    # the raw stream: role first, content deltas, {} with the finish reason, usage, [DONE]
    events = read_sse(server, CH, {"model": MODEL, "messages": messages, "max_tokens": 10,
                                   "temperature": 0, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    usage = {k: getattr(r.usage, k) for k in ("prompt_tokens", "completion_tokens",
                                               "total_tokens")}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == usage
    choices = [ch["choices"][0] for ch in chunks[:-1]]
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(ch["delta"].get("content", "") for ch in choices[1:]) == want.text
    assert choices[-1]["finish_reason"] == want.finish_reason
    assert all(ch["finish_reason"] is None for ch in choices[:-1])
    assert choices[-1]["delta"] == {}, "the finish reason comes in a chunk of its own"


def test_32_concurrent_requests_equal_offline(client, ref):
    n = 32
    prompts = [f"Request {i}: " + "abcdefghij"[: i % 10] * (1 + i % 4) for i in range(n)]
    max_tokens = [4 + (7 * i) % 37 for i in range(n)]
    ignore_eos = [i % 2 == 1 for i in range(n)]
    want = ref.generate(prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=e)
                                  for m, e in zip(max_tokens, ignore_eos)], use_tqdm=False)

    def one(i):
        return client.completions.create(model=MODEL, prompt=prompts[i], temperature=0,
                                         max_tokens=max_tokens[i], logprobs=0,
                                         extra_body={"ignore_eos": ignore_eos[i]})

    with ThreadPoolExecutor(n) as pool:
        got = list(pool.map(one, range(n), timeout=60))
    for i, (r, w) in enumerate(zip(got, want)):
        c = r.choices[0]
        assert (c.text, c.finish_reason) == (w.text, w.finish_reason), f"request {i}"
        assert r.usage.completion_tokens == len(w.token_ids), f"request {i}"
        # the tokens themselves (each id's own string; special ids decode to "")
        assert len(c.logprobs.tokens) == len(w.token_ids), f"request {i}"
        for j, (tok, t) in enumerate(zip(c.logprobs.tokens, w.token_ids)):
            if t not in SPECIAL_IDS:
                assert tok == ref.tokenizer.decode([t]), f"request {i} token {j}"


def test_token_id_prompts_and_several_prompts(client, ref):
    ids = ref.tokenizer("Token ids")["input_ids"]
    want = offline(ref, [ids], temperature=0, max_tokens=6)[0]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert r.choices[0].text == want.text and r.usage.prompt_tokens == len(ids)

    for prompts in (["one", "two two", "three three three"],
                    [ids, [7, 8, 9], ref.tokenizer("x")["input_ids"]]):
        want = offline(ref, prompts, temperature=0, max_tokens=5, ignore_eos=True)
        r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert sorted(c.index for c in r.choices) == [0, 1, 2]
        for c in r.choices:
            assert c.text == want[c.index].text and c.finish_reason == "length"
        assert r.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
        assert r.usage.completion_tokens == 15


def test_several_prompts_stream(server, ref):
    prompts = ["first", "the second one"]
    want = offline(ref, prompts, temperature=0, max_tokens=6, ignore_eos=True)
    events = read_sse(server, C, comp(prompt=prompts, max_tokens=6, temperature=0, stream=True,
                                      ignore_eos=True))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    text, reasons = {0: "", 1: ""}, {0: [], 1: []}
    for ch in chunks[:-1]:
        (c,) = ch["choices"]
        text[c["index"]] += c["text"]
        reasons[c["index"]].append(c["finish_reason"])
    for i in (0, 1):
        assert text[i] == want[i].text
        assert reasons[i][-1] == "length" and not any(reasons[i][:-1]), reasons[i]


def test_echo(client, ref):
    prompt = "Echo me"
    want = offline(ref, [prompt], temperature=0, max_tokens=5)[0]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                  echo=True)
    assert r.choices[0].text == prompt + want.text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)


def test_logit_bias(client, ref):
    prompt = "Hello, my name is"
    plain = offline(ref, [prompt], temperature=0, max_tokens=8, ignore_eos=True)[0]
    bias = {plain.token_ids[0]: -100, 40: 2.5}
    want = offline(ref, [prompt], temperature=0, max_tokens=8, ignore_eos=True,
                   logit_bias=bias)[0]
    assert want.token_ids[0] != plain.token_ids[0]
    wire = {str(t): b for t, b in bias.items()}
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                  logit_bias=wire, extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.text
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, temperature=0, logit_bias={"77": 100},
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == ref.tokenizer.decode([77] * 4)


def test_penalties(client, ref):
    prompt = "Hello, my name is"
    pen = dict(presence_penalty=1.2, frequency_penalty=0.5, repetition_penalty=1.3)
    want = offline(ref, [prompt], temperature=0, max_tokens=16, ignore_eos=True, **pen)[0]
    plain = offline(ref, [prompt], temperature=0, max_tokens=16, ignore_eos=True)[0]
    assert want.token_ids != plain.token_ids
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                  presence_penalty=1.2, frequency_penalty=0.5,
                                  extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
    assert r.choices[0].text == want.text


def test_stop_strings(client, ref):
    prompt = "Stop somewhere"
    full = offline(ref, [prompt], temperature=0, max_tokens=24, ignore_eos=True)[0].text
    assert len(full) > 10, full
    stop = full[6:8]
    want = offline(ref, [prompt], temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])[0]
    assert want.finish_reason == "stop" and want.text == full[: full.find(stop)]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True})
    for stops in (stop, [stop, "never appears"]):
        r = client.completions.create(**kw, stop=stops)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (want.text, "stop")
    chunks = list(client.completions.create(**kw, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    # in chat too
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=24, temperature=0, stop=[stop],
                                       extra_body={"ignore_eos": True})
    assert stop not in r.choices[0].message.content


def test_seed_reproducibility(client, ref):
    kw = dict(model=MODEL, prompt="Seeded", max_tokens=16, temperature=1.0,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw, seed=1234).choices[0].text
    assert client.completions.create(**kw, seed=1234).choices[0].text == a
    assert client.completions.create(**kw, seed=4321).choices[0].text != a
    want = offline(ref, ["Seeded"], temperature=1.0, max_tokens=16, ignore_eos=True, seed=1234)
    assert a == want[0].text


def test_n_choices(client, server, ref):
    """n choices a prompt: choice index = prompt index * n + j; choice j of a seeded request
    samples with seed + j; the prompt counts once in usage; streams interleave the choices."""
    prompts = ["Many choices", [7, 8, 9, 10]]
    greedy = offline(ref, prompts, temperature=0, max_tokens=6, ignore_eos=True)
    r = client.completions.create(model=MODEL, prompt=prompts, n=3, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == list(range(6))
    for c in r.choices:
        assert (c.text, c.finish_reason) == (greedy[c.index // 3].text, "length")
    assert r.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in greedy)
    assert r.usage.completion_tokens == 36

    kw = dict(model=MODEL, prompt="Seeded choices", max_tokens=12, temperature=1.0, seed=77,
              extra_body={"ignore_eos": True})
    want = [offline(ref, ["Seeded choices"], temperature=1.0, max_tokens=12, ignore_eos=True,
                    seed=77 + j)[0].text for j in range(4)]
    assert len(set(want)) > 1
    r = client.completions.create(**kw, n=4, best_of=4)
    assert [c.text for c in r.choices] == want
    assert client.completions.create(**kw).choices[0].text == want[0]  # n = 1: choice 0

    events = read_sse(server, C, dict(kw.pop("extra_body"), **kw, n=4, stream=True, echo=True))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 48
    text, reasons = ["" for _ in want], [[] for _ in want]
    for ch in chunks[:-1]:
        (c,) = ch["choices"]
        text[c["index"]] += c["text"]
        reasons[c["index"]].append(c["finish_reason"])
    assert text == ["Seeded choices" + w for w in want]  # echo: each choice's first chunk
    assert all(rs[-1] == "length" and not any(rs[:-1]) for rs in reasons), reasons

    # chat: n choices whole and streamed
    messages = [{"role": "user", "content": "Pick one"}]
    prompt = ref.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = [offline(ref, [prompt], temperature=1.0, max_tokens=8, ignore_eos=True,
                    seed=5 + j)[0].text for j in range(3)]
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 1.0,
            "seed": 5, "n": 3, "ignore_eos": True}
    status, whole = post_json(server, CH, body)
    assert status == 200, whole
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in whole["choices"]] \
        == [(j, w, "length") for j, w in enumerate(want)]
    assert whole["usage"]["prompt_tokens"] == len(ref.tokenizer(prompt)["input_ids"])
    assert whole["usage"]["completion_tokens"] == 24
    events = read_sse(server, CH, dict(body, stream=True))
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"] == whole["usage"]
    content, deltas = ["", "", ""], [[], [], []]
    for ch in chunks[:-1]:
        (c,) = ch["choices"]
        deltas[c["index"]].append((c["delta"], c["finish_reason"]))
        content[c["index"]] += c["delta"].get("content", "")
    assert content == want
    for ds in deltas:  # role first, the finish reason last in a chunk of its own
        assert ds[0] == ({"role": "assistant", "content": ""}, None)
        assert ds[-1] == ({}, "length") and all(f is None for _, f in ds[:-1])


# ---- logprobs ---------------------------------------------------------------------------------

def test_completion_logprobs(client, ref):
    prompt, n = "Logprobs please", 8
    want = offline(ref, [prompt], temperature=0, max_tokens=n, ignore_eos=True, logprobs=3)[0]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    c = r.choices[0]
    lp = c.logprobs
    assert c.text == want.text and r.usage.completion_tokens == n
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(
        lp.text_offset) == n
    if not SPECIAL_IDS & set(want.token_ids):
        assert "".join(lp.tokens) == c.text
    for i in range(n):
        tok, chosen, top = lp.tokens[i], lp.token_logprobs[i], lp.top_logprobs[i]
        w = want.logprobs[i]
        assert chosen <= 0 and chosen == pytest.approx(w.logprob, abs=1e-4)
        assert len(top) == 3, top
        assert max(top.values()) == pytest.approx(chosen, abs=1e-6)  # greedy: the top one
        assert top[tok] == pytest.approx(chosen, abs=1e-6)
        assert all(v <= chosen + 1e-6 for v in top.values())
        assert sorted(top.values(), reverse=True) == pytest.approx([x for _, x in w.top],
                                                                    abs=1e-4)
        if i:
            assert lp.text_offset[i] - lp.text_offset[i - 1] == len(lp.tokens[i - 1])
    # logprobs=0: the chosen token's logprob, no alternatives
    r0 = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                   logprobs=0)
    assert len(r0.choices[0].logprobs.token_logprobs) == 3
    assert all(len(t or {}) <= 1 for t in r0.choices[0].logprobs.top_logprobs)


def test_chat_logprobs(client, ref):
    messages = [{"role": "user", "content": "logprobs"}]
    prompt = ref.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = offline(ref, [prompt], temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    if not SPECIAL_IDS & set(want.token_ids):
        assert "".join(e.token for e in content) == r.choices[0].message.content
    for e, w in zip(content, want.logprobs):
        assert e.logprob <= 0 and e.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert e.bytes == list(e.token.encode("utf-8"))
        assert len(e.top_logprobs) == 2
        first, second = e.top_logprobs
        assert first.logprob >= second.logprob
        assert first.token == e.token and first.logprob == pytest.approx(e.logprob, abs=1e-6)
        assert [t.logprob for t in e.top_logprobs] == pytest.approx([x for _, x in w.top],
                                                                    abs=1e-4)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                       temperature=0, logprobs=True)
    assert [len(e.top_logprobs) for e in r.choices[0].logprobs.content] == [0, 0, 0]


# ---- errors -----------------------------------------------------------------------------------

ERRORS = {
    "malformed_json": (C, b'{"model": "tiny-qwen3", "prompt": ', 400, None),
    "malformed_json_chat": (CH, b"not json", 400, None),
    "temperature_type": (C, comp(temperature="hot"), 400, "temperature"),
    "max_tokens_type": (C, comp(max_tokens="5"), 400, "max_tokens"),
    "messages_type": (CH, chat(messages="hi"), 400, "messages"),
    "prompt_type": (C, comp(prompt=5), 400, "prompt"),
    "stop_type": (C, comp(stop=5), 400, "stop"),
    "stream_type": (C, comp(stream="yes"), 400, "stream"),
    "echo_type": (C, comp(echo="yes"), 400, "echo"),
    "seed_type": (C, comp(seed="1"), 400, "seed"),
    "top_k_type": (C, comp(top_k=1.5), 400, "top_k"),
    "logprobs_type": (C, comp(logprobs=True), 400, "logprobs"),
    "stop_item_type": (C, comp(stop=[1, 2]), 400, "stop"),
    "message_without_content": (CH, chat(messages=[{"role": "user"}]), 400, "messages"),
    "message_content_type": (CH, chat(messages=[{"role": "user", "content": 5}]), 400,
                             "messages"),
    "chat_logprobs_type": (CH, chat(logprobs=3), 400, "logprobs"),
    "temperature_negative": (C, comp(temperature=-1), 400, "temperature"),
    "top_p_zero": (C, comp(top_p=0), 400, "top_p"),
    "n_0": (C, comp(n=0), 400, "n"),
    "n_129": (C, comp(n=129), 400, "n"),
    "n_type": (C, comp(n=1.5), 400, "n"),
    "logprobs_21": (C, comp(logprobs=21), 400, "logprobs"),
    "max_tokens_0": (C, comp(max_tokens=0), 400, "max_tokens"),
    "presence_penalty": (C, comp(presence_penalty=2.5), 400, "presence_penalty"),
    "frequency_penalty": (CH, chat(frequency_penalty="high"), 400, "frequency_penalty"),
    "repetition_penalty": (C, comp(repetition_penalty=0), 400, "repetition_penalty"),
    "best_of": (C, comp(best_of=2), 400, "best_of"),
    "best_of_above_n": (C, comp(n=2, best_of=3), 400, "best_of"),
    "logit_bias_key": (C, comp(logit_bias={"five": 1}), 400, "logit_bias"),
    "logit_bias_value": (C, comp(logit_bias={"5": 101}), 400, "logit_bias"),
    "logit_bias_value_type": (CH, chat(logit_bias={"5": "up"}), 400, "logit_bias"),
    "logit_bias_out_of_vocab": (C, comp(logit_bias={"512": 1}), 400, "logit_bias"),
    "logit_bias_too_many": (C, comp(logit_bias={str(t): 1 for t in range(1025)}), 400,
                            "logit_bias"),
    "suffix": (C, comp(suffix="the end"), 400, "suffix"),
    "chat_n_0": (CH, chat(n=0), 400, "n"),
    "chat_temperature_negative": (CH, chat(temperature=-1), 400, "temperature"),
    "top_logprobs_without_logprobs": (CH, chat(top_logprobs=2), 400, "top_logprobs"),
    "top_logprobs_21": (CH, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    "chat_unknown_role": (CH, chat(messages=[{"role": "robot", "content": "hi"}]), 400,
                          "messages"),
    "prompt_too_long": (C, comp(prompt="a" * (MAX_LEN + 50)), 400, "prompt"),
    "chat_too_long": (CH, chat(messages=[{"role": "user", "content": "a" * (MAX_LEN + 50)}]),
                      400, "messages"),
    "token_id_out_of_vocab": (C, comp(prompt=[5, 6, 512]), 400, "prompt"),
    "token_id_negative": (C, comp(prompt=[-1, 5]), 400, "prompt"),
    "empty_prompt": (C, comp(prompt=""), 400, "prompt"),
    "missing_prompt": (C, {"model": MODEL, "max_tokens": 2}, 400, "prompt"),
    "missing_messages": (CH, {"model": MODEL, "max_tokens": 2}, 400, "messages"),
    "unknown_model": (C, comp(model="gpt-4"), 404, "ANY"),
    "unknown_model_chat": (CH, chat(model="gpt-4"), 404, "ANY"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_and_the_server_still_serves(server, case):
    path, body, want_status, param = ERRORS[case]
    status, resp = post_json(server, path, body)
    err = assert_error(status, resp, want_status, param)
    if want_status == 404:
        assert err["type"] == "invalid_request_error" and err["code"] == "model_not_found"
    else:
        assert err["type"] == "invalid_request_error"
    # still serves, correctly
    status, ok = post_json(server, path, comp(temperature=0) if path == C else chat(temperature=0))
    assert status == 200, ok
    assert ok["usage"]["completion_tokens"] >= 1


def test_unknown_fields_are_ignored_and_nulls_are_defaults(server):
    status, body = post_json(server, C, comp(temperature=0, foo=1, user="u", metadata={"k": 1},
                                             logprobs=None, stop=None, seed=None, top_k=-1))
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length"), body
    status, body = post_json(server, CH, chat(temperature=0, bar=[1, 2], logprobs=False))
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant", body
    # an int where a float is expected is a number, not a wrong type
    status, body = post_json(server, C, comp(temperature=1, top_p=1, min_p=0))
    assert status == 200, body
    # the neutral values SDKs send by default are accepted
    neutral = dict(temperature=0, n=1, presence_penalty=0, frequency_penalty=0, logit_bias={})
    status, body = post_json(server, C, comp(**neutral, best_of=1))
    assert status == 200, body
    status, body = post_json(server, CH, chat(**neutral))
    assert status == 200, body


def test_openai_client_sees_the_errors(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="hi")
    assert e.value.body["code"] == "model_not_found"


def test_a_failure_inside_one_request_is_a_500_for_it_only(ckpt, ref, monkeypatch):
    """In process (the app over an AsyncLLM, FastAPI's TestClient), so that one request's
    detokenization can be made to raise."""
    from fastapi.testclient import TestClient

    from qwen3_model.engine.async_llm import AsyncLLM
    from qwen3_model.engine.detokenizer import Detokenizer
    from qwen3_model.server.app import build_app
    from tests.server_fixtures import parse_prometheus

    engine = AsyncLLM(ckpt, device="cpu", kvcache_block_size=BS, max_model_len=MAX_LEN,
                      num_kvcache_blocks=64)
    try:
        poison_ids = engine.tokenizer("poison pill")["input_ids"]
        real_step = Detokenizer.step

        def step(self, seq, state, want_text):
            if seq.token_ids[: seq.num_prompt_tokens] == poison_ids:
                raise RuntimeError("detokenizer exploded")
            return real_step(self, seq, state, want_text)

        monkeypatch.setattr(Detokenizer, "step", step)
        with TestClient(build_app(engine, MODEL)) as http:  # (in process: bounded by max_tokens)
            r = http.post(C, json=comp(prompt="poison pill", max_tokens=5))
            err = assert_error(r.status_code, r.json(), 500)
            assert err["type"] == "internal_server_error" and "exploded" in err["message"]
            want = offline(ref, ["healthy"], temperature=0, max_tokens=5)[0]
            r = http.post(C, json=comp(prompt="healthy", max_tokens=5, temperature=0))
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.text
            m = parse_prometheus(http.get("/metrics").text)
            assert finished(m, "error") == 1 and metric(m, "qwen3_kv_blocks_used") == 0
    finally:
        engine.shutdown()


# ---- metrics, disconnects ---------------------------------------------------------------------

def test_metrics_move_with_a_request(server, client):
    status, headers, data = request(server, "GET", "/metrics")
    assert status == 200
    ctype = headers["content-type"]
    assert ctype.startswith("text/plain") and "version=0.0.4" in ctype, ctype
    text = data.decode()
    for name, kind in [("qwen3_requests_running", "gauge"), ("qwen3_requests_waiting", "gauge"),
                       ("qwen3_kv_blocks_used", "gauge"), ("qwen3_kv_blocks_total", "gauge"),
                       ("qwen3_time_to_first_token_seconds", "histogram"),
                       ("qwen3_inter_token_latency_seconds", "histogram")]:
        assert f"# TYPE {name} {kind}" in text, name

    before = wait_for(lambda: samples_idle(server), 10, "server idle")
    assert metric(before, "qwen3_kv_blocks_total") == BLOCKS
    r = client.completions.create(model=MODEL, prompt="count me", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = wait_for(lambda: samples_idle(server), 10, "server idle after the request")

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("qwen3_prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("qwen3_generation_tokens_total") == 5
    assert finished(after, "length") - finished(before, "length") == 1
    for reason in ("stop", "abort", "error"):
        assert finished(after, reason) == finished(before, reason), reason
    assert delta("qwen3_time_to_first_token_seconds_count") == 1
    assert delta("qwen3_time_to_first_token_seconds_sum") > 0
    assert 1 <= delta("qwen3_inter_token_latency_seconds_count") <= 4
    for hist in ("qwen3_time_to_first_token_seconds", "qwen3_inter_token_latency_seconds"):
        buckets = sorted(((float(dict(lab)["le"]), v) for (n, lab), v in after.items()
                          if n == f"{hist}_bucket"))
        assert buckets and buckets[-1][0] == float("inf"), hist
        counts = [v for _, v in buckets]
        assert counts == sorted(counts), f"{hist} buckets are not cumulative"
        assert counts[-1] == metric(after, f"{hist}_count")


def test_client_disconnect_mid_stream_aborts(server):
    before = wait_for(lambda: samples_idle(server), 10, "server idle")
    s = SSEStream(server, C, comp(prompt="Disconnect", max_tokens=MAX_LEN - 20, temperature=0,
                                  stream=True, ignore_eos=True))
    try:
        assert s.status == 200
        events = s.events()
        for _ in range(3):
            next(events)
        during = metrics(server)
        assert metric(during, "qwen3_kv_blocks_used") > 0
        assert metric(during, "qwen3_requests_running") == 1
    finally:
        s.close()
    after = wait_for(lambda: samples_idle(server), 8, "blocks freed after the client went away")
    assert finished(after, "abort") - finished(before, "abort") == 1
    assert finished(after, "length") == finished(before, "length")


def test_client_disconnect_mid_request_aborts(server):
    before = wait_for(lambda: samples_idle(server), 10, "server idle")
    body = json.dumps(comp(prompt="Disconnect", max_tokens=MAX_LEN - 20, temperature=0,
                           ignore_eos=True)).encode()
    sock = socket.create_connection((server.host, server.port), timeout=10)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        wait_for(lambda: metric(metrics(server), "qwen3_kv_blocks_used") > 0, 10,
                 "the request running")
    finally:
        sock.close()
    after = wait_for(lambda: samples_idle(server), 8, "blocks freed after the client went away")
    assert finished(after, "abort") - finished(before, "abort") == 1
    assert finished(after, "length") == finished(before, "length")


def test_a_stream_left_before_its_body_starts_is_aborted(ckpt):
    """The client goes away while the SSE response still sends its headers (the ASGI app called
    in process, its first send never returning), so the body's generator never runs: the
    response itself must abort the request (without that it generated its max_tokens for
    nobody and finished "length"), and keep nothing of it for a reader that never comes."""
    import asyncio

    from qwen3_model.engine.async_llm import AsyncLLM
    from qwen3_model.server.app import build_app
    from tests.server_fixtures import parse_prometheus

    engine = AsyncLLM(ckpt, device="cpu", kvcache_block_size=BS, max_model_len=MAX_LEN,
                      num_kvcache_blocks=64)
    try:
        app = build_app(engine, MODEL)
        body = json.dumps(comp(prompt="Leave early", max_tokens=MAX_LEN - 20, temperature=0,
                               stream=True, ignore_eos=True)).encode()
        sent = []

        async def leave_before_the_body():
            messages = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive():
                return messages.pop(0) if messages else {"type": "http.disconnect"}

            async def send(message):
                sent.append(message["type"])
                if message["type"] == "http.response.start":
                    await asyncio.sleep(3600)  # the headers never leave: the body never starts

            scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                     "http_version": "1.1", "method": "POST", "scheme": "http", "path": C,
                     "raw_path": C.encode(), "query_string": b"", "root_path": "",
                     "headers": [(b"content-type", b"application/json"),
                                 (b"content-length", str(len(body)).encode())],
                     "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
            await asyncio.wait_for(app(scope, receive, send), 30)
            # (in this loop: the engine hands the request's last delta, and its count in the
            # metrics, to the loop it was added from)
            for _ in range(200):
                m = parse_prometheus(engine.metrics.render(engine.stats()))
                if finished(m, "abort") + finished(m, "length") > 0:
                    return m
                await asyncio.sleep(0.05)
            raise AssertionError("the request neither aborted nor finished within 10 s")

        m = asyncio.run(leave_before_the_body())
        assert sent == ["http.response.start"]  # a stream, left before any of its body
        assert finished(m, "abort") == 1 and finished(m, "length") == 0
        stats = engine.stats()
        assert stats["running"] == stats["waiting"] == stats["kv_blocks_used"] == 0, stats
        assert not engine._unclaimed  # nobody will read it: nothing kept for a reader
    finally:
        engine.shutdown()


# ---- an overloaded server, SIGTERM ------------------------------------------------------------

SMALL_BLOCKS = 24  # 384 token slots, less than max_model_len: a request can be too big for it


@pytest.fixture(scope="module")
def small_server(ckpt, logs):
    srv = ServerProcess(ckpt, "--block-size", str(BS), "--max-model-len", "512",
                        "--num-kvcache-blocks", str(SMALL_BLOCKS), "--max-num-seqs", "1",
                        "--max-waiting-requests", "1", log_dir=logs, name="small_server")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_overload_gives_503_and_recovers(small_server, ckpt):
    srv = small_server
    status, _, data = request(srv, "GET", "/v1/models")
    assert json.loads(data)["data"][0]["id"] == ckpt  # no --served-model-name: --model as given
    long_req = dict(model=ckpt, prompt="x", max_tokens=350, temperature=0, ignore_eos=True,
                    stream=True)
    before = wait_for(lambda: samples_idle(srv), 10, "server idle")
    running = SSEStream(srv, C, long_req)
    waiting = None
    try:
        assert running.status == 200
        next(running.events())
        waiting = SSEStream(srv, C, long_req)  # max_num_seqs 1: this one waits
        wait_for(lambda: metric(metrics(srv), "qwen3_requests_waiting") == 1, 10,
                 "the second request waiting")
        status, body = post_json(srv, C, dict(long_req, stream=False), timeout=10)
        err = assert_error(status, body, 503)
        assert err["type"] == "server_overloaded" and err["code"] == "server_busy"
        status, body = post_json(srv, CH, {"model": ckpt, "max_tokens": 2,
                                           "messages": [{"role": "user", "content": "hi"}]},
                                 timeout=10)
        assert_error(status, body, 503)
    finally:
        running.close()
        if waiting is not None:
            waiting.close()
    after = wait_for(lambda: samples_idle(srv), 10, "both long requests aborted")
    assert finished(after, "abort") - finished(before, "abort") == 2
    status, body = post_json(srv, C, {"model": ckpt, "prompt": "hi", "max_tokens": 3})
    assert status == 200, body
    # a prompt + max_tokens that can never fit the KV cache
    status, body = post_json(srv, C, {"model": ckpt, "prompt": "hi", "max_tokens": 400})
    assert_error(status, body, 400, "max_tokens")
    # more generations (prompts x n) than the server ever queues: not a retry later
    status, body = post_json(srv, C, {"model": ckpt, "prompt": "hi", "max_tokens": 3, "n": 2})
    assert "queues at most 1" in assert_error(status, body, 400, "n")["message"]


def test_sigterm_drains_then_exits_0(ckpt, logs):
    srv = ServerProcess(ckpt, "--block-size", str(BS), "--max-model-len", "2048",
                        "--num-kvcache-blocks", "160", "--drain-timeout", "3",
                        "--served-model-name", MODEL, log_dir=logs, name="drain_server")
    long_s = short_s = None
    try:
        srv.wait_ready()
        # one that cannot finish within the drain time, one that can
        long_s = SSEStream(srv, C, comp(prompt="long", max_tokens=2000, temperature=0,
                                        stream=True, ignore_eos=True))
        long_events = long_s.events()
        next(long_events)
        short_s = SSEStream(srv, C, comp(prompt="short", max_tokens=40, temperature=0,
                                         stream=True, ignore_eos=True))
        short_events = short_s.events()
        next(short_events)
        t0 = time.monotonic()
        srv.signal(signal.SIGTERM)
        time.sleep(0.3)
        # a new request is refused: 503 while draining, or the listener is closed
        try:
            status, body = post_json(srv, C, comp(), timeout=5)
            assert_error(status, body, 503)
        except (ConnectionError, OSError) as e:
            assert not isinstance(e, TimeoutError), "a request after SIGTERM hung"
        # the short one completes
        rest = [json.loads(e) for e in short_events if e != "[DONE]"]
        reasons = [ch["choices"][0]["finish_reason"] for ch in rest if ch["choices"]]
        assert reasons and reasons[-1] == "length", rest[-3:]
        assert rest[-1]["usage"]["completion_tokens"] == 40
        # the long one ends (aborted at the drain deadline), not at max_tokens
        rest = [json.loads(e) for e in long_events if e != "[DONE]"]
        reasons = [ch["choices"][0]["finish_reason"] for ch in rest if ch["choices"]]
        assert "length" not in reasons
        assert srv.proc.wait(timeout=20) == 0
        assert time.monotonic() - t0 < 20
    finally:
        for s in (long_s, short_s):
            if s is not None:
                s.close()
        srv.stop()
