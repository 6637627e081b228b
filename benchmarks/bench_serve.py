"""Serving benchmark: the OpenAI-compatible server under Poisson arrivals, like `vllm bench serve`.

    cd benchmarks
    python bench_serve.py --size 8B                              # rates 1, 4, 16, inf
    python bench_serve.py --size 8B --workload chat --request-rates 2,8,32,inf
    python bench_serve.py --size 8B --engine-args "--scheduling-policy longest_first \
        --max-num-seqs 176 --max-num-batched-tokens 384"         # engine flags, as the CLI's
    python bench_serve.py --model ~/Qwen3-0.6B                   # a real checkpoint
    python bench_serve.py --url http://127.0.0.1:8000 --model ~/Qwen3-0.6B --no-baseline

One call: (1) in a separate process (the server is not running then: GPU memory), the offline
baselines: ``LLM.generate`` on the saturation run's requests with the same engine flags (output
tok/s), and "prefill alone": ``LLM.generate([p], max_tokens=1)`` one prompt at a time, after a
warm-up, for the prompts of the lowest finite rate's run; (2) ``python -m qwen3_model serve`` as a
subprocess, ready when GET /health answers 200 (or --url: a server already running); (3) per
request rate, requests sent at Poisson arrival times (inf: all at t = 0) as token-id prompts to
/v1/completions with stream=true, max_tokens and ignore_eos.

The client: asyncio streams, HTTP/1.1 with chunked transfer encoding, SSE lines; one connection per
request (connect time counts in TTFT, as a fresh client's would). Per request: TTFT (send -> first
chunk carrying a token), the inter-token latencies (between token chunks; a chunk of k tokens
counts as k gaps of dt / k), end to end, and the tokens from the final chunk's usage.

Workloads (prompts are random token ids in [0, 10000], wrapped into a smaller vocabulary):
  nano-vllm  bench_engine's: prompt lengths and max_tokens uniform in [100, 1024], temperature
             0.6, ignore_eos; seed 0 at saturation is exactly bench_engine's 256 requests.
  chat       shorter, skewed to short turns: prompt lengths log-uniform in [50, 800], max_tokens
             log-uniform in [20, 400] (median ~200 and ~90 tokens).
Each rate draws its own requests (seed + 1 + its position; saturation: seed), so no run finds
another's prompts in the prefix cache. --num-requests defaults to ~32 s of arrivals per rate
(at least 32, at most 256; saturation 256).

Reported per rate: request throughput, output and total tok/s, TTFT and ITL p50 / p90 / p99, end
to end p50, the GPU's clocks and power; then the saturation run's output tok/s over the offline
one's (acceptance >= 0.95) and the lowest rate's TTFT p50 minus the prefill-alone p50
(acceptance <= 15 ms). JSON: results/serve_<size or model>[_<workload>].json (record.py's run
info + one row per rate); python report.py renders RESULTS.md's Serving table and plots/serve.png.

--size writes a config.json at the real shape (bf16) with a character tokenizer to a temp dir and
runs random weights (--load-format dummy): the speed of a trained checkpoint with ignore_eos.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

import record  # noqa: E402

# (prompt length range, max_tokens range, how lengths are drawn in them)
WORKLOADS = {
    "nano-vllm": dict(input_lens=(100, 1024), output_lens=(100, 1024), draw="uniform"),
    "chat": dict(input_lens=(50, 800), output_lens=(20, 400), draw="loguniform"),
}
TEMPERATURE = 0.6  # bench_engine's
TOKEN_ID_RANGE = 10000  # prompt ids in [0, 10000], as nano-vllm's bench
ACCEPT_SATURATION_RATIO = 0.95  # saturation output tok/s / offline LLM.generate's, at least
ACCEPT_TTFT_OVER_PREFILL_MS = 15.0  # TTFT p50 at the lowest rate - prefill alone p50, at most


# ---- workload ---------------------------------------------------------------------------------

def draw_workload(num: int, seed: int, input_lens: tuple[int, int],
                  output_lens: tuple[int, int], draw: str = "uniform",
                  vocab_size: int | None = None):
    """-> (prompts as token-id lists, max_tokens per request). "uniform" draws in nano-vllm's order
    (each prompt's length then its ids, then every max_tokens), so seed 0 with [100, 1024] twice is
    bench_engine's nano_vllm_workload; "loguniform" draws lengths uniform in log space."""
    rng = random.Random(seed)

    def length(lo, hi):
        if draw == "uniform":
            return rng.randint(lo, hi)
        if draw == "loguniform":
            return min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))
        raise ValueError(f"unknown length distribution {draw!r}; expected uniform or loguniform")

    prompts = [[rng.randint(0, TOKEN_ID_RANGE) for _ in range(length(*input_lens))]
               for _ in range(num)]
    max_tokens = [length(*output_lens) for _ in range(num)]
    if vocab_size is not None and vocab_size <= TOKEN_ID_RANGE:  # a tiny vocabulary: wrap
        prompts = [[t % vocab_size for t in p] for p in prompts]
    return prompts, max_tokens


