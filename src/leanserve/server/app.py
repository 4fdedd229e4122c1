"""The OpenAI-compatible HTTP server: /v1/models, /v1/completions, /v1/chat/completions (streaming or not),
/tokenize and /detokenize (vLLM's shapes), /health and /metrics, over one AsyncEngine (one engine loop,
continuous batching)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from leanserve.chat.template import load_chat_format
from leanserve.server import chat_api, protocol
from leanserve.server.async_engine import AsyncEngine, EngineStopped
from leanserve.server.choice import Choice
from leanserve.server.metrics import ServerMetrics
from leanserve.server.protocol import APIError, GenRequest

logger = logging.getLogger("leanserve")


def build_app(llm, served_model_name: str, api_key: str | None = None, chat_template: str | None = None) -> FastAPI:
    """chat_template: a Jinja file that overrides the model's chat format (`chat/template.py`)."""
    engine = llm.engine
    metrics = ServerMetrics(llm)
    fmt = load_chat_format(engine.config.model, engine.tokenizer, chat_template)
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

    def chat_prompt(body: dict, add_generation_prompt: bool = True, generating: bool = False):
        """(the prompt's ids, the parsed chat) of a chat request's fields."""
        if engine.tokenizer is None:
            raise protocol.bad("This model has no tokenizer, so chat messages cannot be encoded.", "messages")
        chat = chat_api.parse_chat(body, fmt)
        if generating and fmt.structured and chat.messages[-1]["role"] not in ("user", "tool"):
            raise protocol.bad(
                "The last message must be a user or tool message: DeepSeek-V4's format answers those "
                "(continuing an assistant message is not supported).", "messages",
            )  # fmt: skip
        try:
            return fmt.encode(engine.tokenizer, chat, add_generation_prompt), chat
        except ValueError as e:
            raise protocol.bad(str(e), "messages") from None

    async def generate(request: Request, chat: bool):
        check_auth(request)
        async_engine = check_open()
        body = protocol.parse_json(await request.body())
        inputs = []  # the chat's parsed fields, when chat
        req = protocol.parse_request(
            body, chat=chat, served=[served_model_name], max_model_len=engine.max_model_len,
            vocab_size=engine.model_config.vocab_size, tokenizer=engine.tokenizer, chat_prompt=lambda b: inputs.append(chat_prompt(b, generating=True)) or inputs[-1][0],
        )  # fmt: skip
        structured = chat and fmt.structured  # the output is parsed into reasoning, content and tool calls
        constraint = _constraint(body, inputs[0][1] if chat else None)
        if constraint is not None:
            spec, param = constraint
            try:  # the grammar compiled now: a schema it cannot take is a 400 before anything is queued
                engine.check_structured(spec)
                req.params = dataclasses.replace(req.params, structured=spec)
            except ValueError as e:
                raise protocol.bad(str(e), param) from None
        jobs, parsers = [], {}
        for p_index, prompt in enumerate(req.prompts):
            max_tokens = engine.max_model_len - len(prompt) if req.max_tokens is None else req.max_tokens
            for i in range(req.n):
                seed = req.params.seed + i if req.params.seed is not None and req.n > 1 else req.params.seed
                params = dataclasses.replace(req.params, max_tokens=max_tokens, seed=seed)
                try:
                    engine.check_request(prompt, params)
                except ValueError as e:
                    raise protocol.bad(str(e), "messages" if chat else "prompt") from None
                index = p_index * req.n + i
                if structured:  # markup tokens stay in the text for the parser; the finishing EOS does not
                    parsers[index] = chat_api.new_parser(inputs[0][1], fmt)
                    extra = {"keep_special": True, "drop_ids": frozenset(engine.eos_token_ids)}
                else:
                    extra = {}
                choice = Choice(index, len(prompt), req.stop, engine.tokenizer, **extra)
                jobs.append((choice, async_engine.generate(prompt, params)))
        metrics.prompt_tokens(sum(len(p) for p in req.prompts))
        path = request.url.path
        thinking = structured and inputs[0][1].thinking
        if req.stream:
            stream = _stream(req, jobs, parsers, thinking, metrics, path)
            return StreamingResponse(stream, media_type="text/event-stream")
        return await _complete(request, req, jobs, parsers, thinking, metrics, path)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's shape: {"model", "prompt"} or {"model", "messages", ...} -> {"tokens", "count", "max_model_len"}."""
        check_auth(request)
        body = protocol.parse_json(await request.body())
        protocol.check_model(body, [served_model_name])
        chat = "messages" in body
        known = {"model", "return_token_strs"} | (
            {"messages", "add_generation_prompt", "chat_template_kwargs", "tools", "tool_choice", "reasoning_effort"}
            if chat
            else {"prompt", "add_special_tokens"}
        )
        protocol.refuse_unknown(body, known)
        if engine.tokenizer is None:
            raise protocol.bad("This model has no tokenizer.", "messages" if chat else "prompt")
        if chat:
            tokens, _ = chat_prompt(body, protocol.read_bool(body, "add_generation_prompt", True))
        elif isinstance(body.get("prompt"), str):
            tokens = engine.tokenizer.encode(body["prompt"], protocol.read_bool(body, "add_special_tokens", True))
        else:
            raise protocol.bad("'prompt' (a string) or 'messages' is required.", "prompt")
        out = {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}
        if protocol.read_bool(body, "return_token_strs", False):
            out["token_strs"] = [engine.tokenizer.id_to_token(t) for t in tokens]
        metrics.request_done("/tokenize", 200)
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """{"model", "tokens"} -> {"prompt"}: the text of the ids, special tokens included."""
        check_auth(request)
        body = protocol.parse_json(await request.body())
        protocol.check_model(body, [served_model_name])
        protocol.refuse_unknown(body, {"model", "tokens"})
        tokens = body.get("tokens")
        vocab = engine.tokenizer.vocab_size if engine.tokenizer is not None else 0
        if not isinstance(tokens, list) or not all(protocol.is_token(t) and 0 <= t < vocab for t in tokens):
            raise protocol.bad(f"'tokens' must be a list of token ids in [0, {vocab}).", "tokens")
        metrics.request_done("/detokenize", 200)
        return {"prompt": engine.tokenizer.decode(tokens, skip_special_tokens=False)}

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
            if delta.prompt_logprobs is not None:
                choice.prompt_logprobs = delta.prompt_logprobs
            choice.cached_tokens = max(choice.cached_tokens, delta.cached_tokens)
            text, entries = choice.add(delta.tokens, delta.finish_reason)
            await on_delta(choice, text, entries)
            if choice.done:
                return  # leaving the generator aborts the request when a stop string ended it early


