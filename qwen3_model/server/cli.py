"""``python -m qwen3_model serve`` (also ``qwen3-serve``): build the online engine, serve the app.

SIGTERM drains: the server stops admitting (new connections are refused, requests on open ones
and /health get 503), gives the requests in flight up to --drain-timeout seconds, aborts the rest,
and exits 0. Ctrl-C does the same and exits 130, printing "interrupted".

Errors (a bad flag, a checkpoint that does not load) are one line on stderr,
"error: ...", and a non-zero exit status; --debug shows the traceback instead.
"""

from __future__ import annotations

import argparse
import signal
import sys

from qwen3_model.command import Parser, add_debug_arg, add_engine_args, engine_kwargs, guarded


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m qwen3_model serve",
        description="Serve a Qwen3 checkpoint over the OpenAI API (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /health, /metrics).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", required=True,
                   help="checkpoint folder or Hugging Face repo id (e.g. Qwen/Qwen3-0.6B)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the name clients send as 'model' (default: --model as given)")
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="requests waiting for a slot beyond this are refused with 503")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds the requests in flight get to finish")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(p)
    add_debug_arg(p)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    return guarded(lambda: serve(build_parser().parse_args(argv)), "--debug" in argv)


def serve(args: argparse.Namespace) -> None:
    if args.max_waiting_requests < 1:
        raise SystemExit("error: --max-waiting-requests must be >= 1")
    if not 0 <= args.port <= 65535:
        raise SystemExit(f"error: --port must be in [0, 65535], got {args.port}")
    try:
        import uvicorn

        from qwen3_model.server.app import build_app
    except ImportError as e:
        raise SystemExit(f"error: serving needs FastAPI and uvicorn ({e}); "
                         "pip install 'qwen3-kernels[serve]'")
    from qwen3_model.engine.async_llm import AsyncLLM

    engine = AsyncLLM(args.model, **engine_kwargs(args))  # (an error: one line, by guarded)
    name = args.served_model_name or args.model
    app = build_app(engine, name, args.max_waiting_requests, model_aliases=(args.model,))

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.draining = True  # /health and new requests: 503 from now on
            if sig == signal.SIGTERM:
                self.should_exit = True  # (not captured: uvicorn would re-raise it at exit)
            else:
                super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=False, timeout_graceful_shutdown=args.drain_timeout,
                            timeout_keep_alive=30)
    print(f"qwen3_model serve: {name!r} on http://{args.host}:{args.port}/v1 "
          f"(max_model_len {engine.config.max_model_len}, "
          f"{engine.stats()['kv_blocks_total']} KV blocks)", flush=True)
    try:
        Server(config).run()  # Ctrl-C: a KeyboardInterrupt once drained ("interrupted", 130)
    finally:
        engine.shutdown(drain_timeout=0.0)  # (uvicorn has drained; what is left is aborted)