def arrival_offsets(num: int, rate: float, seed: int) -> list[float]:
    """Seconds after the run's start at which each request is sent: a Poisson process of ``rate``
    requests/s (exponential gaps, the first request at its first gap); inf -> all at 0."""
    if math.isinf(rate):
        return [0.0] * num
    if rate <= 0:
        raise ValueError(f"request rate must be > 0 or inf, got {rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--request-rates takes numbers or inf separated by commas, got {text!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"--request-rates: rates must be > 0 (or inf), got "
                                         f"{text!r}")
    return rates


def default_num_requests(rate: float, cap: int = 256) -> int:
    """~32 s of arrivals, at least 32 requests, at most ``cap`` (saturation: ``cap``)."""
    return cap if math.isinf(rate) else max(32, min(cap, round(32 * rate)))


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


# ---- HTTP / SSE parsing -------------------------------------------------------------------------

class ChunkedDecoder:
    """HTTP/1.1 chunked transfer encoding, fed bytes as they come: ``feed`` returns the body bytes
    they complete (a chunk's data is passed on as soon as it arrives, not when the chunk ends);
    ``done`` once the zero-size chunk is seen."""

    def __init__(self):
        self._buf = b""
        self._left = 0  # data bytes of the current chunk still to come
        self._crlf = False  # the CRLF after a chunk's data is still to come
        self.done = False

    def feed(self, data: bytes) -> bytes:
        buf = self._buf + data if self._buf else data
        out = []
        i, n = 0, len(buf)
        while i < n and not self.done:
            if self._left:
                take = min(self._left, n - i)
                out.append(buf[i:i + take])
                i += take
                self._left -= take
                if not self._left:
                    self._crlf = True
                continue
            if self._crlf:
                if n - i < 2:
                    break
                if buf[i:i + 2] != b"\r\n":
                    raise ValueError(f"chunked body: expected CRLF after a chunk, got "
                                     f"{bytes(buf[i:i + 2])!r}")
                i += 2
                self._crlf = False
                continue
            end = buf.find(b"\r\n", i)
            if end < 0:
                break
            line = buf[i:end].split(b";", 1)[0].strip()
            try:
                size = int(line, 16)
            except ValueError:
                raise ValueError(f"chunked body: expected a hex chunk size, got {line!r}") from None
            i = end + 2
            if size == 0:
                self.done = True  # trailers (if any) are not read
            else:
                self._left = size
        self._buf = buf[i:] if not self.done else b""
        return b"".join(out)


class SseParser:
    """Server-sent events: ``feed`` bytes, get the data payloads of the events they complete (an
    event's data lines joined by newlines; events without data are skipped)."""

    def __init__(self):
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf + data
        if b"\r" in buf:  # CRLF line ends (a CR at the end waits for its LF in the next feed)
            buf = buf.replace(b"\r\n", b"\n")
        *events, rest = buf.split(b"\n\n")
        self._buf = rest
        out = []
        for event in events:
            lines = [line[5:].lstrip(b" ") for line in event.split(b"\n")
                     if line.startswith(b"data:")]
            if lines:
                out.append(b"\n".join(lines))
        return out


def chunk_tokens(choice: dict) -> int:
    """Tokens a completion chunk's choice carries: its logprobs' token list when the server sent
    one, else one (the server sends a chunk per engine step that gave the request a token, its
    text possibly empty while the detokenizer holds bytes back)."""
    lp = choice.get("logprobs")
    if isinstance(lp, dict) and isinstance(lp.get("tokens"), list):
        return len(lp["tokens"])
    return 1


