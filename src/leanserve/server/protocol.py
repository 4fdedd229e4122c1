"""OpenAI request parsing and validation, and the response shapes.

Requests are parsed by hand rather than by a schema library so that every problem becomes one 400 in
OpenAI's error shape naming the field (`{"error": {"message", "type", "param", "code"}}`). Unknown fields are
ignored, as OpenAI does.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

from leanserve.sampling_params import SamplingParams

MAX_N = 16
MAX_STOP = 4
MAX_LOGPROBS = 20
MAX_BODY_BYTES = 4 * 1024 * 1024


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type: str | None = None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def parse_json(raw: bytes) -> dict:
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"The request body is larger than {MAX_BODY_BYTES} bytes.", code="body_too_large")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad("The request body is not valid UTF-8.") from None
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise bad(f"The request body is not valid JSON: {e}.") from None
    if not isinstance(body, dict):
        raise bad("The request body must be a JSON object.")
    return body


# --- typed field readers --------------------------------------------------------------------------
def _int(body: dict, name: str, default, lo: int | None = None, hi: int | None = None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{name}' must be an integer, got {json.dumps(value)[:50]}.", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise bad(f"'{name}' must be {bounds}, got {value}.", name)
    return value


def _num(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad(f"'{name}' must be a number, got {json.dumps(value)[:50]}.", name)
    if value < lo or value > hi or (lo_open and value == lo):
        raise bad(f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}.", name)
    return float(value)


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be true or false, got {json.dumps(value)[:50]}.", name)
    return value


@dataclass
class GenRequest:
    """A validated completion or chat request: one or more prompts (token ids), n choices each."""

    model: str
    prompts: list[list[int]]
    params: SamplingParams  # max_tokens may be None -> filled per prompt
    n: int
    stream: bool
    include_usage: bool
    stop: list[str]
    logprobs: int | None  # top-N per token (0 = only the chosen token's), None = no logprobs
    max_tokens: int | None
    chat: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""


def parse_request(
    body: dict, *, chat: bool, served: list[str], max_model_len: int, tokenizer, chat_prompt
) -> GenRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required and must be a string.", "model")
    if model not in served:
        raise APIError(
            404, f"The model '{model}' does not exist; this server serves {served}.", "model", code="model_not_found"
        )
    prompts = [chat_prompt(_messages(body))] if chat else _prompts(body, tokenizer)
    for p in prompts:
        if not p:
            raise bad("The prompt is empty; give at least one token.", "messages" if chat else "prompt")
        if len(p) >= max_model_len:
            raise bad(
                f"The prompt is {len(p)} tokens long; this model's maximum context length is {max_model_len} tokens.",
                "messages" if chat else "prompt",
            )
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, max_name, None, 1, max_model_len)
    if max_tokens is None and not chat:
        max_tokens = 16  # OpenAI's default for completions; chat defaults to the rest of the context
    n = _int(body, "n", 1, 1, MAX_N)
    temperature = _num(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", 0, -1)
    seed = _int(body, "seed", None, -(2**63), 2**63 - 1)
    ignore_eos = _bool(body, "ignore_eos", False)
    stream = _bool(body, "stream", False)
    if _bool(body, "echo", False):
        raise bad("'echo' is not supported by this server.", "echo")
    for name in ("frequency_penalty", "presence_penalty"):
        if _num(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise bad(f"'{name}' is not supported by this server; leave it at 0.", name)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("'stream_options' must be an object.", "stream_options")
    include_usage = _bool(options or {}, "include_usage", False)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("'stop' must be a string or a list of strings.", "stop")
    if len(stop) > MAX_STOP:
        raise bad(f"'stop' may hold at most {MAX_STOP} strings, got {len(stop)}.", "stop")
    if any(s == "" for s in stop):
        raise bad("'stop' strings must not be empty.", "stop")
    if chat:
        want = _bool(body, "logprobs", False)
        top = _int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
        if top is not None and not want:
            raise bad("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
        logprobs = (top or 0) if want else None
    else:
        logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    try:
        params = SamplingParams(
            temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_tokens=max_tokens or 1,
            ignore_eos=ignore_eos, logprobs=logprobs,
        )  # fmt: skip
    except ValueError as e:
        raise bad(str(e)) from None
    return GenRequest(
        model=model, prompts=prompts, params=params, n=n, stream=stream, include_usage=include_usage, stop=stop,
        logprobs=logprobs, max_tokens=max_tokens, chat=chat,
        id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
    )  # fmt: skip


def _prompts(body: dict, tokenizer) -> list[list[int]]:
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("'prompt' is required.", "prompt")
    if isinstance(prompt, str):
        prompt = [prompt]
    if isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        return [list(prompt)]
    if not isinstance(prompt, list) or not prompt:
        raise bad("'prompt' must be a string, a list of strings, or token ids.", "prompt")
    if len(prompt) > MAX_N:
        raise bad(f"'prompt' may hold at most {MAX_N} prompts.", "prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            if tokenizer is None:
                raise bad("This model has no tokenizer; send token ids as the prompt.", "prompt")
            out.append(tokenizer.encode(p))
        elif isinstance(p, list) and all(_is_token(t) for t in p):
            out.append(list(p))
        else:
            raise bad("'prompt' must be a string, a list of strings, or token ids.", "prompt")
    return out


def _is_token(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' is required and must be a non-empty list.", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object.", "messages")
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user", "assistant", "developer", "tool"):
            raise bad(f"messages[{i}].role must be system, user, assistant, developer or tool.", "messages")
        if isinstance(content, list):  # content parts: keep the text ones
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise bad(f"messages[{i}].content parts must be text parts.", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string.", "messages")
        out.append({"role": role, "content": content})
    return out


# --- response pieces --------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(entries: list[dict], offset: int) -> dict:
    """entries: [{"token", "logprob", "top": [(token, logprob)]}] -> the completions API's logprobs object."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        tokens.append(e["token"])
        lps.append(e["logprob"])
        tops.append({t: lp for t, lp in e["top"]})
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: list[dict]) -> dict:
    return {
        "content": [
            {
                "token": e["token"],
                "logprob": e["logprob"],
                "bytes": list(e["token"].encode("utf-8")),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))} for t, lp in e["top"]],
            }
            for e in entries
        ]
    }


def plain_chat_prompt(messages: list[dict[str, str]]) -> str:
    """The documented fallback when the model directory has no chat template:
    "<role>: <content>\\n" per message, then "assistant:"."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
