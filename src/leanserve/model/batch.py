"""Per-step metadata, built once per step (not per layer) from the scheduled chunks.

Tokens of all sequences are laid out flat: [T]. A sequence contributes a contiguous chunk of `n` tokens
at positions [start, start + n). Gather indices address a "store": a layer's cache ring viewed as
[num_slots * ring, C], followed by the step's new rows [T, C] (an index >= num_slots * ring picks a row
produced this step). When every chunk is short (decode, speculative verification) the step writes its
rows into the rings first and the indices address the rings alone (`write_first`), so no store is built.

Attention runs over query blocks: a block holds up to `block` consecutive queries of one sequence and
gathers the keys its queries can see once (block + window - 1 of them), so a long prefill costs about
twice the keys it reads, not window-times. Short chunks form their own group with one block each.

Compressed rows live in paged pools (model/cache.py): a closing window's row goes to the pool row its slot's
block table gives, and readers take the table with the step (`ForwardBatch.block_table`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from leanserve.model.backends.cpu import kernels as cpu_kernels
from leanserve.model.cache import BlockTable, CacheGeometry
from leanserve.model.config import CSA

PREFILL_BLOCK = 64  # queries per attention block for long chunks


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
class AttnGroup:
    """Blocks of queries [NB, Bq] that share one set of keys each."""

    q_rows: torch.Tensor  # [NB, Bq] flat token row of each query (0 where padded)
    q_valid: torch.Tensor  # [NB, Bq] bool
    q_pos: torch.Tensor  # [NB, Bq] position of each query
    block_slot: torch.Tensor  # [NB] cache slot of the block's sequence
    key_index: torch.Tensor  # [NB, Kw] store rows of the window keys, Kw = Bq + W - 1
    key_mask: torch.Tensor  # [NB, Bq, Kw] bool: key in the query's sliding window
    visible: dict[str, torch.Tensor]  # per compressed kind: [NB, Bq] compressed rows each query may see
    max_visible: dict[str, int]  # per compressed kind: max over the group
    # True when the group is every token, one per block, in order (a pure decode step): q_rows is
    # arange(T)[:, None], so gathering queries and scattering outputs are plain reshapes.
    is_identity: bool = False

    def arrays(self) -> tuple[np.ndarray, ...]:
        """Numpy views for the attention kernels: q_rows, q_valid, key_index, key_mask, block_slot."""
        return (
            self.q_rows.numpy(),
            self.q_valid.numpy(),
            self.key_index.numpy(),
            self.key_mask.numpy(),
            self.block_slot.numpy(),
        )

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token rows [T, ...] -> per-query rows [NB, Bq, ...]."""
        return x.unsqueeze(1) if self.is_identity else x[self.q_rows]


