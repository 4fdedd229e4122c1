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
    from leanserve.model.batch import AttnGroup, ForwardBatch
    from leanserve.model.cache import LayerCache

Rope = torch.Tensor  # complex RoPE factors at the step's positions, see torch_math.blocks.ropes


def attention(
    ops: TorchBackend, w: AttentionWeights, x: torch.Tensor, fb: ForwardBatch, cache: LayerCache, ropes: dict,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The layer over a step: x [T, hidden] (the block's normalised input) -> [T, hidden], or [len(rows), hidden]
    at `rows`: every row's keys go into the caches, but only those rows' queries, indexer queries and output
    projections are made (the others' queries are zeros, and what attention gives them is dropped; with no rows
    the attention proper does not run)."""
    rope = ropes[w.rope_kind]
    if rows is None:
        projected = ops.linears(x, w.inputs)
        q_residual, q, kv = queries_kv(ops, w, projected[0], projected[1], rope)
    else:  # (wq_a at the rows alone; the key and compressor inputs at every row)
        asked = ops.linears(x[rows], w.inputs[:1])[0] if len(rows) else None
        projected = (asked, *ops.linears(x, w.inputs[1:]))
        q_residual, q, kv = queries_kv(ops, w, asked, projected[1], rope, rows)

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
            if q is not None and any(g.max_visible[w.layer_type] > idx.topk for g in fb.groups):
                head_w = projected[6] if rows is None else projected[6][rows]
                iq = index_queries(ops, idx, q_residual, head_w, rope if rows is None else rope[rows])
                iq = tuple([_every_row(t, rows, x.shape[0]) for t in iq])
    new_kv = None if fb.window_write_first else kv.to(ring.dtype)
    out = None if q is None else ops.attend(w, q, ring, new_kv, fb, cache, iq, rope)
    if not fb.window_write_first:
        ring.index_copy_(0, write.dst, kv[write.src].to(ring.dtype))
    if out is None:
        return x.new_empty((0, x.shape[1]))
    return output(ops, w, out if rows is None else out[rows])


def queries_kv(
    ops: TorchBackend, w: AttentionWeights, q_in: torch.Tensor | None, kv_in: torch.Tensor, rope: Rope, rows=None
):  # fmt: skip
    """From wq_a(x) and wkv(x) [T, ...]: (q_residual [T, q_lora_rank], the queries [T, H, D]: wq_b, the
    per-head norm and RoPE, the key/value [T, D]: its norm and RoPE). With `rows`, q_in is wq_a(x) at those rows
    alone: q_residual is theirs, the queries are theirs among zeros, and with no rows both are None."""
    kv = ops.norm_rope(kv_in, rope, w.eps, w.kv_norm)
    if q_in is None:
        return None, None, kv
    q_residual = ops.rms_norm(q_in, w.q_eps, w.q_norm)
    q = ops.linears(q_residual, (w.wq_b,))[0].view(q_in.shape[0], w.heads, w.head_dim)
    q = ops.norm_rope(q, rope if rows is None else rope[rows], w.eps)
    return q_residual, _every_row(q, rows, kv_in.shape[0]), kv


def _every_row(t: torch.Tensor, rows: torch.Tensor | None, n: int) -> torch.Tensor:
    """`t` [len(rows), ...] as [n, ...]: its rows at `rows`, zeros elsewhere (`rows` None: `t` as it is; the CPU
    decode path's decode._every_row)."""
    if rows is None:
        return t
    out = t.new_zeros((n, *t.shape[1:]))
    out[rows] = t
    return out


def output(ops: TorchBackend, w: AttentionWeights, out: torch.Tensor) -> torch.Tensor:
    """The grouped low-rank output projection of the attention's output [T, H, D] (inverse RoPE'd): each
    group of heads -> o_lora_rank, then mix to hidden."""
    grouped = out.reshape(out.shape[0], w.o_groups, -1)  # [T, G, H*D/G]
    return ops.linears(ops.grouped_linear(grouped, w.wo_a).flatten(1), (w.wo_b,))[0]


# The attention's working memory: a group's query blocks go through `attend` in passes of as many blocks as keep
# a pass's largest tensor (its scores [blocks, queries, heads, keys], or the keys it reads) within this many
# elements, whatever the context's length (see `attend_plan`).
ATTEND_BUDGET = 64 * 2**20


def attend(
    ops: TorchBackend, w: AttentionWeights, q, ring, new_kv, fb: ForwardBatch, cache: LayerCache, iq, rope
) -> torch.Tensor:
    """The attention proper: queries q [T, H, D] over the window keys (the ring, then this step's `new_kv` when
    they did not go into the ring first) and the compressed rows each query sees: where `iq`, the indexer's
    queries, is given and a query sees more than topk rows, only the indexer's top-k of them (gathered per query,
    `attend_chosen`); else every row it sees (masked). The output [T, H, D] inverse RoPE'd."""
    store = ring if new_kv is None else torch.cat([ring, new_kv])
    out = torch.empty_like(q)
    kind = w.layer_type
    for g in fb.groups:
        n = g.max_visible[kind] if w.compressor is not None else 0
        topk = w.indexer.topk if iq is not None and n > w.indexer.topk else 0  # (0: the indexer does not choose)
        num_blocks, block = g.q_rows.shape
        step = attend_plan(num_blocks, block, w.heads, w.head_dim, g.key_index.shape[1], n, topk, ATTEND_BUDGET)
        for b0 in range(0, num_blocks, step):
            b = slice(b0, b0 + step)
            qb, keys, mask = _gather(g, q, b), store[g.key_index[b]], g.key_mask[b]  # [nb, Bq, H, D], [nb, Kw, D]
            seen = n if step >= num_blocks else int(g.visible[kind][b].max()) if n else 0  # (this pass's most)
            if topk and seen > topk:
                attended = attend_chosen(w, qb, keys, mask, fb, cache, g, b, seen, iq)
            else:
                if seen:
                    rows = paged_rows(cache.comp_rows, fb.block_table, g.block_slot[b], seen)  # [nb, n, D]
                    row_mask = torch.arange(seen, device=q.device) < g.visible[kind][b][..., None]  # [nb, Bq, n]
                    keys = torch.cat([keys, rows.to(keys.dtype)], dim=1)
                    mask = torch.cat([mask, row_mask], dim=-1)
                attended = attend_scores(w, scores(w, qb, keys), mask, keys)  # [nb, Bq, H, D]
            if g.is_identity:
                out[b] = attended.squeeze(1)
            else:
                valid = g.q_valid[b]
                out[g.q_rows[b][valid]] = attended[valid]
    return ops.apply_rope(out, rope, inverse=True)


def attend_chosen(
    w: AttentionWeights, q, keys, mask, fb: ForwardBatch, cache: LayerCache, g: AttnGroup, b: slice, n: int, iq
) -> torch.Tensor:
    """Blocks `b` of group g's queries q [nb, Bq, H, D] over their window `keys` [nb, Kw, D] (`mask` [nb, Bq, Kw])
    and the compressed rows the indexer chooses for each among the first n (compressor.index_select): those rows
    [nb, Bq, topk, D] are gathered from the pool, the scores cover the window and them alone, [nb, Bq, H, Kw + topk].
    The same sink and softmax as `attend_scores`; -> [nb, Bq, H, D]."""
    slots, table = g.block_slot[b], fb.block_table

    def index_rows(blocks: slice, start: int, stop: int) -> torch.Tensor:
        return paged_range(cache.idx_rows, table, slots[blocks], start, stop)

    iq_b = _gather(g, iq[0], b), _gather(g, iq[1], b)
    chosen = index_select(w.indexer, *iq_b, index_rows, g.visible[w.layer_type][b], n)  # [nb, Bq, topk], -1: none
    rows = paged_pick(cache.comp_rows, table, slots, chosen.clamp_min(0)).to(keys.dtype)  # [nb, Bq, topk, D]
    logits = torch.cat([scores(w, q, keys), torch.matmul(q, rows.transpose(-1, -2)) * w.head_dim**-0.5], dim=-1)
    probs = probabilities(w, logits, torch.cat([mask, chosen >= 0], dim=-1), keys.dtype)  # [nb, Bq, H, Kw + topk]
    window = keys.shape[1]
    attended = torch.matmul(probs[..., :window].flatten(1, 2), keys).view(*q.shape)
    return attended + torch.matmul(probs[..., window:], rows)


def attend_plan(blocks: int, queries: int, heads: int, dim: int, window: int, n: int, topk: int, budget: int) -> int:
    """Blocks per pass of `attend` for a group of `blocks` blocks of `queries` queries with `window` window keys
    each, that sees up to n compressed rows, of which the indexer chooses topk (0: it does not choose): as many as
    keep a pass's scores [blocks, queries, heads, keys + the sink] and keys ([blocks, window + n, dim], or the
    chosen rows [blocks, queries, topk, dim]) each within `budget` elements (at least one block)."""
    keys = window + (topk or n)
    per_block = max(queries * heads * (keys + 1), (window + queries * topk if topk else keys) * dim)  # (+1: the sink)
    return max(1, min(blocks, budget // max(1, per_block)))


def paged_pick(pool: torch.Tensor, table: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` [NB, ...] (int64, >= 0) of each of `slots`' [NB] sequences from a pool [blocks, rows per
    block, dim] -> [NB, ..., dim]: row c of slot s is pool[table[s, c // P], c % P] (see cache.paged_rows)."""
    per_block = pool.shape[1]
    flat = rows.flatten(1)  # [NB, m]
    blocks = table[slots[:, None], flat // per_block].long()
    return pool.view(-1, pool.shape[-1])[blocks * per_block + flat % per_block].view(*rows.shape, -1)


def paged_range(pool: torch.Tensor, table: torch.Tensor, slots: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of each of `slots`' sequences [NB, stop - start, dim] from a pool (see `paged_pick`)."""
    rows = torch.arange(start, stop, device=pool.device).expand(slots.shape[0], -1)
    return paged_pick(pool, table, slots, rows)


def _gather(g: AttnGroup, x: torch.Tensor, b: slice) -> torch.Tensor:
    """Per-token rows [T, ...] -> those of blocks `b`'s queries [nb, Bq, ...] (AttnGroup.gather on some blocks)."""
    return x[b].unsqueeze(1) if g.is_identity else x[g.q_rows[b]]


def scores(w: AttentionWeights, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The attention logits q . k / sqrt(D): q [NB, Bq, H, D], keys [NB, K, D] -> [NB, Bq, H, K]."""
    return torch.matmul(q.flatten(1, 2), keys.transpose(1, 2)).view(*q.shape[:3], -1) * w.head_dim**-0.5


def attend_scores(w: AttentionWeights, scores: torch.Tensor, mask: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """scores [NB, Bq, H, K] (see `scores`), mask [NB, Bq, K], keys (= values) [NB, K, D] -> [NB, Bq, H, D]."""
    probs = probabilities(w, scores, mask, keys.dtype)
    return torch.matmul(probs.flatten(1, 2), keys).view(*scores.shape[:3], -1)


def probabilities(w: AttentionWeights, scores: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The attention's weights [NB, Bq, H, K] in `dtype` from scores [NB, Bq, H, K] and mask [NB, Bq, K]: the
    softmax in float32 over the unmasked keys and the head's sink."""
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    # The sink is one extra logit per head that takes probability mass and contributes no value.
    sinks = w.sink.to(scores.dtype).view(1, 1, -1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sinks], dim=-1).float().softmax(dim=-1)[..., :-1].to(dtype)
