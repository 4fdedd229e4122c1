"""Per-request sampling settings, with the same field names and meanings as vLLM's SamplingParams."""

from __future__ import annotations

import math
from dataclasses import dataclass


def _is_int(x: object) -> bool:
    # bool is a subclass of int, but True/False as a seed or count is almost certainly a mistake.
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = disabled
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = disabled
    seed: int | None = None  # None: the engine draws one from its own seeded generator
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()  # a list is accepted and stored as a tuple
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token; 0 = only the sampled token's

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
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}.")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an int >= 0, got {self.logprobs!r}.")
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

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
