"""The engine loop: each step is schedule -> execute -> update."""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from leanserve.engine.blocks import BlockPool
from leanserve.engine.config import EngineConfig, SpeculativeConfig
from leanserve.engine.grammar import compile_structured, grammar_compiler
from leanserve.engine.kv_budget import available_memory, cache_dtype, kv_summary, plan_kv, window_bytes
from leanserve.engine.pipeline import LaunchSpec, PipelineDriver, in_torchrun, serve_torchrun_stage, torchrun_rank
from leanserve.engine.prefix_cache import PrefixCache
from leanserve.engine.proposers import NgramProposer, Proposer
from leanserve.engine.runner import SeqOutput, StageRunner, StepPlan
from leanserve.engine.scheduler import ScheduledBatch, Scheduler, SeqUpdate
from leanserve.engine.sequence import Sequence
from leanserve.engine.topology import PipelineTopology
from leanserve.memory import StageMemory, format_bytes, format_table, format_weights
from leanserve.model.backends.cpu import kernels as cpu_kernels
from leanserve.model.config import ConfigError, ModelConfig
from leanserve.model.loader import checkpoint_dtype, has_mtp_weights
from leanserve.sampling_params import SamplingParams
from leanserve.tokenizer import Tokenizer, generation_eos_ids

logger = logging.getLogger("leanserve")

_INT64 = 2**63


