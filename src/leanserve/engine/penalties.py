"""Logit bias and presence / frequency / repetition penalties, applied on the last stage to the logits a step
samples or verifies from, in vLLM's order (its V1 sampler): the bias is added, then the repetition penalty
(tokens of the prompt or the output: a logit > 0 divided by it, one <= 0 multiplied), then the frequency
penalty times each token's count in the output and the presence penalty once for each token in it are
subtracted. Temperature, top-k and top-p come after, in the sampler. Logprobs stay those of the raw logits.

A request with none of them costs nothing: no tensor is made, no plan field is filled, and rows without
them are not touched. Logit bias needs only the request's params. The penalties need the request's tokens
where sampling happens; the last stage keeps them per cache slot (`PenaltyState`), only while some running
request has penalties:
  - the scheduler names the slots of every running request with penalties in each plan
    (`StepPlan.penalty_slots`, empty when there is none);
  - the first plan naming one allocates `[slots, vocab]` counts of the output's tokens (int32) and a mask of
    the prompt's and output's tokens (bool) through the stage's ledger (feature `penalties`); the first plan
    naming none releases them;
  - a named slot's rows are reset by its sequence's first chunk (start 0), the mask takes every chunk's fed
    tokens (the prompt, chunk by chunk as it is prefilled), and both take the tokens this stage emits after
    verification (accepted drafts and the sampled token), so only accepted tokens count;
  - a preempted request prefills its tokens again in a new slot: the chunks that feed its output tokens again
    count them too (`StepPlan.penalty_recount`);
  - a verified row j of a sequence with drafts sees its history plus drafts[:j]: what plain decoding sees at
    that position once those drafts are accepted, so speculation gives the tokens it gives without.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from leanserve.memory import PENALTIES, MemoryLedger
from leanserve.model.batch import Chunk
from leanserve.sampling_params import SamplingParams

COUNTS, SEEN = "penalty_output_counts", "penalty_seen_tokens"


def apply_penalties(
    logits: torch.Tensor,  # [P, V] float32
    counts: torch.Tensor,  # [P, V]: each token's count in the output so far
    seen: torch.Tensor,  # [P, V] bool: the token is in the prompt or the output so far
    presence: torch.Tensor,  # [P]
    frequency: torch.Tensor,  # [P]
    repetition: torch.Tensor,  # [P]
) -> torch.Tensor:
    """vLLM's penalties: repetition (CTRL's), then frequency and presence (OpenAI's). A penalty that is off
    (1, 0, 0) leaves its row's logits bit-identical."""
    rep = torch.where(seen, repetition[:, None], 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - frequency[:, None] * counts
    return logits - presence[:, None] * (counts > 0)


def biased(logits: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """[R, V] logits with each row's logit_bias added (the drafters' logits); the same tensor when no row has
    one."""
    rows, ids, values = [], [], []
    for i, p in enumerate(params):
        if p.has_logit_bias:
            for t, b in p.logit_bias.nonzero:
                rows.append(i)
                ids.append(t)
                values.append(b)
    if not rows:
        return logits
    out = logits.float().clone()
    return _add_bias(out, rows, ids, values)


def _index(rows: list[int], cols: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(cols, dtype=torch.long, device=device)


def _add_bias(out: torch.Tensor, rows: list[int], ids: list[int], values: list[float]) -> torch.Tensor:
    values_t = torch.tensor(values, dtype=out.dtype, device=out.device)
    return out.index_put_(_index(rows, ids, out.device), values_t, accumulate=True)


class PenaltyState:
    """The last stage's per-slot token counts for the penalties, alive only while a running request has them."""

    def __init__(self, ledger: MemoryLedger, num_slots: int, vocab: int) -> None:
        self.ledger, self.num_slots, self.vocab = ledger, num_slots, vocab
        self.counts: torch.Tensor | None = None  # [slots, vocab] int32: the output's tokens
        self.seen: torch.Tensor | None = None  # [slots, vocab] bool: the prompt's and the output's tokens

    def begin(self, penalty_slots: tuple[int, ...], chunks: Seq[Chunk], samples, recount=()) -> None:
        """Before a step's forward: the buffers made or released as the plan says, the named slots' rows reset
        by a first chunk and given the chunks' fed tokens (their drafts excluded); `recount` (slot, prompt
        length) pairs: those slots' chunks' fed tokens past the prompt are counted as output too."""
        if not penalty_slots:
            if self.counts is not None:
                self.ledger.release(COUNTS)
                self.ledger.release(SEEN)
                self.counts = self.seen = None
            return
        if self.counts is None:
            shape = (self.num_slots, self.vocab)
            self.counts = self.ledger.zeros(COUNTS, "sampler", PENALTIES, shape, torch.int32)
            self.seen = self.ledger.zeros(SEEN, "sampler", PENALTIES, shape, torch.bool)
        named = set(penalty_slots)
        drafts = {s.slot: len(s.drafts) for s in samples}
        prompt_lens = dict(recount)
        fresh, slots, tokens, out_slots, out_tokens = [], [], [], [], []
        for c in chunks:
            if c.slot not in named:
                continue
            if c.start == 0:
                fresh.append(c.slot)
            fed = c.token_ids[: len(c.token_ids) - drafts.get(c.slot, 0)]
            slots.extend([c.slot] * len(fed))
            tokens.extend(fed)
            if c.slot in prompt_lens:
                again = fed[max(0, prompt_lens[c.slot] - c.start) :]
                out_slots.extend([c.slot] * len(again))
                out_tokens.extend(again)
        dev = self.counts.device
        if fresh:
            f = torch.tensor(fresh, dtype=torch.long, device=dev)
            self.counts[f] = 0
            self.seen[f] = False
        if tokens:
            self.seen.index_put_(_index(slots, tokens, dev), torch.tensor(True, device=dev))
        if out_tokens:
            ones = torch.ones(len(out_tokens), dtype=torch.int32, device=dev)
            self.counts.index_put_(_index(out_slots, out_tokens, dev), ones, accumulate=True)

    def record(self, samples, emitted: dict[int, tuple]) -> None:
        """After verification: the tokens each sequence with penalties emitted (its accepted drafts and its
        sampled token) counted in its slot."""
        if self.counts is None:
            return
        slots, tokens = [], []
        for s in samples:
            if s.params.has_penalties:
                for t in emitted[s.seq_id]:
                    slots.append(s.slot)
                    tokens.append(t.token_id)
        if not tokens:
            return
        dev = self.counts.device
        index = _index(slots, tokens, dev)
        self.counts.index_put_(index, torch.ones(len(tokens), dtype=torch.int32, device=dev), accumulate=True)
        self.seen.index_put_(index, torch.tensor(True, device=dev))

    def process(self, logits: torch.Tensor, samples) -> torch.Tensor:
        """[R, V] logits of a step's verified rows (len(drafts) + 1 per sample, in order) -> the logits each
        row samples from; the same tensor when no sample has a logit bias or penalties."""
        bias_rows, bias_ids, bias_values = [], [], []
        rows, slots, presence, frequency, repetition = [], [], [], [], []
        draft_rows, draft_tokens = [], []  # drafts before a row, counted as its history
        row = 0
        for s in samples:
            n, p = len(s.drafts) + 1, s.params
            if p.has_logit_bias:
                for j in range(n):
                    for t, b in p.logit_bias.nonzero:
                        bias_rows.append(row + j)
                        bias_ids.append(t)
                        bias_values.append(b)
            if p.has_penalties:
                for j in range(n):
                    draft_rows.extend([len(rows)] * j)
                    draft_tokens.extend(s.drafts[:j])
                    rows.append(row + j)
                    slots.append(s.slot)
                    presence.append(p.presence_penalty)
                    frequency.append(p.frequency_penalty)
                    repetition.append(p.repetition_penalty)
            row += n
        if not bias_rows and not rows:
            return logits
        out = logits.float().clone()  # the raw logits stay as they are, for the logprobs
        if bias_rows:
            _add_bias(out, bias_rows, bias_ids, bias_values)
        if rows:
            if self.counts is None:
                raise RuntimeError("a sample with penalties in a plan whose penalty_slots do not name its slot")
            dev = out.device
            r = torch.tensor(rows, dtype=torch.long, device=dev)
            at = torch.tensor(slots, dtype=torch.long, device=self.counts.device)
            counts, seen = self.counts[at].to(dev), self.seen[at].to(dev)  # (gathered copies)
            if draft_rows:
                index = _index(draft_rows, draft_tokens, dev)
                counts.index_put_(index, torch.ones(len(draft_rows), dtype=counts.dtype, device=dev), accumulate=True)
                seen.index_put_(index, torch.tensor(True, device=dev))

            def per_row(values: list[float]) -> torch.Tensor:
                return torch.tensor(values, dtype=out.dtype, device=dev)

            out[r] = apply_penalties(out[r], counts, seen, per_row(presence), per_row(frequency), per_row(repetition))
        return out
