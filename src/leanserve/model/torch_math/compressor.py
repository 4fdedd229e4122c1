"""The torch statement of the KV compressor (CSA and HCA) and of the Lightning Indexer (see compressor.py for
what they compute). `ops` is the stage's backend, through which the small ops run."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from leanserve.model.weights import CompressorWeights, IndexerWeights

if TYPE_CHECKING:
    from leanserve.model.backends.torch import TorchBackend
    from leanserve.model.batch import CompressMeta


def compress(
    ops: TorchBackend,
    w: CompressorWeights,
    kv: torch.Tensor,  # [T, width]: wkv(x)
    gate: torch.Tensor,  # [T, width]: wgate(x)
    meta: CompressMeta,
    kv_ring: torch.Tensor,  # [slots, B, width]
    gate_ring: torch.Tensor,  # [slots, B, width]
    rows: torch.Tensor,  # the pool [blocks, rows per block, dim]
    row_rope: torch.Tensor,  # RoPE factors at each closing window's position
) -> None:
    """One step: writes the entries of the windows that close this step into `rows`, and stores this step's
    projections in the rings (before reading them, or after, as `meta.write_first` says)."""
    width = kv.shape[-1]
    kv_flat, gate_flat = kv_ring.view(-1, width), gate_ring.view(-1, width)
    if meta.write_first:
        _store(kv, gate, kv_flat, gate_flat, meta)
    if meta.src.shape[0]:
        if meta.write_first:
            kv_src, gate_src = kv_flat[meta.src], gate_flat[meta.src]  # [NW, span, width]
        else:
            kv_src = torch.cat([kv_flat, kv.to(kv_flat.dtype)])[meta.src]
            gate_src = torch.cat([gate_flat, gate.to(gate_flat.dtype)])[meta.src]
        out = entries(ops, w, kv_src, gate_src, meta.src_valid, row_rope)
        rows.view(-1, w.dim).index_copy_(0, meta.row_dst, out.to(rows.dtype))
    if not meta.write_first:
        _store(kv, gate, kv_flat, gate_flat, meta)


def _store(kv: torch.Tensor, gate: torch.Tensor, kv_flat: torch.Tensor, gate_flat: torch.Tensor, meta) -> None:
    src, dst = meta.write.src, meta.write.dst
    kv_flat.index_copy_(0, dst, kv[src].to(kv_flat.dtype))
    gate_flat.index_copy_(0, dst, gate[src].to(gate_flat.dtype))


def entries(
    ops: TorchBackend,
    w: CompressorWeights,
    kv_src: torch.Tensor,  # [NW, span, width]: wkv of each window's source tokens, in order
    gate_src: torch.Tensor,  # [NW, span, width]: their wgate
    valid: torch.Tensor | None,  # [NW, span] bool: which source tokens exist (None: all)
    row_rope: torch.Tensor,  # [NW, rope/2]: RoPE factors at each window's position
) -> torch.Tensor:
    """The entries [NW, dim] of NW windows (see `pool`). A CSA window's span is 2r: the previous window's r
    tokens, whose Ca (the first half of the channels) pools here, then its own r, whose Cb (the second half)
    does; an HCA window's span is r."""
    if w.overlap:
        r, d = w.ratio, w.dim
        kv_src = torch.cat([kv_src[:, :r, :d], kv_src[:, r:, d:]], dim=1)  # [NW, 2r, dim]
        gate_src = torch.cat([gate_src[:, :r, :d], gate_src[:, r:, d:]], dim=1)
    if valid is not None:
        gate_src = gate_src.masked_fill(~valid[..., None], float("-inf"))
        kv_src = kv_src.masked_fill(~valid[..., None], 0.0)
    return pool(ops, w, kv_src, gate_src, row_rope)