def token_latencies(t_send: float, stamps: list[tuple[float, int]]):
    """(arrival time, tokens) per token chunk -> (TTFT s, inter-token latencies s). TTFT: the
    first chunk's arrival - t_send; each later chunk of k tokens, dt after the one before, adds k
    gaps of dt / k (the extra tokens of the first chunk add none)."""
    if not stamps:
        return None, []
    ttft = stamps[0][0] - t_send
    itl = []
    prev = stamps[0][0]
    for t, k in stamps[1:]:
        if k > 0:
            itl.extend([(t - prev) / k] * k)
            prev = t
    return ttft, itl


def percentile(values, q: float) -> float | None:
    """The q-th percentile (0..100), linear between the closest ranks (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# ---- client -------------------------------------------------------------------------------------

@dataclass
class RequestResult:
    prompt_len: int
    max_tokens: int
    ok: bool = False
    error: str = ""
    ttft: float | None = None  # s
    itl: list[float] = field(default_factory=list)  # s
    e2e: float | None = None  # s
    end: float | None = None  # perf_counter when the stream ended
    output_tokens: int = 0  # usage.completion_tokens
    prompt_tokens: int = 0  # usage.prompt_tokens
    chunk_tokens: int = 0  # the tokens counted chunk by chunk (chunk_tokens)


async def _read_head(reader) -> tuple[int, dict[str, str]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/"):
        raise ValueError(f"expected an HTTP status line, got {lines[0]!r}")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return int(parts[1]), headers


async def _read_body(reader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        dec, out = ChunkedDecoder(), []
        while not dec.done:
            data = await reader.read(1 << 16)
            if not data:
                break
            out.append(dec.feed(data))
        return b"".join(out)
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    return await reader.read()


def http_request(host: str, port: int, method: str, path: str, body: bytes = b"") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json"
            f"\r\nAccept: text/event-stream\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode() + body


async def stream_completion(host: str, port: int, body: bytes, result: RequestResult,
                            path: str = "/v1/completions") -> RequestResult:
    """POST one streaming completion; fills ``result`` (timings, tokens, or the error)."""
    stamps: list[tuple[float, int]] = []
    usage = None
    t_send = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 20)
    try:
        writer.write(http_request(host, port, "POST", path, body))
        await writer.drain()
        status, headers = await _read_head(reader)
        if status != 200:
            text = (await _read_body(reader, headers)).decode("utf-8", "replace")
            try:
                text = json.loads(text)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            result.error = f"HTTP {status}: {text[:300]}"
            return result
        chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        dec, sse, finished = ChunkedDecoder() if chunked else None, SseParser(), False
        while not finished:
            data = await reader.read(1 << 16)
            now = time.perf_counter()
            if not data:
                break
            for payload in sse.feed(dec.feed(data) if dec else data):
                if payload == b"[DONE]":
                    finished = True
                    break
                obj = json.loads(payload)
                if "error" in obj:
                    result.error = f"stream error: {obj['error']}"[:300]
                    return result
                choices = obj.get("choices")
                if choices:
                    k = chunk_tokens(choices[0])
                    if k:
                        stamps.append((now, k))
                if obj.get("usage"):
                    usage = obj["usage"]
            if dec is not None and dec.done:
                break
        result.end = time.perf_counter()
    finally:
        writer.close()
    if not finished:
        result.error = "the stream ended before data: [DONE]"
        return result
    if usage is None:
        result.error = "no usage in the stream's last chunk"
        return result
    result.ttft, result.itl = token_latencies(t_send, stamps)
    result.e2e = result.end - t_send
    result.output_tokens = int(usage.get("completion_tokens", 0))
    result.prompt_tokens = int(usage.get("prompt_tokens", 0))
    result.chunk_tokens = sum(k for _, k in stamps)
    result.ok = result.ttft is not None
    if not result.ok:
        result.error = "no token chunk in the stream"
    return result


def completion_body(model: str, prompt: list[int], max_tokens: int) -> bytes:
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": TEMPERATURE, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}},
                      separators=(",", ":")).encode()


async def run_rate(host: str, port: int, model: str, prompts, max_tokens, offsets,
                   timeout_s: float) -> tuple[list[RequestResult], float]:
    """Sends request i at offsets[i] s after the start; -> (results, seconds from the start to the
    last stream's end). Every request is bounded by ``timeout_s``."""
    bodies = [completion_body(model, p, m) for p, m in zip(prompts, max_tokens)]
    results = [RequestResult(len(p), m) for p, m in zip(prompts, max_tokens)]

    async def one(i):
        try:
            await asyncio.wait_for(stream_completion(host, port, bodies[i], results[i]),
                                   timeout_s)
        except asyncio.TimeoutError:
            results[i].error = f"no complete stream within {timeout_s:g} s"
        except (OSError, ValueError, asyncio.IncompleteReadError,
                asyncio.LimitOverrunError) as e:
            results[i].error = f"{type(e).__name__}: {e}"[:300]

    start = time.perf_counter()
    tasks = []
    for i, off in enumerate(offsets):
        delay = start + off - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    ends = [r.end for r in results if r.end is not None]
    return results, (max(ends) if ends else time.perf_counter()) - start


def summarize(rate: float, results: list[RequestResult], seconds: float) -> dict:
    """One rate's row: counts, throughput, latency percentiles (ms)."""
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)
    ttft = [r.ttft * 1e3 for r in ok]
    itl = [x * 1e3 for r in ok for x in r.itl]
    e2e = [r.e2e * 1e3 for r in ok]
    tpot = [(r.e2e - r.ttft) * 1e3 / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]

    def pcts(xs):
        return {f"p{q}": percentile(xs, q) for q in (50, 90, 99)}

    errors = [r.error for r in results if not r.ok]
    return dict(
        request_rate=None if math.isinf(rate) else rate, rate=rate_label(rate),
        num_requests=len(results), completed=len(ok), failed=len(results) - len(ok),
        errors=sorted(set(errors))[:5], duration_s=seconds,
        request_throughput=len(ok) / seconds if seconds > 0 else None,
        output_tok_s=out_tok / seconds if seconds > 0 else None,
        total_tok_s=(in_tok + out_tok) / seconds if seconds > 0 else None,
        prompt_tokens=in_tok, output_tokens=out_tok,
        requested_output_tokens=sum(r.max_tokens for r in results),
        all_max_tokens=len(ok) == len(results) and all(r.output_tokens == r.max_tokens
                                                       for r in ok),
        chunk_tokens=sum(r.chunk_tokens for r in ok),
        ttft_ms=pcts(ttft), itl_ms=pcts(itl), e2e_ms=pcts(e2e), tpot_ms=pcts(tpot))


