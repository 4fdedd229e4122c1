"""OpenAI request parsing and validation, and the response shapes.

Requests are parsed by hand rather than by a schema library so that every problem becomes one 400 in
OpenAI's error shape naming the field (`{"error": {"message", "type", "param", "code"}}`). Every field is
honoured or refused: a field this server does not know, or one whose value it cannot honour (`best_of` other
than n, `suffix`), is a 400 naming it.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

from leanserve.sampling_params import SamplingParams, StructuredOutput

MAX_N = 16
MAX_STOP = 4
MAX_LOGPROBS = 20
MAX_BODY_BYTES = 4 * 1024 * 1024

# The fields each endpoint knows; `user` (the caller's end-user id, for their own records) has no effect.
COMMON_FIELDS = frozenset(
    {"model", "max_tokens", "n", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stream", "stream_options",
     "stop", "logprobs", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "user",
     "structured_outputs", "guided_json", "guided_regex", "guided_choice"}
)  # fmt: skip
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix", "prompt_logprobs"}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
    "chat_template_kwargs", "reasoning_effort", "response_format",
}  # fmt: skip
HINTS = {"functions": "use 'tools'", "function_call": "use 'tools' and 'tool_choice'"}


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


def read_bool(body: dict, name: str, default: bool) -> bool:
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
    echo: bool = False  # completions: the prompt's text (and its tokens' logprobs) before the completion
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and top-N, in the choice
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""


def check_model(body: dict, served: list[str]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required and must be a string.", "model")
    if model not in served:
        raise APIError(
            404, f"The model '{model}' does not exist; this server serves {served}.", "model", code="model_not_found"
        )
    return model


def refuse_unknown(body: dict, known) -> None:
    for name in body:
        if name not in known:
            hint = f"; {HINTS[name]}" if name in HINTS else ""
            raise bad(f"'{name}' is not supported by this server{hint}.", name)


def parse_request(
    body: dict, *, chat: bool, served: list[str], max_model_len: int, vocab_size: int, tokenizer, chat_prompt
) -> GenRequest:
    model = check_model(body, served)
    _refuse_what_cannot_be_honoured(body, chat)
    prompts = [chat_prompt(body)] if chat else _prompts(body, tokenizer)
    for p in prompts:
        if not p:
            raise bad("The prompt is empty; give at least one token.", "messages" if chat else "prompt")
        if len(p) >= max_model_len:
            raise bad(
                f"The prompt is {len(p)} tokens long; this model's maximum context length is {max_model_len} tokens.",
                "messages" if chat else "prompt",
            )
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    echo = not chat and read_bool(body, "echo", False)
    max_tokens = _int(body, max_name, None, 0 if echo else 1, max_model_len)  # 0: score the prompt only
    if max_tokens is None and not chat:
        max_tokens = 16  # OpenAI's default for completions; chat defaults to the rest of the context
    n = _int(body, "n", 1, 1, MAX_N)
    temperature = _num(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", 0, -1)
    seed = _int(body, "seed", None, -(2**63), 2**63 - 1)
    ignore_eos = read_bool(body, "ignore_eos", False)
    stream = read_bool(body, "stream", False)
    prompt_logprobs = None if chat else _int(body, "prompt_logprobs", None, 0, MAX_LOGPROBS)
    if stream and (echo or prompt_logprobs is not None):
        raise bad(
            "'echo' and 'prompt_logprobs' are not supported with 'stream' yet.", "echo" if echo else "prompt_logprobs"
        )
    penalties = {name: _num(body, name, 0.0, -2.0, 2.0) for name in ("frequency_penalty", "presence_penalty")}
    penalties["repetition_penalty"] = _num(body, "repetition_penalty", 1.0, 0.0, math.inf, lo_open=True)
    logit_bias = _logit_bias(body.get("logit_bias"), vocab_size)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("'stream_options' must be an object.", "stream_options")
    refuse_unknown(options or {}, {"include_usage"})
    include_usage = read_bool(options or {}, "include_usage", False)
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
        want = read_bool(body, "logprobs", False)
        top = _int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
        if top is not None and not want:
            raise bad("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
        logprobs = (top or 0) if want else None
    else:
        logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    # The engine scores the prompt for echo's logprobs (and for max_tokens 0, which needs its prefill only).
    scored = [n for n in (prompt_logprobs, logprobs if echo else None) if n is not None]
    if echo and max_tokens == 0 and not scored:
        scored = [0]
    try:
        params = SamplingParams(
            temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            max_tokens=1 if max_tokens is None else max_tokens, ignore_eos=ignore_eos, logprobs=logprobs,
            logit_bias=logit_bias, prompt_logprobs=max(scored) if scored else None, **penalties,
        )  # fmt: skip
    except ValueError as e:
        raise bad(str(e)) from None
    return GenRequest(
        model=model, prompts=prompts, params=params, n=n, stream=stream, include_usage=include_usage, stop=stop,
        logprobs=logprobs, max_tokens=max_tokens, chat=chat, echo=echo, prompt_logprobs=prompt_logprobs,
        id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
    )  # fmt: skip


def _refuse_what_cannot_be_honoured(body: dict, chat: bool) -> None:
    refuse_unknown(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    best_of = body.get("best_of")
    if best_of is not None and best_of != (body.get("n") or 1):
        raise bad("'best_of' is not supported: every generated choice is returned ('n').", "best_of")
    if body.get("suffix"):
        raise bad("'suffix' is not supported: this model does not fill in the middle.", "suffix")


VLLM_STRUCTURED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice")
STRUCTURED_OUTPUT_KEYS = ("json", "json_object", "regex", "choice")


def vllm_structured(body: dict, after_think: bool = False) -> tuple[StructuredOutput, str] | None:
    """vLLM's constraints: `structured_outputs` with one of {"json": schema, "json_object": true, "regex":
    pattern, "choice": [strings]}, or the older `guided_json` / `guided_regex` / `guided_choice`; (the spec, the
    field that gave it), or None. A grammar (`structured_outputs.grammar`, `guided_grammar`) is refused by name."""
    given = [name for name in VLLM_STRUCTURED if body.get(name) is not None]
    if not given:
        return None
    name, value = given[0], body[given[0]]
    if len(given) > 1:
        raise bad(f"'{given[0]}' and '{given[1]}' both constrain the output; give one.", given[1])
    kind = name.removeprefix("guided_")
    if name == "structured_outputs":
        keys = [k for k, v in value.items() if v is not None and v is not False] if isinstance(value, dict) else None
        if keys is None or len(keys) != 1 or keys[0] not in STRUCTURED_OUTPUT_KEYS:
            raise bad(
                '\'structured_outputs\' takes one of "json", "json_object", "regex" or "choice" here'
                f" (got {sorted(value) if isinstance(value, dict) else type(value).__name__}).",
                name,
            )
        kind, value = keys[0], value[keys[0]]
    try:
        if kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            return StructuredOutput(kind="json", schema=schema, after_think=after_think), name
        if kind == "json_object":
            if value is not True:
                raise ValueError('"json_object" must be true')
            return StructuredOutput(kind="json", after_think=after_think), name
        if kind == "regex":
            if not isinstance(value, str):
                raise ValueError("the regex must be a string")
            return StructuredOutput(kind="regex", pattern=value, after_think=after_think), name
        return StructuredOutput(kind="choice", choices=value, after_think=after_think), name
    except (ValueError, TypeError) as e:
        raise bad(f"'{name}': {e}", name) from None


def _logit_bias(value, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} with biases in [-100, 100]; ids as JSON object keys, so strings."""
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise bad("'logit_bias' must be an object of token ids to biases.", "logit_bias")
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise bad(f"'logit_bias' keys must be token ids, got {json.dumps(key)[:40]}.", "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise bad(
                f"'logit_bias' token id {token} is outside this model's vocabulary of {vocab_size}.", "logit_bias"
            )
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100 <= bias <= 100:
            raise bad(f"'logit_bias' values must be numbers in [-100, 100], got {json.dumps(bias)[:40]}.", "logit_bias")
        out[token] = float(bias)
    return out


def _prompts(body: dict, tokenizer) -> list[list[int]]:
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("'prompt' is required.", "prompt")
    if isinstance(prompt, str):
        prompt = [prompt]
    if isinstance(prompt, list) and prompt and all(is_token(t) for t in prompt):
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
        elif isinstance(p, list) and all(is_token(t) for t in p):
            out.append(list(p))
        else:
            raise bad("'prompt' must be a string, a list of strings, or token ids.", "prompt")
    return out


def is_token(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


# --- response pieces --------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_logprobs(entries: list[dict], offset: int) -> dict:
    """entries: [{"token", "logprob", "top": [(token, logprob)]}] -> the completions API's logprobs object."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        tokens.append(e["token"])
        lps.append(e["logprob"])
        tops.append(None if e["top"] is None else {t: lp for t, lp in e["top"]})
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(entries, n: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then {token id: {"logprob", "rank",
    "decoded_token"}} with the top-n and the prompt token."""
    out = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        keep = {t: lp for t, lp in entry.items() if lp.rank is None or lp.rank <= n}
        out.append(
            {
                str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                for t, lp in keep.items()
            }
        )
    return out


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
