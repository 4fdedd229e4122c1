"""The OpenAI-compatible HTTP server: /v1/models, /v1/completions, /v1/chat/completions (streaming or not),
/health and /metrics, over one AsyncEngine (one engine loop, continuous batching)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from leanserve.server import protocol
from leanserve.server.async_engine import AsyncEngine, EngineStopped
from leanserve.server.choice import Choice
from leanserve.server.metrics import ServerMetrics
from leanserve.server.protocol import APIError, GenRequest

logger = logging.getLogger("leanserve")


class ChatTemplate:
    """The tokenizer's chat template (tokenizer_config.json's `chat_template`) when the model has one,
    otherwise protocol.plain_chat_prompt."""

    def __init__(self, model_dir: str) -> None:
        self.template = None
        path = Path(model_dir) / "tokenizer_config.json"
        if path.is_file():
            config = json.loads(path.read_text())
            source = config.get("chat_template")
            if isinstance(source, str):
                import jinja2.sandbox

                self.template = jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(source)
                # Special tokens may be plain strings or AddedToken objects ({"content": ...}).
                self.special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}

    def encode(self, tokenizer, messages: list[dict]) -> list[int]:
        if tokenizer is None:
            raise protocol.bad("This model has no tokenizer, so chat messages cannot be encoded.", "messages")
        if self.template is None:
            return tokenizer.encode(protocol.plain_chat_prompt(messages))
        try:
            text = self.template.render(messages=messages, add_generation_prompt=True, **self.special)
        except Exception as e:  # jinja2.TemplateError, or the template's own raise_exception()
            raise protocol.bad(f"The model's chat template rejected the messages: {e}", "messages") from None
        return tokenizer.encode(text, add_special_tokens=False)  # the template writes its own special tokens


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def build_app(llm, served_model_name: str, api_key: str | None = None) -> FastAPI:
    engine = llm.engine
    metrics = ServerMetrics(llm)
    template = ChatTemplate(engine.config.model)
    # on_dead: set by `serve` so that a dead engine (e.g. a pipeline stage that died) stops the server.
    state = {"async": None, "shutting_down": False, "on_dead": None}

    def engine_died(reason: str) -> None:
        if state["on_dead"] is not None:
            state["on_dead"](reason)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state["async"] = AsyncEngine(engine, on_step=metrics.on_step, on_dead=engine_died)
        yield
        state["shutting_down"] = True
        await asyncio.get_running_loop().run_in_executor(None, state["async"].stop)

    app = FastAPI(title="leanserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.leanserve = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        metrics.request_done(request.url.path, e.status)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):  # never a bare 500 page: still OpenAI's shape
        logger.exception("unexpected error serving %s", request.url.path)
        metrics.request_done(request.url.path, 500)
        return JSONResponse(APIError(500, "Internal error.").body(), status_code=500)

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), api_key.encode()):
            raise APIError(
                401, "Missing or wrong API key (send 'Authorization: Bearer <key>').", code="invalid_api_key"
            )

    def check_open() -> AsyncEngine:
        if state["shutting_down"] or state["async"] is None:
            raise APIError(503, "The server is shutting down.", type="server_error", code="shutting_down")
        if state["async"].dead:
            raise APIError(503, state["async"].dead, type="server_error", code="engine_dead")
        return state["async"]

    @app.get("/health")
    async def health():
        if state["async"] is None or state["async"].dead or state["shutting_down"]:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        metrics.request_done("/v1/models", 200)
        card = {"id": served_model_name, "object": "model", "created": int(time.time()), "owned_by": "leanserve"}
        return {"object": "list", "data": [{**card, "max_model_len": engine.max_model_len}]}

    async def generate(request: Request, chat: bool):
        check_auth(request)
        async_engine = check_open()
        body = protocol.parse_json(await request.body())
        req = protocol.parse_request(
            body, chat=chat, served=[served_model_name], max_model_len=engine.max_model_len,
            tokenizer=engine.tokenizer, chat_prompt=lambda m: template.encode(engine.tokenizer, m),
        )  # fmt: skip
        jobs = []
        for p_index, prompt in enumerate(req.prompts):
            max_tokens = req.max_tokens or engine.max_model_len - len(prompt)
            for i in range(req.n):
                seed = req.params.seed + i if req.params.seed is not None and req.n > 1 else req.params.seed
                params = dataclasses.replace(req.params, max_tokens=max_tokens, seed=seed)
                try:
                    engine.check_request(prompt, params)
                except ValueError as e:
                    raise protocol.bad(str(e), "messages" if chat else "prompt") from None
                choice = Choice(p_index * req.n + i, len(prompt), req.stop, engine.tokenizer)
                jobs.append((choice, async_engine.generate(prompt, params)))
        metrics.prompt_tokens(sum(len(p) for p in req.prompts))
        path = request.url.path
        if req.stream:
            return StreamingResponse(_stream(req, jobs, metrics, path), media_type="text/event-stream")
        return await _complete(request, req, jobs, metrics, path)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    return app


async def _run_choice(choice: Choice, gen, on_delta, metrics: ServerMetrics) -> None:
    """Feeds one choice's deltas to on_delta(choice, text, entries); stops the request at a stop string."""
    start = last = time.perf_counter()
    async with contextlib.aclosing(gen):
        async for delta in gen:
            now = time.perf_counter()
            if delta.tokens:
                if not choice.token_ids:
                    metrics.first_token(now - start)
                else:
                    metrics.inter_token(now - last, len(delta.tokens))
                last = now
                metrics.generation_tokens(len(delta.tokens))
            text, entries = choice.add(delta.tokens, delta.finish_reason)
            await on_delta(choice, text, entries)
            if choice.done:
                return  # leaving the generator aborts the request when a stop string ended it early


