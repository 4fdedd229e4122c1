"""The torch statement of DeepSeek-V4 attention (see attention.py for what it computes): the layer's wiring
(`attention`) and its pieces. `ops` is the stage's backend, through which the small ops, the compressor steps
and the attention proper (`ops.attend`) run, so that a backend can replace any of them.

The same wiring is stated twice more and changes together with this one: the CPU backend's decode step
(backends/cpu/decode.py: `attention`) and training's forward over whole sequences (train/forward.py: `attention`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from leanserve.model.cache import paged_rows
from leanserve.model.torch_math.compressor import index_queries, index_select
from leanserve.model.weights import AttentionWeights

if TYPE_CHECKING:
    from leanserve.model.backends.torch import TorchBackend
    from leanserve.model.batch import ForwardBatch
    from leanserve.model.cache import LayerCache

Rope = torch.Tensor  # complex RoPE factors at the step's positions, see torch_math.blocks.ropes


def attention(
    ops: TorchBackend, w: AttentionWeights, x: torch.Tensor, fb: ForwardBatch, cache: LayerCache, ropes: dict
) -> torch.Tensor:
    """The layer over a step: x [T, hidden] (the block's normalised input) -> [T, hidden]."""
    rope = ropes[w.rope_kind]
    projected = ops.linears(x, w.inputs)
    q_residual, q, kv = queries_kv(ops, w, projected[0], projected[1], rope)

    # Window keys come from the ring (earlier steps) and this step's rows; see model/batch.py.
    ring = cache.window_kv.view(-1, w.head_dim)
    write = fb.window_write
    if fb.window_write_first:
        ring.index_copy_(0, write.dst, kv[write.src].to(ring.dtype))
    iq = None
    if w.compressor is not None:
        meta = fb.compress[w.layer_type]
        row_rope = ropes[w.layer_type]
        ops.compress(w.compressor, *projected[2:4], meta, cache.comp_kv, cache.comp_gate, cache.comp_rows, row_rope)
        idx = w.indexer
        if idx is not None:
            ops.compress(idx.compressor, *projected[4:6], meta, cache.idx_kv, cache.idx_gate, cache.idx_rows, row_rope)
            if any(g.max_visible[w.layer_type] > idx.topk for g in fb.groups):
                iq = index_queries(ops, idx, q_residual, projected[6], rope)
    new_kv = None if fb.window_write_first else kv.to(ring.dtype)
    out = ops.attend(w, q, ring, new_kv, fb, cache, iq, rope)
    if not fb.window_write_first:
        ring.index_copy_(0, write.dst, kv[write.src].to(ring.dtype))
    return output(ops, w, out)


def queries_kv(ops: TorchBackend, w: AttentionWeights, q_in: torch.Tensor, kv_in: torch.Tensor, rope: Rope):
    """From wq_a(x) and wkv(x) [T, ...]: (q_residual [T, q_lora_rank], the queries [T, H, D]: wq_b, the
    per-head norm and RoPE, the key/value [T, D]: its norm and RoPE)."""
    q_residual = ops.rms_norm(q_in, w.q_eps, w.q_norm)
    q = ops.linears(q_residual, (w.wq_b,))[0].view(q_in.shape[0], w.heads, w.head_dim)
    return q_residual, ops.norm_rope(q, rope, w.eps), ops.norm_rope(kv_in, rope, w.eps, w.kv_norm)


def output(ops: TorchBackend, w: AttentionWeights, out: torch.Tensor) -> torch.Tensor:
    """The grouped low-rank output projection of the attention's output [T, H, D] (inverse RoPE'd): each
    group of heads -> o_lora_rank, then mix to hidden."""
    grouped = out.reshape(out.shape[0], w.o_groups, -1)  # [T, G, H*D/G]
    return ops.linears(ops.grouped_linear(grouped, w.wo_a).flatten(1), (w.wo_b,))[0]


def attend(
    ops: TorchBackend, w: AttentionWeights, q, ring, new_kv, fb: ForwardBatch, cache: LayerCache, iq, rope
) -> torch.Tensor:
    """The attention proper: queries q [T, H, D] over the window keys (the ring, then this step's `new_kv` when
    they did not go into the ring first) and the compressed rows each query sees (the indexer's top-k of them
    when `iq`, its queries, is given); the output [T, H, D] inverse RoPE'd."""
    store = ring if new_kv is None else torch.cat([ring, new_kv])
    out = None if fb.groups[0].is_identity else torch.empty_like(q)  # an identity group is the only one
    for g in fb.groups:
        keys, mask = store[g.key_index], g.key_mask  # [NB, Kw, D], [NB, Bq, Kw]
        n = g.max_visible[w.layer_type] if w.compressor is not None else 0
        if n:
            rows = paged_rows(cache.comp_rows, fb.block_table, g.block_slot, n)  # [NB, n, D]
            row_mask = torch.arange(n, device=q.device) < g.visible[w.layer_type][..., None]  # [NB, Bq, n]
            if iq is not None and n > w.indexer.topk:
                keys_i = paged_rows(cache.idx_rows, fb.block_table, g.block_slot, n)
                row_mask = index_select(w.indexer, iq, g, keys_i, row_mask)
            keys = torch.cat([keys, rows.to(keys.dtype)], dim=1)
            mask = torch.cat([mask, row_mask], dim=-1)
        attended = attend_scores(w, scores(w, g.gather(q), keys), mask, keys)  # [NB, Bq, H, D]
        if g.is_identity:
            out = attended.squeeze(1)
        else:
            out[g.q_rows[g.q_valid]] = attended[g.q_valid]
    return ops.apply_rope(out, rope, inverse=True)


def scores(w: AttentionWeights, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The attention logits q . k / sqrt(D): q [NB, Bq, H, D], keys [NB, K, D] -> [NB, Bq, H, K]."""
    return torch.matmul(q.flatten(1, 2), keys.transpose(1, 2)).view(*q.shape[:3], -1) * w.head_dim**-0.5


def attend_scores(w: AttentionWeights, scores: torch.Tensor, mask: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """scores [NB, Bq, H, K] (see `scores`), mask [NB, Bq, K], keys (= values) [NB, K, D] -> [NB, Bq, H, D]."""
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    # The sink is one extra logit per head that takes probability mass and contributes no value.
    sinks = w.sink.to(scores.dtype).view(1, 1, -1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sinks], dim=-1).float().softmax(dim=-1)[..., :-1].to(keys.dtype)
    return torch.matmul(probs.flatten(1, 2), keys).view(*scores.shape[:3], -1)
