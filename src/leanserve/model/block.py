"""One DeepSeek-V4 decoder block: mHC around attention, then mHC around the MoE."""

from __future__ import annotations

import torch
from torch import nn

from leanserve.config import ModelConfig
from leanserve.model.attention import Attention, Rope
from leanserve.model.batch import ForwardBatch
from leanserve.model.cache import LayerCache
from leanserve.model.hyper import hc_post, hc_pre
from leanserve.model.layers import RMSNorm, fp32_param
from leanserve.model.moe import MoE


class Block(nn.Module):
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

    def _pre(self, streams: torch.Tensor, site: str):
        """(the normalised input of the attention or MoE, post, comb)"""
        fn, base, scale = (getattr(self, f"hc_{site}_{p}") for p in ("fn", "base", "scale"))
        norm = self.attn_norm if site == "attn" else self.ffn_norm
        return hc_pre(streams, fn, base, scale, self.norm_eps, self.hc_eps, self.sinkhorn_iters, norm.weight)

    def forward(
        self, streams: torch.Tensor, fb: ForwardBatch, cache: LayerCache, ropes: dict[str, Rope]
    ) -> torch.Tensor:
        # streams: [T, hc_mult, hidden]
        x, post, comb = self._pre(streams, "attn")
        streams = hc_post(self.attn(x, fb, cache, ropes), streams, post, comb)
        x, post, comb = self._pre(streams, "ffn")
        return hc_post(self.ffn(x, fb.input_ids), streams, post, comb)
