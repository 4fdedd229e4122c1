"""One pipeline stage: its part of the model, its caches and buffers (all in its memory ledger), and the
step that turns a StepPlan (plus the previous stage's streams) into streams or sampled tokens."""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from leanserve.engine.config import EngineConfig
from leanserve.engine.grammar import GrammarState
from leanserve.engine.penalties import PenaltyState
from leanserve.engine.proposers import DraftModelProposer, MTPProposer, ProposeItem
from leanserve.engine.sampler import Sampler, _is_greedy
from leanserve.engine.scheduler import ScheduledBatch
from leanserve.engine.sequence import PromptLogprobs, SampledToken, SeqOutput
from leanserve.memory import KV_CACHE, PIPELINE, SPEC_DRAFT, SPEC_MTP, MemoryLedger, StageMemory, weights_by_format
from leanserve.model.batch import Chunk, build_forward_batch
from leanserve.model.build import build_model
from leanserve.model.cache import BlockTable, CacheGeometry
from leanserve.model.config import ModelConfig
from leanserve.model.deepseek_v4 import StageLayout
from leanserve.model.loader import load_weights
from leanserve.sampling_params import SamplingParams

# The most logits a block of prompt-logprob rows holds at once (64 MiB of float32): the head over a long chunk's
# rows runs in blocks of _HEAD_BLOCK // vocab rows.
_HEAD_BLOCK = 1 << 24
_NO_ROWS = torch.empty(0, dtype=torch.long)  # (seeds and steps of a step whose rows all take the argmax)


@dataclass(frozen=True)
class IntermediateStreams:
    """What a non-last stage hands the next: the residual streams [tokens, hc_mult, hidden], model dtype."""

    streams: torch.Tensor


@dataclass(frozen=True)
class SampleSpec:
    seq_id: int
    params: SamplingParams
    seed: int
    step: int  # tokens the sequence has generated so far (the sampler's counter)
    slot: int = 0
    drafts: tuple[int, ...] = ()  # the draft tokens at the end of the sequence's chunk, to verify


@dataclass(frozen=True)
class PromptLogprobSpec:
    """A prefill chunk's rows whose prompt logprobs its request asks for: the logits at flat row `row + i`
    (prompt position `first - 1 + i`) score prompt token `targets[i]` (at position `first + i`). Every token of
    the prompt is known when the plan is made, so a chunk scores its own rows, its last one included (the next
    chunk's first token is its target): nothing is kept from one chunk to the next."""

    seq_id: int
    row: int
    first: int  # prompt position of targets[0] (>= 1)
    targets: tuple[int, ...]
    k: int  # top logprobs wanted (the request's prompt_logprobs)


# StepPlan.next_tokens' entry for a chunk that ends its request's known tokens and samples nothing (a request
# with max_tokens 0: it only scores its prompt).
SCORE_ONLY = -2


