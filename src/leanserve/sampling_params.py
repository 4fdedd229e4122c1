"""Per-request sampling settings, with the same field names and meanings as vLLM's SamplingParams."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
PENALTY_LIMIT = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]


def _is_int(x: object) -> bool:
    # bool is a subclass of int, but True/False as a seed or count is almost certainly a mistake.
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


class LogitBias(Mapping[int, float]):
    """A read-only, hashable {token id: bias}: how SamplingParams keeps `logit_bias` (its dataclass is frozen).
    `nonzero` is its entries whose bias is not 0, the only ones that change a logit."""

    __slots__ = ("_bias", "nonzero")

    def __init__(self, bias: Mapping[int, float]) -> None:
        self._bias = dict(bias)
        self.nonzero = tuple((t, float(b)) for t, b in self._bias.items() if b != 0)

    def __getitem__(self, token_id: int) -> float:
        return self._bias[token_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._bias)

    def __len__(self) -> int:
        return len(self._bias)

    def __hash__(self) -> int:
        return hash(frozenset(self._bias.items()))

    def __repr__(self) -> str:
        return repr(self._bias)

    def __reduce__(self):
        return LogitBias, (self._bias,)


STRUCTURED_KINDS = ("json", "tool_calls", "regex", "choice")
# The fields each kind reads; any other one set is an error (their defaults: None / False).
_KIND_FIELDS = {
    "json": ("schema", "strict"),
    "tool_calls": ("tools", "required_name"),
    "regex": ("pattern",),
    "choice": ("choices",),
}


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must be (grammar-constrained decoding, leanserve.structured): small, frozen and
    hashable, so it travels in the step plan. The engine compiles it when the request is added (a schema or
    regex that cannot be compiled is a ValueError then) and masks the request's logits with it at every step.

    - kind "json": one JSON value valid against `schema` (JSON text; None = any JSON object). `strict`: a
      schema keyword the grammar cannot enforce is an error (else it is ignored). OpenAI's `response_format`
      {"type": "json_object"} is schema None; {"type": "json_schema", ...} its schema and strict.
    - kind "tool_calls": a DSML tool-call block (DeepSeek-V4's format) calling the OpenAI `tools` (JSON text
      of the list): exactly one call of `required_name` (tool_choice naming a function), or one or more calls
      of any of them (None: tool_choice "required"). A function whose "strict" is true has its parameters'
      schema enforced in full.
    - kind "regex": text that `pattern` matches as a whole (vLLM's structured_outputs regex), in the syntax of
      Rust's `regex` crate, which llguidance compiles: mostly Python's, but no lookaround, backreference,
      ``\\b``, ``\\Z`` or comment; ``^`` and ``$`` change nothing.
    - kind "choice": exactly one of the strings `choices` (vLLM's structured_outputs choice); a list is
      accepted and kept as a tuple.
    - `after_think`: thinking mode: the text up to the first `</think>` is free, the constraint starts after it.

    A dict or list is accepted for `schema` / `tools` and kept as its JSON text. The output ends with EOS as
    soon as the grammar is complete; max_tokens may still cut it short (finish reason "length")."""

    kind: str = "json"
    schema: str | None = None
    strict: bool = False
    tools: str | None = None
    required_name: str | None = None
    after_think: bool = False
    pattern: str | None = None
    choices: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured.kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}.")
        for name in ("strict", "after_think"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured.{name} must be true or false, got {getattr(self, name)!r}.")
        schema, tools = _json_text("schema", self.schema), _json_text("tools", self.tools)
        object.__setattr__(self, "schema", schema)
        object.__setattr__(self, "tools", tools)
        if self.kind == "json":
            if tools is not None or self.required_name is not None:
                raise ValueError('structured.tools and required_name are for kind "tool_calls", not "json".')
            if schema is not None and not isinstance(json.loads(schema), dict | bool):
                raise ValueError("structured.schema must be a JSON schema: an object (or true / false).")
        elif self.kind == "tool_calls":
            if schema is not None or self.strict:
                raise ValueError(
                    'structured.schema and strict are for kind "json"; a tool\'s own "strict" governs its parameters.'
                )
            if tools is None or not isinstance(json.loads(tools), list) or not json.loads(tools):
                raise ValueError('structured kind "tool_calls" needs tools: a non-empty JSON list of OpenAI tools.')
            if self.required_name is not None and (not isinstance(self.required_name, str) or not self.required_name):
                raise ValueError(
                    f"structured.required_name must be a function name or None, got {self.required_name!r}."
                )
        elif self.kind == "regex":
            if not isinstance(self.pattern, str) or not self.pattern:
                raise ValueError(
                    f'structured kind "regex" needs pattern: a non-empty regex string, got {self.pattern!r}.'
                )
        else:
            object.__setattr__(self, "choices", _choices(self.choices))
        for kind, fields in _KIND_FIELDS.items():
            for name in fields:
                if kind != self.kind and getattr(self, name) is not None and getattr(self, name) is not False:
                    raise ValueError(f'structured.{name} is for kind "{kind}", not "{self.kind}".')


def _choices(choices: object) -> tuple[str, ...]:
    """`choices` as a tuple of strings (a list or tuple of them, at least one)."""
    if isinstance(choices, str) or not isinstance(choices, list | tuple):
        raise ValueError(f'structured kind "choice" needs choices: a list of strings, got {type(choices).__name__}.')
    if not choices:
        raise ValueError('structured kind "choice" needs at least one choice.')
    bad = next((c for c in choices if not isinstance(c, str)), None)
    if bad is not None:
        raise ValueError(f"structured.choices must all be strings, got {bad!r}.")
    return tuple(choices)


def _json_text(name: str, value: object) -> str | None:
    """`value` as JSON text (a str is checked to be JSON, a dict or list written as it)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError as e:
            raise ValueError(f"structured.{name} is not valid JSON text: {e}.") from None
        return value
    if isinstance(value, Mapping | list | tuple | bool):
        try:
            return json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"structured.{name} cannot be written as JSON: {e}.") from None
    raise ValueError(f"structured.{name} must be JSON text (or a dict / list), got {type(value).__name__}.")


@dataclass(frozen=True)
class SamplingParams:
    """Logit bias and penalties act as in vLLM (its V1 sampler, in this order): `logit_bias` is added to the
    logits, then `repetition_penalty` (every token of the prompt or the output so far: a logit > 0 divided by
    it, one <= 0 multiplied), `frequency_penalty` (times the token's count in the output so far) and
    `presence_penalty` (once for a token in the output so far) are subtracted; then a `structured` request's
    grammar leaves only the tokens it allows (the others -inf); then temperature, top-k and top-p. Greedy
    requests take the argmax of the processed logits. Logprobs are those of the raw logits, before any of this,
    as vLLM reports them by default (its `logprobs_mode="raw_logprobs"`)."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = disabled
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = disabled
    seed: int | None = None  # None: the engine draws one from its own seeded generator
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()  # a list is accepted and stored as a tuple
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token; 0 = only the sampled token's
    # Per prompt position (vLLM's meaning): the logprob of the prompt token there and the top-N, under the
    # logits at the position before it (the first position gets None); None = off. With it max_tokens may be
    # 0: the prompt is scored and nothing generated (finish reason "length").
    prompt_logprobs: int | None = None
    # {token id: bias in [-100, 100]} added to the logits (-100 effectively bans the token, +100 effectively
    # forces it); stored as a read-only LogitBias. The engine refuses an id outside the model's vocabulary.
    logit_bias: Mapping[int, float] | None = None
    presence_penalty: float = 0.0  # in [-2, 2]: subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # in [-2, 2]: subtracted per occurrence of a token already generated
    repetition_penalty: float = 1.0  # > 0: for tokens in the prompt or the output; 1 = off
    # Grammar-constrained output (JSON, forced tool calls): see StructuredOutput. None = free text.
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}.")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not (0 < p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}.")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 disables it), got {self.top_k!r}.")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}.")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an int >= 0, got {self.logprobs!r}.")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise ValueError(f"prompt_logprobs must be None or an int >= 0, got {self.prompt_logprobs!r}.")
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}.")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError(
                "max_tokens must be an int >= 1, got 0 (0, scoring the prompt alone, needs prompt_logprobs set)."
            )
        stop_msg = f"stop_token_ids must be a sequence of ints >= 0, got {self.stop_token_ids!r}."
        if isinstance(self.stop_token_ids, str | bytes):
            raise ValueError(stop_msg)
        try:
            stop = tuple(self.stop_token_ids)
        except TypeError:
            raise ValueError(stop_msg) from None
        if any(not _is_int(s) or s < 0 for s in stop):
            raise ValueError(stop_msg)
        object.__setattr__(self, "stop_token_ids", stop)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -PENALTY_LIMIT <= v <= PENALTY_LIMIT:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}.")
        r = self.repetition_penalty
        if not _is_number(r) or r <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 disables it), got {r!r}.")
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise ValueError(
                    f"structured must be a StructuredOutput or None, got {type(self.structured).__name__}."
                )
            if self.ignore_eos:
                raise ValueError(
                    "structured output ends with EOS when its grammar is complete; ignore_eos cannot be set."
                )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @cached_property  # (read for every sampled row of every step: computed once)
    def has_logit_bias(self) -> bool:
        """Whether some logit_bias entry is not 0 (a bias of 0, or an empty one, changes nothing)."""
        return self.logit_bias is not None and bool(self.logit_bias.nonzero)

    @cached_property
    def has_penalties(self) -> bool:
        """Whether presence, frequency or repetition penalty is on: the engine then counts the request's tokens."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _logit_bias(bias: object) -> LogitBias:
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}.")
    for t, b in bias.items():
        if not _is_int(t) or t < 0:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {t!r}.")
        if not _is_number(b) or not -LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}.")
    return bias if isinstance(bias, LogitBias) else LogitBias(bias)
