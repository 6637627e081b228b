"""``python -m qwen3_model``: the no-model demo runs the whole loop in under a minute on a CPU;
``--help`` documents every option; a checkpoint with a tokenizer generates from prompts and --chat;
every error (serve's too) is one "error: ..." line and a non-zero exit, Ctrl-C "interrupted" and
exit 130, a traceback only with --debug."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import sigint_as_a_terminal_sends_it

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "qwen3_model", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.perf_counter() - start


def test_no_arguments_runs_the_random_demo_in_under_a_minute():
    proc, seconds = run_cli("--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RANDOM-WEIGHT Qwen3" in proc.stdout  # says plainly what it is
    assert "output tok/s" in proc.stdout and "12 requests" in proc.stdout
    assert seconds < 60, f"took {seconds:.1f} s"


def test_help_lists_every_option():
    from qwen3_model.__main__ import build_parser

    text = build_parser().format_help()
    for flag in ["--model", "--prompts-file", "--chat", "--stream", "--temperature", "--top-k",
                 "--top-p", "--min-p", "--seed", "--max-tokens", "--min-tokens", "--ignore-eos",
                 "--stop", "--stop-token-id", "--dtype", "--max-model-len", "--max-num-seqs",
                 "--max-num-batched-tokens", "--block-size", "--gpu-memory-utilization",
                 "--enforce-eager", "--max-piecewise-graph-tokens", "--no-prefix-caching",
                 "--scheduling-policy", "--tensor-parallel-size", "--tp-all-reduce",
                 "--no-overlap-steps", "--kv-cache-dtype", "--presence-penalty",
                 "--frequency-penalty", "--repetition-penalty"]:
        assert flag in text, flag


def test_sampling_flags_reach_the_params():
    from qwen3_model.__main__ import build_parser, sampling_params

    sp = sampling_params(build_parser().parse_args(
        ["--model", "m", "--presence-penalty", "0.5", "--frequency-penalty", "-0.25",
         "--repetition-penalty", "1.2", "--min-p", "0.1", "--stop-token-id", "7"]))
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -0.25, 1.2)
    assert sp.min_p == 0.1 and sp.stop_token_ids == [7] and sp.penalized
    assert not sampling_params(build_parser().parse_args(["--model", "m"])).penalized


def test_engine_flags_reach_the_engine():
    from qwen3_model.__main__ import build_parser
    from qwen3_model.command import engine_kwargs

    kw = engine_kwargs(build_parser().parse_args(
        ["--model", "m", "--max-piecewise-graph-tokens", "64", "--scheduling-policy",
         "longest_first", "--max-num-batched-tokens", "320"]))
    assert kw["max_piecewise_graph_tokens"] == 64 and kw["scheduling_policy"] == "longest_first"
    assert kw["max_num_batched_tokens"] == 320
    assert kw["tp_all_reduce"] == "auto" and kw["overlap_steps"] is True
    kw = engine_kwargs(build_parser().parse_args(
        ["--model", "m", "--tp-all-reduce", "nccl", "--no-overlap-steps"]))
    assert kw["tp_all_reduce"] == "nccl" and kw["overlap_steps"] is False


# The rest runs main() in this process: a subprocess pays the torch + transformers import again.

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    import torch

    from qwen3_model.random_checkpoint import write_random_checkpoint

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add OpenMP spin-waits
    path = tmp_path_factory.mktemp("cli")
    write_random_checkpoint(path, "demo", num_hidden_layers=1)
    yield str(path)
    torch.set_num_threads(before)


SMALL = ["--block-size", "16", "--max-num-seqs", "8", "--max-model-len", "256", "--no-progress"]


def test_model_prompts_from_args_and_file_with_chat(ckpt, tmp_path, capsys):
    from qwen3_model.__main__ import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond prompt\n")
    main(["--model", ckpt, "third", "--prompts-file", str(prompts), "--chat", "--temperature", "0",
          "--max-tokens", "5", "--ignore-eos", "--scheduling-policy", "longest_first", *SMALL])
    out = capsys.readouterr().out
    assert "3 requests" in out and "15 output tokens" in out
    assert "<|im_start|>user\nsecond prompt<|im_end|>" in out  # the chat template applied


def test_stream_and_bad_arguments(ckpt, capsys):
    from qwen3_model.__main__ import main

    main(["--model", ckpt, "hello", "--stream", "--temperature", "0", "--max-tokens", "4",
          "--ignore-eos", *SMALL])
    assert "[4 tokens in" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="SamplingParams.top_p"):
        main(["--model", ckpt, "hello", "--top-p", "0", *SMALL])
    with pytest.raises(SystemExit, match="give prompts"):
        main(["--model", ckpt, *SMALL])


def test_scheduling_policy_choices_are_the_configs():
    """The CLI spells the policies out (its --help does not import torch): the same as Config's."""
    from qwen3_model.__main__ import build_parser
    from qwen3_model.config import SCHEDULING_POLICIES

    action = next(a for a in build_parser()._actions if "--scheduling-policy" in a.option_strings)
    assert tuple(action.choices) == SCHEDULING_POLICIES