@dataclass
class SpecDecodeMetrics:
    """Speculative decoding counters, as vLLM reports them."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            # tokens emitted per verification: the accepted drafts plus the token the target always adds
            "mean_acceptance_length": 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0,
        }


class LocalExecutor:
    """The whole model in this process (pipeline_parallel_size 1): a launched step runs at once."""

    def __init__(self, runner: StageRunner) -> None:
        self.runner = runner
        self.infos = [runner.info()]
        self._done: deque[dict[int, SeqOutput]] = deque()

    def launch(self, plan: StepPlan) -> None:
        self._done.append(self.runner.execute(plan))

    def collect(self) -> dict[int, SeqOutput]:
        return self._done.popleft()

    def stage_busy_s(self) -> list[float]:
        return [self.runner.busy_s]

    def shutdown(self, graceful: bool = True) -> None:
        pass


def stage_threads(threads: int, num_stages: int) -> int:
    """Each stage's threads when `num_stages` stages share a machine's `threads`: its share (more threads than
    cores, and the threaded kernels wait on each other's busy cores)."""
    return max(1, threads // num_stages)


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        self.model_config = cfg = ModelConfig.from_hf(config.model)
        # Everything that can be wrong with the request is checked here, before any process starts.
        self.topology = PipelineTopology.build(cfg, config.pipeline_parallel_size, config.pipeline_layer_counts)
        check_speculative(config.speculative_config, cfg, config.model)
        self.max_model_len = config.resolved_max_model_len(cfg)
        self.dtype = resolve_dtype(config.dtype, config.model)
        self.cache_itemsize = itemsize = cache_dtype(config, self.dtype).itemsize
        free = available_memory(config.device)
        if free is not None and torch.device(config.device).type == "cpu":  # (the stages share this host's memory)
            free //= self.topology.num_stages
        self.kv = plan_kv(cfg, config, self.topology, self.max_model_len, itemsize, free)
        if self.kv.capped:
            logger.info(
                "paged cache: %s a stage (half the memory free now; kv_cache_memory sets it), %d blocks of %d tokens",
                format_bytes(self.kv.budget), self.kv.num_blocks, self.kv.block_tokens,
            )  # fmt: skip
        if self.topology.num_stages > 1 and in_torchrun() and torchrun_rank() != 0:
            # Under torchrun every rank runs the caller's program; ranks other than 0 serve their stage here.
            raise SystemExit(serve_torchrun_stage())
        self.tokenizer = Tokenizer.from_dir(config.model)
        self.eos_token_ids = generation_eos_ids(config.model) or cfg.eos_token_ids
        if self.topology.num_stages == 1:
            runner = StageRunner(
                cfg, config, self.topology.layout(0), self.dtype, self.max_model_len, progress,
                num_blocks=self.kv.num_blocks,
            )  # fmt: skip
            runner.warmup()
            self.executor: LocalExecutor | PipelineDriver = LocalExecutor(runner)
        else:
            threads = stage_threads(torch.get_num_threads(), self.topology.num_stages)
            if config.device == "cpu":  # this process runs stage 0 (until shutdown)
                self._threads_before = torch.get_num_threads()
                torch.set_num_threads(threads)
                cpu_kernels.limit_threads(threads)
            spec = LaunchSpec(
                config, cfg, self.topology, str(self.dtype).removeprefix("torch."), self.max_model_len, threads,
                self.kv.num_blocks,
            )  # fmt: skip
            try:
                self.executor = PipelineDriver(spec, progress)
            except BaseException:
                self._restore_threads()
                raise
        for info in self.executor.infos:
            m = info.memory
            by_feature = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(m.by_feature().items()))
            layers = f"layers {info.layout.first_layer}-{info.layout.end_layer - 1}"
            logger.info(
                "stage %d (%s): weights %s (%s); buffers %s (%s)", m.stage, layers, format_bytes(m.weights_bytes),
                format_weights(m.weights_by_format), format_bytes(m.buffers_bytes), by_feature,
            )  # fmt: skip
        logger.debug("memory ledger:\n%s", format_table(self.memory_ledger()))
        pool = BlockPool(self.kv.num_blocks, self.kv.block_tokens)
        prefix = PrefixCache(pool, config.prefix_states) if config.enable_prefix_caching else None
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len, pool, prefix)
        # Micro-batches launched and not yet updated, oldest first: one per stage with pipeline overlap.
        self.micro_batches = config.micro_batches if self.topology.num_stages > 1 else 1
        self._in_flight: deque[ScheduledBatch] = deque()
        spec = config.speculative_config
        # Where the proposer lives: the n-gram lookup needs no model and runs here, on the first stage, in the
        # scheduler's update; the MTP layer and a draft model run on the last stage, after verification, and
        # their drafts come back with the step's tokens.
        self.proposer: Proposer | None = NgramProposer(spec) if spec is not None and spec.method == "ngram" else None
        self.spec_metrics = SpecDecodeMetrics(spec.num_speculative_tokens if spec is not None else 0)
        self._rng = random.Random(config.seed)
        self._next_id = 0

    def memory_ledger(self) -> list[StageMemory]:
        """Per stage: its weights' bytes and every persistent buffer it allocated, with the feature needing it."""
        return [info.memory for info in self.executor.infos]

    def shutdown(self) -> None:
        self.executor.shutdown()
        self._restore_threads()

    def _restore_threads(self) -> None:
        # This process's threads as they were before it became stage 0 of a pipeline.
        if self.topology.num_stages > 1 and self.config.device == "cpu":
            cpu_kernels.limit_threads(None)
            torch.set_num_threads(self._threads_before)

    # --- requests -------------------------------------------------------------------------------------
    def check_structured(self, spec) -> None:
        """Compiles a StructuredOutput now (the compiler built when a request first asks): ValueError naming
        what cannot be compiled."""
        compiler = grammar_compiler(self.config.model, self.model_config.vocab_size, tuple(self.eos_token_ids))
        compile_structured(compiler, spec)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError naming the problem; changes nothing."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
        if len(prompt_token_ids) == 0:
            raise ValueError("The prompt is empty; give at least one token.")
        vocab = self.model_config.vocab_size
        for t in prompt_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"Prompt token id {t!r} is out of range for a vocabulary of {vocab}.")
        if params.logit_bias is not None:
            for t in params.logit_bias:
                if t >= vocab:
                    raise ValueError(f"logit_bias token id {t} is out of range for a vocabulary of {vocab}.")
        if params.structured is not None:
            self.check_structured(params.structured)
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"The prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})."
            )

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        self.check_request(prompt_token_ids, params)
        seq_id = self._next_id
        # Every request gets a seed, so its samples do not depend on what else is in the batch.
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        seed = (seed + _INT64) % (2 * _INT64) - _INT64
        seq = Sequence(seq_id, list(prompt_token_ids), params, eos_token_ids=tuple(self.eos_token_ids), seed=seed)
        self.scheduler.add(seq)
        self._next_id += 1
        return seq_id

    def abort(self, seq_id: int) -> None:
        self.scheduler.abort(seq_id)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._in_flight)

    # --- the step -------------------------------------------------------------------------------------
    def step(self) -> list[SeqUpdate]:
        """One engine step: schedule -> execute -> update. Returns what every request sampled in it gained
        (its new tokens, each once, with logprobs), finished requests included with their finish reason."""
        # Schedule: up to one micro-batch per stage in flight, each of requests in no other one (a request's
        # next step is scheduled once its tokens are back), each a share of the running requests so that the
        # first does not take them all. Execute: launch them; wait for the oldest. Update: its bookkeeping.
        while len(self._in_flight) < self.micro_batches:
            busy = {s.seq.seq_id for b in self._in_flight for s in b.seqs}
            batch = self.scheduler.schedule(busy, parts=self.micro_batches)
            if batch is None:
                break
            self.executor.launch(StepPlan.from_batch(batch))
            self._in_flight.append(batch)
        if not self._in_flight:
            return []
        batch = self._in_flight.popleft()
        return self._update(batch, self.executor.collect())

    def _update(self, batch: ScheduledBatch, outputs: dict[int, SeqOutput]) -> list[SeqUpdate]:
        now = time.perf_counter()
        for s in batch.seqs:
            if s.is_sampled and s.num_drafts:
                self.spec_metrics.record(s.num_drafts, len(outputs[s.seq.seq_id].tokens) - 1)
        updates = self.scheduler.update(batch, outputs, self.proposer)
        for u in updates:
            m = u.seq.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            if u.finished:
                m.finished_time = now
        return updates

    def spec_decode_metrics(self) -> dict:
        return self.spec_metrics.as_dict()

    def kv_summary(self) -> dict:
        """The paged cache as `leanserve memory` reports it (engine/kv_budget.py: kv_summary)."""
        cfg, window, itemsize = self.model_config, window_bytes(self.memory_ledger()), self.cache_itemsize
        return kv_summary(cfg, self.topology, self.kv, itemsize, self.max_model_len, self.config.max_num_seqs, window)

    def cache_stats(self) -> dict:
        pool, prefix = self.scheduler.blocks, self.scheduler.prefix
        stats = {
            "block_tokens": pool.block_tokens,
            "num_blocks": pool.num_blocks,
            "blocks_used": pool.num_used,
            "blocks_free": pool.num_free,
            "num_preemptions": self.scheduler.num_preemptions,
        }
        if prefix is not None:
            stats.update(
                prefix_cache_entries=prefix.num_entries, prefix_cache_queries=prefix.queries,
                prefix_cache_hits=prefix.hits,
            )  # fmt: skip
        return stats

    def reset_prefix_cache(self) -> None:
        if self.scheduler.prefix is not None:
            self.scheduler.prefix.clear()


