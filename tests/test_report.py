"""benchmarks/report.py on CPU, from a small synthetic results directory written here: RESULTS.md's
tables (no matplotlib needed), README's table between its markers, and the PNGs (when matplotlib
is installed)."""

from __future__ import annotations

import sys

import pytest

from tests.test_bench_engine import _benchmark_module


@pytest.fixture
def modules():
    report = _benchmark_module("report")
    return report, sys.modules["record"]  # report.py puts benchmarks/ on sys.path for record


def _write_results(record, results):
    """A synthetic run of every bench: a few rows each, numbers made up for the test."""
    def rows(op, unit, sizes, ours_s, base_s, baseline, work, headline_size=None, case=None):
        out = []
        for size in sizes:
            kw = {"flops": work * size} if unit == "TFLOP/s" else {"nbytes": work * size}
            out.append(record.kernel_row(
                op, case(size) if case else f"T={size}", ours_s * size, {baseline: base_s * size,
                                                                        "eager": 3 * base_s * size},
                baseline=baseline, size=size, size_name="T", headline=size == headline_size,
                **kw))
        return out

    el = [r for op in ("silu_and_mul", "rms_norm", "fused_add_rms_norm")
          for r in rows(op, "TB/s", [1, 16, 256, 16384], 1e-6, 1.1e-6, "compile", 4e6, 16384)]
    record.write("bench_elementwise", el, results, ["pytest", "-q", "bench_elementwise.py"])
    record.write("bench_qk_norm_rope",
                 rows("qk_norm_rope", "TB/s", [1, 64, 16384], 1e-6, 1.2e-6, "compile", 3e6, 16384),
                 results)
    record.write("bench_attention_decode",
                 rows("paged_attention_decode", "TB/s", [1, 32], 1e-5, 1e-5, "cudnn", 4e7, 32,
                      case=lambda b: f"B={b} ctx=4096 Hq/Hkv=32/8 bs=16"), results)
    record.write("bench_attention_prefill",
                 rows("paged_attention_prefill", "TFLOP/s", [1, 8], 1e-3, 1.02e-3, "sdpa_cudnn",
                      5e11, 1, case=lambda b: f"causal B={b} L=4096"), results)
    lin = []
    for model in ("0.6B", "8B"):
        lin += rows("linear", "TB/s", [1, 64], 1e-5, 1.3e-5, "cublas", 3e7,
                    case=lambda t, m=model: f"{m} qkv N=6144 K=4096 T={t}")
        lin += rows("linear", "TFLOP/s", [4096], 1e-7, 1e-7, "cublas", 5e7, 4096,
                    case=lambda t, m=model: f"{m} qkv N=6144 K=4096 T={t}")
    record.write("bench_linear", lin, results)
    fp8 = []
    for proj in ("qkv", "o"):
        for t in (1, 16):
            fp8.append(record.kernel_row("linear_fp8", f"8B {proj} N=4096 K=4096 T={t}", 1e-5,
                                         {"cublas_bf16": 1.4e-5}, nbytes=1.7e7, size=t,
                                         size_name="M"))
        row = record.kernel_row("linear_fp8", f"8B {proj} N=4096 K=4096 M=4096", 1.4e-4,
                                {"cublas_bf16": 2e-4, "scaled_mm_blockwise": 1.5e-4},
                                flops=1.4e14, size=4096, size_name="M")
        fp8.append(dict(row, gemm_rate=1100.0, gemm_us=127.0, quantize_us=13.0,
                        gemm_vs={"scaled_mm_blockwise": 1.5e-4 / 1.27e-4}))
    record.write("bench_linear_fp8", fp8, results)
    bench = _benchmark_module("bench_engine")

    class Args:  # bench_engine's argparse namespace, as far as engine_row reads it
        num_seqs, model, size, scheduling_policy, max_num_seqs = 256, None, "8B", "auto", 512
        max_num_batched_tokens, max_piecewise_graph_tokens, no_overlap_steps = 16384, 512, False
        tp_all_reduce, tensor_parallel_size, enforce_eager, block_size = "auto", 1, False, 256
        kv_cache_dtype, deterministic = "auto", False

    result = dict(mode="throughput", model="Qwen3-8B (random weights)", tok_s=9999.0,
                  seconds=10.0, output_tokens=99990, hf_tok_s=1000.0, sm_mhz_median=1980.0,
                  timeline={"prefill": dict(steps=3, ms=50.0, decode_tokens=0),
                            "16": dict(steps=10, ms=60.0, decode_tokens=120),
                            "256": dict(steps=10, ms=140.0, decode_tokens=2500)})
    bench.write_engine_row(bench.engine_row(result, Args), results, ["--size", "8B"])
    Args.max_num_batched_tokens, Args.scheduling_policy = 384, "longest_first"
    bench.write_engine_row(bench.engine_row(dict(result, tok_s=10500.0), Args), results, [])