def _constraint(body: dict, chat: chat_api.ChatInput | None):
    """(what the output must obey, the field that asked), or None: OpenAI's response_format and a forced
    tool_choice (chat), vLLM's structured_outputs / guided_* (both endpoints); two of them: 400."""
    openai_spec = chat_api.structured_output(body, chat) if chat is not None else None
    vllm = protocol.vllm_structured(body, after_think=chat is not None and chat.thinking)
    if openai_spec is not None and vllm is not None:
        raise protocol.bad(f"'{vllm[1]}' and 'response_format' / 'tool_choice' both constrain the output.", vllm[1])
    if openai_spec is not None:
        return openai_spec, "response_format" if openai_spec.kind == "json" else "tools"
    return vllm


def _echo(req: GenRequest, choice: Choice) -> tuple[str, list[dict]]:
    """The prompt's text as the model read it (special tokens included, so that the tokens' text_offsets
    index it), and its tokens' logprob entries (the first has none) when logprobs are asked."""
    prompt = req.prompts[choice.index // req.n]
    text = choice.tokenizer.decode(prompt, skip_special_tokens=False) if choice.tokenizer is not None else ""
    if req.logprobs is None:
        return text, []
    entries = []
    for token, entry in zip(prompt, choice.prompt_logprobs, strict=True):
        piece = choice.piece(token)
        if entry is None:
            entries.append({"token": piece, "logprob": None, "top": None})
        else:
            top = sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)
            top = [(lp.decoded_token, lp.logprob) for lp in top[: req.logprobs]]
            entries.append({"token": piece, "logprob": entry[token].logprob, "top": top})
    return text, entries


