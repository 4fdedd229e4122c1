"""KV compressor (CSA and HCA) and the Lightning Indexer of compressed sparse attention: their parameters.

A compressor turns every window of r source tokens into one entry: softmax-gated (per channel, over the
window, with a learned per-slot bias `ape`) sum of the tokens' projections, RMS-normalised, RoPE'd at the
window's first position. CSA windows overlap: each token projects two series, Ca (first half of the
channels, pooled into the *next* window's entry) and Cb (second half, pooled into its own window's entry),
so an entry has width 2r. HCA windows don't overlap. The indexer scores compressed entries per query,
sum_h w_h * ReLU(q_h . k), and keeps the top `index_topk`.

The math is torch_math/compressor.py; the attention runs it (its projections wkv and wgate are computed with
the attention's other projections of the same input, see Attention.input_weights).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from leanserve.model.layers import Linear, RMSNorm, UsesBackend, fp32_param
from leanserve.model.weights import CompressorWeights, IndexerWeights

if TYPE_CHECKING:
    import torch

    from leanserve.model.batch import CompressMeta


class Compressor(UsesBackend, nn.Module):
    def __init__(self, hidden_size: int, dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        width = 2 * dim if overlap else dim
        self.wkv = Linear(hidden_size, width, bias=False)
        self.wgate = Linear(hidden_size, width, bias=False)
        self.ape = fp32_param(ratio, width)
        self.norm = RMSNorm(dim, eps)

    def weights(self) -> CompressorWeights:
        return CompressorWeights(self.ape, self.norm.weight, self.norm.eps, self.overlap)

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
        projections in the rings."""
        self.ops.compress(self.weights(), kv, gate, meta, kv_ring, gate_ring, rows, row_rope)


class Indexer(nn.Module):
    """The Lightning Indexer's parameters: its query projection (from the attention's q_residual), its head
    weights' projection and its own compressor."""

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

    def weights(self) -> IndexerWeights:
        return IndexerWeights(self.wq_b.w(), self.n_heads, self.head_dim, self.topk, self.compressor.weights())
