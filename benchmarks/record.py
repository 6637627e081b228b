"""The ceilings every figure is held to, and the JSON file each benchmark writes (no torch here:
benchmarks/report.py reads these files on any machine).

    benchmarks/results/<bench>.json = {
        "bench": "bench_elementwise", "command": "pytest -q -s bench_elementwise.py",
        "date": "YYYY-MM-DD HH:MM UTC", "gpu": "NVIDIA H200", "commit": "51e53b0",
        "ceilings": {"read_tbs": 4.31, "bf16_tflops": 739.0},
        "rows": [...]}

A kernel row (conftest.py's ``report`` fixture): op, case, size / size_name (the x of its plot:
T, M, ...), ours_us, unit ("TB/s" or "TFLOP/s"), ours_rate, baseline (the name of the one it is
compared with), baseline_us, baseline_rate, ratio (baseline time / ours: > 1 means ours is
faster), ceiling (in unit), of_ceiling, baselines_us (every baseline timed), note, headline
(true for the rows README's table shows). An engine row (bench_engine.py): workload, model,
settings, output_tok_s, decode_tok_s, baseline / baseline_tok_s / ratio when one ran, clocks.
"""

from __future__ import annotations

import datetime
import json
import shlex
import subprocess
import sys
from pathlib import Path

# The H200 ceilings measured for /work/shared/design/TARGETS.md (torch 2.11, CUDA 13.0, one card).
H200_READ_TBS = 4.31  # read-only reduction over 2 GiB: the practical read ceiling
H200_COPY_TBS = 4.2  # device-to-device copy, read + write
H200_BF16_TFLOPS = 739.0  # cuBLAS 8192^3
CEILINGS = {"TB/s": H200_READ_TBS, "TFLOP/s": H200_BF16_TFLOPS}

HERE = Path(__file__).resolve().parent
DEFAULT_RESULTS_DIR = HERE / "results"


def commit() -> str:
    """The checkout's short commit (+ "-dirty" when tracked files differ), or "unknown"."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, text=True,
                              capture_output=True, timeout=10).stdout.strip()
        if not head:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=HERE, text=True, capture_output=True, timeout=10).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def gpu_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except Exception:  # noqa: BLE001 - no torch, or a CUDA error: the file still gets written
        pass
    return "cpu"


def run_info(command: list[str] | None = None) -> dict:
    """What a results file says about its run: command line, date (UTC), GPU, commit."""
    argv = command if command is not None else [Path(sys.argv[0]).name, *sys.argv[1:]]
    now = datetime.datetime.now(datetime.timezone.utc)
    return {"command": shlex.join(argv), "date": now.strftime("%Y-%m-%d %H:%M UTC"),
            "gpu": gpu_name(), "commit": commit(),
            "ceilings": {"read_tbs": H200_READ_TBS, "bf16_tflops": H200_BF16_TFLOPS}}


def results_path(bench: str, results_dir: str | Path | None = None) -> Path:
    return Path(results_dir or DEFAULT_RESULTS_DIR) / f"{bench}.json"


def write(bench: str, rows: list[dict], results_dir=None, command=None) -> Path:
    """Writes (replaces) benchmarks/results/<bench>.json with these rows and the run's info."""
    path = results_path(bench, results_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"bench": bench, **run_info(command), "rows": rows}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def kernel_row(op: str, case: str, ours_s: float, baselines: dict[str, float], *,
               nbytes: float | None = None, flops: float | None = None,
               baseline: str | None = None, size: float | None = None, size_name: str = "",
               note: str = "", headline: bool = False) -> dict:
    """One kernel row. The rate is TFLOP/s when flops is given, else TB/s of nbytes; ``baseline``
    names the compared one (default: the first of ``baselines``)."""
    unit = "TFLOP/s" if flops else ("TB/s" if nbytes else "")
    work = flops or nbytes

    def rate(s):
        return work / s / 1e12 if work and s else None

    base = baseline if baseline in baselines else next(iter(baselines), None)
    base_s = baselines.get(base) if base else None
    row = {"op": op, "case": case, "size": size, "size_name": size_name,
           "ours_us": ours_s * 1e6, "unit": unit, "ours_rate": rate(ours_s),
           "baseline": base, "baseline_us": base_s * 1e6 if base_s else None,
           "baseline_rate": rate(base_s), "ratio": base_s / ours_s if base_s else None,
           "ceiling": CEILINGS.get(unit), "of_ceiling": None,
           "baselines_us": {k: v * 1e6 for k, v in baselines.items()}, "note": note,
           "headline": headline}
    if row["ceiling"] and row["ours_rate"]:
        row["of_ceiling"] = row["ours_rate"] / row["ceiling"]
    return row
