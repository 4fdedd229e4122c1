"""One DeepSeek-V4 decoder block: mHC around attention, then mHC around the MoE."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from leanserve.config import ModelConfig
from leanserve.model.attention import Attention, AttentionWeights, Rope
from leanserve.model.backend import UsesBackend
from leanserve.model.batch import ForwardBatch
from leanserve.model.cache import LayerCache
from leanserve.model.hyper import MixWeights
from leanserve.model.layers import RMSNorm, fp32_param
from leanserve.model.moe import MoE, MoEWeights


@dataclass(frozen=True)
class BlockWeights:
    """A block's tensors, for a backend that runs blocks whole (see cpu_backend / decode.py)."""

    attn_mix: MixWeights
    attn: AttentionWeights
    ffn_mix: MixWeights
    moe: MoEWeights


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

    def forward(
        self, streams: torch.Tensor, fb: ForwardBatch, cache: LayerCache, ropes: dict[str, Rope]
    ) -> torch.Tensor:
        # streams: [T, hc_mult, hidden]
        x, post, comb = self.ops.hc_pre(streams, self.mix("attn"))
        streams = self.ops.hc_post(self.attn(x, fb, cache, ropes), streams, post, comb)
        x, post, comb = self.ops.hc_pre(streams, self.mix("ffn"))
        return self.ops.hc_post(self.ffn(x, fb.input_ids), streams, post, comb)
