"""Benchmarks collect rows through the ``report`` fixture; the session ends with one table per
bench and one JSON file per bench (record.py says what is in it).

    cd benchmarks && pytest -q -s bench_elementwise.py        # -> results/bench_elementwise.json
    pytest -q -s benchmarks/bench_linear.py --results-dir "$OUT/results"
    python benchmarks/report.py                               # RESULTS.md, plots, README table

Each row: the op and case, our time, each baseline's time from the same run, the bytes that must
move (-> TB/s and the fraction of the H200 read ceiling) or the FLOPs (-> TFLOP/s and the fraction
of cuBLAS's 739 TFLOP/s). A run replaces its bench's file (one command, date and commit per
table): rerun the whole bench before report.py, not a -k subset. Files named bench_*.py are
collected here (tests/ keeps test_*.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # common, record: from any directory

import record  # noqa: E402

_ROWS: dict[str, list[dict]] = {}  # bench -> rows


def pytest_addoption(parser):
    parser.addoption("--results-dir", default=None,
                     help="where each bench writes <bench>.json (default: benchmarks/results)")


def pytest_collect_file(file_path, parent):
    if (file_path.suffix == ".py" and file_path.name.startswith("bench_")
            and not parent.session.isinitpath(file_path)):  # named on the command line: pytest's
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="benchmarks need a CUDA GPU")
    for item in items:
        item.add_marker(skip)


@pytest.fixture
def report(request):
    """add(op, case, ours_s, baselines, nbytes=, flops=, baseline=, size=, size_name=, note=,
    headline=) -> the row (record.kernel_row); baselines: name -> seconds from the same run."""
    bench = Path(str(request.node.fspath)).stem

    def add(op: str, case: str, ours_s: float, baselines: dict[str, float], **kw):
        row = record.kernel_row(op, case, ours_s, baselines, **kw)
        _ROWS.setdefault(bench, []).append(row)
        ratios = " ".join(f"{k}={v / ours_s:.2f}x" for k, v in baselines.items())
        rate = f"{row['ours_rate']:.2f} {row['unit']}" if row["ours_rate"] else ""
        print(f"\n[bench] {op} {case}: {ours_s * 1e6:.2f} us {rate} | speed-up vs {ratios} "
              f"{row['note']}")
        return row
    return add


def _table(rows: list[dict]) -> str:
    lines = ["| op | case | ours (us) | rate | of ceiling | baselines (us) | ours vs baseline |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        rate = f"{r['ours_rate']:.2f} {r['unit']}" if r["ours_rate"] else ""
        ceil = f"{r['of_ceiling']:.0%}" if r["of_ceiling"] else ""
        base = ", ".join(f"{k} {v:.2f}" for k, v in r["baselines_us"].items())
        ratio = ", ".join(f"{v / r['ours_us']:.2f}x {k}" for k, v in r["baselines_us"].items())
        lines.append(f"| {r['op']} | {r['case']} | {r['ours_us']:.2f} | {rate} | {ceil} | "
                     f"{base} | {ratio} |")
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter, config):
    if not _ROWS:
        return
    terminalreporter.write_line("")
    terminalreporter.write_line("ours vs baseline = baseline time / our time (> 1: ours is faster)")
    command = ["pytest", *config.invocation_params.args]
    for bench, rows in _ROWS.items():
        terminalreporter.write_line(_table(rows))
        path = record.write(bench, rows, config.getoption("--results-dir"), command)
        terminalreporter.write_line(f"{len(rows)} rows -> {path}")
