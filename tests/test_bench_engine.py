"""benchmarks/bench_engine.py refuses to time the reference path on a GPU (a number that says
nothing about the kernels), unless asked to with --allow-reference."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import qwen3_kernels


def _bench_engine():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_engine.py"
    spec = importlib.util.spec_from_file_location("bench_engine_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