@dataclass
class CompressMeta:
    ratio: int
    # windows that close during this step, one row each
    src: torch.Tensor  # [NW, span] store rows of the window's source tokens (span = r, or 2r for CSA)
    src_valid: torch.Tensor  # [NW, span] bool (CSA window 0 has no previous window)
    row_dst: torch.Tensor  # [NW] row of the pool viewed as [num_blocks * rows per block]
    row_pos: torch.Tensor  # [NW] window start position w * r (its RoPE position)
    write: RingWrite
    write_first: bool

    def arrays(self) -> tuple[np.ndarray, ...]:
        """Numpy views for the compressor kernel: write src, write dst, src, src_valid, row_dst."""
        return (
            self.write.src.numpy(),
            self.write.dst.numpy(),
            self.src.numpy(),
            self.src_valid.numpy(),
            self.row_dst.numpy(),
        )


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    logits_index: torch.Tensor | None  # rows whose logits are wanted; None = all
    groups: list[AttnGroup]
    window_write: RingWrite
    window_write_first: bool
    compress: dict[str, CompressMeta]
    block_table: torch.Tensor  # [num_slots, max_blocks] int32: the stage's block table (model/cache.py)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def build_forward_batch(
    chunks: list[Chunk],
    geo: CacheGeometry,
    logits_index: list[int] | None = None,
    device: str | torch.device = "cpu",
    table: BlockTable | None = None,
) -> ForwardBatch:
    """The step's metadata. `table`: the slots' blocks (None: the identity table of geometry's largest pools)."""
    table = table if table is not None else BlockTable.identity_for(geo)
    # Index math in numpy (a fraction of torch's per-op cost on these small arrays), tensors at the end.
    sizes = [len(c.token_ids) for c in chunks]
    lens = np.array(sizes, dtype=np.int64)
    starts = np.array([c.start for c in chunks], dtype=np.int64)
    slots = np.array([c.slot for c in chunks], dtype=np.int64)
    input_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long)
    # (every row in order, as a decode step wants them: None, so that no one gathers the rows they already have)
    every = logits_index is None or logits_index == list(range(len(input_ids)))
    logits = None if every else torch.tensor(logits_index, dtype=torch.long)
    on_cpu = device == "cpu" or torch.device(device).type == "cpu"
    if _short_kernels is not None and cpu_kernels.available() and _all_short(sizes, geo):
        fb = _short_batch(slots, starts, lens, input_ids, logits, geo, table.array)
        return fb if on_cpu else _to(fb, device)
    offsets = np.cumsum(lens) - lens  # flat index of each chunk's first token
    total = int(lens.sum())
    seq_of_token = np.repeat(np.arange(len(chunks)), lens)
    positions = starts[seq_of_token] + np.arange(total) - offsets[seq_of_token]
    tok = _Layout(slots, starts, lens, offsets, seq_of_token, positions, int(lens.max()))

    ring = geo.window_ring
    window_ring_rows = geo.num_slots * ring
    short = 1 + ring - geo.window  # chunks up to this long form one block each
    groups = []
    for seqs, block in ((lens <= short, None), (lens > short, PREFILL_BLOCK)):
        if bool(seqs.any()):
            groups.append(_group(tok, np.flatnonzero(seqs), block, geo, window_ring_rows))
    fb = ForwardBatch(
        input_ids=input_ids,
        positions=_t(positions),
        logits_index=logits,
        groups=groups,
        window_write=tok.ring_write(ring),
        window_write_first=tok.write_first(ring, geo.window),
        compress={
            kind: _compress(tok, ratio, ring_b, per_block, geo.num_slots, kind == CSA, table.array)
            for kind, (ratio, ring_b, per_block) in geo.compress.items()
        },
        block_table=table.tensor,
    )
    return fb if on_cpu else _to(fb, device)


@dataclass
class _Layout:
    slots: np.ndarray  # [S]
    starts: np.ndarray  # [S]
    lens: np.ndarray  # [S]
    offsets: np.ndarray  # [S]
    seq: np.ndarray  # [T] chunk of each token
    positions: np.ndarray  # [T]
    max_len: int  # longest chunk

    def write_first(self, ring: int, span: int) -> bool:
        # Writing a chunk of n tokens overwrites the ring rows of positions [start + n - ring, start); reads
        # reach back `span - 1` positions before the chunk, so they survive when n <= ring - span + 1.
        return self.max_len <= ring - span + 1

    def store_rows(self, seq: np.ndarray, pos: np.ndarray, ring: int, ring_rows: int, span: int) -> np.ndarray:
        """Store row holding position `pos` of chunk `seq` (either shape): this step's row if the position
        is in the chunk, else the ring row of the slot. With write_first, always the ring row."""
        old = self.slots[seq] * ring + np.maximum(pos, 0) % ring
        if self.write_first(ring, span):
            return old
        start = self.starts[seq]
        new = ring_rows + self.offsets[seq] + np.maximum(pos - start, 0)
        return np.where(pos >= start, new, old)

    def ring_write(self, ring: int) -> RingWrite:
        # Only the last `ring` tokens of a chunk survive in the ring; writing just those keeps indices unique.
        ends = (self.starts + self.lens)[self.seq]
        keep = self.positions >= ends - ring
        src = np.flatnonzero(keep)
        dst = self.slots[self.seq[src]] * ring + self.positions[src] % ring
        return RingWrite(src=_t(src), dst=_t(dst))