def check_speculative(spec: SpeculativeConfig | None, cfg: ModelConfig, model_dir: str, weights: bool = True) -> None:
    """Errors naming what a speculative method lacks; `weights=False` (a plan from a config alone) skips
    looking for MTP tensors."""
    if spec is None:
        return
    if spec.method == "mtp" and (not cfg.has_mtp or (weights and not has_mtp_weights(model_dir))):
        raise ConfigError(
            f"speculative_config.method 'mtp' needs the checkpoint's MTP layer, but {model_dir} has no MTP weights "
            "(num_nextn_predict_layers or mtp.* tensors missing)."
        )
    if spec.method == "draft_model":
        if not (Path(spec.model) / "config.json").is_file():
            raise ConfigError(f"speculative_config.model {spec.model!r} is not a model directory (no config.json).")
        draft = ModelConfig.from_hf(spec.model)
        if draft.vocab_size != cfg.vocab_size:
            raise ConfigError(
                f"The draft model's vocabulary ({draft.vocab_size} tokens, {spec.model}) differs from the target's "
                f"({cfg.vocab_size}); a draft model must share the target's tokenizer."
            )


def resolve_dtype(name: str, model_dir: str) -> torch.dtype:
    if name == "auto":
        return checkpoint_dtype(model_dir)
    return getattr(torch, name)
