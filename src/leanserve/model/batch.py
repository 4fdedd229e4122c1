"""Per-step metadata, built once per step (not per layer) from the scheduled chunks.

Tokens of all sequences are laid out flat: [T]. A sequence contributes a contiguous chunk of
`num_tokens` tokens at positions [start, start + num_tokens). Every gather index below addresses a
"store": the cache ring of a layer viewed as [num_slots * ring, C], followed by the step's new rows [T, C].
An index >= num_slots * ring therefore picks a row produced this step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leanserve.config import CSA
from leanserve.model.cache import CacheGeometry


@dataclass(frozen=True)
class Chunk:
    slot: int
    start: int  # position of the chunk's first token (== tokens already committed in the cache)
    token_ids: tuple[int, ...] | list[int]


@dataclass
class RingWrite:
    src: torch.Tensor  # [n] flat token rows to store
    dst: torch.Tensor  # [n] rows of the ring viewed as [num_slots * ring]


@dataclass
class WindowMeta:
    index: torch.Tensor  # [T, W] store rows of the keys in each token's sliding window
    valid: torch.Tensor  # [T, W] bool
    write: RingWrite
    # True when every chunk is short enough that writing it into the ring first overwrites nothing it still
    # reads (decode, speculative verification): then `index` addresses the ring alone, and no store is built.
    write_first: bool


@dataclass
class CompressMeta:
    ratio: int
    # windows that close during this step, one row each
    src: torch.Tensor  # [NW, span] store rows of the window's source tokens (span = r, or 2r for CSA)
    src_valid: torch.Tensor  # [NW, span] bool (CSA window 0 has no previous window)
    row_dst: torch.Tensor  # [NW] row in comp_rows viewed as [num_slots * max_rows]
    row_pos: torch.Tensor  # [NW] window start position w * r (its RoPE position)
    # per token: compressed rows it may see are [0, visible)
    visible: torch.Tensor  # [T]
    max_visible: int
    write: RingWrite
    write_first: bool  # as in WindowMeta


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    token_slots: torch.Tensor  # [T]
    logits_index: torch.Tensor | None  # rows whose logits are wanted; None = all
    window: WindowMeta
    compress: dict[str, CompressMeta]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def build_forward_batch(
    chunks: list[Chunk], geo: CacheGeometry, logits_index: list[int] | None = None, device: str = "cpu"
) -> ForwardBatch:
    lens = torch.tensor([len(c.token_ids) for c in chunks], dtype=torch.long)
    starts = torch.tensor([c.start for c in chunks], dtype=torch.long)
    slots = torch.tensor([c.slot for c in chunks], dtype=torch.long)
    offsets = torch.cumsum(lens, 0) - lens  # flat index of each chunk's first token
    total = int(lens.sum())
    input_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long)
    seq_of_token = torch.repeat_interleave(torch.arange(len(chunks)), lens)
    positions = starts[seq_of_token] + torch.arange(total) - offsets[seq_of_token]
    tok = _TokenGeometry(slots, starts, lens, offsets, seq_of_token, positions, total, int(lens.max()))

    window = _window(tok, geo.window, geo.num_slots * geo.window_ring, geo.window_ring)
    compress = {
        kind: _compress(tok, ratio, ring, rows, geo.num_slots, kind == CSA)
        for kind, (ratio, ring, rows) in geo.compress.items()
    }
    fb = ForwardBatch(
        input_ids=input_ids,
        positions=positions,
        token_slots=slots[seq_of_token],
        logits_index=None if logits_index is None else torch.tensor(logits_index, dtype=torch.long),
        window=window,
        compress=compress,
    )
    return fb if device == "cpu" else _to(fb, device)


@dataclass
class _TokenGeometry:
    slots: torch.Tensor  # [S]
    starts: torch.Tensor  # [S]
    lens: torch.Tensor  # [S]
    offsets: torch.Tensor  # [S]
    seq: torch.Tensor  # [T] chunk of each token
    positions: torch.Tensor  # [T]
    total: int
    max_len: int  # longest chunk

    def write_first(self, ring: int, span: int) -> bool:
        # Writing a chunk of n tokens overwrites the ring rows of positions [start + n - ring, start); the
        # reads reach back `span - 1` positions before the chunk, so they survive when n <= ring - span + 1.
        return self.max_len <= ring - span + 1

    def store_rows(self, seq: torch.Tensor, pos: torch.Tensor, ring: int, ring_rows: int, span: int) -> torch.Tensor:
        """Store row holding position `pos` of chunk `seq` (either shape): this step's row if the position
        is in the chunk, else the ring row of the slot. With write_first, always the ring row."""
        old = self.slots[seq] * ring + pos.clamp(min=0) % ring
        if self.write_first(ring, span):
            return old
        start = self.starts[seq]
        new = ring_rows + self.offsets[seq] + (pos - start)
        return torch.where(pos >= start, new, old)

    def ring_write(self, ring: int) -> RingWrite:
        # Only the last `ring` tokens of a chunk survive in the ring; writing just those keeps indices unique.
        ends = (self.starts + self.lens)[self.seq]
        keep = self.positions >= ends - ring
        src = torch.nonzero(keep).flatten()
        dst = self.slots[self.seq[src]] * ring + self.positions[src] % ring
        return RingWrite(src=src, dst=dst)


def _window(tok: _TokenGeometry, window: int, ring_rows: int, ring: int):
    # Keys of token t: positions (t - W, t], i.e. W of them, the last being t itself.
    key_pos = tok.positions[:, None] - window + 1 + torch.arange(window)  # [T, W]
    valid = key_pos >= 0
    index = tok.store_rows(tok.seq[:, None].expand_as(key_pos), key_pos, ring, ring_rows, window)
    return WindowMeta(torch.where(valid, index, 0), valid, tok.ring_write(ring), tok.write_first(ring, window))


def _compress(tok: _TokenGeometry, ratio: int, ring: int, max_rows: int, num_slots: int, overlap: bool):
    ends = tok.starts + tok.lens
    # Windows closing this step: w in [start // r, end // r).
    first, last = tok.starts // ratio, ends // ratio
    counts = last - first
    win_seq = torch.repeat_interleave(torch.arange(len(counts)), counts)
    win_base = torch.cumsum(counts, 0) - counts
    w = first[win_seq] + torch.arange(int(counts.sum())) - win_base[win_seq]  # [NW]
    span = 2 * ratio if overlap else ratio
    # CSA: slots [0, r) hold the previous window's tokens, [r, 2r) this window's.
    src_pos = (w - (1 if overlap else 0))[:, None] * ratio + torch.arange(span)  # [NW, span]
    src_valid = src_pos >= 0
    src = tok.store_rows(win_seq[:, None].expand_as(src_pos), src_pos, ring, num_slots * ring, span)
    visible = (tok.positions + 1) // ratio
    return CompressMeta(
        ratio=ratio,
        src=torch.where(src_valid, src, 0),
        src_valid=src_valid,
        row_dst=tok.slots[win_seq] * max_rows + w,
        row_pos=w * ratio,
        visible=visible,
        max_visible=int(visible.max()) if tok.total else 0,
        write=tok.ring_write(ring),
        write_first=tok.write_first(ring, span),
    )


def _to(fb: ForwardBatch, device: str) -> ForwardBatch:
    def move(obj):
        if isinstance(obj, torch.Tensor):
            return obj.to(device, non_blocking=True)
        if hasattr(obj, "__dataclass_fields__"):
            return type(obj)(**{k: move(v) for k, v in vars(obj).items()})
        if isinstance(obj, dict):
            return {k: move(v) for k, v in obj.items()}
        return obj

    return move(fb)