def _usage(req: GenRequest, choices: list[Choice]) -> dict:
    # (each prompt counted once, as in prompt_tokens: its cached tokens are its first choice's)
    cached = sum(c.cached_tokens for c in choices if c.index % req.n == 0)
    return protocol.usage(sum(len(p) for p in req.prompts), sum(len(c.token_ids) for c in choices), cached)


def _finish(choice: Choice, called_tools: bool = False) -> str:
    if called_tools:
        return "tool_calls"
    return "length" if choice.finish_reason == "length" else "stop"


async def _complete(request: Request, req: GenRequest, jobs, parsers: dict, thinking: bool, metrics, path: str):
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
        if c.index in parsers:  # reasoning, content and tool calls parsed out of the text
            parser = parsers[c.index]
            parser.feed(text)
            parser.finish()
            message = chat_api.message(parser, thinking)
            item = {"index": c.index, "message": message, "finish_reason": _finish(c, bool(parser.tool_calls))}
            item["logprobs"] = protocol.chat_logprobs(entries[c.index]) if req.logprobs is not None else None
        elif req.chat:
            item = {"index": c.index, "message": {"role": "assistant", "content": text}, "finish_reason": _finish(c)}
            item["logprobs"] = protocol.chat_logprobs(entries[c.index]) if req.logprobs is not None else None
        else:
            echoed, echoed_entries = _echo(req, c) if req.echo else ("", [])
            item = {"index": c.index, "text": echoed + text, "finish_reason": _finish(c)}
            lps = echoed_entries + entries[c.index]
            item["logprobs"] = protocol.completion_logprobs(lps, 0) if req.logprobs is not None else None
            if req.prompt_logprobs is not None:
                item["prompt_logprobs"] = protocol.prompt_logprobs(c.prompt_logprobs, req.prompt_logprobs)
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


async def _stream(req: GenRequest, jobs, parsers: dict, thinking: bool, metrics: ServerMetrics, path: str):
    obj = "chat.completion.chunk" if req.chat else "text_completion"
    queue: asyncio.Queue = asyncio.Queue()

    def chunk(choices: list[dict], **extra) -> str:
        payload = {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": choices}
        return f"data: {json.dumps({**payload, **extra})}\n\n"

    async def forward(choice, text, entries):  # whether this delta ended the choice: read now, not when sent
        await queue.put((choice, text, entries, choice.done))

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
        call_ids: dict[int, list[str]] = {i: [] for i in parsers}
        while (item := await queue.get()) is not None:
            choice, text, entries, done = item
            finish = _finish(choice) if done else None
            if choice.index in parsers:  # the parser's deltas: reasoning, content, tool-call fragments
                parser, ids = parsers[choice.index], call_ids[choice.index]
                deltas = [parser.feed(text)] + ([parser.finish()] if done else [])
                fields = [chat_api.delta_fields(d, ids) for d in deltas]
                finish = _finish(choice, bool(ids)) if done else None
                for i, delta in enumerate(fields):
                    last = i == len(fields) - 1
                    if delta or (last and (finish is not None or entries)):
                        piece = {"index": choice.index, "delta": delta, "finish_reason": finish if last else None}
                        show = last and req.logprobs is not None
                        piece["logprobs"] = protocol.chat_logprobs(entries) if show else None
                        yield chunk([piece])
                continue
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
