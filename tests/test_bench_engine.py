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
