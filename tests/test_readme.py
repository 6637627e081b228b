"""README.md: every ```python snippet runs as written on a CPU machine (each in its own fresh
interpreter, no GPU, no download; a client of the server against the README's server command on
the demo checkpoint, as is the curl line), the test command CI runs is the one the README shows,
and the page stays one page for users (under 200 lines, a results table report.py can fill, the
plots)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CI_COMMAND = "bash scripts/setup.sh && . .venv/bin/activate && python -m pytest -q tests"
PLOTS = ["elementwise", "attention_decode", "attention_prefill", "linear", "engine", "serve"]


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", README, flags=re.S | re.M)


SNIPPETS = blocks("python")
PYTHON_SNIPPETS = [b for b in SNIPPETS if "base_url" not in b]  # the rest needs the server
CLIENT_SNIPPETS = [b for b in SNIPPETS if "base_url" in b]


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
    from qwen3_model.server.cli import build_parser as build_serve_parser

    help_text = build_parser().format_help() + build_serve_parser().format_help()
    cli_lines = [line for line in README.splitlines() if "qwen3_model" in line or "`--" in line]
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", "\n".join(cli_lines)))
    assert flags, "the README should show the CLI's flags"
    missing = sorted(f for f in flags if f not in help_text)
    assert not missing, f"README names flags that python -m qwen3_model does not have: {missing}"


def test_readme_has_no_environment_switches_or_diary_labels():
    assert not re.search(r"\bQWEN3_[A-Z_]+", README)
    assert not re.search(r"(th|st|nd|rd) session|session [0-9]|20[0-9]{2}-[0-9]{2}-[0-9]{2}",
                         README, flags=re.I)


def test_the_serve_example_works_as_written(tmp_path):
    """The README's serve command (the demo checkpoint in place of the Hub id, served under that
    name, on a free port for 8000), then its curl line and its openai-client snippet."""
    from tests.server_fixtures import ServerProcess, write_demo_checkpoint

    serve = next(line for b in blocks("bash") for line in b.splitlines()
                 if "qwen3_model serve" in line)
    argv = shlex.split(serve)
    name = argv[argv.index("--model") + 1]
    assert CLIENT_SNIPPETS and f'"{name}"' in CLIENT_SNIPPETS[0]
    srv = ServerProcess(write_demo_checkpoint(tmp_path / "ckpt"), "--served-model-name", name,
                        "--max-model-len", "512", "--block-size", "16", log_dir=tmp_path)
    try:
        srv.wait_ready(timeout=120)
        bash = next(b for b in blocks("bash") if "curl" in b)
        curl = bash[bash.index("curl"):].replace("\\\n", " ").splitlines()[0]
        curl = curl.replace(":8000", f":{srv.port}")
        if shutil.which("curl"):
            proc = subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=60)
            assert proc.returncode == 0, proc.stderr
            out = json.loads(proc.stdout)
        else:  # the same request through the standard library
            from tests.server_fixtures import post_json

            body = json.loads(shlex.split(curl)[shlex.split(curl).index("-d") + 1])
            status, out = post_json(srv, "/v1/completions", body)[:2]
            assert status == 200, out
        assert out["object"] == "text_completion"
        assert 1 <= out["usage"]["completion_tokens"] <= 16
        for snippet in CLIENT_SNIPPETS:
            env = dict(os.environ, PYTHONPATH=str(ROOT), OPENAI_API_KEY="none")
            proc = subprocess.run([sys.executable, "-c",
                                   snippet.replace(":8000", f":{srv.port}")],
                                  cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=120)
            assert proc.returncode == 0, f"{snippet}\n{proc.stderr[-3000:]}"
    finally:
        srv.stop()
