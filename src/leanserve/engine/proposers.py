"""Draft proposers for speculative decoding.

- `MTPProposer` (last stage): the checkpoint's MTP layer. At trunk position t it reads the trunk's pre-hc_head
  streams (the `target_hidden_states` rows of this step) and the embedding of token t+1, and predicts token
  t+2; further drafts feed its own output streams back in.
- `DraftModelProposer` (last stage): a second, smaller DeepSeek-V4 checkpoint with caches of its own.
- `NgramProposer` (first stage, no model): prompt lookup over each sequence's own tokens, called by the
  scheduler's update once the step's tokens are appended.

All three are `Proposer`s: `propose(items, seeds)` takes one `ProposeItem` per chunk of the step just verified
and returns each wanting sequence's drafts.

After verification the model proposers first run over every position this step made final (a prefill chunk,
or the verified token and its accepted drafts), so their caches always hold every committed position; then
they draft one token per call. Cache entries are addressed by position, so drafts past the committed count
are simply overwritten later. A sampled request's drafts are sampled from the drafter's distribution q
(kept in `draft_probs` for the rejection test); a greedy request's are the drafter's argmax.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from leanserve.engine.config import SpeculativeConfig
from leanserve.engine.penalties import biased
from leanserve.engine.sampler import STREAM_DRAFT, Sampler, _is_greedy
from leanserve.memory import MemoryLedger
from leanserve.model.batch import Chunk, build_forward_batch
from leanserve.model.build import build_model
from leanserve.model.cache import BlockTable, CacheGeometry
from leanserve.model.config import ModelConfig
from leanserve.model.deepseek_v4 import DeepseekV4
from leanserve.model.loader import load_weights
from leanserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class ProposeItem:
    """One chunk of the step just verified, as the proposer needs it."""

    slot: int
    start: int  # first position fed this step
    known: tuple[int, ...]  # tokens of positions [start, committed], the last one not yet in any cache
    row: int  # flat row of `start` in this step's batch
    seq_id: int | None = None  # set when the sequence wants drafts
    params: SamplingParams | None = None
    step: int = 0  # output index of the first draft
    num_drafts: int = 0  # how many to propose (the request's remaining budget caps it)
    # Every token of the sequence so far, the newest last: given on the first stage (the n-gram lookup reads
    # it), empty on the last stage, where the model proposers read their caches instead.
    history: tuple[int, ...] = ()


class Proposer(abc.ABC):
    """Proposes up to `k` draft tokens per sequence for the next step to verify."""

    k: int

    @abc.abstractmethod
    def propose(self, items: list[ProposeItem], seeds: dict[int, int]) -> dict[int, tuple[int, ...]]:
        """`items`: one per chunk of the step just verified (in batch order). Returns seq_id -> at most
        `num_drafts` drafts for the items with a seq_id; `seeds`: seq_id -> the request's sampling seed."""


class ModelProposer(Proposer):
    """Shared by the MTP layer and a draft model: catch up over the committed positions, then draft."""

    def __init__(self, k: int, vocab: int, num_slots: int, sampler: Sampler, ledger: MemoryLedger, feature: str):
        self.k, self.sampler = k, sampler
        # q of every pending draft, per slot, for the rejection test of the next step.
        self.draft_probs = ledger.zeros("draft_probs", "proposer", feature, (num_slots, k, vocab), torch.float32)

    def propose(self, items: list[ProposeItem], seeds: dict[int, int]) -> dict[int, tuple[int, ...]]:
        wanted = [it for it in items if it.seq_id is not None and it.num_drafts > 0]
        state, logits = self.first(items, wanted)
        drafts: dict[int, list[int]] = {it.seq_id: [] for it in wanted}
        for j in range(max((it.num_drafts for it in wanted), default=0)):
            if j > 0:
                keep = [i for i, it in enumerate(wanted) if it.num_drafts > j]
                wanted = [wanted[i] for i in keep]
                state, logits = self.next(wanted, [drafts[it.seq_id][-1] for it in wanted], j, state, keep)
            params = [it.params for it in wanted]
            logits = biased(logits, params)  # (penalties are left to the verification: drafts are only guesses)
            if all(_is_greedy(p) for p in params):  # greedy drafts: the argmax (what the sampler takes), no q
                tokens = logits.argmax(dim=-1).tolist()
            else:
                sampled, q = self.sampler.sample(
                    logits,
                    params,
                    torch.tensor([seeds[it.seq_id] for it in wanted], dtype=torch.long),
                    torch.tensor([it.step + j for it in wanted], dtype=torch.long),
                    stream=STREAM_DRAFT,
                    want_probs=True,
                )
                self.draft_probs[torch.tensor([it.slot for it in wanted], dtype=torch.long), j] = q
                tokens = sampled.tolist()
            for it, t in zip(wanted, tokens, strict=True):
                drafts[it.seq_id].append(t)
        return {seq_id: tuple(d) for seq_id, d in drafts.items()}

    # Implemented by the subclasses: the catch-up forward over `items` (logits at each wanted item's last
    # position), and the one-token forward for draft j (1-based) of `wanted`.
    def first(self, items: list[ProposeItem], wanted: list[ProposeItem]):  # pragma: no cover - abstract
        raise NotImplementedError

    def next(self, wanted, tokens, j, state, keep):  # pragma: no cover - abstract
        raise NotImplementedError


