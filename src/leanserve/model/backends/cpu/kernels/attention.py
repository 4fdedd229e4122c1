"""The KV compressor's decode-sized step, attention over a step's query blocks (small matmuls through the linear's tiles),
and the Lightning Indexer's streaming top-k selection."""

from __future__ import annotations

import math

import numpy as np

from leanserve.model.backends.cpu.kernels.base import Threaded, _copy_row_jit, _exp_jit, _jit, _share_jit
from leanserve.model.backends.cpu.kernels.linear import _linear_tiles_jit, _weighted_rows_jit


# --- KV compressor, decode-sized steps ------------------------------------------------------------------
def _store_rows(kv, gate, src_rows, dst_rows, kv_ring, gate_ring):  # pragma: no cover - compiled
    for i in range(src_rows.shape[0]):
        for c in range(kv.shape[1]):
            kv_ring[dst_rows[i], c] = kv[src_rows[i], c]
            gate_ring[dst_rows[i], c] = gate[src_rows[i], c]


_store_rows_jit = _jit(_store_rows)


def compress(work, kv, gate, src_rows, dst_rows, kv_ring, gate_ring, write_first, src, src_valid, ape, overlap, w,
             eps, freqs, rows, row_dst):  # fmt: skip
    """One compressor step: stores this step's kv/gate [T, width] rows src_rows at ring rows dst_rows (before
    reading, with write_first, else after: see model/batch.py), and for each window closing this step (src [NW,
    span] store rows: the ring, then this step's rows; src_valid [NW, span]) pools the window per channel with a
    softmax over gate + ape [r, width], RMS-normalises the entry (times w [dim]), rotates its trailing channels by
    freqs [NW, R/2, 2] and writes it to rows [*, dim] row row_dst. CSA (overlap): the first r slots take channels
    [0, dim) (the previous window's Ca), the last r channels [dim, 2*dim) (this window's Cb). `work`: the windows
    closing this step (they are spread over the cores, compress_windows; on one thread the stores are made in the
    same call)."""
    store = STORE_FIRST if write_first else STORE_AFTER
    if compress_windows.parts(work) < 2:
        compress_windows.kernel(kv, gate, src_rows, dst_rows, kv_ring, gate_ring, store, src, src_valid, ape, overlap,
                                w, eps, freqs, rows, row_dst, 0, 1)  # fmt: skip
        return
    if write_first:
        _store_rows_jit(kv, gate, src_rows, dst_rows, kv_ring, gate_ring)
    compress_windows(work, kv, gate, src_rows, dst_rows, kv_ring, gate_ring, NO_STORE, src, src_valid, ape, overlap, w,
                     eps, freqs, rows, row_dst)  # fmt: skip
    if not write_first:
        _store_rows_jit(kv, gate, src_rows, dst_rows, kv_ring, gate_ring)


NO_STORE, STORE_FIRST, STORE_AFTER = 0, 1, 2  # (compress_windows' `store`: where it stores this step's rows, if at all)


