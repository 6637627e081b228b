"""Benchmarks collect rows through the ``report`` fixture; the session ends with one table.

Each row: the op and case, our time, each baseline's time from the same run, the bytes that must
move (-> TB/s and the fraction of the H200 read ceiling) or the FLOPs (-> TFLOP/s).
The table is printed at the end and written to $BENCH_RESULTS (markdown) when set.
"""

from __future__ import annotations

import os

import pytest
import torch

from common import H200_BF16_TFLOPS, H200_READ_TBS

_ROWS: list[dict] = []


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="benchmarks need a CUDA GPU")
    for item in items:
        item.add_marker(skip)


@pytest.fixture
def report():
    def add(op: str, case: str, ours_s: float, baselines: dict[str, float],
            nbytes: float | None = None, flops: float | None = None, note: str = ""):
        row = {"op": op, "case": case, "ours_us": ours_s * 1e6,
               "base_us": {k: v * 1e6 for k, v in baselines.items()}, "note": note}
        if nbytes:
            row["tbs"] = nbytes / ours_s / 1e12
            row["of_ceiling"] = row["tbs"] / H200_READ_TBS
        if flops:
            row["tflops"] = flops / ours_s / 1e12
            row["of_ceiling"] = row["tflops"] / H200_BF16_TFLOPS
        _ROWS.append(row)
        ratios = " ".join(f"{k}={v / ours_s:.2f}x" for k, v in baselines.items())
        rate = (f"{row['tbs']:.2f} TB/s" if nbytes else "") + (
            f"{row['tflops']:.0f} TFLOP/s" if flops else "")
        print(f"\n[bench] {op} {case}: {ours_s * 1e6:.2f} us {rate} | speed-up vs {ratios} {note}")
        return row
    return add


def _table() -> str:
    lines = ["| op | case | ours (us) | rate | of ceiling | baselines (us) | ours vs baseline |",
             "|---|---|---|---|---|---|---|"]
    for r in _ROWS:
        rate = f"{r['tbs']:.2f} TB/s" if "tbs" in r else (
            f"{r['tflops']:.0f} TFLOP/s" if "tflops" in r else "")
        ceil = f"{r['of_ceiling']:.0%}" if "of_ceiling" in r else ""
        base = ", ".join(f"{k} {v:.2f}" for k, v in r["base_us"].items())
        ratio = ", ".join(f"{v / r['ours_us']:.2f}x {k}" for k, v in r["base_us"].items())
        lines.append(f"| {r['op']} | {r['case']} | {r['ours_us']:.2f} | {rate} | {ceil} | {base} | {ratio} |")
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter):
    if not _ROWS:
        return
    table = _table()
    terminalreporter.write_line("")
    terminalreporter.write_line("ours vs baseline = baseline time / our time (> 1 means we are faster)")
    terminalreporter.write_line(table)
    path = os.environ.get("BENCH_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(table + "\n")
