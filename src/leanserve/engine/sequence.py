"""A request's token state: its prompt, its sampled tokens (each stored once, with its logprobs), its committed
count and the drafts waiting to be verified. Also the per-token types the runner and the scheduler share."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from leanserve.outputs import RequestMetrics

if TYPE_CHECKING:
    from leanserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass(frozen=True)
class PromptLogprobs:
    """The logprobs of prompt positions [first, first + n), from one prefill chunk of a request that asks for
    `prompt_logprobs`: position p's under the logits at p - 1 (raw, as the generated tokens' logprobs). Arrays,
    so a long chunk's travel back from the last stage is a few buffers, not a list of objects."""

    first: int  # prompt position of the first entry (>= 1: nothing predicts position 0)
    logprobs: np.ndarray  # [n] float32: the prompt token's logprob
    top_ids: np.ndarray  # [n, k] int64, best first (k = the request's prompt_logprobs; may be 0)
    top_logprobs: np.ndarray  # [n, k] float32

    def __len__(self) -> int:
        return len(self.logprobs)


@dataclass(frozen=True)
class SeqOutput:
    """A sequence's result of one step: its accepted drafts, then one sampled token; and the drafts proposed
    for the next step (the model proposers run on the last stage). A request with prompt_logprobs also gets
    its chunk's prompt logprobs, on every prefill chunk (`tokens` empty on a chunk that samples nothing)."""

    tokens: tuple[SampledToken, ...]
    drafts: tuple[int, ...] = ()
    prompt_logprobs: PromptLogprobs | None = None


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


def _now() -> RequestMetrics:
    return RequestMetrics(arrival_time=time.perf_counter())


@dataclass
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    seed: int = 0  # the request's sampling seed, so its samples do not depend on what else is in the batch
    # Every sampled token of the output, in order, with its logprobs: the only store of the output.
    output_tokens: list[SampledToken] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose KV is committed in the cache; the cache state is a function of this number, so
    # lowering it (rollback) is enough to discard entries past it. The newest sampled token is not
    # yet committed: it is fed as the next decode token.
    num_computed_tokens: int = 0
    slot: int | None = None  # index into the per-slot cache tensors while RUNNING
    blocks: list[int] = field(default_factory=list)  # cache blocks held while RUNNING, in position order
    num_blocks_sent: int = 0  # of `blocks`, how many a scheduled step has announced to the stages
    num_cached_tokens: int = 0  # prompt tokens the prefix cache gave it (engine/prefix_cache.py)
    prefix_cut: int = 0  # a block boundary its prefill stops at for the prefix cache to keep (0: none)
    # Draft tokens proposed for the positions after the newest token, verified by the next step.
    spec_token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None  # "stop" | "length" | "abort" once FINISHED
    # With params.prompt_logprobs: each prefill chunk's prompt logprobs, in position order (complete, positions
    # 1 to the prompt's end, once the prompt is prefilled: by the sequence's first SeqUpdate).
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=_now)  # arrival, first token and finish times

    @property
    def output_token_ids(self) -> list[int]:
        """The output's token ids (a fresh list, derived from output_tokens)."""
        return [t.token_id for t in self.output_tokens]

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_tokens)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_ids_between(self, start: int, end: int) -> list[int]:
        # Same as all_token_ids[start:end] without copying the whole sequence (decode steps touch 1 token).
        p = len(self.prompt_token_ids)
        if start >= p:
            return [t.token_id for t in self.output_tokens[start - p : end - p]]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + [t.token_id for t in self.output_tokens[: end - p]]
