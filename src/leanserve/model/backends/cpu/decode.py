"""The CPU backend's decode step: a decode-sized step's blocks from the embedding to the last block (and the MTP
layer's) as kernel calls on numpy arrays (arrays.py), without a torch tensor per op.

Wrapping each kernel in torch tensors (an output tensor, its numpy view, the inputs' views, about a microsecond
each, dozens per layer) costs more than the arithmetic at batch 1. Here each block's weights (its typed
`BlockWeights`, as numpy views) and its caches' views are made once and kept in a `Plan`, the step's metadata is
converted once for all layers (`Step`), and intermediate outputs are plain numpy arrays. The MTP layer's step runs
the same way from its tokens' embedding rows (`mtp`); the head stays a torch call.

This is a second statement of the model's wiring: it mirrors torch_math/blocks.py (`blocks`, `block`, `mtp`,
`mtp_input`), torch_math/attention.py (`attention`) and torch_math/moe.py (`moe`) name for name, and changes
together with them and with train/forward.py. tests/test_kernels.py checks it against the torch backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from leanserve.model.backends.cpu import kernels as ck
from leanserve.model.backends.cpu.arrays import (
    NO_NEW_KV,
    attend_arrays,
    cache_rows,
    compress_arrays,
    embedded,
    grouped_linear_arrays,
    hc_pre_arrays,
    mixed_in,
    moe_args,
    moe_arrays,
    rms_norm_arrays,
    rope_arrays,
    settled,
)
from leanserve.model.backends.cpu.views import data_ptrs
from leanserve.model.quant import Fp8Weight
from leanserve.model.weights import BlockWeights, MTPWeights

if TYPE_CHECKING:
    from leanserve.model.batch import ForwardBatch
    from leanserve.model.cache import LayerCache


class Step:
    """The step's metadata as numpy arrays, converted once for all layers; `angles` the RoPE tables per kind as
    real pairs [N, R/2, 2] (torch_math.blocks.ropes over numpy views of the tables)."""

    def __init__(self, fb: ForwardBatch, angles: dict[str, np.ndarray]) -> None:
        g = fb.groups[0]
        self.ids = fb.input_ids.numpy()
        self.angles = angles
        self.window = fb.window_write.src.numpy(), fb.window_write.dst.numpy()
        self.group = g.arrays()
        self.max_visible = g.max_visible
        self.visible = {k: v.numpy() for k, v in g.visible.items()}
        self.no_visible = np.zeros(g.q_rows.shape, dtype=np.int64)
        self.compress = {kind: m.arrays() for kind, m in fb.compress.items()}
        self.table = fb.block_table.numpy()


@dataclass(frozen=True)
class Rings:
    """A compressor's cache views: its kv and gate rings [slots * B, width] and its pool of rows [blocks * P, dim]
    (P rows per block)."""

    kv: np.ndarray
    gate: np.ndarray
    rows: np.ndarray

    @classmethod
    def of(cls, kv: torch.Tensor, gate: torch.Tensor, rows: torch.Tensor) -> Rings:
        width = kv.shape[-1]
        return cls(
            kv.numpy().reshape(-1, width), gate.numpy().reshape(-1, width), rows.numpy().reshape(-1, rows.shape[-1])
        )


class Plan:
    """One block's weights (numpy views of its BlockWeights) and caches, made once per (block weights, cache) by the
    CPU backend and made again only when a weight's storage changes (`.data` assignment)."""

    def __init__(self, w: BlockWeights, tensors: list[torch.Tensor], cache: LayerCache) -> None:
        self.w = w
        self.cache = cache  # (kept: plans are looked up by the cache's id)
        self.tensors, self.ptrs = tensors, data_ptrs(tensors)
        wo_a = w.attn.wo_a  # (an FP8 one is kept as it is: grouped_linear_arrays reads its rows by group)
        self.wo_a = wo_a if isinstance(wo_a, Fp8Weight) else wo_a.reshape(w.attn.o_groups, -1, wo_a.shape[1])
        a = w.attn  # (each linear's kernel calls, worked out once)
        self.inputs, self.wq_b, self.wo_b = ck.Matmuls(a.inputs), ck.Matmuls((a.wq_b,)), ck.Matmuls((a.wo_b,))
        self.q_input, self.kv_inputs = ck.Matmuls(a.inputs[:1]), ck.Matmuls(a.inputs[1:])  # (for some rows' queries)
        self.idx_wq_b = ck.Matmuls((a.indexer.wq_b,)) if a.indexer is not None else None
        self.moe_args = moe_args(w.moe)
        self.ring = cache.window_kv.numpy().reshape(-1, w.attn.head_dim)
        self.rows = cache_rows(cache)
        self.comp_rings = Rings.of(cache.comp_kv, cache.comp_gate, cache.comp_rows) if w.attn.compressor else None
        self.idx_rings = Rings.of(cache.idx_kv, cache.idx_gate, cache.idx_rows) if w.attn.indexer else None

    def current(self) -> bool:
        return data_ptrs(self.tensors) == self.ptrs


def blocks(embed: np.ndarray | None, plans: list[Plan], hc: int, step: Step, streams: np.ndarray | None, rows=None):
    """The blocks of `plans` over a step: from the embedding table's rows of the step's tokens (a first stage,
    `embed` the table's numpy view, float32 or bfloat16 bits) or from `streams` [T, hc, hidden]; the output streams
    at `rows` (None: all), whose last block alone runs its MoE (see block)."""
    if streams is None:
        x = embedded(embed, step.ids)
        streams = np.empty((x.shape[0], hc, x.shape[1]), dtype=np.float32)
        streams[:] = x[:, None, :]
    pending = None  # (each site's hc_post runs with the next one's hc_pre)
    for i, plan in enumerate(plans):
        streams, pending = block(plan, streams, step, pending, rows if i == len(plans) - 1 else None)
    return settled(streams, pending)