class MTPProposer(ModelProposer):
    def __init__(
        self, model: DeepseekV4, geometry: CacheGeometry, caches, target_hidden: torch.Tensor, table: BlockTable, **kw
    ):
        super().__init__(**kw)
        # The MTP layer is sliding-window attention only: its batches need no compression metadata.
        self.geometry = dataclasses.replace(geometry, compress={})
        self.model, self.caches, self.target_hidden, self.table = model, caches, target_hidden, table
        self.device = target_hidden.device

    def first(self, items, wanted):
        # MTP position t takes the trunk streams at t and token t+1: positions [start, committed).
        chunks, rows, logits_index, offset = [], [], [], 0
        last_row = {}
        for it in items:
            n = len(it.known) - 1
            chunks.append(Chunk(it.slot, it.start, it.known[1:]))
            rows.extend(range(it.row, it.row + n))
            offset += n
            last_row[id(it)] = offset - 1
        logits_index = [last_row[id(it)] for it in wanted]
        fb = build_forward_batch(chunks, self.geometry, logits_index, self.device, self.table)
        cfg = self.model.cfg
        if rows == list(range(rows[0], rows[0] + len(rows))):  # one chunk (or adjacent ones): a view, no gather
            streams = self.target_hidden[rows[0] : rows[0] + len(rows)]
        else:
            streams = self.target_hidden[torch.tensor(rows, device=self.device)]
        streams = streams.view(-1, cfg.hc_mult, cfg.hidden_size)
        logits, out = self.model.mtp_forward(streams, fb, self.caches)
        return out, logits  # (the next draft's streams: out, a row per item of `wanted`)

    def next(self, wanted, tokens, j, state, keep):
        # Draft j+1 from the MTP layer's own output streams at the previous position and draft j's embedding.
        chunks = [Chunk(it.slot, it.start + len(it.known) - 2 + j, (t,)) for it, t in zip(wanted, tokens, strict=True)]
        fb = build_forward_batch(chunks, self.geometry, list(range(len(chunks))), self.device, self.table)
        streams = state if len(keep) == state.shape[0] else state[keep]
        logits, out = self.model.mtp_forward(streams, fb, self.caches)
        return out, logits


class DraftModelProposer(ModelProposer):
    def __init__(self, model: DeepseekV4, geometry: CacheGeometry, caches, device: str, table: BlockTable, **kw):
        super().__init__(**kw)
        self.model, self.geometry, self.caches, self.device, self.table = model, geometry, caches, device, table

    @classmethod
    def load(
        cls,
        spec: SpeculativeConfig,
        num_slots: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: str,
        ledger: MemoryLedger,
        feature: str,
        sampler: Sampler,
        progress: bool = False,
    ) -> DraftModelProposer:
        cfg = ModelConfig.from_hf(spec.model)
        model = build_model(
            cfg, max_model_len, dtype, device=device, checkpoint=spec.model if device != "meta" else None
        )
        if device != "meta":
            load_weights(model, spec.model, progress=progress)
        model.register_tables(ledger, prefix="draft.", feature=feature)
        geometry = CacheGeometry.build(cfg, num_slots, max_model_len, spec.num_speculative_tokens)
        caches = model.allocate_cache(geometry, model.act_dtype, ledger, prefix="draft.", feature=feature)
        # (the draft model's pools have a block for every position of every slot: its table never changes)
        table = BlockTable.identity_for(geometry)
        ledger.register("draft.kv_block_table", "draft", feature, table.tensor)
        proposer = cls(
            model, geometry, caches, device, table, k=spec.num_speculative_tokens, vocab=cfg.vocab_size,
            num_slots=num_slots, sampler=sampler, ledger=ledger, feature=feature,
        )  # fmt: skip
        return proposer

    def first(self, items, wanted):
        # The draft model sees every position [start, committed] (the last one is the newest token).
        chunks, logits_index, offset, last_row = [], [], 0, {}
        for it in items:
            known = it.known if it.seq_id is not None else it.known[:-1]
            chunks.append(Chunk(it.slot, it.start, known))
            offset += len(known)
            last_row[id(it)] = offset - 1
        logits_index = [last_row[id(it)] for it in wanted]
        fb = build_forward_batch(chunks, self.geometry, logits_index, self.device, self.table)
        return None, self.model(fb, self.caches)

    def next(self, wanted, tokens, j, state, keep):
        chunks = [Chunk(it.slot, it.start + len(it.known) - 1 + j, (t,)) for it, t in zip(wanted, tokens, strict=True)]
        fb = build_forward_batch(chunks, self.geometry, list(range(len(chunks))), self.device, self.table)
        return None, self.model(fb, self.caches)


class NgramProposer(Proposer):
    """Prompt lookup: the longest n-gram (prompt_lookup_max down to prompt_lookup_min) that ends the sequence
    and occurred earlier in it proposes the k tokens that followed its latest earlier occurrence."""

    def __init__(self, spec: SpeculativeConfig) -> None:
        self.k, self.nmin, self.nmax = spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max

    def propose(self, items: list[ProposeItem], seeds: dict[int, int]) -> dict[int, tuple[int, ...]]:
        return {it.seq_id: self.lookup(it.history, it.num_drafts) for it in items if it.seq_id is not None}

    def lookup(self, token_ids: tuple[int, ...] | list[int], limit: int) -> tuple[int, ...]:
        """Up to min(k, limit) tokens that followed the latest earlier occurrence of the sequence's ending."""
        k = min(self.k, limit)
        if k <= 0:
            return ()
        tokens = np.asarray(token_ids, dtype=np.int64)
        size = len(tokens)
        for n in range(min(self.nmax, size - 1), self.nmin - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: size - 1], n)  # every earlier n-gram
            hits = np.flatnonzero((windows == tokens[size - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the token after the latest earlier occurrence
                return tuple(tokens[start : start + k].tolist())
        return ()
