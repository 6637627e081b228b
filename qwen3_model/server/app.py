"""The OpenAI-compatible HTTP API over the online engine (FastAPI).

    app = build_app(AsyncLLM(path), served_model_name="qwen3", max_waiting_requests=256)

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming),
GET /v1/models, GET /health, GET /metrics. Request fields: ``protocol.py``. A client that goes
away (before or during a stream, or while waiting for a whole response) has its request aborted,
so its KV blocks are freed at the next step.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from qwen3_model.engine.async_llm import AsyncLLM, EngineStopped
from qwen3_model.server import protocol as P


def _json(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _sse(obj) -> str:
    return f"data: {_json(obj)}\n\n"


class _EventStream(StreamingResponse):
    """An SSE response that runs ``on_close`` (abort the stream's requests; a no-op for finished
    ones) however it ends. The generator's own cleanup is not enough: a client that leaves
    before the body starts (the response still at its first send) cancels a generator that
    never ran, so no ``finally`` of it runs, and its requests would generate to the end for
    nobody."""

    def __init__(self, gen, on_close):
        super().__init__(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def error_response(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class _Choice:
    """One choice's generation (a prompt's, n of them a prompt), accumulated from its deltas."""

    def __init__(self, index: int, prompt_ids: list[int]):
        self.index = index
        self.prompt_ids = prompt_ids
        self.text: list[str] = []
        self.num_tokens = 0  # generated, the stop id / EOS that ended it included (usage)
        self.lp_ids: list[int] = []  # the tokens with text, for logprobs
        self.lps: list = []  # their TokenLogprobs
        self.prompt_lps = None  # the prompt's TokenLogprobs (echo with logprobs)
        self.finish_reason: str | None = None

    def add(self, d, visible) -> tuple[list[int], list]:
        """Take delta ``d``; -> its (token ids, logprob entries) that have text."""
        self.text.append(d.text)
        self.num_tokens += len(d.token_ids)
        if d.prompt_logprobs is not None:
            self.prompt_lps = d.prompt_logprobs
        if d.finished:
            self.finish_reason = d.finish_reason
        ids, lps = visible(d)
        self.lp_ids += ids
        self.lps += lps
        return ids, lps


def build_app(engine: AsyncLLM, served_model_name: str, max_waiting_requests: int = 256,
              model_aliases: tuple[str, ...] = ()) -> FastAPI:
    app = FastAPI(title="qwen3-kernels", docs_url=None, redoc_url=None)
    app.state.draining = False
    tok = engine.tokenizer
    text_of = P.TokenText(tok)
    names = {served_model_name, *model_aliases}
    llm = engine.engine
    max_model_len = llm.config.max_model_len
    pool_tokens = llm.scheduler.block_manager.num_blocks * llm.config.kvcache_block_size
    eos_ids = frozenset(llm.config.eos_token_ids)
    created = int(time.time())

    # ---- shared steps ------------------------------------------------------------------------

    async def read_body(request: Request) -> dict:
        if app.state.draining or not engine.is_running:
            raise P.APIError(503, "the server is shutting down" if engine.error is None else
                             f"the engine failed ({engine.error}); restart the server",
                             type_="server_overloaded", code="server_unavailable")
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise P.bad(None, f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise P.bad(None, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model not in names:
            raise P.APIError(404, f"the model {model!r} does not exist; this server serves "
                                  f"{served_model_name!r}", "model", code="model_not_found")
        return body

    def encode(prompt) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if tok is None:
            raise P.bad("prompt", "this model has no tokenizer: send token ids")
        return list(tok(prompt)["input_ids"])

    def admit(prompts_ids: list[list[int]], params: list) -> list[str]:
        """Queue one request per (prompt, its SamplingParams), all checked first; -> their ids."""
        if len(prompts_ids) > max_waiting_requests:  # (would never fit: not a retry later)
            raise P.bad("n", f"this request asks for {len(prompts_ids)} generations (prompts "
                             f"x n); the server queues at most {max_waiting_requests}")
        if engine.num_waiting() + len(prompts_ids) > max_waiting_requests:
            raise P.APIError(503, f"the server is overloaded: more than {max_waiting_requests} "
                                  "requests are waiting; retry later",
                             type_="server_overloaded", code="server_busy")
        try:
            llm.validate_requests(prompts_ids, params)
        except ValueError as e:
            raise P.engine_error(e) from None
        rids = []
        try:
            for ids, sp in zip(prompts_ids, params):
                rids.append(engine.add_request(ids, sp))
        except EngineStopped as e:
            for rid in rids:  # (this response reads none of them)
                engine.abort_request(rid, unread=True)
            raise P.APIError(503, str(e), type_="server_overloaded",
                             code="server_unavailable") from None
        return rids

    def visible_of(params):
        def visible(d) -> tuple[list[int], list]:
            """The delta's token ids and logprob entries without the stop id / EOS that ended the
            request (it is not part of the text)."""
            ids, lps = d.token_ids, d.logprobs or []
            if d.finished and d.finish_reason == "stop" and ids and (
                    ids[-1] in params.stop_token_ids
                    or (not params.ignore_eos and ids[-1] in eos_ids)):
                ids, lps = ids[:-1], lps[:-1]
            return ids, lps
        return visible

    async def merged(rids: list[str]):
        """(choice index, delta) from every request, as they come."""
        if len(rids) == 1:
            async for d in engine.outputs(rids[0]):
                yield 0, d
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i, rid):
            try:
                async for d in engine.outputs(rid):
                    q.put_nowait((i, d))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                q.put_nowait((i, e))

        tasks = [asyncio.create_task(pump(i, rid)) for i, rid in enumerate(rids)]
        try:
            left = len(rids)
            while left:
                i, d = await q.get()
                if isinstance(d, BaseException):
                    raise d
                if d.finished:
                    left -= 1
                yield i, d
        finally:
            for t in tasks:
                t.cancel()
            for rid in rids:
                engine.abort_request(rid)  # (no-op for finished ones)

    async def run_to_end(request: Request, rids, choices, params) -> bool:
        """Collect every delta into ``choices``; False: the client went away (the requests
        were aborted)."""

        visible = visible_of(params)

        async def collect():
            async for i, d in merged(rids):
                choices[i].add(d, visible)

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.create_task(collect())
        watch = asyncio.create_task(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()  # (the client left: merged's cleanup aborts the requests)
                for rid in rids:
                    engine.abort_request(rid)
        if not work.done():
            return False
        work.result()  # re-raise a failure
        return True

    def sse_response(gen, rids: list[str]) -> StreamingResponse:
        # unread: a stream that never started leaves outputs nobody claims (each a no-op for
        # requests its generator read)
        return _EventStream(gen, lambda: [engine.abort_request(rid, unread=True) for rid in rids])

    async def handle(request: Request, endpoint):
        try:
            return await endpoint(await read_body(request), request)
        except P.APIError as e:
            return error_response(e)
        except EngineStopped as e:
            return error_response(P.APIError(503, str(e), type_="server_overloaded",
                                             code="server_unavailable"))
        except Exception as e:  # noqa: BLE001 - this request fails, the server goes on
            return error_response(P.APIError(500, f"{type(e).__name__}: {e}",
                                             type_="internal_server_error"))

    def fail_chunk(e: BaseException) -> str:
        err = (e if isinstance(e, P.APIError) else
               P.APIError(500, f"{type(e).__name__}: {e}", type_="internal_server_error"))
        return _sse(err.body())

    # ---- completions ---------------------------------------------------------------------------

    async def completions(body: dict, request: Request):
        req = P.completion_request(body)
        prompts_ids = [encode(p) for p in req.prompts]
        params = req.params
        n = req.n
        # choice i = prompt i // n, its choice i % n
        choice_ids = [ids for ids in prompts_ids for _ in range(n)]
        rids = admit(choice_ids, P.choice_params(params, n) * len(prompts_ids))
        choices = [_Choice(i, ids) for i, ids in enumerate(choice_ids)]
        cid = P.new_id("cmpl")
        now = int(time.time())
        prompt_tokens = sum(len(ids) for ids in prompts_ids)  # (once a prompt, as OpenAI's)
        echo_text = [p if isinstance(p, str) else (tok.decode(p) if tok else "")
                     for p in req.prompts for _ in range(n)] if req.echo else None

        visible = visible_of(params)

        def logprobs_obj(c: _Choice, ids, lps, offset: int, with_prompt: bool):
            lp = P.completion_logprobs(lps, ids, text_of, offset)
            if with_prompt and c.prompt_lps is not None:  # echo: the prompt's first
                plp = P.completion_logprobs(c.prompt_lps, c.prompt_ids, text_of, 0)
                lp = {k: plp[k] + lp[k] for k in lp}
            return lp

        if req.stream:
            async def gen():
                offsets = [len(echo_text[i]) if echo_text else 0 for i in range(len(rids))]
                started = [False] * len(rids)
                try:
                    async for i, d in merged(rids):
                        c = choices[i]
                        ids, lps = c.add(d, visible)
                        text = d.text
                        first = not started[i]
                        started[i] = True
                        if req.echo and first:
                            text = echo_text[i] + text
                        lp = None
                        if req.logprobs is not None:
                            lp = logprobs_obj(c, ids, lps, offsets[i], req.echo and first)
                            offsets[i] += sum(len(text_of(t)) for t in ids)
                        yield _sse(P.envelope(cid, "text_completion", served_model_name, [
                            {"index": i, "text": text, "logprobs": lp,
                             "finish_reason": d.finish_reason}], now))
                    yield _sse(P.envelope(cid, "text_completion", served_model_name, [], now,
                                          usage=P.usage(prompt_tokens,
                                                        sum(c.num_tokens for c in choices))))
                except Exception as e:  # noqa: BLE001 - the stream ends with the error
                    yield fail_chunk(e)
                yield "data: [DONE]\n\n"

            return sse_response(gen(), rids)

        if not await run_to_end(request, rids, choices, params):
            return Response(status_code=499)  # (nobody reads it: the client left)
        out = []
        for i, c in enumerate(choices):
            offset = len(echo_text[i]) if echo_text else 0
            lp = (logprobs_obj(c, c.lp_ids, c.lps, offset, req.echo)
                  if req.logprobs is not None else None)
            text = "".join(c.text)
            out.append({"index": i, "text": echo_text[i] + text if req.echo else text,
                        "logprobs": lp, "finish_reason": c.finish_reason})
        return JSONResponse(P.envelope(cid, "text_completion", served_model_name, out, now,
                                       usage=P.usage(prompt_tokens,
                                                     sum(c.num_tokens for c in choices))))

    # ---- chat ------------------------------------------------------------------------------------

    async def chat(body: dict, request: Request):
        req = P.chat_request(body)
        if tok is None or not getattr(tok, "chat_template", None):
            raise P.bad("messages", "this model has no chat template; use /v1/completions")
        try:
            text = tok.apply_chat_template(req.messages, tokenize=False,
                                           add_generation_prompt=True, **req.template_kwargs)
        except Exception as e:  # noqa: BLE001 - jinja's errors, for one request
            raise P.bad("messages", f"the chat template failed on these messages: {e}") from None
        ids_ = list(tok(text, add_special_tokens=False)["input_ids"])
        max_tokens = req.max_tokens
        if max_tokens is None:  # up to the context (and what the KV pool can ever hold)
            max_tokens = max(1, min(max_model_len, pool_tokens) - len(ids_))
        params = P.sampling_params(body, max_tokens, req.logprobs)
        try:
            rids = admit([ids_] * req.n, P.choice_params(params, req.n))
        except P.APIError as e:
            if e.param == "prompt":
                e.param = "messages"
            raise
        choices = [_Choice(i, ids_) for i in range(req.n)]
        cid = P.new_id("chatcmpl")
        now = int(time.time())

        def chunk(i: int, delta: dict, lp=None, finish_reason=None) -> str:
            return _sse(P.envelope(cid, "chat.completion.chunk", served_model_name, [
                {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}],
                now))

        def usage():
            return P.usage(len(ids_), sum(c.num_tokens for c in choices))

        visible = visible_of(params)
        if req.stream:
            async def gen():
                for i in range(req.n):
                    yield chunk(i, {"role": "assistant", "content": ""})
                try:
                    async for i, d in merged(rids):
                        ids, lps = choices[i].add(d, visible)
                        lp = (P.chat_logprobs(lps, ids, text_of)
                              if req.logprobs is not None else None)
                        if d.text or lp is not None or not d.finished:
                            yield chunk(i, {"content": d.text}, lp)
                        if d.finished:  # (the finish reason in a chunk of its own, as OpenAI's)
                            yield chunk(i, {}, finish_reason=d.finish_reason)
                    yield _sse(P.envelope(cid, "chat.completion.chunk", served_model_name, [],
                                          now, usage=usage()))
                except Exception as e:  # noqa: BLE001 - the stream ends with the error
                    yield fail_chunk(e)
                yield "data: [DONE]\n\n"

            return sse_response(gen(), rids)

        if not await run_to_end(request, rids, choices, params):
            return Response(status_code=499)
        out = []
        for c in choices:
            lp = (P.chat_logprobs(c.lps, c.lp_ids, text_of)
                  if req.logprobs is not None else None)
            out.append({"index": c.index,
                        "message": {"role": "assistant", "content": "".join(c.text)},
                        "logprobs": lp, "finish_reason": c.finish_reason})
        return JSONResponse(P.envelope(cid, "chat.completion", served_model_name, out, now,
                                       usage=usage()))

    # ---- routes ----------------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def _completions(request: Request):
        return await handle(request, completions)

    @app.post("/v1/chat/completions")
    async def _chat(request: Request):
        return await handle(request, chat)

    @app.get("/v1/models")
    async def _models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model",
                                            "created": created, "owned_by": "qwen3-kernels",
                                            "max_model_len": max_model_len}]}

    @app.get("/health")
    async def _health():
        if app.state.draining or not engine.is_running:
            return JSONResponse({"status": "draining" if engine.error is None else "failed"},
                                status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def _metrics():
        return PlainTextResponse(engine.metrics.render(engine.stats()),
                                 media_type="text/plain; version=0.0.4")

    @app.exception_handler(404)
    async def _not_found(request: Request, exc):
        return error_response(P.APIError(404, f"no route {request.method} {request.url.path}",
                                         code="not_found"))

    @app.exception_handler(405)
    async def _bad_method(request: Request, exc):
        return error_response(P.APIError(405, f"{request.method} is not allowed on "
                                              f"{request.url.path}", code="method_not_allowed"))

    return app
