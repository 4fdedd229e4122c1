"""KV compressor (CSA and HCA) and the Lightning Indexer of compressed sparse attention.

A compressor turns every window of r source tokens into one entry: softmax-gated (per channel, over the
window, with a learned per-slot bias `ape`) sum of the tokens' projections, RMS-normalised, RoPE'd at the
window's first position. CSA windows overlap: each token projects two series, Ca (first half of the
channels, pooled into the *next* window's entry) and Cb (second half, pooled into its own window's entry),
so an entry has width 2r. HCA windows don't overlap.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from leanserve.model.batch import CompressMeta, ForwardBatch
from leanserve.model.layers import RMSNorm, apply_rope, fp32_param


class Compressor(nn.Module):
    def __init__(self, hidden_size: int, dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        width = 2 * dim if overlap else dim
        self.wkv = nn.Linear(hidden_size, width, bias=False)
        self.wgate = nn.Linear(hidden_size, width, bias=False)
        self.ape = fp32_param(ratio, width)
        self.norm = RMSNorm(dim, eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        meta: CompressMeta,
        kv_ring: torch.Tensor,  # [slots, B, width]
        gate_ring: torch.Tensor,  # [slots, B, width]
        rows: torch.Tensor,  # [slots, max_rows, dim]
        row_rope: tuple[torch.Tensor, torch.Tensor],  # cos/sin at each closing window's position
    ) -> None:
        """Writes the entries of the windows that close this step into `rows`, then stores this step's
        projections in the rings."""
        kv, gate = self.wkv(x), self.wgate(x)  # [T, width]
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
            span = meta.src.shape[1]
            gate_src = gate_src + self.ape.repeat(span // self.ratio, 1)
            if self.overlap:
                r, d = self.ratio, self.dim
                kv_src = torch.cat([kv_src[:, :r, :d], kv_src[:, r:, d:]], dim=1)  # [NW, 2r, dim]
                gate_src = torch.cat([gate_src[:, :r, :d], gate_src[:, r:, d:]], dim=1)
            gate_src = gate_src.masked_fill(~meta.src_valid[..., None], float("-inf"))
            kv_src = kv_src.masked_fill(~meta.src_valid[..., None], 0.0)
            weights = gate_src.softmax(dim=1, dtype=torch.float32).to(kv_src.dtype)
            entries = self.norm((kv_src * weights).sum(dim=1))  # [NW, dim]
            entries = apply_rope(entries, *row_rope)
            rows.view(-1, self.dim).index_copy_(0, meta.row_dst, entries.to(rows.dtype))
        if not meta.write_first:
            self._store(kv, gate, kv_flat, gate_flat, meta)

    @staticmethod
    def _store(kv: torch.Tensor, gate: torch.Tensor, kv_flat: torch.Tensor, gate_flat: torch.Tensor, meta) -> None:
        src, dst = meta.write.src, meta.write.dst
        kv_flat.index_copy_(0, dst, kv[src].to(kv_flat.dtype))
        gate_flat.index_copy_(0, dst, gate[src].to(gate_flat.dtype))


class Indexer(nn.Module):
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
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = n_heads, head_dim, topk
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False)
        self.compressor = Compressor(hidden_size, head_dim, ratio, overlap=True, eps=eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        q_residual: torch.Tensor,  # [T, q_lora_rank]
        fb: ForwardBatch,
        meta: CompressMeta,
        cache_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # idx_kv, idx_gate, idx_rows
        rope: tuple[torch.Tensor, torch.Tensor],  # cos/sin at the token positions (compress rope)
        row_rope: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (row indices [T, k], valid [T, k]) of the compressed entries each token attends to."""
        kv_ring, gate_ring, rows = cache_tensors
        self.compressor(x, meta, kv_ring, gate_ring, rows, row_rope)
        n = meta.max_visible
        visible = meta.visible[:, None]
        all_rows = torch.arange(n, device=x.device).expand(x.shape[0], n)
        if n <= self.topk:  # every visible entry is kept: the scores cannot change the selection
            return all_rows, all_rows < visible
        q = self.wq_b(q_residual).view(-1, self.n_heads, self.head_dim)
        q = apply_rope(q, *rope)
        keys = rows[fb.token_slots, :n]  # [T, n, head_dim]
        scores = F.relu(torch.einsum("thd,tnd->thn", q.float(), keys.float())) * self.head_dim**-0.5
        head_weights = self.weights_proj(x).float() * self.n_heads**-0.5  # [T, H]
        scores = (scores * head_weights[..., None]).sum(dim=1)  # [T, n]
        scores = scores.masked_fill(all_rows >= visible, float("-inf"))
        # ReLU scores tie exactly (often at 0); a stable sort breaks ties by row index, so the choice does not
        # depend on how many rows the step pads to (torch.topk's tie order does).
        picked = scores.sort(dim=-1, descending=True, stable=True).indices[:, : self.topk]
        return picked, picked < visible
