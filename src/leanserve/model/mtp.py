"""The MTP layer's parameters: it drafts the token after next from the trunk's pre-hc_head streams at position t
and the embedding of token t+1. Shares `embed` and `head` with the trunk; has its own block (sliding attention,
top-k MoE), norms, projections and hc_head. The wiring is torch_math/blocks.py (`mtp`)."""

from __future__ import annotations

import torch

from leanserve.model.block import Block
from leanserve.model.config import MOE, SLIDING, ModelConfig
from leanserve.model.layers import Linear, RMSNorm, fp32_param
from leanserve.model.weights import MixWeights, MTPWeights, RopeTables


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

    def mtp_weights(self, embed: torch.Tensor, rope: RopeTables, act_dtype: torch.dtype) -> MTPWeights:
        """The layer's typed weights, with what it shares with the trunk (the embedding table, the RoPE tables)."""
        h, e = self.hnorm, self.enorm
        return MTPWeights(
            h.weight, e.weight, self.h_proj.w(), self.e_proj.w(), h.eps, self.weights(), self.head_mix(), embed, rope,
            act_dtype,
        )  # fmt: skip
