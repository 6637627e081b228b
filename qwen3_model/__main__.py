"""Command line: ``python -m qwen3_model`` (also installed as ``qwen3-generate``).

    python -m qwen3_model --model ~/Qwen3-0.6B "The capital of France is" --max-tokens 32
    python -m qwen3_model --model ~/Qwen3-0.6B --chat "Write a haiku about GPUs" --temperature 0.7
    python -m qwen3_model --model ~/Qwen3-0.6B --prompts-file prompts.txt --temperature 0
    python -m qwen3_model            # no model: a small random-weight Qwen3, one batch, throughput
    python -m qwen3_model serve --model ~/Qwen3-0.6B --port 8000    # the OpenAI-compatible server

Errors: every failure (a bad flag, a missing file, a bad checkpoint, a request the engine refuses)
is one line on stderr, "error: ...", and exit status 1 (2 for a flag argparse refuses); Ctrl-C is
one line, "interrupted", and exit status 130. --debug shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from qwen3_model.command import Parser, add_debug_arg, add_engine_args, engine_kwargs, guarded

DEMO_PROMPTS = 12


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m qwen3_model",
        description="Generate text with a Qwen3 checkpoint on the qwen3-kernels engine. Without "
                    "--model, builds a small random-weight Qwen3 in a temporary folder, runs a "
                    "batch through the full engine loop and prints the throughput (a smoke test "
                    "that needs no download and no GPU).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts to complete")
    p.add_argument("--model", help="Hugging Face Qwen3 checkpoint folder (config.json, "
                   "*.safetensors, tokenizer files) or Hub repo id ORG/NAME[@REVISION] "
                   "(downloaded to the HF cache; HF_HUB_OFFLINE=1: the cache only); omit for "
                   "the random-weight demo")
    p.add_argument("--prompts-file", help="file with one prompt per line ('-' for stdin)")
    p.add_argument("--chat", action="store_true",
                   help="wrap each prompt as a user message in the checkpoint's chat template")
    p.add_argument("--system", help="system message for --chat")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    s = p.add_argument_group("sampling")
    s.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    s.add_argument("--top-k", type=int, default=-1, help="-1 = all tokens")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=None, help="per-request seed (reproducible output)")
    s.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt at most")
    s.add_argument("--min-tokens", type=int, default=0)
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable); not included in the output")
    s.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID",
                   help="stop token id (repeatable)")
    s.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from the logit of a token already in the output ([-2, 2])")
    s.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="times the token's count in the output, subtracted ([-2, 2])")
    s.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 1 makes tokens of the prompt or the output less likely (1 = none)")

    add_engine_args(p)
    add_debug_arg(p)
    return p


def read_prompts(args) -> list[str]:
    prompts = list(args.prompts)
    path = args.prompts_file
    if path:
        if path != "-" and not os.path.isfile(path):
            what = "is a directory" if os.path.isdir(path) else "does not exist"
            raise ValueError(f"--prompts-file {path!r} {what}; expected a text file with one "
                             "prompt per line ('-' for stdin)")
        try:
            f = sys.stdin if path == "-" else open(path, encoding="utf-8")
            with f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except UnicodeDecodeError as e:
            raise ValueError(f"--prompts-file {path!r} is not UTF-8 text ({e.reason} at byte "
                             f"{e.start})") from None
        except OSError as e:
            raise ValueError(f"--prompts-file {path!r} cannot be read: "
                             f"{e.strerror or e}") from None
    return prompts


def sampling_params(args, **overrides):
    from qwen3_model.sampling_params import SamplingParams

    kw = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
              seed=args.seed, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
              ignore_eos=args.ignore_eos, stop=args.stop, stop_token_ids=args.stop_token_id,
              presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
              repetition_penalty=args.repetition_penalty)
    kw.update(overrides)
    return SamplingParams(**kw)


def apply_chat(llm, prompts: list[str], system: str | None) -> list[str]:
    tok = llm.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise SystemExit("error: --chat needs a tokenizer with a chat template in the checkpoint")
    out = []
    for prompt in prompts:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}]
        out.append(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return out


def report(outs, seconds: float, llm) -> None:
    n_out = sum(len(o.token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    sched = llm.scheduler
    print(f"\n{len(outs)} requests: {n_in} prompt tokens ({sched.num_prefix_hit_tokens} from the "
          f"prefix cache), {n_out} output tokens in {seconds:.2f} s: "
          f"{n_out / seconds:,.1f} output tok/s, {(n_in + n_out) / seconds:,.1f} total tok/s "
          f"({sched.num_steps} steps, {sched.num_preemptions} preemptions)")


def run_demo(args) -> None:
    max_tokens = args.max_tokens if args.max_tokens != 128 else 32
    sp = sampling_params(args, max_tokens=max_tokens, ignore_eos=True)  # (checked before any work)
    prompts = read_prompts(args) or [
        f"You are a helpful assistant. Answer briefly. Question {i}: what is {i} times {i + 3}?"
        for i in range(DEMO_PROMPTS)
    ]
    import torch

    from qwen3_model.llm import LLM
    from qwen3_model.random_checkpoint import DEMO_SHAPE, write_random_checkpoint

    if args.device in ("auto", "cpu") and not torch.cuda.is_available():
        # The demo's matrices are too small for intra-op threads to pay off, and OpenMP
        # spin-waits make a busy machine far slower with them.
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="qwen3-random-") as path:
        write_random_checkpoint(path, "demo")
        print(f"No --model given: built a small RANDOM-WEIGHT Qwen3 in {path} "
              f"({DEMO_SHAPE['num_hidden_layers']} layers, hidden {DEMO_SHAPE['hidden_size']}, "
              f"vocab {DEMO_SHAPE['vocab_size']}, character tokenizer). Its output is noise; this "
              "run only shows the engine working end to end. Pass --model PATH to use a real "
              "checkpoint.", flush=True)
        kw = engine_kwargs(args)
        kw.update(kvcache_block_size=16 if args.block_size == 256 else args.block_size,
                  max_model_len=min(args.max_model_len, 1024))
        llm = LLM(path, **kw)
        start = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=not args.no_progress)
        seconds = time.perf_counter() - start
        print(f"first completion: {outs[0].text!r}")
        report(outs, seconds, llm)


def run_model(args) -> None:
    from qwen3_model.llm import LLM

    prompts = read_prompts(args)
    if not prompts:
        raise SystemExit("error: give prompts as arguments or with --prompts-file")
    if args.stream and len(prompts) != 1:
        raise SystemExit("error: --stream prints one prompt's tokens as they come; give one prompt")
    sp = sampling_params(args)  # (checked before the model loads)
    llm = LLM(args.model, **engine_kwargs(args))
    if args.chat:
        prompts = apply_chat(llm, prompts, args.system)
    start = time.perf_counter()
    if args.stream:
        outs_text, n_tokens = [], 0
        for delta in llm.stream(prompts, sp):
            print(delta.text, end="", flush=True)
            outs_text.append(delta.text)
            n_tokens += len(delta.token_ids)
        seconds = time.perf_counter() - start
        print(f"\n\n[{n_tokens} tokens in {seconds:.2f} s: {n_tokens / seconds:,.1f} tok/s]")
        return
    outs = llm.generate(prompts, sp, use_tqdm=not args.no_progress)
    seconds = time.perf_counter() - start
    for prompt, out in zip(prompts, outs):
        print(f"\n=== prompt {out.index} ===\n{prompt}\n--- output ({out.finish_reason}) ---\n"
              f"{out.text}")
    report(outs, seconds, llm)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        from qwen3_model.server.cli import main as serve

        return serve(argv[1:])

    def run():
        args = build_parser().parse_args(argv)
        return run_demo(args) if args.model is None else run_model(args)

    # (--debug read before parsing: a Ctrl-C while argparse runs is guarded too)
    return guarded(run, "--debug" in argv)


if __name__ == "__main__":
    main()