def _ms(x) -> str:
    return "" if x is None else f"{x:,.1f}"


def _f0(x) -> str:
    return "" if x is None else f"{x:.0f}"


def print_table(rows: list[dict]) -> None:
    print("| rate (req/s) | requests | ok | req/s | output tok/s | total tok/s | TTFT p50 / p90 / "
          "p99 (ms) | ITL p50 / p90 / p99 (ms) | e2e p50 (ms) | SM MHz | power W |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c = r.get("clocks") or {}
        t, i = r["ttft_ms"], r["itl_ms"]
        print(f"| {r['rate']} | {r['num_requests']} | {r['completed']} | "
              f"{_ms(r['request_throughput'])} | {_ms(r['output_tok_s'])} | "
              f"{_ms(r['total_tok_s'])} | {_ms(t['p50'])} / {_ms(t['p90'])} / {_ms(t['p99'])} | "
              f"{_ms(i['p50'])} / {_ms(i['p90'])} / {_ms(i['p99'])} | {_ms(r['e2e_ms']['p50'])} "
              f"| {_f0(c.get('sm_mhz_median'))} | {_f0(c.get('power_w_median'))} |")
        for e in r["errors"]:
            print(f"    failed: {e}")


# ---- GPU clocks, server side -------------------------------------------------------------------

def server_gpu_clocks(enabled: bool = True):
    """bench_engine's GpuClocks, on the server's GPU (CUDA_VISIBLE_DEVICES' first, else 0), found
    through nvidia-smi: this client process never touches CUDA. Nothing sampled without
    nvidia-smi."""
    from bench_engine import GpuClocks

    class ServerGpuClocks(GpuClocks):
        def __enter__(self):
            if not (self.enabled and shutil.which("nvidia-smi")):
                return self
            dev = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
            try:
                out = subprocess.run(["nvidia-smi", "-i", dev, "--query-gpu=uuid",
                                      "--format=csv,noheader"], capture_output=True, text=True,
                                     timeout=10)
            except (OSError, subprocess.SubprocessError):
                return self
            if out.returncode != 0 or not out.stdout.strip().startswith("GPU-"):
                return self
            self.uuid = out.stdout.strip().splitlines()[0]
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
            return self

    return ServerGpuClocks(enabled=enabled)


# ---- server process ----------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_healthy(url: str, proc, timeout_s: float, log_path: Path | None) -> float:
    """Polls GET /health until 200 -> seconds waited; fails when the server exits or the time is
    up (with the tail of its log)."""
    start = time.perf_counter()
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready"
                               + log_tail(log_path))
        try:
            if http_get(url + "/health", timeout=2.0)[0] == 200:
                return time.perf_counter() - start
        except (OSError, urllib.error.URLError):
            pass
        if time.perf_counter() - start > timeout_s:
            raise RuntimeError(f"the server at {url} was not healthy within {timeout_s:g} s"
                               + log_tail(log_path))
        time.sleep(0.5)