def _compress_windows(kv, gate, src_rows, dst_rows, kv_ring, gate_ring, store, src, src_valid, ape, overlap, w, eps,
                      freqs, rows, row_dst, part, parts):  # fmt: skip
    # (compiled) compress's windows (this part's share of them), with this step's rows stored before or after them
    # when `store` says (one thread: a single call)
    if store == STORE_FIRST:
        _store_rows_jit(kv, gate, src_rows, dst_rows, kv_ring, gate_ring)
    ring_rows = kv_ring.shape[0]
    span = src.shape[1]
    ratio = ape.shape[0]
    dim = rows.shape[1]
    half = freqs.shape[1]
    lead = dim - 2 * half
    lo, hi = _share_jit(src.shape[0], part, parts)
    for v in range(lo, hi):
        # Per channel: the softmax's running maximum, its sum and the weighted sum; channels innermost (vectors).
        top = np.full(dim, -np.inf, dtype=np.float32)
        total = np.zeros(dim, dtype=np.float32)
        entry = np.zeros(dim, dtype=np.float32)
        for p in range(span):
            if src_valid[v, p]:
                r, off, a = src[v, p], dim if overlap and p >= ratio else 0, p % ratio
                g = gate_ring[r] if r < ring_rows else gate[r - ring_rows]
                for c in range(dim):
                    top[c] = max(top[c], g[off + c] + ape[a, off + c])
        for p in range(span):
            if src_valid[v, p]:
                r, off, a = src[v, p], dim if overlap and p >= ratio else 0, p % ratio
                g = gate_ring[r] if r < ring_rows else gate[r - ring_rows]
                x = kv_ring[r] if r < ring_rows else kv[r - ring_rows]
                for c in range(dim):
                    e = _exp_jit(g[off + c] + ape[a, off + c] - top[c])
                    total[c] += e
                    entry[c] += e * x[off + c]
        for c in range(dim):
            entry[c] /= total[c]
        s = np.float32(0.0)
        for c in range(dim):
            s += entry[c] * entry[c]
        r = np.float32(1.0) / np.float32(math.sqrt(s / np.float32(dim) + np.float32(eps)))
        out = rows[row_dst[v]]
        for c in range(dim):
            out[c] = entry[c] * r * w[c]
        for q in range(half):
            cr, ci = freqs[v, q, 0], freqs[v, q, 1]
            re, im = out[lead + 2 * q], out[lead + 2 * q + 1]
            out[lead + 2 * q] = re * cr - im * ci
            out[lead + 2 * q + 1] = re * ci + im * cr
    if store == STORE_AFTER:
        _store_rows_jit(kv, gate, src_rows, dst_rows, kv_ring, gate_ring)


# work = windows closing this step
compress_windows = Threaded(_compress_windows, min_work=64)


# --- attention over a step's query blocks -----------------------------------------------------------------
KEY_BLOCK = 64  # keys a query's scores are computed against at a time (64 KB at 512 wide: they stay in L2)


def _scores_of(q, kv, keys, scores):  # pragma: no cover - compiled
    # scores[:, :keys] = q [R, D] . kv[:keys] [*, D], KEY_BLOCK keys at a time through the linear's tiles (each
    # entry the same arithmetic in any tile: see _linear_tiles)
    for j0 in range(0, keys, KEY_BLOCK):
        j1 = min(keys, j0 + KEY_BLOCK)
        _linear_tiles_jit(q, kv[j0:j1], scores[:, j0:j1], q.shape[0])


_scores_of_jit = _jit(_scores_of)


def _probabilities(scores, seen, count, sink, scale, kept, ones, total, tops):  # pragma: no cover - compiled
    # One query's scores [H, K] (its heads' rows; keys it does not see among them) -> its softmax probabilities
    # in place, over its keys seen[:count] (places in the K columns, in key order) and each head's sink logit;
    # 0 at the keys it does not see. Each head's sum runs over the query's own keys alone, in their order,
    # through the tiles' fixed order: the same whichever other queries share the key columns.
    heads, keys = scores.shape
    for h in range(heads):
        row = scores[h]
        top = sink[h]
        for j in range(count):
            kept[h, j] = row[seen[j]] * scale
            top = max(top, kept[h, j])
        tops[h] = top
        for j in range(count):
            kept[h, j] = _exp_jit(kept[h, j] - top)
    _linear_tiles_jit(kept[:, :count], ones[:, :count], total, heads)
    for h in range(heads):
        row = scores[h]
        inv = np.float32(1.0) / (total[h, 0] + _exp_jit(sink[h] - tops[h]))
        for k in range(keys):
            row[k] = np.float32(0.0)
        for j in range(count):
            row[seen[j]] = kept[h, j] * inv


_probabilities_jit = _jit(_probabilities)


def _rotate_out(values, freqs, t, out):  # pragma: no cover - compiled
    # out[t] = values [H, D] rotated back by RoPE (the inverse of freqs at token t: multiply by its conjugate)
    heads, dim = values.shape
    half = freqs.shape[1]
    lead = dim - 2 * half
    for h in range(heads):
        acc = values[h]
        for d in range(lead):
            out[t, h, d] = acc[d]
        for p2 in range(half):
            cr, ci = freqs[t, p2, 0], freqs[t, p2, 1]
            re, im = acc[lead + 2 * p2], acc[lead + 2 * p2 + 1]
            out[t, h, lead + 2 * p2] = re * cr + im * ci
            out[t, h, lead + 2 * p2 + 1] = im * cr - re * ci


