"""benchmarks/bench_engine.py on CPU: it refuses to time the reference path on a GPU (a number
that says nothing about the kernels) unless asked to with --allow-reference; its step timeline,
clock sampling, engine-setting flags and results/bench_engine.json."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch

import qwen3_kernels


def _benchmark_module(name: str):
    """benchmarks/<name>.py as a fresh module (benchmarks/ is not a package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_engine():
    return _benchmark_module("bench_engine")


def test_refuses_gpu_without_the_extension(monkeypatch, capsys):
    bench = _bench_engine()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(qwen3_kernels, "has_cuda_kernels", lambda: False)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--size", "demo", "--batch1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "extension is not loaded" in err and "--allow-reference" in err


class _Event:
    """A recorded CUDA event stand-in: a time stamp in ms."""

    def __init__(self, t: float):
        self.t = t

    def elapsed_time(self, end: "_Event") -> float:
        return end.t - self.t


def test_timeline_summary_bins_steps_and_counts_idle(monkeypatch, capsys):
    bench = _bench_engine()
    monkeypatch.setattr(bench, "sync", lambda: None)
    # (prefill tokens, decodes, start, end): a prefill step, decode steps of 3, 16, 17 and 200
    # sequences, with 1 ms idle before the second step and 0.5 ms before the last
    stamps = [(500, 2, 0.0, 100.0), (0, 3, 101.0, 106.0), (0, 16, 106.0, 112.0),
              (0, 17, 112.0, 119.0), (0, 200, 119.5, 131.5)]
    records = [(p, d, _Event(a), _Event(b)) for p, d, a, b in stamps]
    out = bench.timeline_summary(records)
    assert out["timeline_wall_ms"] == pytest.approx(131.5)
    assert out["timeline_idle_ms"] == pytest.approx(1.5)
    t = out["timeline"]
    assert t["prefill"] == dict(steps=1, ms=pytest.approx(100.0), decode_tokens=2)
    assert t["16"] == dict(steps=2, ms=pytest.approx(11.0), decode_tokens=19)  # 3 and 16
    assert t["64"] == dict(steps=1, ms=pytest.approx(7.0), decode_tokens=17)
    assert t["256"] == dict(steps=1, ms=pytest.approx(12.0), decode_tokens=200)
    assert "128" not in t and "192" not in t
    text = capsys.readouterr().out
    assert "| decode 1..16 | 2 |" in text and "| decode 193..256 | 1 |" in text


def test_gpu_clocks_parse_and_summary(monkeypatch):
    bench = _bench_engine()
    assert bench.GpuClocks.parse("1980, 3201, 512.34, 45") == (1980.0, 3201.0, 512.34, 45.0)
    assert bench.GpuClocks.parse("1980, 3201, [N/A], 45") is None
    assert bench.GpuClocks.parse("") is None
    clocks = bench.GpuClocks()
    assert clocks.summary() is None and clocks.describe() == ""
    clocks.uuid = "GPU-x"
    clocks.samples = [(1980.0, 3201.0, 600.0, 50.0), (1755.0, 3201.0, 700.0, 61.0),
                      (1980.0, 3201.0, 650.0, 55.0)]
    s = clocks.summary()
    assert s == dict(gpu_uuid="GPU-x", clock_samples=3, sm_mhz_min=1755.0, sm_mhz_median=1980.0,
                     mem_mhz_median=3201.0, power_w_median=650.0, power_w_max=700.0,
                     temp_c_max=61.0)
    assert "1755 / 1980 MHz" in clocks.describe() and "650 / 700 W" in clocks.describe()


def test_gpu_clocks_without_cuda_samples_nothing(monkeypatch):
    bench = _bench_engine()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with bench.GpuClocks(period_s=0.01) as clocks:
        time.sleep(0.05)
    assert clocks.samples == [] and clocks.summary() is None


def test_workload_run_reports_its_scheduling_setting(tmp_path, capsys):
    """The throughput path end to end on CPU (the demo shape, 3 short requests): every request
    gets its max_tokens, the printout names the policy and the budget, and the run's row lands in
    results/bench_engine.json with its settings; a second run of the same setting replaces it."""
    import json

    bench = _bench_engine()
    argv = ["--size", "demo", "--num-seqs", "3", "--max-input-len", "120",
            "--max-output-len", "104", "--scheduling-policy", "longest_first",
            "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--no-gpu-clocks",
            "--results-dir", str(tmp_path)]
    result = bench.main(argv)
    text = capsys.readouterr().out
    assert "(longest_first, max_num_batched_tokens 64, max_piecewise_graph_tokens 512):" in text
    _, max_tokens = bench.nano_vllm_workload(3, max_input_len=120, max_output_len=104)
    assert result["output_tokens"] == sum(max_tokens)
    assert result["partial_prefills"] > 0  # 64-token budget: every prompt was chunked
    doc = json.loads((tmp_path / "bench_engine.json").read_text())
    assert doc["bench"] == "bench_engine" and doc["commit"] and doc["gpu"] == "cpu"
    (row,) = doc["rows"]
    assert row["workload"] == "nano-vllm: 3 requests" and row["size"] == "demo"
    assert row["output_tokens"] == sum(max_tokens) and row["output_tok_s"] > 0
    assert row["settings"]["scheduling_policy"] == "longest_first"
    assert row["settings"]["max_num_batched_tokens"] == 64
    assert row["settings"]["overlap_steps"] is True and row["settings"]["tp_all_reduce"] == "auto"
    assert row["settings"]["kv_cache_dtype"] == "auto"
    assert "--max-num-batched-tokens 64" in row["command"]
    bench.write_engine_row(dict(row, output_tok_s=1.0), tmp_path)  # same setting: replaced
    bench.write_engine_row(dict(row, workload="other"), tmp_path)  # another: kept beside it
    fp8 = dict(row["settings"], kv_cache_dtype="fp8")
    bench.write_engine_row(dict(row, settings=fp8, output_tok_s=2.0), tmp_path)  # kept beside
    rows = json.loads((tmp_path / "bench_engine.json").read_text())["rows"]
    assert [(r["workload"], r["output_tok_s"]) for r in rows] == [
        ("nano-vllm: 3 requests", 1.0), ("other", row["output_tok_s"]),
        ("nano-vllm: 3 requests", 2.0)]
    # a row from before --kv-cache-dtype (no such setting) is the "auto" one: replaced
    old = {k: v for k, v in row["settings"].items() if k != "kv_cache_dtype"}
    bench.write_engine_row(dict(row, settings=old, output_tok_s=3.0), tmp_path)
    rows = json.loads((tmp_path / "bench_engine.json").read_text())["rows"]
    assert sorted(r["output_tok_s"] for r in rows) == [2.0, 3.0, row["output_tok_s"]]


def test_engine_settings_flags():
    """--no-overlap-steps / --tp-all-reduce reach LLM as overlap_steps / tp_all_reduce."""
    bench = _bench_engine()
    seen = {}

    class FakeLLM:
        def __init__(self, path, **kw):
            seen.update(kw)
            raise RuntimeError("stop")

    bench.LLM = FakeLLM
    with pytest.raises(RuntimeError, match="stop"):
        bench.main(["--size", "demo", "--batch1", "--no-gpu-clocks"])
    assert seen["overlap_steps"] is True and seen["tp_all_reduce"] == "auto"
    assert seen["kv_cache_dtype"] == "auto"
    with pytest.raises(RuntimeError, match="stop"):
        bench.main(["--size", "demo", "--batch1", "--no-gpu-clocks", "--no-overlap-steps",
                    "--tp-all-reduce", "nccl", "--kv-cache-dtype", "fp8"])
    assert seen["overlap_steps"] is False and seen["tp_all_reduce"] == "nccl"
    assert seen["kv_cache_dtype"] == "fp8"


def test_profile_context_takes_a_length_or_a_range(capsys):
    """--profile-context N or LO..HI (each sequence's length drawn from it); anything else is
    refused by the parser. On CPU the profile runs its decode steps and reports no kernel time."""
    import argparse

    bench = _bench_engine()
    assert bench.context_range("512") == (512, 512)
    assert bench.context_range("100..2047") == (100, 2047)
    for bad in ("0", "9..3", "a..b", "5..", "-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected N or LO..HI"):
            bench.context_range(bad)
    with pytest.warns(UserWarning, match="CUDA is not available"):  # (the profiler's)
        result = bench.main(["--size", "demo", "--profile", "--num-seqs", "3", "--profile-context",
                             "5..40", "--no-gpu-clocks"])
    assert result["mode"] == "profile" and result["context"] == "5..40"
    assert "no CUDA kernel time recorded" in capsys.readouterr().out