def log_tail(path: Path | None, lines: int = 40) -> str:
    if path is None or not path.exists():
        return ""
    tail = path.read_text(errors="replace").splitlines()[-lines:]
    return f"; the last lines of its log {path}:\n" + "\n".join(tail)


def start_server(model: str, port: int, dummy: bool, engine_args: list[str],
                 server_args: list[str], max_waiting: int, log_path: Path):
    cmd = [sys.executable, "-m", "qwen3_model", "serve", "--model", model, "--host",
           "127.0.0.1", "--port", str(port)]
    # every request of a saturation run may wait at once: never a 503 for that (the server's
    # default, 1024, is kept when it is larger)
    cmd += ["--max-waiting-requests", str(max(max_waiting, 1024))]
    if dummy:
        cmd += ["--load-format", "dummy"]
    cmd += engine_args + server_args
    print(f"server: {shlex.join(cmd)} (log: {log_path})", flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    log = open(log_path, "w")
    try:
        # its own process group: a stop that has to kill takes its workers with it
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        log.close()


def stop_server(proc, timeout_s: float = 60.0) -> None:
    """SIGTERM (the server drains, then exits), SIGKILL to its process group past ``timeout_s``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


# ---- offline baselines (a process of their own) -------------------------------------------------

def offline_worker(spec_path: str, out_path: str) -> None:
    """The offline baselines, in the process that runs this (python bench_serve.py
    --offline-worker SPEC OUT): the engine as the generate CLI's flags build it (the "auto"
    scheduling policy as fcfs, the server's); prefill alone on
    spec["prefill_prompts"], then one LLM.generate of spec["prompts"] / spec["max_tokens"]."""
    from bench_engine import GpuClocks, free_gpu, sync
    from qwen3_model.__main__ import build_parser
    from qwen3_model.command import engine_kwargs
    from qwen3_model.llm import LLM
    from qwen3_model.sampling_params import SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    cli = build_parser().parse_args(["--model", spec["model"], *spec["engine_args"]])
    kw = engine_kwargs(cli)
    if spec["dummy"]:
        kw["load_format"] = "dummy"
    if kw.get("scheduling_policy") == "auto":
        # the server's schedule ("auto" serves fcfs; offline it may not): the baseline then
        # measures what serving costs, not another schedule
        kw["scheduling_policy"] = "fcfs"
    start = time.perf_counter()
    llm = LLM(spec["model"], **kw)
    out = dict(engine_ready_s=time.perf_counter() - start)
    vocab = llm.config.hf_config.vocab_size
    rng = random.Random(12345)

    if spec["prefill_prompts"]:
        one = SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=1)
        for n in map(len, spec["prefill_prompts"][:3]):  # warm-up: prompts seen nowhere else
            warm = [rng.randrange(min(vocab, TOKEN_ID_RANGE)) for _ in range(n)]
            llm.generate([warm], one, use_tqdm=False)
        times = []
        for p in spec["prefill_prompts"]:
            sync()
            t0 = time.perf_counter()
            llm.generate([p], one, use_tqdm=False)
            times.append((time.perf_counter() - t0) * 1e3)
        out.update(prefill_alone_ms=dict(p50=percentile(times, 50), p90=percentile(times, 90)),
                   prefill_alone_n=len(times))
        print(f"offline: prefill alone, {len(times)} prompts one at a time (max_tokens=1): p50 "
              f"{out['prefill_alone_ms']['p50']:.2f} ms", flush=True)

    if spec["prompts"]:
        llm.generate([[1, 2, 3, 4] * 8], SamplingParams(max_tokens=16), use_tqdm=False)
        params = [SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=m)
                  for m in spec["max_tokens"]]
        with GpuClocks(enabled=spec["gpu_clocks"]) as clocks:
            sync()
            t0 = time.perf_counter()
            outs = llm.generate(spec["prompts"], params, use_tqdm=False)
            seconds = time.perf_counter() - t0
        n_out = sum(len(o.token_ids) for o in outs)
        out.update(output_tok_s=n_out / seconds, seconds=seconds, output_tokens=n_out,
                   num_requests=len(outs), clocks=clocks.summary())
        print(f"offline: LLM.generate, {len(outs)} requests: {seconds:.2f} s, "
              f"{n_out / seconds:,.0f} output tok/s", flush=True)
        if clocks.samples:
            print(clocks.describe(), flush=True)
    llm.close()
    del llm
    free_gpu()
    Path(out_path).write_text(json.dumps(out))


def run_offline(spec: dict, tmp: Path, timeout_s: float) -> dict:
    spec_path, out_path = tmp / "offline_spec.json", tmp / "offline_out.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--offline-worker", str(spec_path),
           str(out_path)]
    try:
        proc = subprocess.run(cmd, cwd=HERE, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the offline baseline took more than {timeout_s:g} s") from None
    if proc.returncode != 0 or not out_path.exists():
        raise RuntimeError(f"the offline baseline failed (exit {proc.returncode}): "
                           f"{shlex.join(cmd)}")
    return json.loads(out_path.read_text())


# ---- main ---------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    from qwen3_model.random_checkpoint import QWEN3_SIZES

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--size", choices=sorted(QWEN3_SIZES) + ["demo"], default=None,
                     help="random-weight Qwen3 at this real shape (default 8B; demo: a tiny one "
                          "with weights, for a CPU run)")
    src.add_argument("--model", help="a checkpoint folder instead of --size (with --url: the "
                                     "served one, for its vocabulary size)")
    p.add_argument("--url", help="a running server (http://host:port) instead of starting one; "
                                 "the offline baseline then needs --no-baseline or a free GPU")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="nano-vllm")
    p.add_argument("--request-rates", type=parse_rates, default=parse_rates("1,4,16,inf"),
                   help="requests/s, comma-separated; inf = all at t = 0 (saturation)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per rate (default: ~32 s of arrivals, 32..256; inf: 256)")
    p.add_argument("--input-lens", type=int, nargs=2, metavar=("MIN", "MAX"),
                   help="prompt lengths (default: the workload's)")
    p.add_argument("--output-lens", type=int, nargs=2, metavar=("MIN", "MAX"),
                   help="max_tokens range (default: the workload's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-args", default="",
                   help="engine flags for the server and the offline baseline, as the generate "
                        "CLI takes them (e.g. \"--max-num-seqs 176 --device cpu\")")
    p.add_argument("--server-args", default="", help="further flags for the server only")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the offline baselines (LLM.generate, prefill alone)")
    p.add_argument("--server-timeout", type=float, default=900.0,
                   help="seconds the server may take to become healthy")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds one request may take")
    p.add_argument("--offline-timeout", type=float, default=1200.0)
    p.add_argument("--server-log", type=Path, default=None,
                   help="the server's output (default: a temp file, its tail shown on failure)")
    p.add_argument("--tag", help="results file serve_<tag>.json (default: size or model folder, "
                                 "+ _<workload> unless nano-vllm)")
    p.add_argument("--no-gpu-clocks", action="store_true")
    p.add_argument("--allow-reference", action="store_true",
                   help="run on a CUDA device even when the qwen3_kernels extension is not loaded")
    p.add_argument("--results-dir", default=None,
                   help="where results/serve_<tag>.json goes (default: benchmarks/results)")
    p.add_argument("--offline-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    return p


def main(argv=None) -> dict:
    p = build_parser()
    args = p.parse_args(argv)
    if args.offline_worker:
        offline_worker(*args.offline_worker)
        return {}
    if args.url and not args.model and not args.no_baseline:
        p.error("--url with the baseline needs --model (the checkpoint the server runs)")
    engine_args, server_args = shlex.split(args.engine_args), shlex.split(args.server_args)
    from qwen3_model.__main__ import build_parser as generate_parser

    try:  # the engine flags, checked before any engine loads
        device = generate_parser().parse_args(["--model", "x", *engine_args]).device
    except SystemExit:
        p.error(f"--engine-args: not the generate CLI's engine flags: {args.engine_args!r}")
    if not args.url and device != "cpu":
        import torch

        if torch.cuda.is_available():
            import qwen3_kernels

            if not qwen3_kernels.has_cuda_kernels() and not args.allow_reference:
                # the reference path on a GPU says nothing about this engine (bench_engine's rule)
                p.error("the qwen3_kernels CUDA extension is not loaded "
                        f"({qwen3_kernels.cuda_kernels_import_error()}); build it "
                        "(pip install --no-build-isolation -e .) or pass --allow-reference")
    wl = WORKLOADS[args.workload]
    input_lens = tuple(args.input_lens or wl["input_lens"])
    output_lens = tuple(args.output_lens or wl["output_lens"])
    for name, (lo, hi) in (("--input-lens", input_lens), ("--output-lens", output_lens)):
        if not 1 <= lo <= hi:
            p.error(f"{name}: expected 1 <= MIN <= MAX, got {lo} {hi}")
    rates = args.request_rates
    size = None if args.model else (args.size or "8B")

    with tempfile.TemporaryDirectory(prefix="qwen3-serve-bench-") as tmp_s:
        tmp = Path(tmp_s)
        if args.model:
            model, dummy, name = args.model, False, Path(args.model).name
        else:
            import torch

            from qwen3_model.random_checkpoint import write_random_checkpoint

            model = str(tmp / f"Qwen3-{size}")
            if size == "demo":
                write_random_checkpoint(model, "demo")
                dummy, name = False, "Qwen3-demo (random weights)"
            else:
                write_random_checkpoint(model, size, dtype=torch.bfloat16, weights=False)
                dummy, name = True, f"Qwen3-{size} (random weights)"
        vocab = None
        cfg_path = Path(model).expanduser() / "config.json"
        if cfg_path.exists():
            vocab = json.loads(cfg_path.read_text()).get("vocab_size")

        # each rate its own requests (saturation: the seed's, the offline baseline's too)
        runs = []
        for i, rate in enumerate(rates):
            n = args.num_requests or default_num_requests(rate)
            seed = args.seed if math.isinf(rate) else args.seed + 1 + i
            prompts, max_tokens = draw_workload(n, seed, input_lens, output_lens, wl["draw"],
                                                vocab)
            runs.append(dict(rate=rate, seed=seed, prompts=prompts, max_tokens=max_tokens,
                             offsets=arrival_offsets(n, rate, seed + 7919)))
        sat = next((r for r in runs if math.isinf(r["rate"])), None)
        low = min((r for r in runs if not math.isinf(r["rate"])), key=lambda r: r["rate"],
                  default=None)

        offline = None
        if not args.no_baseline:
            spec = dict(model=model, dummy=dummy, engine_args=engine_args,
                        gpu_clocks=not args.no_gpu_clocks,
                        prompts=sat["prompts"] if sat else [],
                        max_tokens=sat["max_tokens"] if sat else [],
                        prefill_prompts=low["prompts"] if low else [])
            offline = run_offline(spec, tmp, args.offline_timeout)

        proc = None
        log_path = args.server_log or tmp / "server.log"
        # a SIGTERM (e.g. from `timeout`) unwinds through the finally below: the server goes too
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        try:
            if args.url:
                url = args.url.rstrip("/")
                wait_healthy(url, None, args.server_timeout, None)
            else:
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                proc = start_server(model, port, dummy, engine_args, server_args,
                                    max(len(r["prompts"]) for r in runs), log_path)
                waited = wait_healthy(url, proc, args.server_timeout, log_path)
                print(f"server healthy after {waited:.1f} s", flush=True)
            host_port = url.split("://", 1)[-1].split("/", 1)[0]
            host, port = host_port.rsplit(":", 1)
            served = json.loads(http_get(url + "/v1/models", timeout=10)[1])["data"][0]["id"]
            rows = asyncio.run(run_all(host, int(port), served, runs, vocab, args))
        finally:
            if proc is not None:
                stop_server(proc)

    doc = dict(model=name, size=size, workload=args.workload,
               workload_lens=dict(input=list(input_lens), output=list(output_lens),
                                  draw=wl["draw"]),
               engine_args=args.engine_args, server_args=args.server_args, seed=args.seed,
               temperature=TEMPERATURE, rows=rows, offline=offline)
    print(f"\n{name}, {args.workload} workload (prompts {input_lens[0]}..{input_lens[1]}, "
          f"max_tokens {output_lens[0]}..{output_lens[1]}, {wl['draw']}), engine args "
          f"{args.engine_args or '(defaults)'}:")
    print_table(rows)
    doc.update(compare(rows, offline))
    for line in compare_lines(doc):
        print(line)
    tag = args.tag or ((size or Path(model).name)
                       + ("" if args.workload == "nano-vllm" else f"_{args.workload}"))
    info = record.run_info(["bench_serve.py", *(sys.argv[1:] if argv is None else argv)])
    path = record.results_path(f"serve_{tag}", args.results_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"bench": f"serve_{tag}", **info, **doc}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"  -> {path}")
    return doc


async def run_all(host, port, model, runs, vocab, args) -> list[dict]:
    # warm-up: a few short requests of prompts no run uses
    rng = random.Random(args.seed + 104729)
    warm = [[rng.randrange(min(vocab or TOKEN_ID_RANGE, TOKEN_ID_RANGE)) for _ in range(64)]
            for _ in range(4)]
    res, _ = await run_rate(host, port, model, warm, [8] * 4, [0.0] * 4, args.request_timeout)
    if not all(r.ok for r in res):
        raise RuntimeError(f"warm-up requests failed: {[r.error for r in res if not r.ok]}")
    rows = []
    for run in runs:
        print(f"rate {rate_label(run['rate'])} req/s: {len(run['prompts'])} requests", flush=True)
        with server_gpu_clocks(not args.no_gpu_clocks) as clocks:
            results, seconds = await run_rate(host, port, model, run["prompts"],
                                              run["max_tokens"], run["offsets"],
                                              args.request_timeout)
        row = summarize(run["rate"], results, seconds)
        row.update(seed=run["seed"], clocks=clocks.summary())
        rows.append(row)
        if clocks.samples:
            print(clocks.describe(), flush=True)
    return rows


def compare(rows: list[dict], offline: dict | None) -> dict:
    """The two acceptance figures: saturation / offline output tok/s, and the lowest rate's TTFT
    p50 over prefill alone."""
    sat = next((r for r in rows if r["request_rate"] is None), None)
    finite = [r for r in rows if r["request_rate"] is not None]
    low = min(finite, key=lambda r: r["request_rate"]) if finite else None
    out = dict(saturation_vs_offline=None, ttft_over_prefill_ms=None,
               low_rate=low["rate"] if low else None)
    if offline and sat and offline.get("output_tok_s") and sat["output_tok_s"]:
        out["saturation_vs_offline"] = sat["output_tok_s"] / offline["output_tok_s"]
    if offline and low and offline.get("prefill_alone_ms") and low["ttft_ms"]["p50"] is not None:
        out["ttft_over_prefill_ms"] = low["ttft_ms"]["p50"] - offline["prefill_alone_ms"]["p50"]
    out["acceptance"] = {
        f"saturation_vs_offline >= {ACCEPT_SATURATION_RATIO}":
            None if out["saturation_vs_offline"] is None
            else out["saturation_vs_offline"] >= ACCEPT_SATURATION_RATIO,
        f"ttft_over_prefill_ms <= {ACCEPT_TTFT_OVER_PREFILL_MS:g}":
            None if out["ttft_over_prefill_ms"] is None
            else out["ttft_over_prefill_ms"] <= ACCEPT_TTFT_OVER_PREFILL_MS}
    return out


def compare_lines(doc: dict) -> list[str]:
    off, lines = doc.get("offline") or {}, []
    if doc["saturation_vs_offline"] is not None:
        lines.append(f"  offline LLM.generate on the saturation requests: "
                     f"{off['output_tok_s']:,.0f} output tok/s; server at saturation / offline = "
                     f"{doc['saturation_vs_offline']:.3f} (acceptance >= "
                     f"{ACCEPT_SATURATION_RATIO})")
        if (off.get("clocks") or {}).get("sm_mhz_median"):
            c = off["clocks"]
            lines.append(f"    offline run's GPU: SM median {c['sm_mhz_median']:.0f} MHz, power "
                         f"median {c['power_w_median']:.0f} W")
    if doc["ttft_over_prefill_ms"] is not None:
        lines.append(f"  prefill alone (LLM.generate, max_tokens=1, the {doc['low_rate']} req/s "
                     f"prompts) p50 {off['prefill_alone_ms']['p50']:.2f} ms; TTFT p50 at "
                     f"{doc['low_rate']} req/s minus it = {doc['ttft_over_prefill_ms']:.2f} ms "
                     f"(acceptance <= {ACCEPT_TTFT_OVER_PREFILL_MS:g})")
    return lines


if __name__ == "__main__":
    main()
