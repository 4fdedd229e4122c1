"""The KV compressor's decode-sized step, attention over a step's query blocks (two small matmuls each), and
the Lightning Indexer's top-k selection."""

from __future__ import annotations

import math

import numpy as np

from leanserve.model.backends.cpu.kernels.base import Threaded, _copy_row_jit, _exp_jit, _jit, prange
from leanserve.model.backends.cpu.kernels.linear import _linear_tiles_jit, _weighted_rows_jit


# --- KV compressor, decode-sized steps ------------------------------------------------------------------
def _store_rows(kv, gate, src_rows, dst_rows, kv_ring, gate_ring):  # pragma: no cover - compiled
    for i in range(src_rows.shape[0]):
        for c in range(kv.shape[1]):
            kv_ring[dst_rows[i], c] = kv[src_rows[i], c]
            gate_ring[dst_rows[i], c] = gate[src_rows[i], c]


_store_rows_jit = _jit(_store_rows)


def _compress(kv, gate, src_rows, dst_rows, kv_ring, gate_ring, write_first, src, src_valid, ape, overlap, w, eps,
              freqs, rows, row_dst):  # fmt: skip
    # (compiled) One compressor step: stores this step's kv/gate [T, width] rows src_rows at ring rows dst_rows
    # (before reading, with write_first, else after: see model/batch.py), and for each window closing this
    # step (src [NW, span] store rows: the ring, then this step's rows; src_valid [NW, span]) pools the window
    # per channel with a softmax over gate + ape [r, width], RMS-normalises the entry (times w [dim]), rotates
    # its trailing channels by freqs [NW, R/2, 2] and writes it to rows [*, dim] row row_dst. CSA (overlap):
    # the first r slots take channels [0, dim) (the previous window's Ca), the last r channels [dim, 2*dim)
    # (this window's Cb).
    if write_first:
        _store_rows_jit(kv, gate, src_rows, dst_rows, kv_ring, gate_ring)
    ring_rows = kv_ring.shape[0]
    span = src.shape[1]
    ratio = ape.shape[0]
    dim = rows.shape[1]
    half = freqs.shape[1]
    lead = dim - 2 * half
    for v in prange(src.shape[0]):
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

    if not write_first:
        _store_rows_jit(kv, gate, src_rows, dst_rows, kv_ring, gate_ring)


# work = windows closing this step
compress = Threaded(_compress, min_work=64)


