from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from leanserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose KV is committed in the cache; the cache state is a function of this number, so
    # lowering it (rollback) is enough to discard entries past it. The newest sampled token is not
    # yet committed: it is fed as the next decode token.
    num_computed_tokens: int = 0
    slot: int | None = None  # index into the per-slot cache tensors while RUNNING
    # Draft tokens proposed for the positions after the newest token, verified by the next step.
    spec_token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None  # "stop" | "length" | "abort" once FINISHED

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

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
        # Same as all_token_ids[start:end] without copying the whole prompt (decode steps touch 1 token).
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]
