"""The torch statement of a stage's blocks and of the MTP layer: the wiring of the model from the embedding to
the streams before the head. `ops` is the stage's backend; every piece (mHC, attention, MoE) runs through it.

The same wiring is stated twice more, name for name, and changes together with this one: the CPU backend's
decode step (backends/cpu/decode.py: `blocks`, `block`, `attention`, `moe`, `mtp`, `mtp_input`) and training's
forward over whole sequences (train/forward.py: `blocks`, `block`, `attention`, `moe`, `mtp`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from leanserve.model.weights import BlockWeights, MTPWeights, RopeTables, StageWeights

if TYPE_CHECKING:
    from leanserve.model.backends.torch import TorchBackend
    from leanserve.model.batch import ForwardBatch
    from leanserve.model.cache import LayerCache


def table_rows(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A RoPE table's complex factors at `positions`: [..., rope_dim / 2]."""
    return table[positions]


def ropes(tables: RopeTables, fb: ForwardBatch, get: Callable = table_rows) -> dict:
    """The step's RoPE factors per kind: the main and compress tables at the tokens' positions, and the
    compress table at each compressed kind's new rows; `get(table, positions)` reads a table (the CPU backend
    reads numpy views of them)."""
    out = {"main": get(tables.main, fb.positions)}
    if tables.compress is not None and fb.compress:  # (the MTP layer's batches have no compression)
        out["compress"] = get(tables.compress, fb.positions)
        for kind, meta in fb.compress.items():
            out[kind] = get(tables.compress, meta.row_pos)
    return out


def embed(table: torch.Tensor, ids: torch.Tensor, act_dtype: torch.dtype) -> torch.Tensor:
    """The embedding rows of `ids` in the activations' dtype (where activations start)."""
    return F.embedding(ids, table).to(act_dtype)


def blocks(
    ops: TorchBackend, w: StageWeights, fb: ForwardBatch, caches: Sequence[LayerCache], streams: torch.Tensor | None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The stage's blocks over a step, from the embedding (first stage, `streams` None) or from the previous
    stage's streams [T, hc, hidden]: the output streams, at `rows` only (None: all), whose last block alone runs
    its MoE (see block)."""
    if streams is None:
        x = embed(w.embed, fb.input_ids, w.act_dtype)
        streams = x.unsqueeze(1).expand(-1, w.hc_mult, -1).contiguous()
    step_ropes = ropes(w.rope, fb)
    last = len(w.blocks) - 1
    for i, (bw, cache) in enumerate(zip(w.blocks, caches, strict=True)):
        streams = ops.block(bw, streams, fb, cache, step_ropes, rows if i == last else None)
    return streams


def block(
    ops: TorchBackend, w: BlockWeights, streams: torch.Tensor, fb: ForwardBatch, cache: LayerCache, step_ropes: dict,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """One block: mHC around the attention, then mHC around the MoE. streams [T, hc, hidden]. `rows` (None: all
    T): the rows whose output is wanted, [len(rows), hc, hidden]; the others go through the attention only as far
    as their keys, which go into the cache (the MTP layer's catch-up, whose last position alone drafts; a prompt's
    rows before its last in the last block)."""
    x, post, comb = ops.hc_pre(streams, w.attn_mix)
    out, ids = ops.attention(w.attn, x, fb, cache, step_ropes, rows), fb.input_ids
    if rows is not None:
        streams, post, comb, ids = streams[rows], post[rows], comb[rows], ids[rows]
    streams = ops.hc_post(out, streams, post, comb)
    x, post, comb = ops.hc_pre(streams, w.ffn_mix)
    return ops.hc_post(ops.moe(w.moe, x, ids), streams, post, comb)


def mtp(
    ops: TorchBackend, w: MTPWeights, streams: torch.Tensor, fb: ForwardBatch, cache: LayerCache
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP layer over a step (fb: the t+1 tokens) from the trunk's streams at t: (the shared head's input [T',
    hidden], the block's output streams [T', hc, hidden]) at the rows fb.logits_index (None: all T); the other
    rows' keys go into the cache, and their MoE is not run."""
    x = mtp_input(ops, w, streams, embed(w.embed, fb.input_ids, w.act_dtype))
    out = ops.block(w.block, x, fb, cache, ropes(w.rope, fb), fb.logits_index)
    return ops.hc_head(out, w.head), out


def mtp_input(ops: TorchBackend, w: MTPWeights, streams: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
    """The MTP block's input streams [T, hc, hidden]: h_proj(hnorm(trunk streams)) + e_proj(enorm(embedding))."""
    h = ops.linears(ops.rms_norm(streams, w.eps, w.hnorm), (w.h_proj,))[0]
    return h + ops.linears(ops.rms_norm(embedded, w.eps, w.enorm), (w.e_proj,))[0].unsqueeze(1)