@dataclass(frozen=True)
class StepPlan:
    """Everything any stage needs for one step, built once by the first stage and sent to the others.
    Each chunk's `start` is its sequence's committed token count, so every stage learns the committed
    counts from the plan (a rollback is a start lower than what a slot has written)."""

    chunks: tuple[Chunk, ...]
    logits_rows: tuple[int, ...]  # flat token rows whose logits are used: len(drafts) + 1 per sample, in order
    samples: tuple[SampleSpec, ...]
    # Per chunk: the token right after it when that is already known (a non-final prefill chunk), else -1
    # (SCORE_ONLY when the chunk samples nothing either). The MTP layer at the chunk's last position reads it.
    next_tokens: tuple[int, ...] = ()
    # The slots of every running request with presence / frequency / repetition penalties (in this plan or
    # not): the last stage keeps their token counts while this is not empty. () when no request has them.
    penalty_slots: tuple[int, ...] = ()
    # The rows of the prefill chunks whose requests ask for prompt_logprobs (the last stage takes the head at
    # them too); () when none does, so the others' steps take the head at their sampled rows alone.
    prompt_logprobs: tuple[PromptLogprobSpec, ...] = ()
    # The seq ids of every running request with structured output (in this plan or not): the last stage keeps
    # their grammar matchers while they are named. () when no request has it.
    structured: tuple[int, ...] = ()
    # (slot, prompt length) of chunks that feed a preempted request's output again (ScheduledBatch's).
    penalty_recount: tuple[tuple[int, int], ...] = ()
    # The cache blocks sequences took for this step: (slot, first, blocks) says the slot's blocks first, first + 1,
    # ... are `blocks` (every stage's block table takes them before the step runs).
    blocks: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    # The prefix cache's copies before the step (ScheduledBatch's): window states saved and restored, block rows.
    saves: tuple[tuple[int, int], ...] = ()
    restores: tuple[tuple[int, int, int], ...] = ()
    block_copies: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @classmethod
    def from_batch(cls, batch: ScheduledBatch) -> StepPlan:
        chunks, rows, samples, next_tokens, prompt = [], [], [], [], []
        offset = 0
        for s in batch.seqs:
            chunks.append(Chunk(s.slot, s.start, s.token_ids))
            seq = s.seq
            if seq.params.prompt_logprobs is not None:
                # Positions [start, end) of this chunk score prompt tokens start+1 .. end (the prompt's last
                # position predicts the first output token, not a prompt token), those not scored already (a
                # preempted request prefills its prompt again).
                end = min(s.start + len(s.fed_token_ids), seq.num_prompt_tokens - 1)
                first = max(s.start, sum(len(p) for p in seq.prompt_logprobs))
                if end > first:
                    targets = tuple(seq.prompt_token_ids[first + 1 : end + 1])
                    row = offset + first - s.start
                    prompt.append(PromptLogprobSpec(seq.seq_id, row, first + 1, targets, seq.params.prompt_logprobs))
            offset += s.num_tokens
            if s.is_sampled:
                rows.extend(range(offset - 1 - s.num_drafts, offset))
                step = seq.num_output_tokens
                samples.append(SampleSpec(seq.seq_id, seq.params, seq.seed, step, s.slot, s.draft_token_ids))
                next_tokens.append(-1)
            else:
                end = s.start + s.num_tokens
                following = seq.token_ids_between(end, end + 1)
                next_tokens.append(following[0] if following else SCORE_ONLY)
        blocks = tuple((s.slot, s.first_block, s.new_blocks) for s in batch.seqs if s.new_blocks)
        return cls(
            tuple(chunks), tuple(rows), tuple(samples), tuple(next_tokens), batch.penalty_slots, tuple(prompt),
            batch.structured, batch.penalty_recount, blocks, batch.saves, batch.restores, batch.block_copies,
        )  # fmt: skip


@dataclass(frozen=True)
class StageInfo:
    """What a stage reports once it is loaded."""

    layout: StageLayout
    memory: StageMemory
    param_names: tuple[str, ...]