def _usage(req: GenRequest, choices: list[Choice]) -> dict:
    return protocol.usage(sum(len(p) for p in req.prompts), sum(len(c.token_ids) for c in choices))


def _finish(choice: Choice) -> str:
    return "length" if choice.finish_reason == "length" else "stop"


async def _complete(request: Request, req: GenRequest, jobs, metrics: ServerMetrics, path: str):
    texts: dict[int, list[str]] = {c.index: [] for c, _ in jobs}
    entries: dict[int, list[dict]] = {c.index: [] for c, _ in jobs}

    async def collect(choice, text, new_entries):
        texts[choice.index].append(text)
        entries[choice.index].extend(new_entries)

    work = asyncio.gather(*(_run_choice(c, g, collect, metrics) for c, g in jobs))
    # A client that disconnects while waiting: cancel, which aborts its requests and frees their slots.
    while not work.done():
        done, _ = await asyncio.wait({work}, timeout=0.25)
        if not done and await request.is_disconnected():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, EngineStopped):
                await work
            metrics.request_done(path, 499)
            return Response(status_code=499)
    try:
        work.result()
    except EngineStopped as e:
        raise APIError(503, str(e), type="server_error", code="engine_stopped") from None
    choices = [c for c, _ in jobs]
    if any(c.finish_reason == "abort" for c in choices):  # ended by a shutdown, not by the model
        raise APIError(
            503, "The server is shutting down; the request was ended.", type="server_error", code="shutting_down"
        )
    out_choices = []
    for c in choices:
        text = "".join(texts[c.index])
        if req.chat:
            item = {"index": c.index, "message": {"role": "assistant", "content": text}, "finish_reason": _finish(c)}
            item["logprobs"] = protocol.chat_logprobs(entries[c.index]) if req.logprobs is not None else None
        else:
            item = {"index": c.index, "text": text, "finish_reason": _finish(c)}
            item["logprobs"] = protocol.completion_logprobs(entries[c.index], 0) if req.logprobs is not None else None
        out_choices.append(item)
    metrics.request_done(path, 200)
    return {
        "id": req.id,
        "object": "chat.completion" if req.chat else "text_completion",
        "created": req.created,
        "model": req.model,
        "choices": out_choices,
        "usage": _usage(req, choices),
    }


async def _stream(req: GenRequest, jobs, metrics: ServerMetrics, path: str):
    obj = "chat.completion.chunk" if req.chat else "text_completion"
    queue: asyncio.Queue = asyncio.Queue()

    def chunk(choices: list[dict], **extra) -> str:
        payload = {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": choices}
        return f"data: {json.dumps({**payload, **extra})}\n\n"

    async def forward(choice, text, entries):
        await queue.put((choice, text, entries))

    async def run_all():
        try:
            await asyncio.gather(*(_run_choice(c, g, forward, metrics) for c, g in jobs))
        finally:
            await queue.put(None)

    task = asyncio.create_task(run_all())
    status = 200
    try:
        if req.chat:
            yield chunk(
                [
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for c, _ in jobs
                ]
            )
        offsets = {c.index: 0 for c, _ in jobs}
        while (item := await queue.get()) is not None:
            choice, text, entries = item
            finish = _finish(choice) if choice.done else None
            if not text and not entries and finish is None:
                continue
            if req.chat:
                piece = {"index": choice.index, "delta": {"content": text} if text else {}, "finish_reason": finish}
                piece["logprobs"] = protocol.chat_logprobs(entries) if req.logprobs is not None else None
            else:
                piece = {"index": choice.index, "text": text, "finish_reason": finish}
                piece["logprobs"] = (
                    protocol.completion_logprobs(entries, offsets[choice.index]) if req.logprobs is not None else None
                )
                offsets[choice.index] += sum(len(e["token"]) for e in entries)
            yield chunk([piece])
        try:
            task.result()
            if any(c.finish_reason == "abort" for c, _ in jobs):  # ended by a shutdown, not by the model
                raise EngineStopped("The server is shutting down; the request was ended.")
        except EngineStopped as e:
            status = 503
            yield f"data: {json.dumps(APIError(503, str(e), type='server_error').body())}\n\n"
        if req.include_usage and status == 200:
            yield chunk([], usage=_usage(req, [c for c, _ in jobs]))
        yield "data: [DONE]\n\n"
    except asyncio.CancelledError:  # the client went away: cancelling aborts its requests
        status = 499
        raise
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, EngineStopped):
                await task
        metrics.request_done(path, status)
