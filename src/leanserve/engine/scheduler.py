from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Set
from dataclasses import dataclass

from leanserve.engine.blocks import BlockPool
from leanserve.engine.config import micro_batch_tokens
from leanserve.engine.kv_manager import KvCacheManager
from leanserve.engine.prefix_cache import PrefixCache
from leanserve.engine.proposers import ProposeItem, Proposer
from leanserve.engine.sequence import SampledToken, SeqOutput, Sequence, SequenceStatus
from leanserve.engine.slots import CacheSlots
from leanserve.model.cache import BLOCK_TOKENS, blocks_for


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # position of the first token fed this step (== seq.num_computed_tokens at schedule time)
    slot: int
    # seq.all_token_ids[start : start + len(fed_token_ids)]: a prefill chunk, or the newest token for a decode
    fed_token_ids: tuple[int, ...]
    # True when this step reaches the end of the sequence's known tokens, so the logit row of its last
    # fed token is sampled. False for a non-final chunk of a chunked prefill, and for the last chunk of a
    # request with max_tokens 0 (scoring its prompt only: it finishes once that chunk is in, sampling nothing).
    is_sampled: bool
    # Speculative tokens for the positions after the fed ones, to verify (only on a sampled chunk).
    draft_token_ids: tuple[int, ...] = ()
    # Cache blocks the sequence took for this step: its blocks first_block, first_block + 1, ... (engine/blocks.py)
    first_block: int = 0
    new_blocks: tuple[int, ...] = ()

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The chunk the model sees: the fed tokens, then the drafts."""
        return self.fed_token_ids + self.draft_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.fed_token_ids) + len(self.draft_token_ids)

    @property
    def num_drafts(self) -> int:
        return len(self.draft_token_ids)


@dataclass(frozen=True)
class ScheduledBatch:
    seqs: tuple[ScheduledSeq, ...]
    num_tokens: int  # sum of seqs[i].num_tokens; <= max_num_batched_tokens
    # The slots of every running request with presence / frequency / repetition penalties, this batch's or
    # not (the last stage keeps their token counts while this is not empty); () when no request has them.
    penalty_slots: tuple[int, ...] = ()
    # The seq ids of every running request with structured output, this batch's or not (the last stage keeps
    # their grammar matchers while it names them); () when no request has it.
    structured: tuple[int, ...] = ()
    # (slot, prompt length) of this batch's chunks that feed a preempted request's output tokens again: its new
    # slot's penalty counts take them (they were counted in the old slot as they were sampled).
    penalty_recount: tuple[tuple[int, int], ...] = ()
    # The prefix cache's copies, made by every stage before the step, in this order: (slot, saved state) window
    # states saved, (saved state, slot, position) restored (the slot then holds `position` tokens), and
    # (block, block) rows copied.
    saves: tuple[tuple[int, int], ...] = ()
    restores: tuple[tuple[int, int, int], ...] = ()
    block_copies: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class SeqUpdate:
    """What one sampled sequence gained in a step: its new tokens (up to the one that finished it: tokens after
    a stop are not part of the output), and its finish reason when the step finished it."""

    seq: Sequence
    new_tokens: tuple[SampledToken, ...]
    finish_reason: str | None = None  # "stop" | "length" when finished this step

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Scheduler:
    """Continuous batching with chunked prefill over a fixed pool of cache slots (one per running sequence) and
    a pool of cache blocks (engine/blocks.py: a sequence holds the blocks for the positions it writes).

    One engine step is schedule() -> model execute -> update(). Running sequences are served first, in the
    order they started running, each taking the blocks its step writes; then waiting ones are admitted FIFO
    while a slot, the token budget and the blocks for the rest of their prompt (beyond what sequences still
    prefilling will take) remain. When a running sequence needs a block and none is free, the most recently
    admitted running sequences are preempted (recompute: their slot and blocks are freed, their tokens kept,
    and they wait at the head of the queue to prefill them again), itself last. add() refuses a request that
    could never fit: prompt + max_tokens beyond max_model_len or beyond the whole pool.
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        blocks: BlockPool | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        """blocks None: a pool with room for max_num_seqs sequences of max_model_len (never preempts).
        prefix_cache None: no prefix caching (nothing hashed or kept)."""
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}.")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # One slot per concurrently running sequence; the model sizes its per-slot caches to match.
        self.slots = CacheSlots(max_num_seqs)
        if blocks is None:
            blocks = BlockPool(max_num_seqs * blocks_for(max_model_len, BLOCK_TOKENS), BLOCK_TOKENS)
        self.kv = KvCacheManager(blocks, prefix_cache)
        self.num_preemptions = 0  # sequences preempted so far
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # in the order they started running
        self._live: dict[int, Sequence] = {}  # seq_id -> every waiting or running sequence
        self._penalty_slots: set[int] = set()  # slots of running sequences with penalties
        self._structured: set[int] = set()  # seq ids of running sequences with structured output
        self._recomputing: set[int] = set()  # ids of preempted requests with penalties, until their tokens are back

    @property
    def blocks(self) -> BlockPool:
        return self.kv.pool

    @property
    def prefix(self) -> PrefixCache | None:
        return self.kv.prefix

    @property
    def has_unfinished(self) -> bool:
        return bool(self._live)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_computed_tokens(self) -> int:
        """Positions the running sequences have in the cache (what their blocks hold)."""
        return sum(seq.num_computed_tokens for seq in self._running)

    def add(self, seq: Sequence) -> None:
        n, m = seq.num_prompt_tokens, seq.params.max_tokens
        if n == 0:
            raise ValueError(f"Request {seq.seq_id} has an empty prompt.")
        if m < 1 and not (m == 0 and seq.params.prompt_logprobs is not None):
            raise ValueError(f"Request {seq.seq_id} has max_tokens ({m}) < 1 (0 only with prompt_logprobs).")
        if n + m > self.max_model_len:
            raise ValueError(
                f"Request {seq.seq_id}: prompt ({n} tokens) + max_tokens ({m}) exceeds "
                f"max_model_len ({self.max_model_len})."
            )
        pool = self.blocks
        if pool.blocks_for(n + m) > pool.num_blocks:
            raise ValueError(
                f"Request {seq.seq_id}: prompt ({n} tokens) + max_tokens ({m}) needs {pool.blocks_for(n + m)} cache "
                f"blocks of {pool.block_tokens} tokens; the cache holds {pool.num_blocks}."
            )
        if seq.seq_id in self._live:
            raise ValueError(f"Request id {seq.seq_id} is already waiting or running.")
        if seq.status is not SequenceStatus.WAITING or seq.slot is not None:
            raise ValueError(f"Request {seq.seq_id} is not a fresh WAITING sequence (status {seq.status}).")
        self._waiting.append(seq)
        self._live[seq.seq_id] = seq

    def abort(self, seq_id: int) -> Sequence | None:
        seq = self._live.get(seq_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self._finish(seq, "abort")
        return seq

    def schedule(self, busy: Set[int] = frozenset(), parts: int = 1) -> ScheduledBatch | None:
        """The next step's batch. With pipeline micro-batches: `busy`, the requests in micro-batches still in
        flight, are left out, and the batch takes at most 1/parts of the requests there are to serve (running
        ones and those a free slot can admit), so that the running requests spread over `parts` batches, and
        a 1/parts share of max_num_batched_tokens."""
        budget = total = micro_batch_tokens(self.max_num_batched_tokens, parts)
        out: list[ScheduledSeq] = []
        most = self.max_num_seqs
        if parts > 1:
            serving = len(self._running) + min(len(self._waiting), self.slots.num_free)
            most = min(most, max(1, -(-serving // parts)))
        # A running sequence mid-prefill is always among the last admitted (it only stops short of its
        # prompt end when the budget ran out), so decodes are never starved behind a long prefill.
        for seq in list(self._running):  # (a copy: preemption removes sequences)
            if budget == 0 or len(out) == most:
                break
            if seq.seq_id not in busy and seq.status is SequenceStatus.RUNNING:
                n = self._chunk(seq, budget)
                if n > 0 and self._make_room(seq, seq.num_computed_tokens + n, busy):
                    budget -= self._take(seq, n, out)
        # Drafts only from what is left once every running sequence has its token, so they never starve one; and
        # only as many as the blocks the sequence holds or can get without preempting anyone take.
        for i, s in enumerate(out):
            if budget == 0:
                break
            extra = self._drafts(s, budget)
            if extra:
                end = s.start + len(s.fed_token_ids)
                if not self.kv.grow(s.seq, end + len(extra)):
                    extra = extra[: len(s.seq.blocks) * self.blocks.block_tokens - end]
                if extra:
                    out[i] = self._announce(dataclasses.replace(s, draft_token_ids=extra))
                    budget -= len(extra)
        # Blocks the running sequences still prefilling will take for the rest of their tokens (only when a request
        # waits: a decode-only step pays nothing for it).
        owed = sum(self.kv.owed(q) for q in self._running) if self._waiting else 0
        while self._waiting and self.slots.num_free > 0 and len(out) < most and budget > 0:
            seq = self._waiting[0]
            hit = self.kv.lookup(seq)
            if not self.kv.make_free(self.kv.blocks_to_admit(seq, hit) + owed, hit):
                break
            self._waiting.popleft()
            seq.slot = self.slots.allocate()
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            if seq.params.has_penalties:
                self._penalty_slots.add(seq.slot)
            if seq.params.structured is not None:
                self._structured.add(seq.seq_id)
            self.kv.admitted(seq, hit)
            n = self._chunk(seq, budget)
            self.kv.grow(seq, seq.num_computed_tokens + n)
            budget -= self._take(seq, n, out)
            owed += self.kv.owed(seq)
        if not out:
            return None
        penalty_slots = tuple(sorted(self._penalty_slots)) if self._penalty_slots else ()
        structured = tuple(sorted(self._structured)) if self._structured else ()
        recount = self._recount(out) if self._recomputing else ()
        return ScheduledBatch(tuple(out), total - budget, penalty_slots, structured, recount, *self.kv.take_copies())

    def _recount(self, out: list[ScheduledSeq]) -> tuple[tuple[int, int], ...]:
        """(slot, prompt length) of the chunks that feed a preempted request's output again (ScheduledBatch's
        penalty_recount); a request's recompute ends with its sampled chunk."""
        recount = []
        for s in out:
            seq = s.seq
            if seq.seq_id in self._recomputing:
                if s.start + len(s.fed_token_ids) > seq.num_prompt_tokens:
                    recount.append((s.slot, seq.num_prompt_tokens))
                if s.is_sampled:
                    self._recomputing.discard(seq.seq_id)
        return tuple(recount)

    def update(
        self, batch: ScheduledBatch, outputs: dict[int, SeqOutput], proposer: Proposer | None = None
    ) -> list[SeqUpdate]:
        """The step's bookkeeping. outputs: seq_id -> the accepted drafts and the sampled token (and the last
        stage's drafts for the next step), for every ScheduledSeq with is_sampled, and the chunk's prompt
        logprobs for every prefill chunk of a request that asks for them. Appends each sequence's tokens up to
        the first that finishes it, commits the counts, finishes sequences, and stores the next drafts: the
        outputs' (a model proposer on the last stage), or `proposer`'s when it is given (a proposer on the
        first stage, fed each sequence's tokens). Returns one SeqUpdate per sampled sequence, in batch order,
        finished ones included (not those aborted since schedule()), and one, without tokens, for a request
        with max_tokens 0 whose prompt is now all in (finished: "length")."""
        updates: list[SeqUpdate] = []
        wanting: list[ProposeItem] = []
        row = 0
        for s in batch.seqs:
            seq, first_row = s.seq, row
            row += s.num_tokens
            if seq.is_finished:  # aborted between schedule() and update(); its slot is already free
                continue
            assert seq.num_computed_tokens == s.start, "update() must follow the schedule() of this batch"
            seq.num_computed_tokens += len(s.fed_token_ids)
            seq.spec_token_ids = ()
            out = outputs.get(seq.seq_id)
            if out is not None and out.prompt_logprobs is not None:
                seq.prompt_logprobs.append(out.prompt_logprobs)
            if not s.is_sampled:
                self.kv.committed(seq, seq.num_computed_tokens, finished=False)
                if seq.params.max_tokens == 0 and seq.num_computed_tokens == seq.num_tokens:
                    updates.append(SeqUpdate(seq, (), "length"))  # scored, nothing to generate
                    self._running.remove(seq)
                    self._finish(seq, "length")
                continue
            new, reason = self._append_tokens(seq, out.tokens)
            # Accepted drafts, then one sampled token: the accepted drafts' cache entries are committed
            # (rejected ones are left behind, to be overwritten: the cache is addressed by position).
            seq.num_computed_tokens += len(new) - 1
            updates.append(SeqUpdate(seq, new, reason))
            self.kv.committed(seq, s.start + len(s.fed_token_ids), finished=reason is not None)
            if reason is not None:
                self._running.remove(seq)
                self._finish(seq, reason)
            elif proposer is None:
                seq.spec_token_ids = out.drafts
            else:
                known = tuple(seq.token_ids_between(s.start, seq.num_tokens))  # positions [start, committed]
                # Only what the request can still use (one token always comes with the drafts).
                n = max(0, min(proposer.k, seq.params.max_tokens - seq.num_output_tokens - 1))
                item = ProposeItem(
                    seq.slot, s.start, known, first_row, seq.seq_id, seq.params, seq.num_output_tokens, n,
                    tuple(seq.all_token_ids),
                )  # fmt: skip
                wanting.append(item)
        if wanting:
            drafts = proposer.propose(wanting, {it.seq_id: self._live[it.seq_id].seed for it in wanting})
            for seq_id, d in drafts.items():
                self._live[seq_id].spec_token_ids = tuple(d)
        return updates

    @staticmethod
    def _chunk(seq: Sequence, budget: int) -> int:
        """The tokens seq's next step feeds: what it has left, within the budget, up to its prefix cut."""
        n = min(seq.num_uncomputed_tokens, budget)
        if seq.num_computed_tokens < seq.prefix_cut:
            n = min(n, seq.prefix_cut - seq.num_computed_tokens)
        return n

    def _take(self, seq: Sequence, n: int, out: list[ScheduledSeq]) -> int:
        # Schedules the next n tokens of a RUNNING seq (holding the blocks they write) into out; returns n.
        start = seq.num_computed_tokens
        assert seq.slot is not None and n > 0
        s = ScheduledSeq(
            seq=seq,
            start=start,
            slot=seq.slot,
            fed_token_ids=tuple(seq.token_ids_between(start, start + n)),
            is_sampled=start + n == seq.num_tokens and seq.params.max_tokens > 0,
        )
        out.append(self._announce(s))
        return n

    # --- blocks -------------------------------------------------------------------------------------------
    def _make_room(self, seq: Sequence, tokens: int, busy: Set[int]) -> bool:
        """kv.grow(seq, tokens), preempting the most recently admitted running sequences not in flight until the
        blocks are free; False when seq itself had to go."""
        while not self.kv.grow(seq, tokens):
            victim = next(q for q in reversed(self._running) if q is seq or q.seq_id not in busy)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _announce(self, s: ScheduledSeq) -> ScheduledSeq:
        """s with the blocks its sequence took since its last scheduled step (the stages' block tables learn them
        from the plan)."""
        seq = s.seq
        if seq.num_blocks_sent == len(seq.blocks):
            return s
        first, seq.num_blocks_sent = seq.num_blocks_sent, len(seq.blocks)
        first_block = s.first_block if s.new_blocks else first  # (drafts' blocks continue the chunk's)
        return dataclasses.replace(s, first_block=first_block, new_blocks=s.new_blocks + tuple(seq.blocks[first:]))

    def _preempt(self, seq: Sequence) -> None:
        """Back to the head of the queue with its tokens (to prefill them again): its slot and blocks freed."""
        self._running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.spec_token_ids = ()
        self._waiting.appendleft(seq)
        self.num_preemptions += 1
        if seq.params.has_penalties and seq.num_output_tokens:
            self._recomputing.add(seq.seq_id)

    def _release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self._penalty_slots.discard(seq.slot)
            self.slots.free(seq.slot)
            seq.slot = None
        self.kv.release(seq)

    @staticmethod
    def _drafts(s: ScheduledSeq, budget: int) -> tuple[int, ...]:
        # As many drafts as the budget takes and the request can still use (one token always comes).
        seq = s.seq
        if not s.is_sampled or not seq.spec_token_ids:
            return ()
        room = min(budget, seq.params.max_tokens - seq.num_output_tokens - 1)
        return seq.spec_token_ids[: max(room, 0)]

    @staticmethod
    def _append_tokens(seq: Sequence, tokens: tuple[SampledToken, ...]) -> tuple[tuple[SampledToken, ...], str | None]:
        # Appends tokens in order, stopping at the first one that finishes the sequence (later ones are
        # dropped). Returns the tokens appended and the finish reason (None if the sequence continues).
        p = seq.params
        for i, tok in enumerate(tokens):
            seq.output_tokens.append(tok)
            t = tok.token_id
            if (t in seq.eos_token_ids and not p.ignore_eos) or t in p.stop_token_ids:
                return tuple(tokens[: i + 1]), "stop"
            if seq.num_output_tokens >= p.max_tokens:
                return tuple(tokens[: i + 1]), "length"
        return tuple(tokens), None

    def _finish(self, seq: Sequence, reason: str) -> None:
        # Caller has already removed seq from _waiting/_running. The slot is reusable immediately.
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._structured.discard(seq.seq_id)
        self._recomputing.discard(seq.seq_id)
        self._release(seq)
        del self._live[seq.seq_id]
