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

import numpy as np
import torch
from torch import nn

from leanserve.config import CSA, SLIDING, ModelConfig
from leanserve.model import cpu_kernels
from leanserve.model.batch import ForwardBatch
from leanserve.model.cache import LayerCache
from leanserve.model.compressor import Compressor, Indexer
from leanserve.model.layers import Linear, RMSNorm, apply_rope, fp32_param, grouped_linear, linears, norm_rope

Rope = torch.Tensor  # complex RoPE factors, see layers.Rotary

NO_ROWS = np.empty((1, 0, 1), dtype=np.float32)
NO_CHOICE = np.empty((0, 0, 0), dtype=np.bool_)
NO_NEW_KV = np.empty((0, 1), dtype=np.float32)  # (a step whose rows went into the ring first)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.rope_kind = "main" if layer_type == SLIDING else "compress"
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.o_groups, self.eps = cfg.o_groups, cfg.rms_norm_eps
        hidden = cfg.hidden_size
        self.wq_a = Linear(hidden, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wkv = Linear(hidden, self.head_dim, bias=False)
        self.norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        group_in = self.n_heads * self.head_dim // cfg.o_groups
        self.wo_a = Linear(group_in, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, hidden, bias=False)
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
            )
        # The projections of the layer input x, computed together (one call on the CPU kernels' path).
        inputs = [self.wq_a, self.wkv]
        if self.compressor is not None:
            inputs += [self.compressor.wkv, self.compressor.wgate]
        if self.indexer is not None:
            inputs += [self.indexer.compressor.wkv, self.indexer.compressor.wgate, self.indexer.weights_proj]
        self._inputs = tuple(inputs)  # (a plain tuple: the modules stay registered where they are)

    def forward(self, x: torch.Tensor, fb: ForwardBatch, cache: LayerCache, ropes: dict[str, Rope]) -> torch.Tensor:
        num_tokens = x.shape[0]
        rope = ropes[self.rope_kind]
        projected = linears(x, tuple(m.weight for m in self._inputs), self)
        q_residual = self.q_norm(projected[0])  # [T, q_lora_rank]
        q = self.wq_b(q_residual).view(num_tokens, self.n_heads, self.head_dim)
        q = norm_rope(q, rope, self.eps)
        kv = norm_rope(projected[1], rope, self.eps, self.norm.weight)  # [T, D]

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
        # On the CPU in float32 every step attends through the compiled kernel (threaded over query blocks: no
        # [blocks, heads, queries, keys] score tensors); elsewhere through batched torch matmuls.
        if cpu_kernels.fast(q, ring, new_kv):
            out = self._attend_kernel(q, ring, new_kv, fb, cache, index_queries, rope)
        else:
            out = self._attend_torch(q, ring, new_kv, fb, cache, index_queries, rope)
        if not fb.window_write_first:
            ring.index_copy_(0, write.dst, kv[write.src].to(ring.dtype))

        # Grouped low-rank output projection: each group of heads -> o_lora_rank, then mix to hidden.
        grouped = out.reshape(num_tokens, self.o_groups, -1)  # [T, G, H*D/G]
        w = self.wo_a.weight.view(self.o_groups, -1, grouped.shape[-1])  # [G, o_lora_rank, H*D/G]
        return self.wo_b(grouped_linear(grouped, w).flatten(1))

    def _attend_torch(self, q, ring, new_kv, fb: ForwardBatch, cache: LayerCache, index_queries, rope) -> torch.Tensor:
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
        return apply_rope(out, rope, inverse=True)

    def _attend_kernel(self, q, ring, new_kv, fb: ForwardBatch, cache: LayerCache, index_queries, rope):
        out = torch.empty_like(q)
        arrays = q.numpy(), ring.numpy(), NO_NEW_KV if new_kv is None else new_kv.numpy()
        angles = torch.view_as_real(rope.contiguous()).numpy()
        iq = None if index_queries is None else (index_queries[0].numpy(), index_queries[1].numpy())
        params, rows = self.attend_params(), cache_rows(cache)
        for g in fb.groups:
            most = g.max_visible[self.layer_type] if self.compressor is not None else 0
            visible = g.visible[self.layer_type].numpy() if most else np.zeros(g.q_rows.shape, dtype=np.int64)
            attend_arrays(params, *arrays, g.arrays(), most, visible, *rows, iq, angles, out.numpy())
        return out

    def attend_params(self) -> tuple:
        """attend_arrays' fixed arguments: (sink, scale, indexer top-k, indexer scale); no indexer: top-k 0."""
        (sink,) = cpu_kernels.numpy_views(self, self.attn_sink, key="sink")
        idx = self.indexer
        return sink, self.head_dim**-0.5, idx.topk if idx else 0, idx.head_dim**-0.5 if idx else 0.0

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [NB, Bq, H, D], keys (= values) [NB, K, D], mask [NB, Bq, K] -> [NB, Bq, H, D]."""
        scores = torch.einsum("bqhd,bkd->bhqk", q, keys) * self.head_dim**-0.5
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        # The sink is one extra logit per head that takes probability mass and contributes no value.
        sinks = self.attn_sink.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sinks], dim=-1).float().softmax(dim=-1)[..., :-1]
        return torch.einsum("bhqk,bkd->bqhd", probs.to(keys.dtype), keys)


def cache_rows(cache: LayerCache) -> tuple[np.ndarray, np.ndarray]:
    """Numpy views of a layer's compressed rows and indexer rows (NO_ROWS where the layer has none)."""
    rows = cache.comp_rows.numpy() if cache.comp_rows is not None else NO_ROWS
    return rows, cache.idx_rows.numpy() if cache.idx_rows is not None else NO_ROWS


def attend_arrays(params, q, ring, new_kv, group, most: int, visible, rows, idx_rows, index_queries, angles, out):
    """The attention kernels for one group of query blocks, on numpy arrays (see cpu_kernels.attend): params
    from Attention.attend_params(); q, out [T, H, D]; the window ring and this step's new rows (or NO_NEW_KV);
    group from AttnGroup.arrays(); visible [NB, Bq] the compressed rows each query may see, `most` their
    maximum; the layer's compressed and indexer rows (cache_rows); index_queries the indexer's (queries, head
    weights), or None when it does not choose."""
    sink, scale, topk, index_scale = params
    q_rows, q_valid, key_index, key_mask, block_slot = group
    chosen = NO_CHOICE
    if index_queries is not None and most > topk:
        chosen = np.empty((*q_rows.shape, most), dtype=np.bool_)
        cpu_kernels.index_select(
            q_rows.shape[0], *index_queries, q_rows, q_valid, block_slot, idx_rows, visible, topk, index_scale,
            chosen,
        )  # fmt: skip
    cpu_kernels.attend(
        q_rows.shape[0], q, ring, new_kv, q_rows, q_valid, key_index, key_mask, block_slot, rows, visible, chosen,
        sink, scale, angles, out,
    )  # fmt: skip
