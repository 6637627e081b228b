"""README.md: every ```python snippet runs as written on a CPU machine (each in its own fresh
interpreter, no GPU, no download), the test command CI runs is the one the README shows, and the
page stays one page for users (under 200 lines, a results table report.py can fill, the plots)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CI_COMMAND = "bash scripts/setup.sh && . .venv/bin/activate && python -m pytest -q tests"
PLOTS = ["elementwise", "attention_decode", "attention_prefill", "linear", "engine"]


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", README, flags=re.S | re.M)


PYTHON_SNIPPETS = blocks("python")


def test_readme_has_python_snippets():
    assert len(PYTHON_SNIPPETS) >= 2  # the engine's Python API and the ops


@pytest.mark.parametrize("index", range(len(PYTHON_SNIPPETS)))
def test_python_snippet_runs_as_written_on_cpu(index, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", PYTHON_SNIPPETS[index]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (
        f"README python snippet {index} failed:\n{PYTHON_SNIPPETS[index]}\n{proc.stderr[-3000:]}")


def test_readme_shows_the_command_ci_runs():
    assert any(CI_COMMAND in b for b in blocks("bash"))
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "bash scripts/setup.sh" in ci and "python -m pytest -q tests" in ci


def test_readme_is_one_page_with_a_results_table_and_the_plots():
    assert len(README.splitlines()) < 200
    begin, end = README.index("<!-- results:begin -->"), README.index("<!-- results:end -->")
    assert begin < end and "\n| " in README[begin:end]
    for name in PLOTS:
        assert f"](benchmarks/plots/{name}.png)" in README, name


def test_readme_names_only_flags_the_cli_has():
    from qwen3_model.__main__ import build_parser

    help_text = build_parser().format_help()
    cli_lines = [line for line in README.splitlines() if "qwen3_model" in line or "`--" in line]
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", "\n".join(cli_lines)))
    assert flags, "the README should show the CLI's flags"
    missing = sorted(f for f in flags if f not in help_text)
    assert not missing, f"README names flags that python -m qwen3_model does not have: {missing}"


def test_readme_has_no_environment_switches_or_diary_labels():
    assert not re.search(r"\bQWEN3_[A-Z_]+", README)
    assert not re.search(r"(th|st|nd|rd) session|session [0-9]|20[0-9]{2}-[0-9]{2}-[0-9]{2}",
                         README, flags=re.I)