def test_tables_without_matplotlib(tmp_path, modules, monkeypatch):
    report, record = modules
    results = tmp_path / "results"
    _write_results(record, results)
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n<!-- results:begin -->\nold\n<!-- results:end -->\n\nafter\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    md = tmp_path / "RESULTS.md"
    args = ["--results-dir", str(results), "--results-md", str(md), "--readme", str(readme),
            "--plots-dir", str(tmp_path / "plots")]
    assert report.main(args + ["--no-plots"]) == 0
    text = md.read_text()
    assert len(text.splitlines()) < 400
    assert "4.31 TB/s" in text and "739 TFLOP/s" in text  # the ceilings, in the header
    assert "## bench_elementwise" in text and "`pytest -q bench_elementwise.py`" in text
    assert text.index("## bench_elementwise") < text.index("## bench_linear") < text.index(
        "## bench_engine")
    assert "| silu_and_mul | T=16384 | 16,384 | 4.00 TB/s | 93% | compile |" in text
    assert "scheduling_policy=longest_first, max_num_batched_tokens=384" in text
    assert "| nano-vllm: 256 requests | Qwen3-8B (random weights) | defaults | 9,999 |" in text
    assert "| 13.00 | 127.00 us, 1100 TFLOP/s, 1.18x scaled_mm blockwise |" in text  # GEMM alone
    body = readme.read_text()
    assert "old" not in body and body.endswith("<!-- results:end -->\n\nafter\n")
    table = body[body.index("<!-- results:begin -->"):body.index("<!-- results:end -->")]
    lines = [ln for ln in table.splitlines() if ln.startswith("| ")]
    # the header, the headline kernel rows (3 + 1 + 1 + 1 + 2) and the engine row at the
    # defaults (the other settings' rows are in RESULTS.md only)
    assert len(lines) == 1 + 8 + 1, lines
    assert "| silu_and_mul T=16384 | 4.00 TB/s | compile 3.64 TB/s | 1.10x | cpu |" in table
    assert "(defaults) | 9,999 tok/s | transformers 1,000 tok/s | 10.00x | cpu |" in table
    assert "10,500" not in table
    # the plots without matplotlib: a clear error naming the fix, after the tables are written
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        report.main(args)


def test_plots(tmp_path, modules):
    pytest.importorskip("matplotlib")
    report, record = modules
    results = tmp_path / "results"
    _write_results(record, results)
    plots = tmp_path / "plots"
    report.main(["--results-dir", str(results), "--results-md", str(tmp_path / "R.md"),
                 "--readme", str(tmp_path / "none.md"), "--plots-dir", str(plots)])
    names = sorted(p.name for p in plots.glob("*.png"))
    assert names == ["attention_decode.png", "attention_prefill.png", "elementwise.png",
                     "engine.png", "linear.png", "linear_fp8.png"]
    assert all((plots / n).read_bytes()[:4] == b"\x89PNG" for n in names)
    # a plot whose JSON is absent is skipped
    (results / "bench_linear.json").unlink()
    other = tmp_path / "plots2"
    report.main(["--results-dir", str(results), "--results-md", str(tmp_path / "R.md"),
                 "--readme", str(tmp_path / "none.md"), "--plots-dir", str(other)])
    assert not (other / "linear.png").exists() and (other / "engine.png").exists()


def test_no_results_gives_a_stub(tmp_path, modules):
    report, _ = modules
    md = tmp_path / "RESULTS.md"
    readme = tmp_path / "README.md"
    readme.write_text("<!-- results:begin -->\n<!-- results:end -->\n")
    report.main(["--results-dir", str(tmp_path / "none"), "--results-md", str(md),
                 "--readme", str(readme)])
    assert "No results yet" in md.read_text()
    table = readme.read_text()
    assert "\n| what | ours | baseline in the same run |" in table and "report.py" in table
