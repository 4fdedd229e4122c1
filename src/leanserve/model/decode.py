"""The CPU backend's numpy statement of the model: each piece as a compiled kernel call on numpy arrays
(`*_arrays`, used by the CPU backend's ops too), and a decode-sized step's blocks from the embedding to the last
block without a torch tensor per op.

Wrapping each kernel in torch tensors (an output tensor, its numpy view, the inputs' views, about a microsecond
each, dozens per layer) costs more than the arithmetic at batch 1. Here each block's weights (its typed
`BlockWeights`, as numpy views) and its caches' views are made once and kept in a `Plan`, the step's metadata is
converted once for all layers (`Step`), and intermediate outputs are plain numpy arrays. The MTP layer's step runs
the same way from its tokens' embedding rows (`run_mtp`: its input projections, its block, its hc_head and norm on
the wanted rows); the head stays a torch call.
tests/test_kernels.py checks this path against the torch backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from leanserve.model import cpu_kernels as ck
from leanserve.model.attention import AttentionWeights
from leanserve.model.batch import ForwardBatch
from leanserve.model.block import BlockWeights
from leanserve.model.cache import LayerCache
from leanserve.model.compressor import CompressorWeights
from leanserve.model.hyper import MixWeights
from leanserve.model.moe import MoEWeights
from leanserve.model.quant import Fp8Weight

NO_ROWS = np.empty((1, 0, 1), dtype=np.float32)
NO_CHOICE = np.empty((0, 0, 0), dtype=np.bool_)
NO_NEW_KV = np.empty((0, 1), dtype=np.float32)  # (a step whose rows went into the ring first)
NO_TABLE = np.empty((0, 0), dtype=np.int64)
SCORING = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}


# --- the pieces on numpy arrays (weights: numpy views of the typed weights) --------------------------------
def spread(tasks: int, work: int) -> int:
    """A threaded kernel's work measure (its multiply-adds or elements) when its outer loop has `tasks` iterations
    to spread over the cores; 0 (the one-thread build) for a single one, which no other core could share."""
    return work if tasks > 1 else 0


def rms_norm_arrays(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    out = np.empty_like(x)
    ck.rms_norm(x.shape[0], x, weight, eps, out)
    return out


def rope_arrays(x: np.ndarray, angles: np.ndarray, eps: float, normalize: bool, weight, inverse=False) -> np.ndarray:
    """(RMSNorm per head, times `weight` unless empty, then) RoPE of x [T, H, D] by angles [T, R/2, 2]."""
    out = np.empty_like(x)
    ck.norm_rope(x.shape[0], x, weight, eps, normalize, angles, inverse, out)
    return out


def hc_pre_arrays(streams: np.ndarray, w: MixWeights) -> tuple[np.ndarray, np.ndarray]:
    """hc_pre (or hc_head, sinkhorn_iters 0): (normalised block input [T, D], pre | post | comb weights [T, M])."""
    n = streams.shape[0]
    x, weights = _pre_outputs(streams, w)
    ck.hc_pre(n, streams, w.fn, w.scale, w.base, w.hc_eps, w.sinkhorn_iters, w.norm_eps, w.norm_weight, x, weights)
    return x, weights


def _pre_outputs(streams: np.ndarray, w: MixWeights) -> tuple[np.ndarray, np.ndarray]:
    """hc_pre's outputs for `streams` [T, hc, D]: the normalised block input [T, D] and its weights [T, M]."""
    n = streams.shape[0]
    return np.empty((n, streams.shape[2]), dtype=np.float32), np.empty((n, w.fn.shape[0]), dtype=np.float32)


def hc_post_arrays(block_out, streams, post, comb) -> np.ndarray:
    """The new streams [T, hc, D]; post [T, hc], comb [T, hc * hc] (row-major)."""
    out = np.empty_like(streams)
    ck.hc_post(streams.shape[0], block_out, streams, post, comb, out)
    return out


def post_comb(weights: np.ndarray, hc: int) -> tuple[np.ndarray, np.ndarray]:
    """hc_post's post [T, hc] and comb [T, hc * hc] weights: views of hc_pre's weights [T, M] (pre | post | comb)."""
    return weights[:, hc : 2 * hc], weights[:, 2 * hc :]


