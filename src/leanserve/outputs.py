"""What `LLM.generate` returns, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely; None when the sampled token is outside the returned top-k
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    # With SamplingParams.prompt_logprobs (vLLM's shape): one entry per prompt token, None for the first (nothing
    # predicts it), else {token id: Logprob} holding the prompt token and the top prompt_logprobs, as `logprobs`.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache gave (vLLM's name)