def _group(tok: _Layout, seqs: np.ndarray, block: int | None, geo: CacheGeometry, ring_rows: int) -> AttnGroup:
    lens = tok.lens[seqs]
    block = int(lens.max()) if block is None else block
    num_blocks = (lens + block - 1) // block
    block_seq = np.repeat(seqs, num_blocks)  # chunk index of each block
    first_block = np.cumsum(num_blocks) - num_blocks
    block_in_seq = np.arange(int(num_blocks.sum())) - np.repeat(first_block, num_blocks)
    first_pos = tok.starts[block_seq] + block_in_seq * block  # [NB]
    q_pos = first_pos[:, None] + np.arange(block)  # [NB, Bq]
    end = (tok.starts + tok.lens)[block_seq][:, None]
    q_valid = q_pos < end
    q_rows = np.where(q_valid, tok.offsets[block_seq][:, None] + q_pos - tok.starts[block_seq][:, None], 0)

    window = geo.window
    key_pos = first_pos[:, None] - window + 1 + np.arange(block + window - 1)  # [NB, Kw]
    key_index = tok.store_rows(block_seq[:, None], key_pos, geo.window_ring, ring_rows, window)
    rel = q_pos[:, :, None] - key_pos[:, None, :]  # [NB, Bq, Kw]: query pos - key pos
    key_mask = (rel >= 0) & (rel < window) & (key_pos >= 0)[:, None, :] & q_valid[:, :, None]

    visible, max_visible = {}, {}
    for kind, (ratio, _, _) in geo.compress.items():
        rows = np.where(q_valid, (q_pos + 1) // ratio, 0)
        visible[kind], max_visible[kind] = _t(rows), int(rows.max())
    return AttnGroup(
        q_rows=_t(q_rows),
        q_valid=_t(q_valid),
        q_pos=_t(q_pos),
        block_slot=_t(tok.slots[block_seq]),
        key_index=_t(np.where((key_pos >= 0) & (key_pos < end), key_index, 0)),
        key_mask=_t(key_mask),
        visible=visible,
        max_visible=max_visible,
        is_identity=block == 1 and len(seqs) == len(tok.lens) and len(tok.seq) == len(seqs),
    )


def _compress(
    tok: _Layout, ratio: int, ring: int, per_block: int, num_slots: int, overlap: bool, table: np.ndarray
) -> CompressMeta:
    ends = tok.starts + tok.lens
    # Windows closing this step: w in [start // r, end // r).
    first, last = tok.starts // ratio, ends // ratio
    counts = last - first
    win_seq = np.repeat(np.arange(len(counts)), counts)
    win_base = np.cumsum(counts) - counts
    w = first[win_seq] + np.arange(int(counts.sum())) - win_base[win_seq]  # [NW]
    span = 2 * ratio if overlap else ratio
    # CSA: slots [0, r) hold the previous window's tokens, [r, 2r) this window's.
    src_pos = (w - (1 if overlap else 0))[:, None] * ratio + np.arange(span)  # [NW, span]
    src_valid = src_pos >= 0
    src = tok.store_rows(win_seq[:, None], src_pos, ring, num_slots * ring, span)
    return CompressMeta(
        ratio=ratio,
        src=_t(np.where(src_valid, src, 0)),
        src_valid=_t(src_valid),
        row_dst=_t(table[tok.slots[win_seq], w // per_block].astype(np.int64) * per_block + w % per_block),
        row_pos=_t(w * ratio),
        write=tok.ring_write(ring),
        write_first=tok.write_first(ring, span),
    )


# --- Steps of short chunks (decode, speculative verification, the MTP layer's steps) ------------------------
# When every chunk writes its rows into the rings first (write_first for the window and every compressed
# kind), the metadata above reduces to a few loops per chunk: compiled, they cost a fraction of the ~70 numpy
# calls of the general path, which stays the reference (tests/test_batch.py compares the two).
def _all_short(sizes: list[int], geo: CacheGeometry) -> bool:
    # (plain Python: on a few chunks, numpy's reductions cost more than the loop)
    most = max(sizes)
    if min(sizes) < 1 or most > geo.window_ring - geo.window + 1:
        return False
    return all(most <= ring - (2 * r if kind == CSA else r) + 1 for kind, (r, ring, _) in geo.compress.items())


def _short_group(slots, starts, lens, window, ring, ratios):  # pragma: no cover - compiled
    # The one attention group (a block per chunk), the compressed rows each query sees, the window ring write.
    num, total, block = slots.shape[0], lens.sum(), lens.max()
    span = block + window - 1
    positions = np.empty(total, dtype=np.int64)
    q_rows = np.zeros((num, block), dtype=np.int64)
    q_valid = np.zeros((num, block), dtype=np.bool_)
    q_pos = np.empty((num, block), dtype=np.int64)
    key_index = np.zeros((num, span), dtype=np.int64)
    key_mask = np.zeros((num, block, span), dtype=np.bool_)
    visible = np.zeros((ratios.shape[0], num, block), dtype=np.int64)
    ring_dst = np.empty(total, dtype=np.int64)
    offset = 0
    for s in range(num):
        start, n, slot = starts[s], lens[s], slots[s]
        for j in range(block):
            q_pos[s, j] = start + j
            if j < n:
                q_valid[s, j] = True
                q_rows[s, j] = offset + j
                positions[offset + j] = start + j
                ring_dst[offset + j] = slot * ring + (start + j) % ring
                for k in range(ratios.shape[0]):
                    visible[k, s, j] = (start + j + 1) // ratios[k]
        for i in range(span):
            key = start - window + 1 + i
            if key < 0:
                continue
            if key < start + n:
                key_index[s, i] = slot * ring + key % ring
            for j in range(n):
                key_mask[s, j, i] = 0 <= start + j - key < window
        offset += n
    return positions, q_rows, q_valid, q_pos, key_index, key_mask, visible, ring_dst


def _short_compress(slots, starts, lens, ratio, ring, per_block, overlap, table):  # pragma: no cover - compiled
    # One compressed kind: the windows that close this step, and the ring write.
    num = slots.shape[0]
    closing = 0
    for s in range(num):
        closing += (starts[s] + lens[s]) // ratio - starts[s] // ratio
    span = 2 * ratio if overlap else ratio
    src = np.zeros((closing, span), dtype=np.int64)
    src_valid = np.zeros((closing, span), dtype=np.bool_)
    row_dst = np.empty(closing, dtype=np.int64)
    row_pos = np.empty(closing, dtype=np.int64)
    ring_dst = np.empty(lens.sum(), dtype=np.int64)
    i, offset = 0, 0
    for s in range(num):
        start, n, slot = starts[s], lens[s], slots[s]
        for w in range(start // ratio, (start + n) // ratio):
            first = (w - 1 if overlap else w) * ratio
            for c in range(span):
                if first + c >= 0:
                    src_valid[i, c] = True
                    src[i, c] = slot * ring + (first + c) % ring
            row_dst[i] = np.int64(table[slot, w // per_block]) * per_block + w % per_block
            row_pos[i] = w * ratio
            i += 1
        for j in range(n):
            ring_dst[offset + j] = slot * ring + (start + j) % ring
        offset += n
    return src, src_valid, row_dst, row_pos, ring_dst


_short_kernels = None
if cpu_kernels.numba is not None:
    _short_kernels = cpu_kernels._jit(_short_group), cpu_kernels._jit(_short_compress)


def _short_batch(slots, starts, lens, input_ids, logits_index, geo: CacheGeometry, table: np.ndarray) -> ForwardBatch:
    group_fn, compress_fn = _short_kernels
    kinds = list(geo.compress)
    ratios = np.array([geo.compress[k][0] for k in kinds], dtype=np.int64)
    positions, q_rows, q_valid, q_pos, key_index, key_mask, visible, ring_dst = group_fn(
        slots, starts, lens, geo.window, geo.window_ring, ratios
    )
    # (the kernels' outputs are new C-contiguous arrays: wrapped as they are)
    t = torch.from_numpy
    every = torch.arange(positions.shape[0])  # every token's row is written (chunks are shorter than rings)
    group = AttnGroup(
        q_rows=t(q_rows),
        q_valid=t(q_valid),
        q_pos=t(q_pos),
        block_slot=t(slots),
        key_index=t(key_index),
        key_mask=t(key_mask),
        visible={k: t(visible[i]) for i, k in enumerate(kinds)},
        max_visible={k: int(visible[i].max()) for i, k in enumerate(kinds)},
        is_identity=q_rows.shape[1] == 1,
    )
    compress = {}
    for kind in kinds:
        ratio, ring, per_block = geo.compress[kind]
        src, src_valid, row_dst, row_pos, dst = compress_fn(
            slots, starts, lens, ratio, ring, per_block, kind == CSA, table
        )
        compress[kind] = CompressMeta(
            ratio, t(src), t(src_valid), t(row_dst), t(row_pos), RingWrite(every, t(dst)), write_first=True
        )
    return ForwardBatch(
        input_ids=input_ids,
        positions=t(positions),
        logits_index=logits_index,
        groups=[group],
        window_write=RingWrite(every, t(ring_dst)),
        window_write_first=True,
        compress=compress,
        block_table=t(table),
    )


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def _to(obj, device: str):
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, list):
        return [_to(v, device) for v in obj]
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if hasattr(obj, "__dataclass_fields__"):
        return type(obj)(**{k: _to(v, device) for k, v in vars(obj).items()})
    return obj
