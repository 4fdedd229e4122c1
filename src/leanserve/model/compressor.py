"""KV compressor (CSA and HCA) and the Lightning Indexer of compressed sparse attention.

A compressor turns every window of r source tokens into one entry: softmax-gated (per channel, over the
window, with a learned per-slot bias `ape`) sum of the tokens' projections, RMS-normalised, RoPE'd at the
window's first position. CSA windows overlap: each token projects two series, Ca (first half of the
channels, pooled into the *next* window's entry) and Cb (second half, pooled into its own window's entry),
so an entry has width 2r. HCA windows don't overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from leanserve.model.backend import UsesBackend
from leanserve.model.batch import AttnGroup, CompressMeta
from leanserve.model.layers import Linear, RMSNorm, fp32_param


@dataclass(frozen=True)
class CompressorWeights:
    """What a backend that runs a compressor step whole needs besides its projections (wkv, wgate: the attention
    computes those with its other input projections)."""

    ape: torch.Tensor  # [ratio, width] float32: per-slot gate bias
    norm_weight: torch.Tensor  # [dim]
    eps: float
    overlap: bool  # CSA (overlapping windows, width 2 * dim) or HCA


class Compressor(UsesBackend, nn.Module):
    def __init__(self, hidden_size: int, dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        width = 2 * dim if overlap else dim
        self.wkv = Linear(hidden_size, width, bias=False)
        self.wgate = Linear(hidden_size, width, bias=False)
        self.ape = fp32_param(ratio, width)
        self.norm = RMSNorm(dim, eps)

    def forward(
        self,
        kv: torch.Tensor,  # [T, width]: wkv(x)
        gate: torch.Tensor,  # [T, width]: wgate(x)
        meta: CompressMeta,
        kv_ring: torch.Tensor,  # [slots, B, width]
        gate_ring: torch.Tensor,  # [slots, B, width]
        rows: torch.Tensor,  # [slots, max_rows, dim]
        row_rope: torch.Tensor,  # RoPE factors at each closing window's position
    ) -> None:
        """Writes the entries of the windows that close this step into `rows`, then stores this step's
        projections in the rings. (The attention computes the projections with its other ones.)"""
        self.ops.compress(self, kv, gate, meta, kv_ring, gate_ring, rows, row_rope)

    def step_torch(self, kv, gate, meta: CompressMeta, kv_ring, gate_ring, rows, row_rope) -> None:
        width = kv.shape[-1]
        kv_flat, gate_flat = kv_ring.view(-1, width), gate_ring.view(-1, width)
        if meta.write_first:
            self._store(kv, gate, kv_flat, gate_flat, meta)
        if meta.src.shape[0]:
            if meta.write_first:
                kv_src, gate_src = kv_flat[meta.src], gate_flat[meta.src]  # [NW, span, width]
            else:
                kv_src = torch.cat([kv_flat, kv.to(kv_flat.dtype)])[meta.src]
                gate_src = torch.cat([gate_flat, gate.to(gate_flat.dtype)])[meta.src]
            entries = self.entries(kv_src, gate_src, meta.src_valid, row_rope)
            rows.view(-1, self.dim).index_copy_(0, meta.row_dst, entries.to(rows.dtype))
        if not meta.write_first:
            self._store(kv, gate, kv_flat, gate_flat, meta)

    def entries(
        self,
        kv_src: torch.Tensor,  # [NW, span, width]: wkv of each window's source tokens, in order
        gate_src: torch.Tensor,  # [NW, span, width]: their wgate
        valid: torch.Tensor | None,  # [NW, span] bool: which source tokens exist (None: all)
        row_rope: torch.Tensor,  # [NW, rope/2]: RoPE factors at each window's position
    ) -> torch.Tensor:
        """The entries [NW, dim] of NW windows (see `pool`). A CSA window's span is 2r: the previous window's r
        tokens, whose Ca (the first half of the channels) pools here, then its own r, whose Cb (the second half)
        does; an HCA window's span is r."""
        if self.overlap:
            r, d = self.ratio, self.dim
            kv_src = torch.cat([kv_src[:, :r, :d], kv_src[:, r:, d:]], dim=1)  # [NW, 2r, dim]
            gate_src = torch.cat([gate_src[:, :r, :d], gate_src[:, r:, d:]], dim=1)
        if valid is not None:
            gate_src = gate_src.masked_fill(~valid[..., None], float("-inf"))
            kv_src = kv_src.masked_fill(~valid[..., None], 0.0)
        return self.pool(kv_src, gate_src, row_rope)

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, row_rope: torch.Tensor) -> torch.Tensor:
        """Windows' entries [NW, dim] from their tokens' kv and gate [NW, span, dim] (CSA: Ca of the previous
        window's r tokens, then Cb of its own r; -inf gates for tokens that do not exist): per channel, the
        softmax over the window of gate + ape weights the sum of kv; then the norm and RoPE (`row_rope`
        [NW, rope/2], at each window's position)."""
        r, d = self.ratio, self.dim
        ape = torch.cat([self.ape[:, :d], self.ape[:, d:]]) if self.overlap else self.ape.repeat(kv.shape[1] // r, 1)
        weights = (gate + ape).softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        return self.ops.apply_rope(self.norm((kv * weights).sum(dim=1)), row_rope)

    def weights(self) -> CompressorWeights:
        return CompressorWeights(self.ape, self.norm.weight, self.norm.eps, self.overlap)

    @staticmethod
    def _store(kv: torch.Tensor, gate: torch.Tensor, kv_flat: torch.Tensor, gate_flat: torch.Tensor, meta) -> None:
        src, dst = meta.write.src, meta.write.dst
        kv_flat.index_copy_(0, dst, kv[src].to(kv_flat.dtype))
        gate_flat.index_copy_(0, dst, gate[src].to(gate_flat.dtype))


class Indexer(UsesBackend, nn.Module):
    """Scores compressed entries per query, sum_h w_h * ReLU(q_h . k), and keeps the top `index_topk`."""

    def __init__(
        self,
        hidden_size: int,
        q_lora_rank: int,
        n_heads: int,
        head_dim: int,
        topk: int,
        ratio: int,
        eps: float,
        quant: str | None = None,
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = n_heads, head_dim, topk
        self.wq_b = Linear(q_lora_rank, n_heads * head_dim, quant=quant)
        self.weights_proj = Linear(hidden_size, n_heads, bias=False)
        self.compressor = Compressor(hidden_size, head_dim, ratio, overlap=True, eps=eps)

    def queries(
        self, q_residual: torch.Tensor, head_weights: torch.Tensor, rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token: RoPE'd indexer queries [T, H, d] and head weights [T, H] (float32), from the attention's
        q_residual and weights_proj(x)."""
        q = self.ops.apply_rope(self.wq_b(q_residual).view(-1, self.n_heads, self.head_dim), rope)
        return q.float(), head_weights.float() * self.n_heads**-0.5

    def select(
        self,
        queries: tuple[torch.Tensor, torch.Tensor],
        group: AttnGroup,
        rows: torch.Tensor,  # idx_rows [slots, max_rows, d]
        visible: torch.Tensor,  # [NB, Bq, n] bool: rows each query may see
    ) -> torch.Tensor:
        """[NB, Bq, n] bool: the `topk` visible rows with the highest index scores, per query."""
        q, head_weights = group.gather(queries[0]), group.gather(queries[1])  # [NB, Bq, H, d], [NB, Bq, H]
        keys = rows[group.block_slot, : visible.shape[-1]].float()  # [NB, n, d]
        return self.pick(self.scores(q, keys, head_weights).masked_fill(~visible, float("-inf")), visible)

    def scores(self, q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor) -> torch.Tensor:
        """sum_h w_h * ReLU(q_h . k) / sqrt(d): q [N, Q, H, d], keys [N, n, d], head_weights [N, Q, H] (float32,
        see `queries`) -> [N, Q, n]."""
        scores = F.relu(torch.matmul(q.flatten(1, 2), keys.transpose(1, 2))) * self.head_dim**-0.5  # [N, Q*H, n]
        return torch.matmul(head_weights.unsqueeze(2), scores.view(*q.shape[:3], -1)).squeeze(2)

    def pick(self, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """[N, Q, n] bool: the `topk` visible rows with the highest `scores` (-inf where not visible), per query."""
        # ReLU scores tie exactly (often at 0); a stable sort breaks ties by row index, so the choice does not
        # depend on how many rows the step pads to (torch.topk's tie order does).
        picked = scores.sort(dim=-1, descending=True, stable=True).indices[..., : self.topk]
        return torch.zeros_like(visible).scatter_(-1, picked, True) & visible
