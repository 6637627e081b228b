"""benchmarks/bench_serve.py on CPU: the HTTP chunked / SSE parsing and the latency math, the
client against a scripted streaming server, the workloads and arrivals, and the whole benchmark
end to end (server subprocess, offline baseline, JSON, report.py's Serving table) on the demo
checkpoint."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import random
import sys
import time
from pathlib import Path

import pytest

from tests.test_bench_engine import _benchmark_module


@pytest.fixture(scope="module")
def bench():
    """benchmarks/bench_serve.py as a module, registered in sys.modules (its dataclass needs it)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_serve.py"
    spec = importlib.util.spec_from_file_location("bench_serve_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


# ---- parsing and math ---------------------------------------------------------------------------

def _chunked(parts: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def _sse(objs) -> list[bytes]:
    return [b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n\n"
            for o in objs]


def test_chunked_and_sse_survive_any_split(bench):
    """The same events come out however the bytes are cut (in a size line, a CRLF, a payload)."""
    objs = [{"choices": [{"text": f"t{i}\n", "finish_reason": None}]} for i in range(20)]
    objs.append({"choices": [], "usage": {"completion_tokens": 20}})
    events = _sse(objs) + [b"data: [DONE]\n\n"]
    # several events in one HTTP chunk, one event over two chunks, CRLF line ends in one event
    parts = [events[0] + events[1], events[2][:7], events[2][7:]]
    parts += [e.replace(b"\n", b"\r\n") if i == 3 else e for i, e in enumerate(events[3:], 3)]
    wire = _chunked(parts)
    want = [e[6:-2] for e in events]
    rng = random.Random(0)
    for trial in range(200):
        cuts = sorted(rng.sample(range(1, len(wire)), rng.randint(1, 40))) if trial else []
        pieces = [wire[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire)])]
        dec, sse, got = bench.ChunkedDecoder(), bench.SseParser(), []
        for piece in pieces:
            got += sse.feed(dec.feed(piece))
        assert dec.done
        assert got == want


def test_chunked_rejects_garbage(bench):
    with pytest.raises(ValueError, match="hex chunk size"):
        bench.ChunkedDecoder().feed(b"zz\r\nabc\r\n")
    with pytest.raises(ValueError, match="CRLF after a chunk"):
        bench.ChunkedDecoder().feed(b"3\r\nabcXY")


def test_sse_skips_comments_and_joins_data_lines(bench):
    sse = bench.SseParser()
    assert sse.feed(b": ping\n\nevent: x\ndata: a\ndata: b\n\ndata:c\n\nda") == [b"a\nb", b"c"]
    assert sse.feed(b"ta: d\n\n") == [b"d"]


def test_chunk_tokens(bench):
    assert bench.chunk_tokens({"text": "ab", "finish_reason": None}) == 1
    assert bench.chunk_tokens({"text": "", "finish_reason": None}) == 1  # text held back
    assert bench.chunk_tokens({"text": "", "finish_reason": "length"}) == 1  # e.g. a special
    assert bench.chunk_tokens({"text": "x", "finish_reason": "length"}) == 1
    assert bench.chunk_tokens({"text": "xyz", "logprobs": {"tokens": ["x", "y", "z"]}}) == 3


def test_token_latencies_split_multi_token_chunks(bench):
    ttft, itl = bench.token_latencies(10.0, [(10.5, 2), (10.6, 1), (10.9, 3), (11.0, 1)])
    assert ttft == pytest.approx(0.5)
    assert itl == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.1])  # 0.3 s over 3 tokens: 3 gaps of 0.1
    assert bench.token_latencies(1.0, []) == (None, [])


def test_percentile_is_numpy_linear(bench):
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert bench.percentile(xs, 50) == 3.0
    assert bench.percentile(xs, 90) == pytest.approx(4.6)
    assert bench.percentile(xs, 99) == pytest.approx(4.96)
    assert bench.percentile([7.0], 99) == 7.0 and bench.percentile([], 50) is None


