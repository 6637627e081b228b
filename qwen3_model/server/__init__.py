"""The OpenAI-compatible HTTP server over the online engine (``qwen3_model.engine.async_llm``).

    python -m qwen3_model serve --model ~/Qwen3-0.6B --port 8000      # or: qwen3-serve ...

``protocol.py`` reads requests and writes responses, ``app.py`` is the FastAPI app, ``cli.py``
the command line and the server's lifetime (drain on SIGTERM).
"""
