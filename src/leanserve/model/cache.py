"""The caches of the three attention kinds, allocated once.

What a sequence holds per layer is of two sorts:
  - bounded by the window, per cache slot (one slot per running sequence, `max_num_seqs` of them):
      window_kv    [slots, R, head_dim]   ring of the last R positions' shared K=V (R = sliding_window + spec)
      comp_kv/gate [slots, B, C]          ring of the compressor's raw projections (B = r + spec, or 2r + spec
                                          for CSA, whose windows overlap the previous one; C = head_dim, or
                                          2*head_dim for CSA)
      idx_kv/gate                         the same for the CSA Lightning Indexer at index_head_dim
  - growing with the sequence, in pools of fixed-size blocks shared by every slot (paged):
      comp_rows    [blocks, T // r, head_dim]   compressed entries, row w = window [w*r, (w+1)*r)
      idx_rows     [blocks, T // r, index_head_dim]
    A block holds the rows of T consecutive tokens (T = `block_tokens`, a multiple of every compression rate),
    and a sequence's block table row maps its j-th block (tokens [j*T, (j+1)*T)) to a block of the pool; one
    table serves every layer and kind of a stage, so compressed row w of a slot lives at
    pool[table[slot, w // (T // r)], w % (T // r)].

Every entry is addressed by the absolute position it holds, so a slot's state is a function of its
sequence's committed token count: lowering that count (rollback of rejected speculative tokens) needs no
copy, and a freed slot or block is reused without clearing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from leanserve.memory import PREFIX_CACHE, MemoryLedger
from leanserve.model.config import CSA, HCA, SLIDING, ModelConfig

# Tokens per block, rounded up to a multiple of the model's compression rates: DeepSeek-V4's smallest (one row of
# its HCA layers, rate 128); smaller blocks waste less of a sequence's last block and cost no measurable speed
# (docs/paged-cache.md, `leanserve bench kv --block-sizes`).
BLOCK_TOKENS = 128


@dataclass(frozen=True)
class CacheGeometry:
    """Sizes shared by every layer of a kind; the step metadata is built against these."""

    num_slots: int
    max_model_len: int
    window: int  # sliding window W
    window_ring: int  # R
    # per compressed kind: (ratio r, raw-projection ring B, rows per block T // r)
    compress: dict[str, tuple[int, int, int]]
    block_tokens: int = BLOCK_TOKENS  # T
    num_blocks: int = 0  # blocks in each pool
    num_states: int = 0  # saved window states (the prefix cache's; 0 when it is off)

    @property
    def max_blocks(self) -> int:
        """Blocks one sequence of max_model_len tokens holds (the block table's width)."""
        return blocks_for(self.max_model_len, self.block_tokens)

    @classmethod
    def build(
        cls,
        cfg: ModelConfig,
        num_slots: int,
        max_model_len: int,
        num_spec_tokens: int = 0,
        num_blocks: int | None = None,
        block_tokens: int | None = None,
        num_states: int = 0,
    ) -> CacheGeometry:
        """num_blocks None: every slot can hold max_model_len tokens at once (the pools' largest useful size);
        block_tokens None: the model's default (default_block_tokens)."""
        block_tokens = default_block_tokens(cfg) if block_tokens is None else block_tokens
        check_block_tokens(cfg, block_tokens)
        compress = {}
        for kind in (CSA, HCA):
            r = cfg.compress_rate(kind)
            span = 2 * r if kind == CSA else r
            compress[kind] = (r, span + num_spec_tokens, block_tokens // r)
        most = num_slots * blocks_for(max_model_len, block_tokens)
        return cls(
            num_slots=num_slots,
            max_model_len=max_model_len,
            window=cfg.sliding_window,
            window_ring=cfg.sliding_window + num_spec_tokens,
            compress=compress,
            block_tokens=block_tokens,
            num_blocks=most if num_blocks is None else num_blocks,
            num_states=num_states,
        )


def blocks_for(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens)


def default_block_tokens(cfg: ModelConfig) -> int:
    """BLOCK_TOKENS rounded up to a multiple of the model's compression rates."""
    step = math.lcm(cfg.compress_rate_csa, cfg.compress_rate_hca)
    return -(-BLOCK_TOKENS // step) * step


def check_block_tokens(cfg: ModelConfig, block_tokens: int) -> None:
    rates = sorted({cfg.compress_rate_csa, cfg.compress_rate_hca})
    if block_tokens < 1 or any(block_tokens % r for r in rates):
        raise ValueError(
            f"kv_block_size must be a positive multiple of the compression rates {rates}, got {block_tokens}."
        )


class BlockTable:
    """Each slot's blocks, [num_slots, max_blocks] int32 (a numpy array and a tensor on it): entry (s, j) is the
    pool block holding tokens [j*T, (j+1)*T) of the sequence in slot s. Entries past what a sequence holds are
    stale and never read. `identity` maps slot s's j-th block to block s * max_blocks + j: the layout of pools
    with a block for every position of every slot, which needs no bookkeeping (a draft model's caches)."""

    def __init__(self, num_slots: int, max_blocks: int, identity: bool = False) -> None:
        if identity:
            self.array = np.arange(num_slots * max_blocks, dtype=np.int32).reshape(num_slots, max_blocks)
        else:
            self.array = np.zeros((num_slots, max_blocks), dtype=np.int32)
        self.tensor = torch.from_numpy(self.array)

    @classmethod
    def identity_for(cls, geo: CacheGeometry) -> BlockTable:
        return cls(geo.num_slots, geo.max_blocks, identity=True)

    def assign(self, slot: int, first: int, blocks) -> None:
        """Slot `slot`'s blocks first, first + 1, ... are now `blocks`."""
        self.array[slot, first : first + len(blocks)] = blocks


def paged_rows(pool: torch.Tensor, table: torch.Tensor, slots: torch.Tensor, n: int) -> torch.Tensor:
    """Rows [0, n) of each of `slots`' sequences [NB, n, dim] from a pool [blocks, rows per block, dim]."""
    per_block = pool.shape[1]
    row = torch.arange(n, device=pool.device)
    blocks = table[slots][:, row // per_block].long()  # [NB, n]
    return pool.view(-1, pool.shape[-1])[blocks * per_block + row % per_block]


PER_SLOT = ("window_kv", "comp_kv", "comp_gate", "idx_kv", "idx_gate")  # a slot's window state
POOLED = ("comp_rows", "idx_rows")


@dataclass
class LayerCache:
    window_kv: torch.Tensor
    comp_kv: torch.Tensor | None = None
    comp_gate: torch.Tensor | None = None
    comp_rows: torch.Tensor | None = None
    idx_kv: torch.Tensor | None = None
    idx_gate: torch.Tensor | None = None
    idx_rows: torch.Tensor | None = None
    # Saved window states [num_states, ...] of each per-slot tensor, by its name (the prefix cache's; None when off)
    states: dict[str, torch.Tensor] | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}

    def save_state(self, slot: int, state: int) -> None:
        """Copies slot `slot`'s window state (its rings) into saved state `state`."""
        for name, saved in self.states.items():
            saved[state].copy_(getattr(self, name)[slot])

    def restore_state(self, state: int, slot: int) -> None:
        """Copies saved state `state` into slot `slot`'s rings."""
        for name, saved in self.states.items():
            getattr(self, name)[slot].copy_(saved[state])

    def copy_block(self, src: int, dst: int) -> None:
        """Copies pool block `src`'s rows into block `dst`."""
        for name in POOLED:
            pool = getattr(self, name)
            if pool is not None:
                pool[dst].copy_(pool[src])


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

    def empty(name: str, *shape: int, count: int = geo.num_slots) -> torch.Tensor:
        return ledger.zeros(f"{owner}.{name}", owner, feature, (count, *shape), dtype)

    cache = LayerCache(window_kv=empty("window_kv", geo.window_ring, cfg.head_dim))
    if layer_type != SLIDING:
        _, ring, per_block = geo.compress[layer_type]
        width = 2 * cfg.head_dim if layer_type == CSA else cfg.head_dim
        cache.comp_kv, cache.comp_gate = empty("comp_kv", ring, width), empty("comp_gate", ring, width)
        cache.comp_rows = empty("comp_rows", per_block, cfg.head_dim, count=geo.num_blocks)
        if layer_type == CSA:
            cache.idx_kv = empty("idx_kv", ring, 2 * cfg.index_head_dim)
            cache.idx_gate = empty("idx_gate", ring, 2 * cfg.index_head_dim)
            cache.idx_rows = empty("idx_rows", per_block, cfg.index_head_dim, count=geo.num_blocks)
    if geo.num_states:
        cache.states = {
            name: ledger.zeros(f"{owner}.{name}_states", owner, PREFIX_CACHE, (geo.num_states, *t.shape[1:]), dtype)
            for name in PER_SLOT
            if (t := getattr(cache, name)) is not None
        }
    return cache