# Tokens below which a site's hc_post and the next one's hc_pre run as one call on one thread: from there on the
# two kernels take their threaded builds.
FUSED_MIX = ck.hc_pre.min_work


def mixed_in(streams: np.ndarray, w: MixWeights, pending) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A site's input: (streams, hc_pre's normalised input [T, D], its weights [T, M]). `pending`: None, or the
    previous site's (output [T, D], hc_pre weights), whose hc_post still has to make `streams`; below FUSED_MIX
    tokens both run as one kernel call (hc_post_pre), above it as the two threaded ones."""
    if pending is None:
        return streams, *hc_pre_arrays(streams, w)
    n = streams.shape[0]
    if n >= FUSED_MIX:
        streams = settled(streams, pending)
        return streams, *hc_pre_arrays(streams, w)
    block_out, before = pending
    out = np.empty_like(streams)
    x, weights = _pre_outputs(streams, w)
    ck.hc_post_pre(
        block_out, streams, before, out, w.fn, w.scale, w.base, w.hc_eps, w.sinkhorn_iters, w.norm_eps,
        w.norm_weight, x, weights,
    )  # fmt: skip
    return out, x, weights


def settled(streams: np.ndarray, pending) -> np.ndarray:
    """The streams once the last site's hc_post (`pending`, see mixed_in) has run."""
    block_out, weights = pending
    return hc_post_arrays(block_out, streams, *post_comb(weights, streams.shape[1]))


def compress_arrays(kv, gate, meta_arrays, kv_ring, gate_ring, rows, angles, write_first: bool, w: CompressorWeights):
    """One compressor step: kv, gate [T, width]; meta_arrays from CompressMeta.arrays(); the rings [slots * B,
    width]; rows [slots * max_rows, dim]; angles [NW, R/2, 2]."""
    write_src, write_dst, src, src_valid, row_dst = meta_arrays
    ck.compress(
        src.shape[0], kv, gate, write_src, write_dst, kv_ring, gate_ring, write_first, src, src_valid, w.ape,
        w.overlap, w.norm_weight, w.eps, angles, rows, row_dst,
    )  # fmt: skip


def attend_arrays(w: AttentionWeights, q, ring, new_kv, group, most: int, visible, rows, idx_rows, index_queries,
                  angles, out) -> None:  # fmt: skip
    """The attention kernels for one group of query blocks (see cpu_kernels.attend): q, out [T, H, D]; the window
    ring and this step's new rows (or NO_NEW_KV); group from AttnGroup.arrays(); visible [NB, Bq] the compressed
    rows each query may see, `most` their maximum; the layer's compressed and indexer rows (cache_rows);
    index_queries the indexer's (queries, head weights), or None when it does not choose."""
    q_rows, q_valid, key_index, key_mask, block_slot = group
    chosen = NO_CHOICE
    idx = w.indexer
    if index_queries is not None and most > idx.topk:
        chosen = np.empty((*q_rows.shape, most), dtype=np.bool_)
        work = spread(q_rows.shape[0], q_rows.size * idx.heads * idx.head_dim * most)  # (query-row products x width)
        ck.index_select(
            work, *index_queries, q_rows, q_valid, block_slot, idx_rows, visible, idx.topk, idx.head_dim**-0.5, chosen
        )
    work = spread(q_rows.shape[0], q_rows.size * q.shape[1] * q.shape[2] * (key_index.shape[1] + most))  # (likewise)
    ck.attend(
        work, q, ring, new_kv, q_rows, q_valid, key_index, key_mask, block_slot, rows, visible, chosen, w.sink,
        w.head_dim**-0.5, angles, out,
    )  # fmt: skip


def moe_arrays(x: np.ndarray, input_ids: np.ndarray, args: tuple) -> np.ndarray:
    """The whole MoE as one compiled call: x, out [T, hidden] float32 (experts plain, FP4 or FP8; the shared
    expert plain or FP8); `args` its weights as moe_args gives them."""
    out = np.empty_like(x)
    ck.moe_tokens(ck.moe_work(x.shape[0], args), x, input_ids, *args, out)
    return out


