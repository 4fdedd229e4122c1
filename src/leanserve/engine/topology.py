"""The pipeline topology: a frozen value saying which layers each stage holds. It is computed once, checked
before any process starts, and handed to constructors; nothing asks a process group for its rank."""

from __future__ import annotations

from dataclasses import dataclass

from leanserve.config import ConfigError, ModelConfig
from leanserve.model.deepseek_v4 import StageLayout


@dataclass(frozen=True)
class PipelineTopology:
    layer_counts: tuple[int, ...]  # layers per stage, first to last

    @classmethod
    def build(cls, cfg: ModelConfig, num_stages: int, layer_counts: tuple[int, ...] | None = None) -> PipelineTopology:
        """Even split, the remainder on the earliest stages (the last also carries hc_head, norm, head and the
        MTP layer), unless `layer_counts` says otherwise."""
        n = cfg.num_hidden_layers  # num_stages is a positive integer (EngineConfig checks it)
        if num_stages > n:
            raise ConfigError(
                f"pipeline_parallel_size ({num_stages}) is larger than the model's {n} layers; "
                "every stage needs at least one layer."
            )
        if layer_counts is None:
            base, extra = divmod(n, num_stages)
            return cls(tuple(base + (1 if i < extra else 0) for i in range(num_stages)))
        counts = tuple(layer_counts)
        if len(counts) != num_stages:
            raise ConfigError(
                f"pipeline_layer_counts has {len(counts)} entries but pipeline_parallel_size is {num_stages}."
            )
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
            raise ConfigError(f"pipeline_layer_counts entries must be positive integers, got {list(counts)}.")
        if sum(counts) != n:
            raise ConfigError(
                f"pipeline_layer_counts {list(counts)} sums to {sum(counts)}, but the model has {n} layers."
            )
        return cls(counts)

    @property
    def num_stages(self) -> int:
        return len(self.layer_counts)

    def layout(self, stage: int) -> StageLayout:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} is outside a {self.num_stages}-stage pipeline")
        first = sum(self.layer_counts[:stage])
        return StageLayout(
            first_layer=first,
            end_layer=first + self.layer_counts[stage],
            is_first=stage == 0,
            is_last=stage == self.num_stages - 1,
            index=stage,
        )