def pool(ops: TorchBackend, w: CompressorWeights, kv: torch.Tensor, gate: torch.Tensor, row_rope: torch.Tensor):
    """Windows' entries [NW, dim] from their tokens' kv and gate [NW, span, dim] (CSA: Ca of the previous
    window's r tokens, then Cb of its own r; -inf gates for tokens that do not exist): per channel, the
    softmax over the window of gate + ape weights the sum of kv; then the norm and RoPE (`row_rope`
    [NW, rope/2], at each window's position)."""
    r, d = w.ratio, w.dim
    ape = torch.cat([w.ape[:, :d], w.ape[:, d:]]) if w.overlap else w.ape.repeat(kv.shape[1] // r, 1)
    weights = (gate + ape).softmax(dim=1, dtype=torch.float32).to(kv.dtype)
    return ops.apply_rope(ops.rms_norm((kv * weights).sum(dim=1), w.eps, w.norm_weight), row_rope)


# --- the Lightning Indexer: scores compressed entries per query, sum_h w_h * ReLU(q_h . k), keeps the top k ---
def index_queries(
    ops: TorchBackend, w: IndexerWeights, q_residual: torch.Tensor, head_weights: torch.Tensor, rope: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: RoPE'd indexer queries [T, H, d] and head weights [T, H] (float32), from the attention's
    q_residual and weights_proj(x)."""
    q = ops.linears(q_residual, (w.wq_b,))[0].view(-1, w.heads, w.head_dim)
    return ops.apply_rope(q, rope).float(), head_weights.float() * w.heads**-0.5


# The indexer's working memory: a pass scores a chunk of rows for some query blocks, and its rows, its scores
# [blocks, queries x heads, rows] and its candidates [blocks, queries, topk + rows] together hold at most this
# many elements (float32: 256 MiB; see `index_plan`), whatever the context's length.
INDEX_BUDGET = 64 * 2**20
# Chunks of rows are multiples of this many: torch's CPU matmul (its BLAS) computes every column of such widths
# alike, so that one key scores the same in any chunk (at other widths the edge columns may round differently).
ROW_ALIGN = 64

# (blocks, start, stop) -> the indexer's rows [start, stop) of those blocks' sequences [blocks, stop - start, d]
Rows = Callable[[slice, int, int], torch.Tensor]


def index_select(
    w: IndexerWeights,
    q: torch.Tensor,  # [NB, Bq, H, d] float32: each query's indexer queries (index_queries', gathered per query)
    head_weights: torch.Tensor,  # [NB, Bq, H] float32: their head weights
    keys: Rows,  # the indexer's rows of each block's sequence, a range at a time
    visible: torch.Tensor,  # [NB, Bq] int64: query i of block b may see rows c < visible[b, i]
    n: int,  # rows of each block's sequence that `keys` can give (>= visible)
    budget: int | None = None,  # (INDEX_BUDGET)
) -> torch.Tensor:
    """The Lightning Indexer's choice, per query: the `topk` rows it sees with the highest index scores (among
    equal scores the lower row: the first topk of one stable descending sort of every row's score, -inf where not
    seen, as `index_pick` chooses), as rows [NB, Bq, min(topk, n)] int64 in ascending order, -1 past those it sees
    (a query that sees fewer than topk rows keeps every one). Scored a chunk of rows at a time with a running
    top-k, so that no tensor holds every row's score (see `index_plan`)."""
    num_blocks, block = q.shape[:2]
    topk = min(w.topk, n)
    out = torch.empty(num_blocks, block, topk, dtype=torch.long, device=q.device)
    if topk == 0:
        return out
    budget = INDEX_BUDGET if budget is None else budget
    step, chunk, width = index_plan(num_blocks, block, w.heads, w.head_dim, topk, n, budget)
    scale = w.head_dim**-0.5
    with torch.no_grad():
        for b0 in range(0, num_blocks, step):
            b = slice(b0, b0 + step)
            qb, hw, seen = q[b].flatten(1, 2), head_weights[b].unsqueeze(2), visible[b, :, None]  # [nb, Bq*H, d] ..
            best = rows = None  # the topk best scores so far [nb, Bq, topk] and their rows, in no order
            for c0 in range(0, n, chunk):
                c1 = min(n, c0 + chunk)
                # index_scores on the chunk's rows (ReLU and scale in place: the same values), at one width, a
                # multiple of ROW_ALIGN: so that equal keys score exactly equal, and tie, in whichever chunk and
                # place they fall (a matmul's float rounding may change with its shape and a column's place in it)
                k = F.pad(keys(b, c0, c1).float(), (0, 0, 0, c0 + width - c1))
                s = torch.matmul(qb, k.transpose(1, 2)).relu_().mul_(scale)  # [nb, Bq*H, width]
                s = torch.matmul(hw, s.view(*hw.shape[:2], w.heads, -1)).squeeze(2)[..., : c1 - c0]  # [nb, Bq, c]
                s = s.masked_fill_((torch.arange(c0, c1, device=q.device) >= seen) | s.isnan(), float("-inf"))
                best, rows = _merge(best, rows, s, c0, topk)
            rows = rows.sort(dim=-1).values
            out[b] = rows.masked_fill(rows >= seen, -1)
    return out


def index_plan(blocks: int, queries: int, heads: int, dim: int, topk: int, n: int, budget: int) -> tuple[int, int, int]:
    """(blocks per pass, rows per chunk, the width a chunk is scored at) for scoring n rows of width `dim` for
    `blocks` blocks of `queries` queries of `heads` heads each. A pass's rows [blocks, width, dim], scores
    [blocks, queries x heads, width] and candidates [blocks, queries, topk + width] (counted twice: their scores
    and their comparisons, or order keys) hold at most `budget` elements together. Chunks are multiples of
    ROW_ALIGN rows, scored at one width (the last, or the only one, padded with zero rows), and at least topk
    rows: passes take fewer blocks first (down to one, then fewer rows, at least one, unaligned below ROW_ALIGN)."""
    per_row, kept = queries * (heads + 2) + dim, 2 * queries * topk  # a block's elements: per row, for the kept
    whole = -(-n // ROW_ALIGN) * ROW_ALIGN
    least = min(whole, -(-max(topk, 1) // ROW_ALIGN) * ROW_ALIGN)  # the narrowest chunk worth a pass
    step = max(1, min(blocks, budget // (per_row * least + kept)))
    fit = max(1, (budget // step - kept) // per_row)  # the widest chunk a pass holds
    if fit >= whole:
        return step, n, whole
    if fit >= ROW_ALIGN:  # as many chunks as the widest aligned one needs, of (about) equal widths
        chunks = -(-n // (fit - fit % ROW_ALIGN))
        width = -(-n // (chunks * ROW_ALIGN)) * ROW_ALIGN
        return step, width, width
    return step, min(fit, n), min(fit, n)


def _merge(best: torch.Tensor | None, rows: torch.Tensor | None, scores: torch.Tensor, start: int, k: int):
    """The k best (score, row) of the kept best [.., k'] at `rows` (None: none yet) and a chunk's `scores` [.., c]
    (float32, no NaN) at rows start..start+c-1: the highest scores, among equal ones the lower rows (the first k
    of a stable descending sort by row). -> (scores [.., k], rows [.., k]), in no order."""
    kept = 0 if best is None else best.shape[-1]
    cand = scores if best is None else torch.cat([best, scores], -1)
    at = torch.arange(start - kept, start + scores.shape[-1], device=scores.device)  # the chunk's rows (from kept)
    if cand.shape[-1] <= k:
        return cand, at.expand_as(cand) if rows is None else torch.cat([rows, at[kept:].expand_as(scores)], -1)
    values, index = cand.topk(k, dim=-1, sorted=False)
    chosen = (
        at[index] if rows is None else torch.where(index < kept, rows.gather(-1, index.clamp(max=kept - 1)), at[index])
    )
    # topk's choice among scores equal to the k-th best is not the lowest rows': where some of those are left
    # out, choose again exactly (order keys: score, then row) for those queries alone.
    ties = (cand >= values.amin(dim=-1, keepdim=True)).sum(dim=-1) > k
    if bool(ties.any()):
        every = at.expand_as(cand) if rows is None else torch.cat([rows, at[kept:].expand_as(scores)], -1)
        order = _order_keys(cand[ties], every[ties]).topk(k, dim=-1, sorted=False).indices
        values[ties], chosen[ties] = cand[ties].gather(-1, order), every[ties].gather(-1, order)
    return values, chosen


_ROW_BITS = 2**32 - 1


def _order_keys(scores: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """int64 keys [.., c] of scores [.., c] (float32, no NaN) at rows [.., c] (distinct, < 2**32) that order as a
    stable descending sort of the scores by row does: by score, then, among equal scores, the lower row first (the
    high 32 bits the score's bits made monotonic, -0.0 as 0.0; the low 32 bits 2**32 - 1 - row). No two are
    equal, so one topk of them is exactly the stable sort's first k, in any order."""
    bits = (scores + 0.0).view(torch.int32)  # (+ 0.0: -0.0 becomes 0.0, which it equals)
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: larger bits are smaller numbers
    return (bits.long() << 32) | (_ROW_BITS - rows)


def index_scores(w: IndexerWeights, q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor) -> torch.Tensor:
    """sum_h w_h * ReLU(q_h . k) / sqrt(d): q [N, Q, H, d], keys [N, n, d], head_weights [N, Q, H] (float32,
    see `index_queries`) -> [N, Q, n]."""
    scores = F.relu(torch.matmul(q.flatten(1, 2), keys.transpose(1, 2))) * w.head_dim**-0.5  # [N, Q*H, n]
    return torch.matmul(head_weights.unsqueeze(2), scores.view(*q.shape[:3], -1)).squeeze(2)


def index_pick(w: IndexerWeights, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """[N, Q, n] bool: the `topk` visible rows with the highest `scores` (-inf where not visible), per query."""
    # ReLU scores tie exactly (often at 0); a stable sort breaks ties by row index, so the choice does not
    # depend on how many rows the step pads to (torch.topk's tie order does).
    picked = scores.sort(dim=-1, descending=True, stable=True).indices[..., : w.topk]
    return torch.zeros_like(visible).scatter_(-1, picked, True) & visible