# --- attention over a step's query blocks -----------------------------------------------------------------
def _attend(q, ring, new_kv, q_rows, q_valid, key_index, key_mask, slot, table, rows, visible, chosen, sink, scale,
            freqs, out):  # fmt: skip
    # (compiled) Shared-KV attention (keys = values) for one group of query blocks, see model/batch.py:
    #   q [T, H, D] RoPE'd queries; window keys are store rows key_index[b, :] masked by key_mask[b, i, :],
    #   where the store is ring [Rr, D] followed by new_kv [T, D]; then the compressed rows 0..n-1 of slot[b]'s
    #   sequence (row c at rows[table[slot[b], c // P], c % P] of the pool rows [blocks, P, D], model/cache.py)
    #   with n = visible[b, i], restricted to chosen[b, i, :] when chosen is not empty (the indexer's top-k:
    #   the block then reads only the rows some query of it chose).
    # Each head has a sink logit (probability mass, no value). The output is rotated back by RoPE (the
    # inverse of freqs at the query's token) and written to out[q_rows[b, i]].
    # Per block, its keys are gathered once for all its queries and heads (the KV is shared); the scores are a
    # small matmul through the linear's register tiles (rows are (query, head) pairs), masked keys get
    # probability 0; each row's softmax sum runs over its own keys alone, and the weighted values are one chain
    # of multiply-adds per entry in key order (_weighted_rows): a query's output is the same whichever other
    # queries share its block, so a token gets the same output in any step (batch invariance).
    num_blocks, block = q_rows.shape
    heads, dim = q.shape[1], q.shape[2]
    ring_rows = ring.shape[0]
    width = key_index.shape[1]
    half = freqs.shape[1]
    lead = dim - 2 * half
    picked = chosen.shape[0] > 0
    per_block = rows.shape[1]
    for b in prange(num_blocks):
        most = 0
        for i in range(block):
            if q_valid[b, i]:
                most = max(most, visible[b, i])
        # The compressed rows the block reads: every visible one, or with the indexer's choice only those some
        # query of the block chose (the others would get probability 0).
        sel = np.arange(most)
        comp = most
        if picked:
            comp = 0
            for c in range(most):
                for i in range(block):
                    if q_valid[b, i] and c < visible[b, i] and chosen[b, i, c]:
                        sel[comp] = c
                        comp += 1
                        break
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
        keys = span + comp
        kv = np.empty((keys, dim), dtype=np.float32)  # the block's keys (= values)
        for k in range(span):
            r = key_index[b, lo + k]
            _copy_row_jit(kv[k], ring[r] if r < ring_rows else new_kv[r - ring_rows])
        for j in range(comp):
            c = sel[j]
            _copy_row_jit(kv[span + j], rows[table[slot[b], c // per_block], c % per_block])
        qh = np.zeros((block * heads, dim), dtype=np.float32)  # rows (query i, head h) at i * heads + h
        for i in range(block):
            if q_valid[b, i]:
                for h in range(heads):
                    _copy_row_jit(qh[i * heads + h], q[q_rows[b, i], h])
        scores = np.empty((block * heads, keys), dtype=np.float32)
        _linear_tiles_jit(qh, kv, scores, block * heads)
        seen = np.empty(keys, dtype=np.int64)  # a query's keys (their places in kv), in key order
        kept = np.empty((heads, keys), dtype=np.float32)  # per head, its scaled scores, then e^(score - max)
        ones = np.ones((1, keys), dtype=np.float32)
        total = np.empty((heads, 1), dtype=np.float32)
        tops = np.empty(heads, dtype=np.float32)
        for i in range(block):
            if not q_valid[b, i]:
                continue
            n = visible[b, i]
            count = 0
            for k in range(keys):
                if k < span:
                    mine = key_mask[b, i, lo + k]
                else:
                    c = sel[k - span]
                    mine = c < n and (not picked or chosen[b, i, c])
                if mine:
                    seen[count] = k
                    count += 1
            for h in range(heads):
                row = scores[i * heads + h]
                top = sink[h]
                for j in range(count):
                    kept[h, j] = row[seen[j]] * scale
                    top = max(top, kept[h, j])
                tops[h] = top
                for j in range(count):
                    kept[h, j] = _exp_jit(kept[h, j] - top)
            # Each head's sum over the query's own keys, in their order, through the tiles' fixed order: the same
            # whichever other queries share the block.
            _linear_tiles_jit(kept[:, :count], ones[:, :count], total, heads)
            for h in range(heads):
                row = scores[i * heads + h]
                inv = np.float32(1.0) / (total[h, 0] + _exp_jit(sink[h] - tops[h]))
                for k in range(keys):  # (keys the query does not see: probability 0)
                    row[k] = np.float32(0.0)
                for j in range(count):
                    row[seen[j]] = kept[h, j] * inv
        values = np.empty((block * heads, dim), dtype=np.float32)
        _weighted_rows_jit(scores, kv, values, block * heads)  # (each entry in key order: see its notes)
        for i in range(block):
            if not q_valid[b, i]:
                continue
            t = q_rows[b, i]
            for h in range(heads):
                acc = values[i * heads + h]
                for d in range(lead):
                    out[t, h, d] = acc[d]
                for p2 in range(half):  # inverse RoPE: multiply by conj(freqs)
                    cr, ci = freqs[t, p2, 0], freqs[t, p2, 1]
                    re, im = acc[lead + 2 * p2], acc[lead + 2 * p2 + 1]
                    out[t, h, lead + 2 * p2] = re * cr + im * ci
                    out[t, h, lead + 2 * p2 + 1] = im * cr - re * ci


# work = query-key dot products times the keys' width, over the window's keys and the compressed rows (see
# index_select's)
attend = Threaded(_attend, min_work=1 << 17)


def _index_select(q, head_w, q_rows, q_valid, slot, table, keys, visible, topk, scale, out):  # pragma: no cover
    # (compiled) The Lightning Indexer's choice for one group of query blocks: score each visible compressed row
    # c < visible[b, i] as sum_h head_w[t, h] * relu(q[t, h] . keys[slot[b], c]) * scale and keep the `topk`
    # best (ties to the lower row: the stable sort's choice, kept by insertion into the topk best so far, no
    # sort), out [NB, Bq, n] bool. q [T, H, d], head_w [T, H], keys the indexer's pool [blocks, P, d] (row c of
    # slot s at keys[table[s, c // P], c % P]).
    num_blocks, block = q_rows.shape
    heads, dim = q.shape[1], q.shape[2]
    n = out.shape[2]
    per_block = keys.shape[1]
    flat = keys.reshape(-1, dim)  # (pool rows, so that a row is two loads, not a view per query and row)
    for b in prange(num_blocks):
        best = np.empty(topk, dtype=np.float32)  # the topk best scores so far, best first, and their rows
        rows = np.empty(topk, dtype=np.int64)
        at = np.empty(n, dtype=np.int64)  # the pool row of each of the sequence's rows
        for c in range(n):
            at[c] = np.int64(table[slot[b], c // per_block]) * per_block + c % per_block
        for i in range(block):
            for c in range(n):
                out[b, i, c] = False
            if not q_valid[b, i]:
                continue
            t = q_rows[b, i]
            m = visible[b, i]
            if m <= topk:
                for c in range(m):
                    out[b, i, c] = True
                continue
            kept = 0
            for c in range(m):
                r = at[c]
                total = np.float32(0.0)
                for h in range(heads):
                    s = np.float32(0.0)
                    for d in range(dim):
                        s += q[t, h, d] * flat[r, d]
                    total += max(s, np.float32(0.0)) * scale * head_w[t, h]
                # Insert after every kept score >= total (an equal score keeps the lower row), if it makes the cut.
                if kept == topk and total <= best[topk - 1]:
                    continue
                j = kept if kept < topk else topk - 1
                while j > 0 and best[j - 1] < total:
                    best[j] = best[j - 1]
                    rows[j] = rows[j - 1]
                    j -= 1
                best[j] = total
                rows[j] = c
                kept = min(kept + 1, topk)
            for r in range(topk):
                out[b, i, rows[r]] = True


# work = the query-row dot products of a block's queries and heads, times the rows' width: threads pay from about
# eight decode blocks of the shipped model (2 cores); a block is one prange iteration
index_select = Threaded(_index_select, min_work=1 << 17)