class StageRunner:
    def __init__(
        self,
        cfg: ModelConfig,
        config: EngineConfig,
        layout: StageLayout,
        dtype: torch.dtype,
        max_model_len: int,
        progress: bool = True,
        device: str | None = None,
        num_blocks: int | None = None,
    ) -> None:
        """device "meta" builds the stage's shapes without memory or weights (`leanserve memory --plan`).
        num_blocks: the paged pools' blocks (engine/kv_budget.py; None: room for max_num_seqs sequences of
        max_model_len, each slot's blocks its own until a plan says otherwise)."""
        self.cfg, self.layout = cfg, layout
        self.device = device = device or config.device
        spec = config.speculative_config
        # The MTP layer and the trunk streams it reads exist only when the MTP drafter runs, on the last stage.
        uses_mtp = spec is not None and spec.needs_target_hidden_states() and layout.is_last
        checkpoint = config.model if device != "meta" else None  # (its headers checked before allocating)
        self.model = build_model(
            cfg,
            max_model_len,
            dtype,
            layout,
            uses_mtp,
            device,
            config.backend,
            checkpoint,
            config.fp4_inputs,
            config.fp8_inputs,
        )
        if device != "meta":
            load_weights(self.model, config.model, progress=progress)
        self.ledger = ledger = MemoryLedger(layout.index, device)
        self.model.register_tables(ledger)
        num_spec = spec.num_speculative_tokens if spec is not None else 0
        self.geometry = geo = CacheGeometry.build(
            cfg, config.max_num_seqs, max_model_len, num_spec, num_blocks, config.kv_block_size, config.prefix_states
        )
        full = geo.num_slots * geo.max_blocks
        self.block_table = BlockTable(geo.num_slots, geo.max_blocks, identity=geo.num_blocks == full)
        ledger.register("kv_block_table", "kv_cache", KV_CACHE, self.block_table.tensor)
        act = self.model.act_dtype  # (float32 on the CPU when the weights are bfloat16: see activation_dtype)
        self.caches = self.model.allocate_cache(self.geometry, act, ledger)
        tokens = config.max_num_batched_tokens
        # Stable address (CUDA-graph safe); the forward copies the pre-hc_head streams into it each step.
        self.target_hidden = (
            ledger.empty("target_hidden_states", "model", SPEC_MTP, (tokens, cfg.hc_dim), act) if uses_mtp else None
        )
        # A non-first stage receives the previous stage's streams here, at stable addresses: one buffer per
        # micro-batch in flight (overlap receives the next one while this stage computes the current one).
        shape = (config.micro_batches, config.micro_batch_tokens, cfg.hc_mult, cfg.hidden_size)
        self.recv_streams = (
            None if layout.is_first else ledger.empty("pp_recv_streams", "pipeline", PIPELINE, shape, act)
        )
        self.sampler = Sampler() if layout.is_last else None
        # Per-slot token counts for the penalties: no tensor until a running request has penalties.
        self.penalties = PenaltyState(ledger, config.max_num_seqs, cfg.vocab_size) if layout.is_last else None
        # Grammar matchers of running requests with structured output: none (nor a compiler) until one comes.
        self.grammars = GrammarState(config.model, cfg, self.device) if layout.is_last else None
        self.proposer = None
        if layout.is_last and spec is not None and spec.method in ("mtp", "draft_model"):
            common = dict(k=num_spec, num_slots=config.max_num_seqs, sampler=self.sampler, ledger=ledger)
            if spec.method == "mtp":
                self.proposer = MTPProposer(
                    self.model, self.geometry, self.caches, self.target_hidden, self.block_table, vocab=cfg.vocab_size,
                    feature=SPEC_MTP, **common,
                )  # fmt: skip
            else:
                self.proposer = DraftModelProposer.load(
                    spec, config.max_num_seqs, max_model_len, dtype, device, ledger, SPEC_DRAFT, self.sampler
                )
        self.memory = ledger.memory
        self.memory.add_weights(weights_by_format(self.model))
        if isinstance(self.proposer, DraftModelProposer):  # the draft model's weights are weights too
            self.memory.add_weights(weights_by_format(self.proposer.model))
        self._written = np.zeros(config.max_num_seqs, dtype=np.int64)  # positions each slot holds
        self.busy_s = 0.0  # seconds spent in execute (a pipeline's busy fractions)
        self.max_num_batched_tokens = tokens
        freeze_built_objects()  # (warm-up freezes once more, for the kernels it loads)

    def info(self) -> StageInfo:
        return StageInfo(self.layout, self.memory, tuple(n for n, _ in self.model.named_parameters()))

    @torch.inference_mode()
    def warmup(self) -> None:
        """Throw-away forwards, so first-call costs (compiling or loading the kernels' variants, the allocator)
        are not billed to the first request, through the trunk and the drafter when there is one. Each kernel
        runs whole or in threaded parts (their launcher compiled per argument types), taken by the call's size,
        and some take other array layouts for one token than for several, so the warm-up runs one step of each
        shape a request's steps take:
          - a long prefill chunk (the torch path; threaded parts), past index_topk compressed rows of the CSA
            layers (their indexer's top-k selection) and over more than one query block;
          - prefill chunks of 16 tokens and of a few (the torch path's few-row kernels: threaded, one-thread);
          - a one-token decode step (the decode path), and with speculation a verification-sized step too.
        They write positions of slot 0, which no sequence has committed yet (a request's prefill overwrites
        them). Each chunk fits max_num_batched_tokens; all of them fit max_model_len, shortening the first."""
        from leanserve.model.backends.cpu import kernels as cpu_kernels
        from leanserve.model.batch import PREFILL_BLOCK
        from leanserve.model.config import CSA

        if torch.device(self.device).type == "cpu" and not cpu_kernels.compiled_before():
            logging.getLogger("leanserve").info(
                "compiling the CPU kernels into numba's cache (once per checkout: a few minutes on 2 cores; "
                "`leanserve prebuild` compiles every weight format ahead, in parallel)"
            )
        cfg, geo = self.cfg, self.geometry
        short = 1 + geo.window_ring - geo.window  # the longest chunk that takes the decode path
        cap = max(1, self.max_num_batched_tokens)
        tail = [min(max(16, short + 1), cap), min(short + 1, cap), 1] + ([min(short, cap)] if short > 1 else [])
        long = 2 * PREFILL_BLOCK  # threaded attention over two query blocks
        if CSA in cfg.layer_types and cfg.index_topk > 0:  # a query seeing index_topk + 1 compressed rows
            long = max(long, (cfg.index_topk + 1) * cfg.compress_rate_csa)
        long = min(long, cap, geo.max_model_len - sum(tail))
        hc, hidden = cfg.hc_mult, cfg.hidden_size
        start = 0
        for size in (long, *tail):
            if size < 1:
                continue
            if start + size > geo.max_model_len:
                break
            chunk = Chunk(0, start, [0] * size)
            start += size
            fb = build_forward_batch(
                [chunk], self.geometry, logits_index=[size - 1], device=self.device, table=self.block_table
            )
            streams = None
            if not self.layout.is_first:
                streams = torch.zeros(size, hc, hidden, dtype=self.recv_streams.dtype, device=self.device)
            self.model(fb, self.caches, streams, target_hidden=self.target_hidden)
            if isinstance(self.proposer, MTPProposer):
                mtp_fb = build_forward_batch(
                    [chunk], self.proposer.geometry, logits_index=[size - 1], device=self.device, table=self.block_table
                )
                self.model.mtp_forward(self.target_hidden[:size].view(size, hc, hidden), mtp_fb, self.caches)
            elif isinstance(self.proposer, DraftModelProposer):
                draft = self.proposer
                draft.model(
                    build_forward_batch(
                        [chunk], draft.geometry, logits_index=[size - 1], device=self.device, table=draft.table
                    ),
                    draft.caches,
                )
        freeze_built_objects()

    def streams_buffer(self, index: int, num_tokens: int) -> torch.Tensor:
        """Receive buffer `index` (one per micro-batch in flight), sized to a step of `num_tokens` tokens."""
        if num_tokens > self.recv_streams.shape[1]:
            raise RuntimeError(f"a step of {num_tokens} tokens exceeds max_num_batched_tokens")
        return self.recv_streams[index, :num_tokens]

    @torch.inference_mode()
    def execute(
        self,
        plan: StepPlan,
        received: IntermediateStreams | None = None,
        *,
        propose: bool = True,
        capture_hidden: bool = True,
    ) -> IntermediateStreams | dict[int, SeqOutput]:
        """Runs this stage's part of one step on the previous stage's streams (none on the first stage):
        returns this stage's streams (non-last stage) or the sampled token of every sequence in
        plan.samples (last stage).

        propose=False skips the model proposer (MTP layer or draft model) this step: no drafts come back, and
        its cache misses this step's positions (later drafts may be worse, never wrong). capture_hidden=False
        skips copying the pre-hc_head streams into the target-hidden buffer, which only the MTP proposer
        reads, so it needs propose=False on an MTP runner."""
        if propose and not capture_hidden and isinstance(self.proposer, MTPProposer):
            raise ValueError(
                "execute(propose=True, capture_hidden=False): the MTP proposer reads the target-hidden streams "
                "this step captures; pass propose=False too, or keep capture_hidden=True."
            )
        start = time.perf_counter()
        try:
            return self._execute(plan, received, propose, capture_hidden)
        finally:
            self.busy_s += time.perf_counter() - start

    def _execute(self, plan, received, propose, capture_hidden):
        if plan.saves or plan.restores or plan.block_copies:
            self._copy(plan)
        self._check_committed(plan)
        geo = self.geometry
        for slot, first, blocks in plan.blocks:
            if first + len(blocks) > geo.max_blocks or max(blocks) >= geo.num_blocks:
                raise RuntimeError(
                    f"stage {self.layout.index}: slot {slot} is given blocks {first}..{first + len(blocks) - 1} = "
                    f"{list(blocks)}, beyond its {geo.max_blocks} blocks or the pool's {geo.num_blocks}"
                )
            self.block_table.assign(slot, first, blocks)
        last = self.layout.is_last
        logits_index = list(plan.logits_rows) if last else None
        fb = build_forward_batch(
            list(plan.chunks), self.geometry, logits_index=logits_index, device=self.device, table=self.block_table
        )
        streams = received.streams if received is not None else None
        if last:  # (before the model runs: the step's grammar masks are filled while it does)
            self.grammars.begin(plan.structured, plan.samples)
        # The last stage's streams at the sampled rows only (the others skip the last block's MoE), unless the MTP
        # layer takes every row's or prompt logprobs read theirs.
        capture = self.target_hidden if capture_hidden else None
        sampled_only = last and capture is None and not plan.prompt_logprobs
        out = self.model.trunk(fb, self.caches, streams, capture, fb.logits_index if sampled_only else None)
        if not last:
            return IntermediateStreams(out)
        # The head at the sampled rows, and only for requests asking for prompt logprobs at their prompt rows.
        prompt = self._prompt_logprobs(out, plan.prompt_logprobs) if plan.prompt_logprobs else {}
        self.penalties.begin(plan.penalty_slots, plan.chunks, plan.samples, plan.penalty_recount)
        rows = out if sampled_only or fb.logits_index is None else out[fb.logits_index]  # (None: every row)
        tokens = self._verify(self.model.head_logits(rows), plan.samples) if plan.samples else {}
        drafts = self._propose(plan, tokens) if propose and self.proposer is not None else {}
        outputs = {
            seq_id: SeqOutput(t, drafts.get(seq_id, ()), prompt.pop(seq_id, None)) for seq_id, t in tokens.items()
        }
        outputs.update((seq_id, SeqOutput((), prompt_logprobs=p)) for seq_id, p in prompt.items())
        return outputs

    def _prompt_logprobs(
        self, streams: torch.Tensor, specs: tuple[PromptLogprobSpec, ...]
    ) -> dict[int, PromptLogprobs]:
        """The head at the rows `specs` name, in blocks of at most _HEAD_BLOCK logits (so a long chunk's rows
        never hold [chunk, vocab] at once): per request, its targets' logprobs under log_softmax of the raw
        logits (as the sampler's) and its top-k."""
        dev = streams.device
        rows = torch.tensor([r for s in specs for r in range(s.row, s.row + len(s.targets))], device=dev)
        targets = torch.tensor([t for s in specs for t in s.targets], device=dev)
        vocab = self.cfg.vocab_size
        k = min(max(s.k for s in specs), vocab)
        block = max(1, _HEAD_BLOCK // vocab)
        lps, top_ids, top_lps = [], [], []
        for i in range(0, len(rows), block):
            logp = torch.log_softmax(self.model.head_logits(streams[rows[i : i + block]]), dim=-1)
            lps.append(logp.gather(1, targets[i : i + block, None]).squeeze(1))
            if k:
                values, ids = logp.topk(k, dim=-1)  # sorted descending
                top_lps.append(values)
                top_ids.append(ids)
        lp = torch.cat(lps).cpu().numpy()
        n = len(lp)
        tid = torch.cat(top_ids).cpu().numpy() if k else np.zeros((n, 0), dtype=np.int64)
        tlp = torch.cat(top_lps).cpu().numpy() if k else np.zeros((n, 0), dtype=np.float32)
        out, at = {}, 0
        for s in specs:
            end = at + len(s.targets)
            m = min(s.k, vocab)
            out[s.seq_id] = PromptLogprobs(s.first, lp[at:end].copy(), tid[at:end, :m].copy(), tlp[at:end, :m].copy())
            at = end
        return out

    def _copy(self, plan: StepPlan) -> None:
        """The prefix cache's copies, in every layer's caches: states saved, then restored, then block rows."""
        caches = self.caches.values()
        for slot, state in plan.saves:
            for cache in caches:
                cache.save_state(slot, state)
        for state, slot, position in plan.restores:
            for cache in caches:
                cache.restore_state(state, slot)
            self._written[slot] = position
        for src, dst in plan.block_copies:
            for cache in caches:
                cache.copy_block(src, dst)

    def _check_committed(self, plan: StepPlan) -> None:
        # Every stage checks the plan against what it has written, so stages cannot drift apart silently.
        for c in plan.chunks:
            if c.start > self._written[c.slot]:
                raise RuntimeError(
                    f"stage {self.layout.index}: slot {c.slot} is asked to continue at position {c.start} "
                    f"but holds only {self._written[c.slot]} positions"
                )
            self._written[c.slot] = c.start + len(c.token_ids)

    def _verify(self, logits: torch.Tensor, samples: tuple[SampleSpec, ...]) -> dict[int, tuple[SampledToken, ...]]:
        """Per sequence: its accepted drafts and one sampled token (just the sampled token without drafts)."""
        params, seeds, steps, drafts, slots, cols = [], [], [], [], [], []
        for s in samples:
            for j in range(len(s.drafts) + 1):
                params.append(s.params)
                seeds.append(s.seed)
                steps.append(s.step + j)
                drafts.append(s.drafts[j] if j < len(s.drafts) else -1)
                slots.append(s.slot)
                cols.append(min(j, self.proposer.k - 1) if self.proposer is not None else 0)
        # Logprobs are the raw logits' (vLLM's default); bias, penalties and grammars change what is sampled.
        raw = logits
        logits = self.penalties.process(logits, samples)
        if self.grammars.matchers:  # (constrained rows: their grammar's mask, after bias and penalties)
            logits = self.grammars.mask(logits, samples)
        plain = len(params) == len(samples)  # no drafts
        greedy = all(_is_greedy(p) for p in params)
        if plain and greedy:  # (argmax rows: no seeds or steps to draw with)
            seeds_t = steps_t = _NO_ROWS
        else:
            seeds_t, steps_t = torch.tensor(seeds, dtype=torch.long), torch.tensor(steps, dtype=torch.long)
        if plain:
            final, _ = self.sampler.sample(logits, params, seeds_t, steps_t)
            accepted = [False] * len(params)
        else:
            drafts_t = torch.tensor(drafts, dtype=torch.long)
            q = None
            # Model drafts of sampled requests were drawn from q; ngram drafts and greedy drafts need no q.
            if self.proposer is not None and not greedy:
                q = self.proposer.draft_probs[torch.tensor(slots), torch.tensor(cols)]
            accepted_t, emit = self.sampler.verify(logits, params, seeds_t, steps_t, drafts_t, q)
            final = torch.where(accepted_t, drafts_t, emit)
            accepted = accepted_t.tolist()
        out = self.sampler.with_logprobs(raw, final, params)
        token_ids = final.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        result, row = {}, 0
        for s in samples:
            emitted = []
            for j in range(len(s.drafts) + 1):
                r = row + j
                want = s.params.logprobs
                if want is None:
                    emitted.append(SampledToken(token_ids[r]))
                else:
                    top = tuple(zip(top_ids[r][:want], top_lp[r][:want], strict=True)) if want and top_ids else ()
                    emitted.append(SampledToken(token_ids[r], logprobs[r], top))
                if not accepted[r]:  # the first row not accepted emits its own token and ends the sequence's run
                    break
            result[s.seq_id] = tuple(emitted)
            row += len(s.drafts) + 1
        self.penalties.record(samples, result)
        self.grammars.record(samples, result)
        return result

    def _propose(self, plan: StepPlan, tokens: dict[int, tuple[SampledToken, ...]]) -> dict[int, tuple[int, ...]]:
        k = self.proposer.k
        samples = iter(plan.samples)
        items, row, seeds = [], 0, {}
        for chunk, next_token in zip(plan.chunks, plan.next_tokens, strict=True):
            fed = tuple(chunk.token_ids)
            if next_token == SCORE_ONLY:  # the request ends with this chunk: nothing to draft for
                pass
            elif next_token >= 0:  # a non-final prefill chunk: its positions are final, the next token is known
                items.append(ProposeItem(chunk.slot, chunk.start, fed + (next_token,), row))
            else:
                s = next(samples)
                emitted = tokens[s.seq_id]
                valid = len(fed) - len(s.drafts) + len(emitted) - 1  # the fed tokens now committed
                known = fed[:valid] + (emitted[-1].token_id,)
                step = s.step + len(emitted)  # output index of the first draft
                # Propose only what the request can still use (one token always comes with the drafts).
                limit = max(0, min(k, s.params.max_tokens - step - 1))
                items.append(ProposeItem(chunk.slot, chunk.start, known, row, s.seq_id, s.params, step, limit))
                seeds[s.seq_id] = s.seed
            row += len(fed)
        return self.proposer.propose(items, seeds) if items else {}


def freeze_built_objects() -> None:
    """Puts every object the process holds now (the model, torch's and numba's modules, the compiled kernels) out
    of the garbage collector's walks: they live as long as the process, and a full collection, which the steps'
    own garbage sets off now and then, would walk them all (80-100 ms on 2 cores, a stall in the middle of a
    step). The garbage made so far is collected first."""
    gc.collect()
    gc.freeze()
