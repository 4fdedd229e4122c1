"""One DeepSeek-V4 decoder block's parameters: mHC around attention, then mHC around the MoE. The wiring is
torch_math/blocks.py (`block`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from leanserve.model.attention import Attention
from leanserve.model.config import ModelConfig
from leanserve.model.layers import RMSNorm, UsesBackend, fp32_param
from leanserve.model.moe import MoE
from leanserve.model.weights import BlockWeights, MixWeights

if TYPE_CHECKING:
    import torch

    from leanserve.model.batch import ForwardBatch
    from leanserve.model.cache import LayerCache


class Block(UsesBackend, nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, mlp_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.norm_eps, self.hc_eps, self.sinkhorn_iters = cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_type)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = MoE(cfg, mlp_type)
        mix = (2 + cfg.hc_mult) * cfg.hc_mult
        for site in ("attn", "ffn"):  # mHC parameters, float32, named as in the checkpoint
            self.register_parameter(f"hc_{site}_fn", fp32_param(mix, cfg.hc_dim))
            self.register_parameter(f"hc_{site}_base", fp32_param(mix))
            self.register_parameter(f"hc_{site}_scale", fp32_param(3))

    def mix(self, site: str) -> MixWeights:
        """The mHC weights before the attention ("attn") or the MoE ("ffn"), with that block input's norm."""
        fn, base, scale = (getattr(self, f"hc_{site}_{p}") for p in ("fn", "base", "scale"))
        norm = self.attn_norm if site == "attn" else self.ffn_norm
        return MixWeights(fn, base, scale, norm.weight, self.norm_eps, self.hc_eps, self.sinkhorn_iters)

    def weights(self) -> BlockWeights:
        return BlockWeights(self.mix("attn"), self.attn.weights(), self.mix("ffn"), self.ffn.weights())

    def forward(self, streams: torch.Tensor, fb: ForwardBatch, cache: LayerCache, ropes: dict) -> torch.Tensor:
        """streams [T, hc_mult, hidden] -> the block's output streams."""
        return self.ops.block(self.weights(), streams, fb, cache, ropes)