_rotate_out_jit = _jit(_rotate_out)


def _attend(q, ring, new_kv, q_rows, q_valid, key_index, key_mask, slot, table, rows, visible, chosen, sink, scale,
            freqs, splits, out, part, parts):  # fmt: skip
    # (compiled) Shared-KV attention (keys = values) for one group of query blocks, see model/batch.py:
    #   q [T, H, D] RoPE'd queries; window keys are store rows key_index[b, :] masked by key_mask[b, i, :],
    #   where the store is ring [Rr, D] followed by new_kv [T, D]; then the compressed rows 0..n-1 of slot[b]'s
    #   sequence (row c at rows[table[slot[b], c // P], c % P] of the pool rows [blocks, P, D], model/cache.py)
    #   with n = visible[b, i]; or, when chosen [NB, Bq, k] is not empty (the indexer's top-k), the rows
    #   chosen[b, i, :] (ascending, -1 after the last).
    # Each head has a sink logit (probability mass, no value). The output is rotated back by RoPE (the
    # inverse of freqs at the query's token) and written to out[q_rows[b, i]].
    # A block gathers its window keys once (the span its queries see) and, without the indexer's choice, every
    # compressed row its queries see (they differ by a row at most); with it, each query gathers its own k rows.
    # Each query is then scored against its keys (the block's, or its window's and its own rows) through the
    # linear's register tiles, its softmax sums run over its own keys alone, and its weighted values are one
    # chain of multiply-adds per entry in key order (_weighted_rows; keys it does not see weigh an exact 0): a
    # query's output is the same whichever other queries share its block, so a token gets the same output in any
    # step (batch invariance), and its working memory is its keys, not the block's queries times them.
    # A task is a block's heads or `splits` equal ranges of them (fewer blocks than cores, as in decode: each range
    # gathers the block's keys itself); every head's arithmetic is its own, so the split changes no output.
    num_blocks, block = q_rows.shape
    heads, dim = q.shape[1], q.shape[2]
    ring_rows = ring.shape[0]
    width = key_index.shape[1]
    picked = chosen.shape[0] > 0
    per_block = rows.shape[1]
    lo_task, hi_task = _share_jit(num_blocks * splits, part, parts)
    for task in range(lo_task, hi_task):
        b, split = task // splits, task % splits
        h0, h1 = heads * split // splits, heads * (split + 1) // splits
        most = 0
        for i in range(block):
            if q_valid[b, i]:
                most = max(most, visible[b, i])
        # The window keys the block reads: from the first one some query of it sees to the last (at the start of
        # a sequence, or in a short chunk, the leading ones are before its first token).
        lo, hi = width, 0
        for i in range(block):
            if q_valid[b, i]:
                for k in range(width):
                    if key_mask[b, i, k]:
                        lo = min(lo, k)
                        break
                for k in range(width - 1, -1, -1):
                    if key_mask[b, i, k]:
                        hi = max(hi, k + 1)
                        break
        span = max(hi - lo, 0)
        lo = min(lo, hi)
        keys = span + (chosen.shape[2] if picked else most)
        kv = np.empty((keys, dim), dtype=np.float32)  # the block's keys (= values); with the choice, a query's
        for k in range(span):
            r = key_index[b, lo + k]
            _copy_row_jit(kv[k], ring[r] if r < ring_rows else new_kv[r - ring_rows])
        if not picked:
            for c in range(most):
                _copy_row_jit(kv[span + c], rows[table[slot[b], c // per_block], c % per_block])
        own = np.empty((keys, dim), dtype=np.float32) if picked else kv  # (the choice: a query's window, its rows)
        seen = np.empty(keys, dtype=np.int64)  # a query's keys (their places among the keys it is scored on)
        scores = np.empty((h1 - h0, keys), dtype=np.float32)
        kept = np.empty((h1 - h0, keys), dtype=np.float32)
        ones = np.ones((1, keys), dtype=np.float32)
        total = np.empty((h1 - h0, 1), dtype=np.float32)
        tops = np.empty(h1 - h0, dtype=np.float32)
        values = np.empty((h1 - h0, dim), dtype=np.float32)
        for i in range(block):
            if not q_valid[b, i]:
                continue
            count = 0
            if picked:
                for k in range(span):
                    if key_mask[b, i, lo + k]:
                        _copy_row_jit(own[count], kv[k])
                        seen[count] = count
                        count += 1
                for j in range(chosen.shape[2]):
                    c = chosen[b, i, j]
                    if c < 0:
                        break
                    _copy_row_jit(own[count], rows[table[slot[b], c // per_block], c % per_block])
                    seen[count] = count
                    count += 1
                scored = count
            else:
                n = visible[b, i]
                for k in range(keys):
                    if (key_mask[b, i, lo + k]) if k < span else (k - span < n):
                        seen[count] = k
                        count += 1
                scored = keys
            t = q_rows[b, i]
            _scores_of_jit(q[t, h0:h1], own, scored, scores)
            _probabilities_jit(scores[:, :scored], seen, count, sink[h0:h1], scale, kept, ones, total, tops)
            _weighted_rows_jit(scores[:, :scored], own[:scored], values, h1 - h0)
            _rotate_out_jit(values, freqs, t, out[:, h0:h1])


# work = query-key dot products times the keys' width, over the window's keys and the compressed rows (see
# index_select's)
attend = Threaded(_attend, min_work=1 << 17)


def attend_splits(blocks: int, heads: int, work: int) -> int:
    """Into how many ranges `attend` splits each query block's heads for a call of `blocks` blocks and `work`: as
    many as leave none of the call's parts idle where there are fewer blocks than parts (decode), else 1 (each
    range gathers the block's keys again)."""
    return min(-(-attend.parts(work) // blocks), heads)


# --- the Lightning Indexer's top-k ------------------------------------------------------------------------
INDEX_ROWS = 256  # compressed rows scored at a time (their keys, 128 KB at 128 wide, stay in L2 for every query)


def _keep_best(score, row, kept, topk):  # pragma: no cover - compiled
    # score[:kept], row[:kept] (rows ascending) -> their `topk` best in place (the higher score; of equal ones,
    # the lower row: the stable sort's choice), still in ascending row order; returns how many are kept
    if kept <= topk:
        return kept
    best = np.sort(np.argsort(-score[:kept], kind="mergesort")[:topk])  # (stable: ties keep row order)
    for j in range(topk):  # (best[j] >= j: nothing is overwritten before it is read)
        score[j] = score[best[j]]
        row[j] = row[best[j]]
    return topk


_keep_best_jit = _jit(_keep_best)


def index_select(work, q, head_w, q_rows, q_valid, slot, table, keys, visible, topk, scale, splits, out):
    """The Lightning Indexer's choice for one group of query blocks: each visible compressed row c < visible[b, i]
    scores sum_h head_w[t, h] * scale * relu(q[t, h] . keys row c), and a query keeps its `topk` best (of equal
    scores, the lower row): out [NB, Bq, topk] their rows ascending, -1 after the last (a query that sees at most
    topk rows keeps them all). q [T, H, d], head_w [T, H], keys the indexer's pool [blocks, P, d] (row c of slot s
    at keys[table[s, c // P], c % P]).
    The rows stream past INDEX_ROWS at a time: their scores for every query of the block, then each query's
    candidates that beat its k-th best so far; the candidates (up to 2 * topk) are cut back to the topk best when
    full. A block's rows may be split in `splits` ranges scored in parallel (decode: one query per block), whose
    candidates are merged at the end (index_merge); the choice is exact, so it does not depend on the split, and
    each score is the same arithmetic in any step (the linear's tiles, heads summed in order): batch invariant.
    `work`: see index_scores."""
    num_blocks, block = q_rows.shape
    room = 2 * topk
    cand_s = np.empty((num_blocks, splits, block, room), dtype=np.float32)
    cand_r = np.empty((num_blocks, splits, block, room), dtype=np.int64)
    cand_n = np.zeros((num_blocks, splits, block), dtype=np.int64)
    index_scores(work, q, head_w, q_rows, q_valid, slot, table, keys, visible, topk, scale, cand_s, cand_r, cand_n)
    index_merge(work, q_rows, q_valid, visible, topk, cand_s, cand_r, cand_n, out)


def _index_scores(q, head_w, q_rows, q_valid, slot, table, keys, visible, topk, scale, cand_s, cand_r, cand_n, part,
                  parts):  # fmt: skip  # pragma: no cover - compiled
    # index_select's candidates of each (block, split of its rows): this part's share of them
    num_blocks, block = q_rows.shape
    splits = cand_s.shape[1]
    heads, dim = q.shape[1], q.shape[2]
    per_block = keys.shape[1]
    flat = keys.reshape(-1, dim)
    room = 2 * topk
    lo_u, hi_u = _share_jit(num_blocks * splits, part, parts)
    for u in range(lo_u, hi_u):
        b, split = u // splits, u % splits
        most = 0
        for i in range(block):
            if q_valid[b, i]:
                most = max(most, visible[b, i])
        if most <= topk:
            continue
        lo, hi = _share_jit(most, split, splits)
        floor = np.full(block, -np.inf, dtype=np.float32)  # each query's k-th best after its last cut
        chunk = np.empty((INDEX_ROWS, dim), dtype=np.float32)
        scores = np.empty((heads, INDEX_ROWS), dtype=np.float32)
        total = np.empty(INDEX_ROWS, dtype=np.float32)
        for c0 in range(lo, hi, INDEX_ROWS):
            c1 = min(hi, c0 + INDEX_ROWS)
            for c in range(c0, c1):
                _copy_row_jit(chunk[c - c0], flat[np.int64(table[slot[b], c // per_block]) * per_block + c % per_block])
            for i in range(block):
                m = visible[b, i]
                if not q_valid[b, i] or m <= topk or c0 >= m:
                    continue
                t, n = q_rows[b, i], min(c1, m) - c0
                _linear_tiles_jit(q[t], chunk[:n], scores, heads)
                for r in range(n):
                    total[r] = np.float32(0.0)
                for h in range(heads):
                    wh = head_w[t, h] * np.float32(scale)
                    for r in range(n):
                        total[r] += max(scores[h, r], np.float32(0.0)) * wh
                s, rr = cand_s[b, split, i], cand_r[b, split, i]
                kept = cand_n[b, split, i]
                for r in range(n):
                    if total[r] > floor[i]:
                        s[kept] = total[r]
                        rr[kept] = c0 + r
                        kept += 1
                        if kept == room:
                            kept = _keep_best_jit(s, rr, kept, topk)
                            floor[i] = np.min(s[:kept])
                cand_n[b, split, i] = kept


def _index_merge(q_rows, q_valid, visible, topk, cand_s, cand_r, cand_n, out, part, parts):  # pragma: no cover
    # (compiled) index_select's choice per query from its splits' candidates, this part's share of the blocks
    num_blocks, block = q_rows.shape
    splits, room = cand_s.shape[1], cand_s.shape[3]
    lo_b, hi_b = _share_jit(num_blocks, part, parts)
    for b in range(lo_b, hi_b):
        merged_s = np.empty(splits * room, dtype=np.float32)
        merged_r = np.empty(splits * room, dtype=np.int64)
        for i in range(block):
            for j in range(topk):
                out[b, i, j] = -1
            m = visible[b, i]
            if not q_valid[b, i]:
                continue
            if m <= topk:
                for c in range(m):
                    out[b, i, c] = c
                continue
            kept = 0  # the splits' candidates in split order: rows ascending
            for split in range(splits):
                for j in range(cand_n[b, split, i]):
                    merged_s[kept] = cand_s[b, split, i, j]
                    merged_r[kept] = cand_r[b, split, i, j]
                    kept += 1
            kept = _keep_best_jit(merged_s, merged_r, kept, topk)
            for j in range(kept):
                out[b, i, j] = merged_r[j]


# work = the query-row dot products of a block's queries and heads, times the rows' width: threads pay from about
# eight decode blocks of the shipped model (2 cores); a block (or a split of its rows) is one task
index_scores = Threaded(_index_scores, min_work=1 << 17)
index_merge = Threaded(_index_merge, min_work=1 << 17)