def moe_args(w: MoEWeights) -> tuple:
    """The MoE kernel's weight arguments, in its order."""
    return (
        w.gate, ck.EMPTY if w.bias is None else w.bias, NO_TABLE if w.tid2eid is None else w.tid2eid, w.top_k,
        SCORING[w.scoring], w.route_scale, *ck.stored(w.w13), *ck.stored(w.w2), *ck.stored(w.shared_w1),
        *ck.stored(w.shared_w3), *ck.stored(w.shared_w2), w.limit,
    )  # fmt: skip


def grouped_linear_arrays(x: np.ndarray, w) -> np.ndarray:
    """x [T, G, in] -> [T, G, out]: group g times w[g] [out, in]^T (w [G, out, in] float32 or bfloat16 bits), or
    times rows [g * out, (g + 1) * out) of an Fp8Weight [G * out, in]."""
    n, groups = x.shape[0], x.shape[1]
    if isinstance(w, Fp8Weight):
        out = np.empty((n, groups, w.q.shape[0] // groups), dtype=np.float32)
        ck.grouped_linear_fp8(n * w.q.size, x, w.q, w.scale, out)
    else:
        out = np.empty((n, groups, w.shape[1]), dtype=np.float32)
        ck.grouped_linear(n * w.size, x, w, out)
    return out


def cache_rows(cache: LayerCache) -> tuple[np.ndarray, np.ndarray]:
    """Numpy views of a layer's compressed rows and indexer rows (NO_ROWS where the layer has none)."""
    rows = cache.comp_rows.numpy() if cache.comp_rows is not None else NO_ROWS
    return rows, cache.idx_rows.numpy() if cache.idx_rows is not None else NO_ROWS


# --- a decode-sized step ------------------------------------------------------------------------------------
class Step:
    """The step's metadata as numpy arrays, converted once for all layers; `angles` the RoPE tables per kind as
    real pairs [N, R/2, 2] (DeepseekV4.ropes, read from numpy views of Rotary.pairs)."""

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


@dataclass(frozen=True)
class Rings:
    """A compressor's cache views: its kv and gate rings [slots * B, width] and its rows [slots * rows, dim]."""

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
    """One block's weights (numpy views of its BlockWeights) and caches, made once per (block, cache) by the CPU
    backend and made again only when a weight's storage changes (loading, `.data` assignment)."""

    def __init__(self, w: BlockWeights, tensors: list[torch.Tensor], cache: LayerCache) -> None:
        self.w = w
        self.cache = cache  # (kept: plans are looked up by the cache's id)
        self.tensors, self.ptrs = tensors, data_ptrs(tensors)
        wo_a = w.attn.wo_a  # (an FP8 one is kept as it is: grouped_linear_arrays reads its rows by group)
        self.wo_a = wo_a if isinstance(wo_a, Fp8Weight) else wo_a.reshape(w.attn.o_groups, -1, wo_a.shape[1])
        a = w.attn  # (each linear's kernel calls, worked out once)
        self.inputs, self.wq_b, self.wo_b = ck.Matmuls(a.inputs), ck.Matmuls((a.wq_b,)), ck.Matmuls((a.wo_b,))
        self.idx_wq_b = ck.Matmuls((a.indexer.wq_b,)) if a.indexer is not None else None
        self.moe_args = moe_args(w.moe)
        self.ring = cache.window_kv.numpy().reshape(-1, w.attn.head_dim)
        self.rows = cache_rows(cache)
        self.comp_rings = Rings.of(cache.comp_kv, cache.comp_gate, cache.comp_rows) if w.attn.compressor else None
        self.idx_rings = Rings.of(cache.idx_kv, cache.idx_gate, cache.idx_rows) if w.attn.indexer else None

    def current(self) -> bool:
        return data_ptrs(self.tensors) == self.ptrs


def data_ptrs(tensors: list[torch.Tensor]) -> list[int]:
    """Where each tensor's storage is: views of them are current while these stay the same."""
    return list(map(torch.Tensor.data_ptr, tensors))


def run_blocks(embed: np.ndarray | None, plans: list[Plan], hc: int, step: Step, streams: np.ndarray | None):
    """The blocks of `plans` over a step: from the embedding table's rows of the step's tokens (a first stage,
    `embed` the table's numpy view, float32 or bfloat16 bits) or from `streams` [T, hc, hidden]."""
    if streams is None:
        x = embedded(embed, step.ids)
        streams = np.empty((x.shape[0], hc, x.shape[1]), dtype=np.float32)
        streams[:] = x[:, None, :]
    pending = None  # (each site's hc_post runs with the next one's hc_pre)
    for plan in plans:
        streams, pending = block_arrays(plan, streams, step, pending)
    return settled(streams, pending)


def embedded(embed: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The embedding table's rows of `ids` (its numpy view, float32 or bfloat16 bits) as float32 [T, hidden]."""
    rows = embed[ids]
    return rows if rows.dtype == np.float32 else (rows.astype(np.uint32) << 16).view(np.float32)


def run_mtp(w, plan: Plan, embed: np.ndarray, streams: np.ndarray, step: Step, rows) -> tuple[np.ndarray, np.ndarray]:
    """The MTP layer over a step from the embedding of its tokens (w the MTPWeights views, plan its block's):
    (the shared head's input at `rows` (None: all) [T', hidden], the block's output streams [T, hc, hidden])."""
    out = settled(*block_arrays(plan, mtp_inputs(w, streams, embedded(embed, step.ids)), step))
    return hc_pre_arrays(out if rows is None else out[rows], w.head)[0], out


def mtp_inputs(w, streams: np.ndarray, embedded: np.ndarray) -> np.ndarray:
    """The MTP block's input streams: h_proj(hnorm(streams)) + e_proj(enorm(embedded)), w the MTPWeights views."""
    n, hc, dim = streams.shape
    h = rms_norm_arrays(streams.reshape(n * hc, dim), w.hnorm, w.eps)
    e = rms_norm_arrays(embedded, w.enorm, w.eps)
    return ck.matmuls(h, (w.h_proj,))[0].reshape(n, hc, dim) + ck.matmuls(e, (w.e_proj,))[0][:, None, :]


def block_arrays(p: Plan, s: np.ndarray, step: Step, pending=None):
    """One block: (its streams before its last hc_post, that hc_post's pending inputs); `pending` the previous
    block's (see mixed_in)."""
    for mix, sub in ((p.w.attn_mix, _attention), (p.w.ffn_mix, _moe)):
        s, x, weights = mixed_in(s, mix, pending)
        pending = sub(p, x, step), weights
    return s, pending


def _attention(p: Plan, x: np.ndarray, step: Step) -> np.ndarray:
    w = p.w.attn
    n, dim = x.shape[0], w.head_dim
    projected = p.inputs(x)
    q_residual = rms_norm_arrays(projected[0], w.q_norm, w.q_eps)
    angles = step.angles[w.rope_kind]
    q = rope_arrays(p.wq_b(q_residual)[0].reshape(n, w.heads, dim), angles, w.eps, True, ck.EMPTY)
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
                iq = p.idx_wq_b(q_residual)[0].reshape(n, idx.heads, idx.head_dim)
                iq = rope_arrays(iq, angles, 0.0, False, ck.EMPTY)
                index_queries = iq, projected[6] * np.float32(idx.heads**-0.5)
    visible = step.visible[w.layer_type] if most else step.no_visible
    out = np.empty((n, w.heads, dim), dtype=np.float32)
    attend_arrays(w, q, p.ring, NO_NEW_KV, step.group, most, visible, *p.rows, index_queries, angles, out)
    low = grouped_linear_arrays(out.reshape(n, w.o_groups, -1), p.wo_a)
    return p.wo_b(low.reshape(n, -1))[0]


def _moe(p: Plan, x: np.ndarray, step: Step) -> np.ndarray:
    return moe_arrays(x, step.ids, p.moe_args)
