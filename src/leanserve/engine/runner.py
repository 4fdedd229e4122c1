"""One stage's model runner: turns a scheduled batch into a forward pass and sampled tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leanserve.engine.sampler import Sampler
from leanserve.engine.scheduler import ScheduledBatch
from leanserve.model.batch import Chunk, build_forward_batch
from leanserve.model.cache import CacheGeometry
from leanserve.model.deepseek_v4 import DeepseekV4


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


class ModelRunner:
    def __init__(self, model: DeepseekV4, geometry: CacheGeometry, cache_dtype: torch.dtype, device: str = "cpu"):
        self.model, self.geometry, self.device = model, geometry, device
        # Allocated once for max_num_seqs slots; sequences index them by slot.
        self.caches = model.allocate_cache(geometry, cache_dtype, device)
        self.sampler = Sampler()

    @torch.inference_mode()
    def warmup(self) -> None:
        """One throw-away forward, so first-call costs (kernel compilation, allocator) are not billed to the
        first request. It writes position 0 of slot 0, which no sequence has committed yet."""
        fb = build_forward_batch([Chunk(0, 0, [0])], self.geometry, logits_index=[0], device=self.device)
        self.model(fb, self.caches)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, seeds: dict[int, int]) -> dict[int, SampledToken]:
        """Runs one step; returns the sampled token of every sequence whose last chunk was fed."""
        chunks, rows, sampled = [], [], []
        offset = 0
        for s in batch.seqs:
            chunks.append(Chunk(s.slot, s.start, s.token_ids))
            offset += s.num_tokens
            if s.is_sampled:
                rows.append(offset - 1)
                sampled.append(s.seq)
        fb = build_forward_batch(chunks, self.geometry, logits_index=rows, device=self.device)
        logits = self.model(fb, self.caches)
        if not sampled:
            return {}
        out = self.sampler(
            logits,
            [seq.params for seq in sampled],
            torch.tensor([seeds[seq.seq_id] for seq in sampled], dtype=torch.long),
            torch.tensor([len(seq.output_token_ids) for seq in sampled], dtype=torch.long),
        )
        token_ids = out.token_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        result = {}
        for i, seq in enumerate(sampled):
            want = seq.params.logprobs
            if want is None:
                result[seq.seq_id] = SampledToken(token_ids[i])
                continue
            top = tuple(zip(top_ids[i][:want], top_lp[i][:want], strict=True)) if want and top_ids else ()
            result[seq.seq_id] = SampledToken(token_ids[i], logprobs[i], top)
        return result
