"""The engine's own configuration: `EngineConfig` (what `LLM(model, **options)` and the CLI's engine options
set) and `SpeculativeConfig` (its `speculative_config`), each checked once when it is made.

The model's configuration (`ModelConfig`, read from a checkpoint's config.json) is model/config.py's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from leanserve.memory import parse_bytes
from leanserve.model.config import ConfigError, ModelConfig
from leanserve.model.quant import check_inputs

DTYPES = ("auto", "float32", "bfloat16", "float16")
# model/backends/REGISTRY's names; "auto" takes the first that can run the stage (the CPU kernels where they run)
BACKENDS = ("auto", "cpu", "torch")


SPEC_METHODS = ("mtp", "ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which speculative method runs and how far it drafts. The fields and the use_eagle() /
    uses_draft_model() predicates follow vLLM's; needs_target_hidden_states() says whether the last stage
    must keep the trunk's pre-hc_head streams for the drafter, and only MTP reads them."""

    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft_model: the draft checkpoint's directory
    prompt_lookup_max: int | None = None  # ngram: longest n-gram matched against the context
    prompt_lookup_min: int | None = None  # ngram: shortest (defaults to 1)

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"speculative_config.method must be one of {SPEC_METHODS}, got {self.method!r}.")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"speculative_config.num_speculative_tokens must be an integer >= 1, got {k!r}.")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ConfigError(
                    "speculative_config.model (the draft checkpoint's directory) is required for draft_model."
                )
        elif self.model is not None:
            raise ConfigError(f"speculative_config.model is only for draft_model, not {self.method}.")
        lookup = (self.prompt_lookup_min, self.prompt_lookup_max)
        if self.method != "ngram":
            if lookup != (None, None):
                raise ConfigError(f"speculative_config.prompt_lookup_min/max are only for ngram, not {self.method}.")
            return
        if self.prompt_lookup_max is None:
            raise ConfigError("speculative_config.prompt_lookup_max is required for ngram.")
        if self.prompt_lookup_min is None:
            object.__setattr__(self, "prompt_lookup_min", 1)
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"speculative_config.{name} must be an integer >= 1, got {value!r}.")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) is larger than "
                f"prompt_lookup_max ({self.prompt_lookup_max})."
            )

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, a dict, or the same as a JSON string (the CLI's form)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config is not valid JSON: {e}.") from None
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a JSON object, got {type(value).__name__}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config has unknown field(s) {unknown}; known: {sorted(known)}.")
        for name in ("method", "num_speculative_tokens"):
            if name not in value:
                raise ConfigError(f"speculative_config.{name} is required.")
        return cls(**value)

    def use_eagle(self) -> bool:
        return self.method in ("eagle", "eagle3", "mtp")

    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    def needs_target_hidden_states(self) -> bool:
        return self.method == "mtp"


def micro_batch_tokens(max_num_batched_tokens: int, micro_batches: int) -> int:
    """Micro-batches in flight share max_num_batched_tokens, so overlap keeps as many tokens in flight (and
    buffers for as many) as one step at a time does."""
    return max(1, max_num_batched_tokens // micro_batches)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model: every option of `LLM(model, **options)` is one of these fields, with the
    default given here (the CLI's engine options set the same fields).

    dtype                   activations, caches and unquantized weights: auto (the checkpoint's), float32,
                            bfloat16 or float16
    seed                    the seed of sampling without a per-request seed
    max_model_len           prompt + output tokens per sequence (None: the model's, capped at 8192)
    max_num_seqs            sequences in a batch at once
    max_num_batched_tokens  tokens in one step (prefill chunks and decode tokens together)
    device                  where the model runs (cpu, cuda, cuda:1, ...)
    pipeline_parallel_size  N > 1 runs the model as N stage processes (the caller is stage 0; the others are
                            spawned, or are the other ranks under torchrun)
    pipeline_layer_counts   layers per stage, first to last (a list or tuple; None: balanced by the bytes each layer reads per step)
    pipeline_overlap        with N stages, N micro-batches in flight (False: one step at a time)
    speculative_config      a SpeculativeConfig, its dict or JSON, e.g. {"method": "mtp", "num_speculative_tokens": 1}
    backend                 the model's math: auto, torch or cpu (model/backend.py)
    fp4_inputs              what a published checkpoint's FP4 experts multiply: float32 (the activations as they
                            are), bfloat16 (rounded to it: faster on CPUs with AVX512-BF16) or int8 (rounded to 8
                            bits a block of 32: faster on CPUs with AVX2; docs/checkpoints.md)
    fp8_inputs              the same for its FP8 weights (attention, shared experts, FP8 experts): float32 or
                            bfloat16
    kv_cache_memory         bytes of paged cache each stage holds for its layers: an int or a size such as
                            "20GiB" (None: what max_num_seqs sequences of max_model_len take, at most half the
                            memory free when the engine starts; docs/memory.md)
    kv_block_size           tokens per cache block, a multiple of the model's compression rates (None: 128,
                            rounded up to one)
    enable_prefix_caching   a request starts after the longest prefix the engine has kept (docs/prefix-caching.md);
                            not with a draft model
    """

    model: str
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped at 8192
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    device: str = "cpu"
    pipeline_parallel_size: int = 1
    # Layers per stage, first to last; None splits evenly (the remainder on the earliest stages).
    pipeline_layer_counts: tuple[int, ...] | None = None
    # With N > 1 stages, keep up to N micro-batches in flight so that every stage has work (False: one step
    # at a time through the stages, each idle while the others work).
    pipeline_overlap: bool = True
    speculative_config: SpeculativeConfig | None = None
    backend: str = "auto"  # which statement of the model's math each stage runs (model/backend.py)
    fp4_inputs: str = "float32"  # quant.Fp4Weight.inputs of the FP4 experts
    fp8_inputs: str = "float32"  # quant.Fp8Weight.inputs of the FP8 weights
    kv_cache_memory: int | str | None = None
    kv_block_size: int | None = None
    enable_prefix_caching: bool | None = None  # None: on, unless a draft model drafts

    def __post_init__(self) -> None:
        pp = self.pipeline_parallel_size
        if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
            raise ConfigError(f"pipeline_parallel_size must be a positive integer, got {pp!r}.")
        if not isinstance(self.pipeline_overlap, bool):
            raise ConfigError(f"pipeline_overlap must be true or false, got {self.pipeline_overlap!r}.")
        if self.pipeline_layer_counts is not None:  # checked against the model by PipelineTopology.build
            object.__setattr__(self, "pipeline_layer_counts", tuple(self.pipeline_layer_counts))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}.")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {BACKENDS}, got {self.backend!r}.")
        check_inputs(self.fp4_inputs, self.fp8_inputs)  # (the model's formats: build_model)
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}.")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ConfigError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}.")
        if self.kv_cache_memory is not None:
            try:
                object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory, "kv_cache_memory"))
            except ValueError as e:
                raise ConfigError(str(e)) from None
        caching, spec = self.enable_prefix_caching, self.speculative_config
        if caching is not None and not isinstance(caching, bool):
            raise ConfigError(f"enable_prefix_caching must be true or false, got {caching!r}.")
        if caching and spec is not None and spec.method == "draft_model":
            raise ConfigError(
                "enable_prefix_caching does not work with a draft model (its caches are not kept with a prefix); "
                "turn one of them off."
            )
        if caching is None:
            object.__setattr__(self, "enable_prefix_caching", spec is None or spec.method != "draft_model")
        size = self.kv_block_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ConfigError(f"kv_block_size must be a positive integer, got {size!r}.")

    @property
    def prefix_states(self) -> int:
        """Window states the prefix cache keeps (one per slot), 0 when it is off."""
        return self.max_num_seqs if self.enable_prefix_caching else 0

    @property
    def micro_batches(self) -> int:
        """Steps in flight at once: one per stage with overlap, else one."""
        return self.pipeline_parallel_size if self.pipeline_overlap else 1

    @property
    def micro_batch_tokens(self) -> int:
        """The token budget of one micro-batch (micro_batch_tokens)."""
        return micro_batch_tokens(self.max_num_batched_tokens, self.micro_batches)

    def resolved_max_model_len(self, cfg: ModelConfig) -> int:
        if self.max_model_len is None:
            return min(cfg.max_position_embeddings, 8192)
        if self.max_model_len > cfg.max_position_embeddings:
            raise ConfigError(
                f"max_model_len ({self.max_model_len}) exceeds the model's max_position_embeddings "
                f"({cfg.max_position_embeddings})."
            )
        return self.max_model_len