def test_tp_all_reduce_choices_are_the_configs():
    from qwen3_model.__main__ import build_parser
    from qwen3_model.config import TP_ALL_REDUCE_CHOICES

    action = next(a for a in build_parser()._actions if "--tp-all-reduce" in a.option_strings)
    assert tuple(action.choices) == TP_ALL_REDUCE_CHOICES


def test_kv_cache_dtype_choices_are_the_configs():
    from qwen3_model.__main__ import build_parser
    from qwen3_model.config import KV_CACHE_DTYPES

    action = next(a for a in build_parser()._actions if "--kv-cache-dtype" in a.option_strings)
    assert tuple(action.choices) == KV_CACHE_DTYPES and action.default == "auto"


# ---- errors and Ctrl-C: one line on stderr, a non-zero exit, no traceback without --debug ------


def one_error_line(proc):
    assert proc.returncode not in (0, None), (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    return lines[0]


def test_user_errors_are_one_line_and_a_nonzero_exit(ckpt, tmp_path, capsys):
    """In this process (a subprocess each would pay the torch import again): main() ends in a
    SystemExit whose message (what the interpreter prints) is one "error: ..." line."""
    from qwen3_model.__main__ import main

    small = [a for a in SMALL if a != "--no-progress"]
    cases = [
        (["--model", ckpt, "--prompts-file", str(tmp_path / "missing.txt"), *SMALL],
         "does not exist"),
        (["--model", ckpt, "--prompts-file", str(tmp_path), *SMALL], "is a directory"),
        (["--top-p", "1e-50", "--no-progress"], "SamplingParams.top_p"),  # the demo, no model
        (["--model", ckpt, "hi", "--temperature", "inf", *SMALL], "SamplingParams.temperature"),
        (["--model", ckpt, "hi", "--min-p", "nan", *SMALL], "SamplingParams.min_p"),
        (["--model", ckpt, "hi", "--repetition-penalty", "0", *SMALL],
         "SamplingParams.repetition_penalty"),
        (["--model", ckpt, "x" * 300, *SMALL], "max_model_len"),  # refused by the engine
        (["--model", str(tmp_path / "nothing"), "hi", *SMALL], "checkpoint folder"),
        (["serve", "--model", str(tmp_path / "nothing"), *small], "checkpoint folder"),
        (["serve", "--model", ckpt, "--port", "70000", *small], "--port"),
    ]
    for args, words in cases:
        with pytest.raises(SystemExit) as e:
            main(args)
        msg = e.value.code
        assert isinstance(msg, str) and msg.startswith("error: ") and "\n" not in msg, (args, msg)
        assert words in msg, (args, msg)
    for args in (["--model", ckpt, "hi", "--top-p", "abc"], ["serve", "--bogus"]):  # argparse's
        with pytest.raises(SystemExit) as e:
            main(args)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err


def test_errors_from_the_command_line_have_no_traceback(ckpt, tmp_path):
    for args, words in [(["--top-p", "1e-50"], "SamplingParams.top_p"),  # (the probe)
                        (["serve", "--model", str(tmp_path / "nothing")], "checkpoint folder")]:
        proc, _ = run_cli(*args, timeout=60)
        line = one_error_line(proc)
        assert proc.returncode == 1 and words in line, (args, line)


def test_debug_shows_the_traceback(tmp_path):
    for args in (["--debug", "--prompts-file", str(tmp_path / "missing.txt"), "--no-progress"],):
        proc, _ = run_cli(*args, timeout=60)
        assert proc.returncode == 1
        assert "Traceback" in proc.stderr and proc.stderr.strip().splitlines()[-1].startswith(
            "error: "), proc.stderr[-3000:]


def interrupt(args, ready: str, delay: float = 1.0):
    """Start the CLI, wait for ``ready`` on its stdout, then ``delay`` s, then SIGINT."""
    import signal

    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.Popen([sys.executable, "-m", "qwen3_model", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_as_a_terminal_sends_it)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # (the line comes flushed; readline returns with it)
            line = proc.stdout.readline()
            if ready in line or not line:
                break
        assert ready in line, (line, proc.poll())
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode, err


def test_ctrl_c_is_one_line_and_exit_130(ckpt):
    # the demo, mid-generation (or loading: either way)
    rc, err = interrupt(["--max-tokens", "900", "--max-model-len", "1024", "--no-progress"],
                        "RANDOM-WEIGHT")
    assert rc == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "interrupted", err[-3000:]
    # the server, serving
    rc, err = interrupt(["serve", "--model", ckpt, "--port", "0", "--block-size", "16",
                         "--max-model-len", "256", "--log-level", "warning"],
                        "qwen3_model serve:", delay=0.5)
    assert rc == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "interrupted", err[-3000:]
