"""Per-sequence caches for the three attention kinds, allocated once, indexed by cache slot.

Every entry is addressed by the absolute position it holds, so a slot's state is a function of its
sequence's committed token count: lowering that count (rollback of rejected speculative tokens) needs no
copy, and a freed slot is reused without clearing.

Per layer, per slot:
  window_kv   [R, head_dim]      ring of the last R positions' shared K=V (R = sliding_window + spec tokens)
  comp_kv/gate[B, C]             ring of the compressor's raw projections (B = r + spec, or 2r + spec for CSA,
                                 whose windows overlap the previous one; C = head_dim, or 2*head_dim for CSA)
  comp_rows   [max_len // r, head_dim]   compressed entries, row w = window [w*r, (w+1)*r)
  idx_kv/gate, idx_rows          the same for the CSA Lightning Indexer at index_head_dim
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leanserve.memory import MemoryLedger
from leanserve.model.config import CSA, HCA, SLIDING, ModelConfig


@dataclass(frozen=True)
class CacheGeometry:
    """Sizes shared by every layer of a kind; the step metadata is built against these."""

    num_slots: int
    max_model_len: int
    window: int  # sliding window W
    window_ring: int  # R
    # per compressed kind: (ratio r, raw-projection ring B, max rows)
    compress: dict[str, tuple[int, int, int]]

    @classmethod
    def build(cls, cfg: ModelConfig, num_slots: int, max_model_len: int, num_spec_tokens: int = 0) -> CacheGeometry:
        compress = {}
        for kind in (CSA, HCA):
            r = cfg.compress_rate(kind)
            span = 2 * r if kind == CSA else r
            compress[kind] = (r, span + num_spec_tokens, max_model_len // r)
        return cls(
            num_slots=num_slots,
            max_model_len=max_model_len,
            window=cfg.sliding_window,
            window_ring=cfg.sliding_window + num_spec_tokens,
            compress=compress,
        )


@dataclass
class LayerCache:
    window_kv: torch.Tensor
    comp_kv: torch.Tensor | None = None
    comp_gate: torch.Tensor | None = None
    comp_rows: torch.Tensor | None = None
    idx_kv: torch.Tensor | None = None
    idx_gate: torch.Tensor | None = None
    idx_rows: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in vars(self).items() if v is not None}


def allocate_layer_cache(
    cfg: ModelConfig,
    layer_type: str,
    geo: CacheGeometry,
    dtype: torch.dtype,
    ledger: MemoryLedger,
    owner: str,
    feature: str,
) -> LayerCache:
    """Allocates one layer's caches through the ledger, each entry named `{owner}.{field}`."""

    def empty(name: str, *shape: int) -> torch.Tensor:
        return ledger.zeros(f"{owner}.{name}", owner, feature, (geo.num_slots, *shape), dtype)

    cache = LayerCache(window_kv=empty("window_kv", geo.window_ring, cfg.head_dim))
    if layer_type == SLIDING:
        return cache
    _, ring, rows = geo.compress[layer_type]
    width = 2 * cfg.head_dim if layer_type == CSA else cfg.head_dim
    cache.comp_kv, cache.comp_gate = empty("comp_kv", ring, width), empty("comp_gate", ring, width)
    cache.comp_rows = empty("comp_rows", rows, cfg.head_dim)
    if layer_type == CSA:
        cache.idx_kv = empty("idx_kv", ring, 2 * cfg.index_head_dim)
        cache.idx_gate = empty("idx_gate", ring, 2 * cfg.index_head_dim)
        cache.idx_rows = empty("idx_rows", rows, cfg.index_head_dim)
    return cache
