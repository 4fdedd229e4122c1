"""The torch statement of the KV compressor (CSA and HCA) and of the Lightning Indexer (see compressor.py for
what they compute). `ops` is the stage's backend, through which the small ops run."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from leanserve.model.weights import CompressorWeights, IndexerWeights

if TYPE_CHECKING:
    from leanserve.model.backends.torch import TorchBackend
    from leanserve.model.batch import AttnGroup, CompressMeta


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


def index_select(
    w: IndexerWeights,
    queries: tuple[torch.Tensor, torch.Tensor],
    group: AttnGroup,
    keys: torch.Tensor,  # [NB, n, d]: the indexer's rows 0..n-1 of each block's sequence
    visible: torch.Tensor,  # [NB, Bq, n] bool: rows each query may see
) -> torch.Tensor:
    """[NB, Bq, n] bool: the `topk` visible rows with the highest index scores, per query."""
    q, head_weights = group.gather(queries[0]), group.gather(queries[1])  # [NB, Bq, H, d], [NB, Bq, H]
    keys = keys.float()
    return index_pick(w, index_scores(w, q, keys, head_weights).masked_fill(~visible, float("-inf")), visible)


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