def test_summarize_counts_and_orders(bench):
    rs = []
    for i in range(10):
        r = bench.RequestResult(prompt_len=100, max_tokens=5, ok=True, ttft=0.01 * (i + 1),
                                itl=[0.002] * 4, e2e=0.05 + 0.01 * i, end=1.0, output_tokens=5,
                                prompt_tokens=100, chunk_tokens=5)
        rs.append(r)
    rs.append(bench.RequestResult(prompt_len=100, max_tokens=5, error="HTTP 503: busy"))
    row = bench.summarize(4.0, rs, 2.0)
    assert (row["num_requests"], row["completed"], row["failed"]) == (11, 10, 1)
    assert row["errors"] == ["HTTP 503: busy"] and row["all_max_tokens"] is False
    assert row["request_throughput"] == 5.0 and row["output_tok_s"] == 25.0
    assert row["total_tok_s"] == 525.0 and row["rate"] == "4" and row["request_rate"] == 4.0
    assert row["ttft_ms"]["p50"] == pytest.approx(55.0)
    assert row["ttft_ms"]["p50"] <= row["ttft_ms"]["p90"] <= row["ttft_ms"]["p99"]
    assert row["itl_ms"]["p50"] == pytest.approx(2.0)
    sat = bench.summarize(math.inf, rs[:10], 1.0)
    assert sat["rate"] == "inf" and sat["request_rate"] is None and sat["all_max_tokens"]


def test_workloads_and_arrivals(bench):
    engine = _benchmark_module("bench_engine")
    assert bench.draw_workload(8, 0, (100, 1024), (100, 1024)) == \
        engine.nano_vllm_workload(8, 0)  # bench_engine's draw, in nano-vllm's order
    prompts, max_tokens = bench.draw_workload(400, 3, (50, 800), (20, 400), "loguniform", 512)
    lens = sorted(map(len, prompts))
    assert 50 <= lens[0] and lens[-1] <= 800 and 120 < lens[200] < 330  # median ~200
    assert all(20 <= m <= 400 for m in max_tokens) and all(t < 512 for p in prompts for t in p)
    offs = bench.arrival_offsets(4000, 16.0, 1)
    assert offs == sorted(offs) and offs[-1] / 4000 == pytest.approx(1 / 16, rel=0.05)
    assert bench.arrival_offsets(3, math.inf, 1) == [0.0, 0.0, 0.0]
    assert bench.default_num_requests(1.0) == 32 and bench.default_num_requests(4.0) == 128
    assert bench.default_num_requests(16.0) == 256 and bench.default_num_requests(math.inf) == 256
    assert bench.parse_rates("1, 4,inf") == [1.0, 4.0, math.inf]


# ---- the client against a scripted server -------------------------------------------------------

def test_client_times_a_scripted_stream(bench):
    """A raw asyncio server streams 5 token chunks 20 ms apart (the 4th carrying 2 tokens, the
    last closing the choice), usage and [DONE]: TTFT >= the first delay, ITL >= 20 ms and two
    equal gaps >= 10 ms for the 2-token chunk, tokens from usage. A 503 comes back as the
    request's error."""
    async def handler(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        n = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0]
                .split(b":")[1])
        body = json.loads(await reader.readexactly(n))
        if body["max_tokens"] == 99:
            msg = b'{"error": {"message": "server busy", "type": "server_overloaded"}}'
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(msg), msg))
            await writer.drain()
            writer.close()
            return
        assert body["stream"] and body["ignore_eos"] and body["prompt"] == [1, 2, 3]
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        await asyncio.sleep(0.05)
        chunks = [{"text": "a"}, {"text": "b"}, {"text": "c"},
                  {"text": "de", "logprobs": {"tokens": ["d", "e"]}}, {"text": "f"}]
        for i, c in enumerate(chunks):
            if i:
                await asyncio.sleep(0.02)
            reason = "length" if i == len(chunks) - 1 else None
            for ev in _sse([{"choices": [dict(c, finish_reason=reason)]}]):
                writer.write(b"%x\r\n%s\r\n" % (len(ev), ev))
            await writer.drain()
        tail = _sse([{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6}},
                     b"[DONE]"])
        writer.write(_chunked([b"".join(tail)]))
        await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            ok = await bench.stream_completion("127.0.0.1", port,
                                               bench.completion_body("m", [1, 2, 3], 6),
                                               bench.RequestResult(3, 6))
            busy = await bench.stream_completion("127.0.0.1", port,
                                                 bench.completion_body("m", [1], 99),
                                                 bench.RequestResult(1, 99))
        return ok, busy

    ok, busy = asyncio.run(asyncio.wait_for(main(), 20))
    assert ok.ok, ok.error
    assert (ok.output_tokens, ok.prompt_tokens, ok.chunk_tokens) == (6, 3, 6)
    assert 0.045 < ok.ttft < 5
    assert len(ok.itl) == 5 and min(ok.itl[0], ok.itl[1], ok.itl[4]) > 0.019
    assert ok.itl[2] == ok.itl[3] and ok.itl[2] > 0.0095  # >= 20 ms over the chunk's 2 tokens
    assert ok.e2e >= ok.ttft + sum(ok.itl)
    assert not busy.ok and busy.error == "HTTP 503: server busy"


