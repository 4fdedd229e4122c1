"""The model's pieces as kernel calls on numpy arrays (`*_arrays`): what the CPU backend's ops and its decode step
(decode.py) run. Weights are numpy views of the typed weights (views.py); outputs are new numpy arrays."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from leanserve.model.backends.cpu import kernels as ck
from leanserve.model.quant import Fp8Weight, bf16_inputs, input_code
from leanserve.model.weights import AttentionWeights, CompressorWeights, MixWeights, MoEWeights

if TYPE_CHECKING:
    from leanserve.model.cache import LayerCache

NO_ROWS = np.empty((0, 1, 1), dtype=np.float32)
NO_CHOICE = np.empty((0, 0, 0), dtype=np.int64)
INDEX_PART_ROWS = 256  # the fewest compressed rows worth a core of their own in the indexer's choice
NO_NEW_KV = np.empty((0, 1), dtype=np.float32)  # (a step whose rows went into the ring first)
NO_TABLE = np.empty((0, 0), dtype=np.int64)
SCORING = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}


def spread(tasks: int, work: int) -> int:
    """A threaded kernel's work measure (its multiply-adds or elements) when its outer loop has `tasks` iterations
    to spread over the cores; 0 (one thread) for a single one, which no other core could share."""
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
# two kernels run in threaded parts.
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
    width]; rows the pool [blocks * rows per block, dim]; angles [NW, R/2, 2]."""
    write_src, write_dst, src, src_valid, row_dst = meta_arrays
    ck.compress(
        src.shape[0], kv, gate, write_src, write_dst, kv_ring, gate_ring, write_first, src, src_valid, w.ape,
        w.overlap, w.norm_weight, w.eps, angles, rows, row_dst,
    )  # fmt: skip


def attend_arrays(w: AttentionWeights, q, ring, new_kv, group, table, most: int, visible, rows, idx_rows,
                  index_queries, angles, out) -> None:  # fmt: skip
    """The attention kernels for one group of query blocks (see kernels.attend): q, out [T, H, D]; the window
    ring and this step's new rows (or NO_NEW_KV); group from AttnGroup.arrays(); table the block table
    [slots, max_blocks] (model/cache.py); visible [NB, Bq] the compressed
    rows each query may see, `most` their maximum; the layer's compressed and indexer rows (cache_rows);
    index_queries the indexer's (queries, head weights), or None when it does not choose."""
    q_rows, q_valid, key_index, key_mask, block_slot = group
    chosen = NO_CHOICE
    idx = w.indexer
    if index_queries is not None and most > idx.topk:
        chosen = np.empty((*q_rows.shape, idx.topk), dtype=np.int64)
        # (fewer blocks than cores, as in decode: each block's rows split in ranges scored in parallel)
        parts = max(1, min(-(-ck.threads() // q_rows.shape[0]), most // INDEX_PART_ROWS))
        work = spread(q_rows.shape[0] * parts, q_rows.size * idx.heads * idx.head_dim * most)  # (products x width)
        ck.index_select(
            work,
            *index_queries,
            q_rows,
            q_valid,
            block_slot,
            table,
            idx_rows,
            visible,
            idx.topk,
            idx.head_dim**-0.5,
            parts,
            chosen,
        )
    work = q_rows.size * q.shape[1] * q.shape[2] * (key_index.shape[1] + most)  # (likewise)
    splits = ck.attend_splits(q_rows.shape[0], q.shape[1], work)  # (fewer blocks than cores: heads in ranges)
    ck.attend(
        spread(q_rows.shape[0] * splits, work), q, ring, new_kv, q_rows, q_valid, key_index, key_mask, block_slot,
        table, rows, visible, chosen, w.sink, w.head_dim**-0.5, angles, splits, out,
    )  # fmt: skip


def moe_arrays(x: np.ndarray, input_ids: np.ndarray, args: tuple) -> np.ndarray:
    """The whole MoE (kernels.moe_tokens): x, out [T, hidden] float32 (experts plain, FP4 or FP8; the shared
    expert plain or FP8); `args` its weights as moe_args gives them."""
    out = np.empty_like(x)
    ck.moe_tokens(ck.moe_work(x.shape[0], args), x, input_ids, *args, out)
    return out


def moe_args(w: MoEWeights) -> tuple:
    """The MoE kernel's weight arguments, in its order."""
    return (
        w.gate, ck.EMPTY if w.bias is None else w.bias, NO_TABLE if w.tid2eid is None else w.tid2eid, w.top_k,
        SCORING[w.scoring], w.route_scale, *ck.stored(w.w13), *ck.stored(w.w2), *ck.stored(w.shared_w1),
        *ck.stored(w.shared_w3), *ck.stored(w.shared_w2), w.limit, input_code(w.w13),
        bf16_inputs(w.shared_w1),
    )  # fmt: skip


def grouped_linear_arrays(x: np.ndarray, w) -> np.ndarray:
    """x [T, G, in] -> [T, G, out]: group g times w[g] [out, in]^T (w [G, out, in] float32 or bfloat16 bits), or
    times rows [g * out, (g + 1) * out) of an Fp8Weight [G * out, in]."""
    n, groups = x.shape[0], x.shape[1]
    if isinstance(w, Fp8Weight):
        out = np.empty((n, groups, w.q.shape[0] // groups), dtype=np.float32)
        ck.grouped_linear_fp8(n * w.q.size, x, w.q, w.scale, bf16_inputs(w), out)
    else:
        out = np.empty((n, groups, w.shape[1]), dtype=np.float32)
        ck.grouped_linear(n * w.size, x, w, out)
    return out


def cache_rows(cache: LayerCache) -> tuple[np.ndarray, np.ndarray]:
    """Numpy views of a layer's compressed rows and indexer rows (NO_ROWS where the layer has none)."""
    rows = cache.comp_rows.numpy() if cache.comp_rows is not None else NO_ROWS
    return rows, cache.idx_rows.numpy() if cache.idx_rows is not None else NO_ROWS


def embedded(embed: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The embedding table's rows of `ids` (its numpy view, float32 or bfloat16 bits) as float32 [T, hidden]."""
    rows = embed[ids]
    return rows if rows.dtype == np.float32 else (rows.astype(np.uint32) << 16).view(np.float32)
