"""The pipeline topology: a frozen value saying which layers each stage holds. It is computed once, checked
before any process starts, and handed to constructors; nothing asks a process group for its rank."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from leanserve.engine.costs import stage_costs
from leanserve.model.config import ConfigError, ModelConfig
from leanserve.model.deepseek_v4 import StageLayout


@dataclass(frozen=True)
class PipelineTopology:
    layer_counts: tuple[int, ...]  # layers per stage, first to last

    @classmethod
    def build(cls, cfg: ModelConfig, num_stages: int, layer_counts: tuple[int, ...] | None = None) -> PipelineTopology:
        """The split that balances what a decode token reads on each stage (`balanced`; the last stage also
        reads the final norm, hc_head and the head), unless `layer_counts` says otherwise."""
        n = cfg.num_hidden_layers  # num_stages is a positive integer (EngineConfig checks it)
        if num_stages > n:
            raise ConfigError(
                f"pipeline_parallel_size ({num_stages}) is larger than the model's {n} layers; "
                "every stage needs at least one layer."
            )
        if layer_counts is None:
            if num_stages == 1:
                return cls((n,))
            return cls(balanced(*stage_costs(cfg), num_stages))
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


def balanced(layer_costs: list[int], tail: int, num_stages: int) -> tuple[int, ...]:
    """Layers per stage, each stage at least one, contiguous, minimising the largest stage's cost (the sum of
    its layers' costs, plus `tail` on the last stage); among the splits that reach it, the one with the
    smallest sum of squared stage costs, then the one with more layers on the earliest stages (equal costs and
    no tail: the even split, the remainder first)."""
    n = len(layer_costs)
    ends = [0]
    for c in layer_costs:
        ends.append(ends[-1] + c)

    def cost(i: int, j: int) -> int:  # layers [i, j), and the tail when they end the model
        return ends[j] - ends[i] + (tail if j == n else 0)

    @cache
    def best(i: int, k: int) -> int:  # the smallest largest cost of layers [i, n) over k stages
        if k == 1:
            return cost(i, n)
        return min(max(cost(i, j), best(j, k - 1)) for j in range(i + 1, n - k + 2))

    most = best(0, num_stages)

    @cache
    def spread(i: int, k: int) -> tuple[float, tuple[int, ...]]:  # (sum of squared stage costs, -counts) at best
        if k == 1:
            return (cost(i, n) ** 2, (i - n,)) if cost(i, n) <= most else (float("inf"), ())
        options = []
        for j in range(i + 1, n - k + 2):
            if cost(i, j) <= most:
                sq, rest = spread(j, k - 1)
                options.append((cost(i, j) ** 2 + sq, (i - j, *rest)))
        return min(options)

    return tuple(-c for c in spread(0, num_stages)[1])