# ---- end to end ---------------------------------------------------------------------------------

def test_end_to_end_demo(bench, tmp_path):
    """The whole benchmark on CPU: the demo checkpoint served by `python -m qwen3_model serve`,
    rates 2 and inf of a few short requests, the offline baselines in their own process; the JSON
    is sane and report.py renders it."""
    from qwen3_model.random_checkpoint import write_random_checkpoint

    pytest.importorskip("qwen3_model.server")
    model = tmp_path / "demo"
    write_random_checkpoint(model, "demo")
    results = tmp_path / "results"
    start = time.perf_counter()
    doc = bench.main(["--model", str(model), "--request-rates", "2,inf", "--num-requests", "4",
                      "--input-lens", "8", "40", "--output-lens", "4", "12", "--engine-args",
                      "--device cpu --block-size 16 --max-model-len 256 --max-num-seqs 8",
                      "--server-timeout", "60", "--request-timeout", "30", "--offline-timeout",
                      "60", "--no-gpu-clocks", "--results-dir", str(results), "--tag", "demo"])
    assert time.perf_counter() - start < 90
    saved = json.loads((results / "serve_demo.json").read_text())
    assert saved["bench"] == "serve_demo" and saved["rows"] == json.loads(json.dumps(doc["rows"]))
    assert saved["commit"] and saved["gpu"] == "cpu" and saved["workload"] == "nano-vllm"
    low, sat = saved["rows"]
    assert (low["rate"], sat["rate"]) == ("2", "inf")
    for row in saved["rows"]:
        assert (row["num_requests"], row["completed"], row["failed"]) == (4, 4, 0), row["errors"]
        assert row["all_max_tokens"] and row["output_tokens"] == row["requested_output_tokens"]
        assert row["chunk_tokens"] == row["output_tokens"]  # one token per chunk, none lost
        assert row["prompt_tokens"] > 0 and row["output_tok_s"] > 0
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            p = row[key]
            assert 0 <= p["p50"] <= p["p90"] <= p["p99"], (key, p)
        assert row["ttft_ms"]["p50"] <= row["e2e_ms"]["p50"]
    off = saved["offline"]
    assert off["output_tokens"] == sat["requested_output_tokens"] and off["output_tok_s"] > 0
    assert off["prefill_alone_n"] == 4 and off["prefill_alone_ms"]["p50"] > 0
    assert saved["saturation_vs_offline"] == pytest.approx(
        sat["output_tok_s"] / off["output_tok_s"])
    assert saved["ttft_over_prefill_ms"] == pytest.approx(
        low["ttft_ms"]["p50"] - off["prefill_alone_ms"]["p50"])
    assert set(saved["acceptance"].values()) <= {True, False}

    report = _benchmark_module("report")
    md, readme = tmp_path / "RESULTS.md", tmp_path / "README.md"
    readme.write_text(f"x\n{report.BEGIN}\n{report.END}\n")
    assert report.main(["--results-dir", str(results), "--results-md", str(md), "--no-plots",
                        "--readme", str(readme)]) == 0
    text = md.read_text()
    assert "## Serving" in text and "| 2 | 4 | 4 |" in text and "| inf | 4 | 4 |" in text
    assert "Saturation / offline `LLM.generate`" in text and "minus prefill alone" in text
    (row,) = [line for line in readme.read_text().splitlines() if "serving nano-vllm" in line]
    assert "tok/s at saturation; TTFT p50" in row and f"{doc['saturation_vs_offline']:.2f}x" in row
    pytest.importorskip("matplotlib")
    report.main(["--results-dir", str(results), "--results-md", str(md), "--no-readme",
                 "--plots-dir", str(tmp_path / "plots")])
    assert (tmp_path / "plots" / "serve.png").stat().st_size > 10_000


def test_refuses_gpu_without_the_extension_and_bad_engine_flags(bench, monkeypatch, capsys):
    import torch

    import qwen3_kernels

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(qwen3_kernels, "has_cuda_kernels", lambda: False)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--size", "demo"])
    assert exc.value.code == 2 and "--allow-reference" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        bench.main(["--size", "demo", "--engine-args", "--no-such-flag 3"])
    assert exc.value.code == 2 and "--engine-args" in capsys.readouterr().err
