"""The MTP layer: drafts the token after next from the trunk's pre-hc_head streams at position t and the
embedding of token t+1. Shares `embed` and `head` with the trunk; has its own block (sliding attention,
top-k MoE), norms, projections and hc_head."""

from __future__ import annotations

import torch

from leanserve.config import MOE, SLIDING, ModelConfig
from leanserve.model import decode
from leanserve.model.attention import Rope
from leanserve.model.batch import ForwardBatch
from leanserve.model.block import Block
from leanserve.model.cache import LayerCache
from leanserve.model.hyper import hc_head
from leanserve.model.layers import Linear, RMSNorm, fp32_param


class MTPBlock(Block):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, SLIDING, MOE)
        hidden = cfg.hidden_size
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.e_proj = Linear(hidden, hidden, bias=False)
        self.h_proj = Linear(hidden, hidden, bias=False)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hc_head_fn = fp32_param(cfg.hc_mult, cfg.hc_dim)
        self.hc_head_base = fp32_param(cfg.hc_mult)
        self.hc_head_scale = fp32_param(1)

    def forward(
        self,
        streams: torch.Tensor,  # [T, hc, hidden]: trunk streams at position t
        embedded: torch.Tensor,  # [T, hidden]: embedding of token t+1
        fb: ForwardBatch,  # positions / input ids of the t+1 tokens
        cache: LayerCache,
        ropes: dict[str, Rope],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed hidden [T, hidden] for the shared head, output streams [T, hc, hidden])."""
        if decode.eligible(fb, streams.dtype) and streams.is_contiguous() and embedded.is_contiguous():
            return decode.run_mtp(self, streams, embedded, fb, cache, ropes)
        x = self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(embedded)).unsqueeze(1)
        out = super().forward(x, fb, cache, ropes)
        return self.head_hidden(out), out

    def head_hidden(self, out: torch.Tensor) -> torch.Tensor:
        """The shared head's input [T, hidden] from the block's output streams: hc_head, then the norm."""
        head_fn, base, scale, norm = self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.norm.weight
        return hc_head(out, head_fn, base, scale, self.norm_eps, self.hc_eps, norm)
