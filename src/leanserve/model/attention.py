"""DeepSeek-V4 attention: shared-KV MQA over a sliding window, plus compressed entries.

  sliding_attention             keys = the last `sliding_window` positions (K = V, one head)
  compressed_sparse_attention   + the top-k compressed entries (r = 4) the Lightning Indexer picks
  heavily_compressed_attention  + every compressed entry (r = 128)

Queries come from a low-rank path (wq_a -> q_norm -> wq_b, then a per-head unweighted RMSNorm); partial
RoPE rotates the trailing rope dims of q and kv, and its inverse is applied to the output (V carries K's
rotation). Each head has a learned attention sink. The output projection is grouped and low-rank
(wo_a per group, then wo_b).

This module holds the parameters; the math is torch_math/attention.py (through the stage's backend).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from leanserve.model.compressor import Compressor, Indexer
from leanserve.model.config import CSA, SLIDING, ModelConfig
from leanserve.model.layers import Linear, RMSNorm, UsesBackend, fp32_param
from leanserve.model.weights import AttentionWeights

if TYPE_CHECKING:
    from leanserve.model.batch import ForwardBatch
    from leanserve.model.cache import LayerCache


class Attention(UsesBackend, nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.rope_kind = "main" if layer_type == SLIDING else "compress"
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.o_groups, self.eps = cfg.o_groups, cfg.rms_norm_eps
        hidden = cfg.hidden_size
        fp8 = "fp8" if cfg.quantization is not None else None  # (the published checkpoints' linears)
        self.wq_a = Linear(hidden, cfg.q_lora_rank, quant=fp8)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, quant=fp8)
        self.wkv = Linear(hidden, self.head_dim, quant=fp8)
        self.norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        group_in = self.n_heads * self.head_dim // cfg.o_groups
        self.wo_a = Linear(group_in, cfg.o_groups * cfg.o_lora_rank, quant=fp8)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, hidden, quant=fp8)
        self.attn_sink = fp32_param(self.n_heads)
        self.compressor = None
        self.indexer = None
        if layer_type != SLIDING:
            ratio = cfg.compress_rate(layer_type)
            self.compressor = Compressor(hidden, self.head_dim, ratio, overlap=layer_type == CSA, eps=self.eps)
        if layer_type == CSA:
            self.indexer = Indexer(
                hidden,
                cfg.q_lora_rank,
                cfg.index_n_heads,
                cfg.index_head_dim,
                cfg.index_topk,
                ratio,
                self.eps,
                fp8,
            )

    def input_weights(self) -> tuple[torch.Tensor, ...]:
        """The projections of the layer input x, computed together (one call on the CPU kernels' path): wq_a,
        wkv, then the compressor's wkv and wgate, then the indexer's compressor wkv, wgate and weights_proj."""
        mods = [self.wq_a, self.wkv]
        if self.compressor is not None:
            mods += [self.compressor.wkv, self.compressor.wgate]
        if self.indexer is not None:
            mods += [self.indexer.compressor.wkv, self.indexer.compressor.wgate, self.indexer.weights_proj]
        return tuple([m.w() for m in mods])

    def weights(self) -> AttentionWeights:
        indexer = self.indexer.weights() if self.indexer is not None else None
        return AttentionWeights(
            self.input_weights(), self.q_norm.weight, self.q_norm.eps, self.wq_b.w(), self.norm.weight, self.eps,
            self.wo_a.w(), self.o_groups, self.wo_b.w(), self.attn_sink, self.n_heads, self.head_dim, self.layer_type,
            self.rope_kind, self.compressor.weights() if self.compressor is not None else None, indexer,
        )  # fmt: skip

    def forward(self, x: torch.Tensor, fb: ForwardBatch, cache: LayerCache, ropes: dict) -> torch.Tensor:
        """x [T, hidden] (the block's normalised input) -> [T, hidden]."""
        return self.ops.attention(self.weights(), x, fb, cache, ropes)
