"""The MTP layer: drafts the token after next from the trunk's pre-hc_head streams at position t and the
embedding of token t+1. Shares `embed` and `head` with the trunk; has its own block (sliding attention,
top-k MoE), norms, projections and hc_head."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leanserve.config import MOE, SLIDING, ModelConfig
from leanserve.model.attention import Rope
from leanserve.model.batch import ForwardBatch
from leanserve.model.block import Block, BlockWeights
from leanserve.model.cache import LayerCache
from leanserve.model.hyper import MixWeights
from leanserve.model.layers import Linear, RMSNorm, fp32_param


@dataclass(frozen=True)
class MTPWeights:
    """The MTP layer's tensors, for a backend that runs it whole: its input norms and projections, its block,
    and its hc_head with the norm before the shared head."""

    hnorm: torch.Tensor
    enorm: torch.Tensor
    h_proj: torch.Tensor  # (or an Fp8Weight: a published checkpoint's)
    e_proj: torch.Tensor
    eps: float
    block: BlockWeights
    head: MixWeights


class MTPBlock(Block):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, SLIDING, MOE)
        hidden = cfg.hidden_size
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
        fp8 = "fp8" if cfg.quantization is not None else None
        self.e_proj = Linear(hidden, hidden, quant=fp8)
        self.h_proj = Linear(hidden, hidden, quant=fp8)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hc_head_fn = fp32_param(cfg.hc_mult, cfg.hc_dim)
        self.hc_head_base = fp32_param(cfg.hc_mult)
        self.hc_head_scale = fp32_param(1)

    def head_mix(self) -> MixWeights:
        """hc_head's weights and the norm before the shared head."""
        fn, base, scale = self.hc_head_fn, self.hc_head_base, self.hc_head_scale
        return MixWeights(fn, base, scale, self.norm.weight, self.norm_eps, self.hc_eps, 0)

    def mtp_weights(self) -> MTPWeights:
        h, e = self.hnorm, self.enorm
        return MTPWeights(h.weight, e.weight, self.h_proj.w(), self.e_proj.w(), h.eps, self.weights(), self.head_mix())

    def forward(
        self,
        streams: torch.Tensor,  # [T, hc, hidden]: trunk streams at position t
        embedded: torch.Tensor,  # [T, hidden]: embedding of token t+1
        fb: ForwardBatch,  # positions / input ids of the t+1 tokens
        cache: LayerCache,
        ropes: dict[str, Rope],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch statement (the backend's `run_mtp` runs the whole layer, see DeepseekV4.mtp_forward):
        (normed hidden [T, hidden] for the shared head, output streams [T, hc, hidden])."""
        out = super().forward(self.block_input(streams, embedded), fb, cache, ropes)
        return self.head_hidden(out), out

    def block_input(self, streams: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """The block's input streams [T, hc, hidden]: h_proj(hnorm(trunk streams)) + e_proj(enorm(embedding))."""
        return self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(embedded)).unsqueeze(1)

    def head_hidden(self, out: torch.Tensor) -> torch.Tensor:
        """The shared head's input [T, hidden] from the block's output streams: hc_head, then the norm."""
        return self.ops.head_hidden(self, out)