def mtp(w: MTPWeights, plan: Plan, streams: np.ndarray, step: Step, rows) -> tuple[np.ndarray, np.ndarray]:
    """The MTP layer over a step from the embedding of its tokens (w the MTPWeights views, plan its block's):
    (the shared head's input [T', hidden], the block's output streams [T', hc, hidden]) at `rows` (None: all T),
    the other rows going through the attention only (torch_math.blocks.mtp)."""
    out = settled(*block(plan, mtp_input(w, streams, embedded(w.embed, step.ids)), step, rows=rows))
    return hc_pre_arrays(out, w.head)[0], out


def mtp_input(w: MTPWeights, streams: np.ndarray, embeds: np.ndarray) -> np.ndarray:
    """The MTP block's input streams: h_proj(hnorm(streams)) + e_proj(enorm(embeds)), w the MTPWeights views."""
    n, hc, dim = streams.shape
    h = rms_norm_arrays(streams.reshape(n * hc, dim), w.hnorm, w.eps)
    e = rms_norm_arrays(embeds, w.enorm, w.eps)
    return ck.matmuls(h, (w.h_proj,))[0].reshape(n, hc, dim) + ck.matmuls(e, (w.e_proj,))[0][:, None, :]


def block(p: Plan, s: np.ndarray, step: Step, pending=None, rows=None):
    """One block: (its streams before its last hc_post, that hc_post's pending inputs); `pending` the previous
    block's (see mixed_in); `rows` (None: all): the rows whose output is wanted, the others going through the
    attention only (torch_math.blocks.block)."""
    s, x, weights = mixed_in(s, p.w.attn_mix, pending)
    out, ids = attention(p, x, step, rows), step.ids
    if rows is not None:
        s, weights, ids = s[rows], weights[rows], ids[rows]
    s, x, weights = mixed_in(s, p.w.ffn_mix, (out, weights))
    return s, (moe(p, x, ids), weights)


def attention(p: Plan, x: np.ndarray, step: Step, rows=None) -> np.ndarray:
    """The attention layer (torch_math.attention.attention) on x [T, hidden]; every step's rows go into the ring
    and the compressors' rings first (CpuBackend.decode_step). `rows` (None: all): the rows whose output it
    returns; the others' keys are made and stored, their queries are zeros (what attention gives them is unused),
    and their query and output projections are not run."""
    w = p.w.attn
    n, dim = x.shape[0], w.head_dim
    projected = p.inputs(x) if rows is None else p.q_input(x[rows]) + p.kv_inputs(x)
    q_residual = rms_norm_arrays(projected[0], w.q_norm, w.q_eps)
    asked = q_residual.shape[0]
    angles = step.angles[w.rope_kind]
    q_angles = angles if rows is None else angles[rows]
    q = rope_arrays(p.wq_b(q_residual)[0].reshape(asked, w.heads, dim), q_angles, w.eps, True, ck.EMPTY)
    q = _every_row(q, rows, n)
    kv = rope_arrays(projected[1].reshape(n, 1, dim), angles, w.eps, True, w.kv_norm).reshape(n, dim)
    src, dst = step.window
    p.ring[dst] = kv[src]
    most, index_queries = 0, None
    if w.compressor is not None:
        meta, row_angles = step.compress[w.layer_type], step.angles[w.layer_type]
        r = p.comp_rings
        compress_arrays(projected[2], projected[3], meta, r.kv, r.gate, r.rows, row_angles, True, w.compressor)
        most = step.max_visible[w.layer_type]
        idx = w.indexer
        if idx is not None:
            r = p.idx_rings
            compress_arrays(projected[4], projected[5], meta, r.kv, r.gate, r.rows, row_angles, True, idx.compressor)
            if most > idx.topk:  # the indexer's queries (RoPE'd, no norm) and head weights
                iq = p.idx_wq_b(q_residual)[0].reshape(asked, idx.heads, idx.head_dim)
                iq = _every_row(rope_arrays(iq, q_angles, 0.0, False, ck.EMPTY), rows, n)
                index_queries = iq, projected[6] * np.float32(idx.heads**-0.5)
    visible = step.visible[w.layer_type] if most else step.no_visible
    out = np.empty((n, w.heads, dim), dtype=np.float32)
    attend_arrays(w, q, p.ring, NO_NEW_KV, step.group, step.table, most, visible, *p.rows, index_queries, angles, out)
    if rows is not None:
        out = out[rows]
    low = grouped_linear_arrays(out.reshape(asked, w.o_groups, w.heads * dim // w.o_groups), p.wo_a)
    return p.wo_b(low.reshape(asked, low.shape[1] * low.shape[2]))[0]  # (explicit sizes: `asked` may be 0)


def _every_row(a: np.ndarray, rows, n: int) -> np.ndarray:
    """`a` [len(rows), ...] as [n, ...]: its rows at `rows`, zeros elsewhere (`rows` None: `a` as it is)."""
    if rows is None:
        return a
    out = np.zeros((n, *a.shape[1:]), dtype=a.dtype)
    out[rows] = a
    return out


def moe(p: Plan, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The MoE (torch_math.moe.moe) as one kernel call; `ids` the rows' tokens (hash routing)."""
    return moe_arrays(x, ids, p.moe_args)
