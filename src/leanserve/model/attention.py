"""DeepSeek-V4 attention: shared-KV MQA over a sliding window, plus compressed entries.

  sliding_attention             keys = the last `sliding_window` positions (K = V, one head)
  compressed_sparse_attention   + the top-k compressed entries (r = 4) the Lightning Indexer picks
  heavily_compressed_attention  + every compressed entry (r = 128)

Queries come from a low-rank path (wq_a -> q_norm -> wq_b, then a per-head unweighted RMSNorm); partial
RoPE rotates the trailing rope dims of q and kv, and its inverse is applied to the output (V carries K's
rotation). Each head has a learned attention sink. The output projection is grouped and low-rank
(wo_a per group, then wo_b).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from leanserve.config import CSA, SLIDING, ModelConfig
from leanserve.model.backend import UsesBackend
from leanserve.model.batch import ForwardBatch
from leanserve.model.cache import LayerCache
from leanserve.model.compressor import Compressor, CompressorWeights, Indexer
from leanserve.model.layers import Linear, RMSNorm, fp32_param

Rope = torch.Tensor  # complex RoPE factors, see layers.Rotary


@dataclass(frozen=True)
class IndexerWeights:
    wq_b: torch.Tensor  # [heads * head_dim, q_lora_rank]
    heads: int
    head_dim: int
    topk: int
    compressor: CompressorWeights


@dataclass(frozen=True)
class AttentionWeights:
    """An attention layer's tensors and constants, for a backend that runs the layer whole."""

    inputs: tuple[torch.Tensor, ...]  # the projections of the layer input, see Attention.input_weights
    q_norm: torch.Tensor
    q_eps: float
    wq_b: torch.Tensor
    kv_norm: torch.Tensor
    eps: float  # of the per-head query norm and the kv norm
    wo_a: torch.Tensor  # [groups * o_lora_rank, heads * head_dim / groups]: group g's rows g * o_lora_rank...
    o_groups: int
    wo_b: torch.Tensor
    sink: torch.Tensor  # [heads] float32
    heads: int
    head_dim: int
    layer_type: str
    rope_kind: str  # "main" (sliding layers) or "compress"
    compressor: CompressorWeights | None
    indexer: IndexerWeights | None


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
        idx = self.indexer
        indexer = None
        if idx is not None:
            indexer = IndexerWeights(idx.wq_b.w(), idx.n_heads, idx.head_dim, idx.topk, idx.compressor.weights())
        return AttentionWeights(
            self.input_weights(), self.q_norm.weight, self.q_norm.eps, self.wq_b.w(), self.norm.weight, self.eps,
            self.wo_a.w(), self.o_groups, self.wo_b.w(), self.attn_sink, self.n_heads, self.head_dim, self.layer_type,
            self.rope_kind, self.compressor.weights() if self.compressor is not None else None, indexer,
        )  # fmt: skip

    def forward(self, x: torch.Tensor, fb: ForwardBatch, cache: LayerCache, ropes: dict[str, Rope]) -> torch.Tensor:
        rope = ropes[self.rope_kind]
        projected = self.ops.linears(x, self.input_weights())
        q_residual, q, kv = self.queries_kv(projected[0], projected[1], rope)

        # Window keys come from the ring (earlier steps) and this step's rows; see model/batch.py.
        ring = cache.window_kv.view(-1, self.head_dim)
        write = fb.window_write
        if fb.window_write_first:
            ring.index_copy_(0, write.dst, kv[write.src].to(ring.dtype))
        index_queries = None
        if self.compressor is not None:
            meta = fb.compress[self.layer_type]
            row_rope = ropes[self.layer_type]
            self.compressor(*projected[2:4], meta, cache.comp_kv, cache.comp_gate, cache.comp_rows, row_rope)
            if self.indexer is not None:
                self.indexer.compressor(*projected[4:6], meta, cache.idx_kv, cache.idx_gate, cache.idx_rows, row_rope)
                if any(g.max_visible[self.layer_type] > self.indexer.topk for g in fb.groups):
                    index_queries = self.indexer.queries(q_residual, projected[6], rope)
        new_kv = None if fb.window_write_first else kv.to(ring.dtype)
        out = self.ops.attend(self, q, ring, new_kv, fb, cache, index_queries, rope)
        if not fb.window_write_first:
            ring.index_copy_(0, write.dst, kv[write.src].to(ring.dtype))
        return self.output(out)

    def queries_kv(self, q_in: torch.Tensor, kv_in: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, ...]:
        """From wq_a(x) and wkv(x) [T, ...]: (q_residual [T, q_lora_rank], the queries [T, H, D]: wq_b, the
        per-head norm and RoPE, the key/value [T, D]: its norm and RoPE)."""
        q_residual = self.q_norm(q_in)
        q = self.wq_b(q_residual).view(q_in.shape[0], self.n_heads, self.head_dim)
        return (
            q_residual,
            self.ops.norm_rope(q, rope, self.eps),
            self.ops.norm_rope(kv_in, rope, self.eps, self.norm.weight),
        )

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """The grouped low-rank output projection of the attention's output [T, H, D] (inverse RoPE'd): each
        group of heads -> o_lora_rank, then mix to hidden."""
        grouped = out.reshape(out.shape[0], self.o_groups, -1)  # [T, G, H*D/G]
        return self.wo_b(self.ops.grouped_linear(grouped, self.wo_a.w()).flatten(1))

    def attend_torch(self, q, ring, new_kv, fb: ForwardBatch, cache: LayerCache, index_queries, rope) -> torch.Tensor:
        store = ring if new_kv is None else torch.cat([ring, new_kv])
        out = None if fb.groups[0].is_identity else torch.empty_like(q)  # an identity group is the only one
        for g in fb.groups:
            keys, mask = store[g.key_index], g.key_mask  # [NB, Kw, D], [NB, Bq, Kw]
            n = g.max_visible[self.layer_type] if self.compressor is not None else 0
            if n:
                rows = cache.comp_rows[g.block_slot, :n]  # [NB, n, D]
                row_mask = torch.arange(n, device=q.device) < g.visible[self.layer_type][..., None]  # [NB, Bq, n]
                if index_queries is not None and n > self.indexer.topk:
                    row_mask = self.indexer.select(index_queries, g, cache.idx_rows, row_mask)
                keys = torch.cat([keys, rows.to(keys.dtype)], dim=1)
                mask = torch.cat([mask, row_mask], dim=-1)
            attended = self._attend(g.gather(q), keys, mask)  # [NB, Bq, H, D]
            if g.is_identity:
                out = attended.squeeze(1)
            else:
                out[g.q_rows[g.q_valid]] = attended[g.q_valid]
        return self.ops.apply_rope(out, rope, inverse=True)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [NB, Bq, H, D], keys (= values) [NB, K, D], mask [NB, Bq, K] -> [NB, Bq, H, D]."""
        return self.attend_scores(self.scores(q, keys), mask, keys)

    def scores(self, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """The attention logits q . k / sqrt(D): q [NB, Bq, H, D], keys [NB, K, D] -> [NB, Bq, H, K]."""
        return torch.matmul(q.flatten(1, 2), keys.transpose(1, 2)).view(*q.shape[:3], -1) * self.head_dim**-0.5

    def attend_scores(self, scores: torch.Tensor, mask: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """scores [NB, Bq, H, K] (see `scores`), mask [NB, Bq, K], keys (= values) [NB, K, D] -> [NB, Bq, H, D]."""
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
        # The sink is one extra logit per head that takes probability mass and contributes no value.
        sinks = self.attn_sink.to(scores.dtype).view(1, 1, -1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sinks], dim=-1).float().softmax(dim=-1)[..., :-1].to(keys.dtype)
        return torch.matmul(probs.flatten(1, 2), keys).view(*scores.shape[:3], -1)
