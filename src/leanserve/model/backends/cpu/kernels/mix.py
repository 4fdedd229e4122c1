"""RMSNorm, mHC (`hc_pre`: the streams' projection, Sinkhorn-normalised comb, collapse and norm; `hc_post`) and
norm + RoPE, on float32 arrays."""

from __future__ import annotations

import math

import numpy as np

from leanserve.model.backends.cpu.kernels.base import _EXACT, Threaded, _exp_jit, _inlined, _jit, _share_jit, numba
from leanserve.model.backends.cpu.kernels.linear import _linear_rows_jit


# --- RMSNorm --------------------------------------------------------------------------------------------
def _rms_norm(x, w, eps, out, part, parts):  # pragma: no cover - compiled
    # x, out [N, D]; w [D] or empty (unweighted); this part's rows (see base.Threaded)
    n, d = x.shape
    weighted = w.shape[0] > 0
    lo, hi = _share_jit(n, part, parts)
    for t in range(lo, hi):
        s = np.float32(0.0)
        for i in range(d):
            s += x[t, i] * x[t, i]
        r = np.float32(1.0) / np.float32(math.sqrt(s / np.float32(d) + np.float32(eps)))
        if weighted:
            for i in range(d):
                out[t, i] = x[t, i] * r * w[i]
        else:
            for i in range(d):
                out[t, i] = x[t, i] * r


rms_norm = Threaded(_rms_norm, min_work=64)


# --- mHC --------------------------------------------------------------------------------------------------
# The mHC weights of up to LANES tokens are computed side by side, each value stored as m[entry, lane]: every
# step of the Sinkhorn loop is then a vector operation over the lanes instead of a chain of scalar divisions.
# (The lane loops run to m's width, a number known only at run time: LLVM unrolls a loop of a constant count
# this small into scalar code instead of vectorising it.) Up to FEW_LANES lanes the Sinkhorn loop runs a lane
# at a time instead: a vector loop's set-up would cost more than its iterations. No reassociation and no
# reciprocals here (_EXACT): each lane then gets the same IEEE operations in the same order either way, and
# the two loops give identical weights.
LANES = 32
FEW_LANES = 4


def _comb(c0, hc, x, y, it):  # pragma: no cover - compiled: entry y of line x in Sinkhorn pass `it`
    return c0 + x * hc + y if it % 2 == 1 else c0 + y * hc + x


_comb_jit = _inlined(_comb) if numba is not None else None


def _mhc_lanes(m, scale, base, hc, hc_eps, iters):  # pragma: no cover - compiled
    # m [(2+hc)*hc, lanes] mixes, in place -> pre (sigmoid + eps) | post (2 * sigmoid) | comb (softmax per row
    # + eps, then Sinkhorn-normalised; row-major). m [hc, lanes] (hc_head's mixes): pre only.
    one = np.float32(1.0)
    eps = np.float32(hc_eps)
    lanes = m.shape[1]
    for i in range(hc):
        for a in range(lanes):
            m[i, a] = one / (one + _exp_jit(-(m[i, a] * scale[0] + base[i]))) + eps
    if m.shape[0] == hc:
        return
    for i in range(hc):
        for a in range(lanes):
            z = m[hc + i, a] * scale[1] + base[hc + i]
            m[hc + i, a] = np.float32(2.0) / (one + _exp_jit(-z))
    c0 = 2 * hc
    top = np.empty(lanes, dtype=np.float32)
    total = np.empty(lanes, dtype=np.float32)
    for i in range(hc):  # softmax over each row, + eps
        row = c0 + i * hc
        top[:] = -np.inf
        for j in range(hc):
            for a in range(lanes):
                m[row + j, a] = m[row + j, a] * scale[2] + base[row + j]
                top[a] = max(top[a], m[row + j, a])
        total[:] = 0.0
        for j in range(hc):
            for a in range(lanes):
                m[row + j, a] = _exp_jit(m[row + j, a] - top[a])
                total[a] += m[row + j, a]
        for j in range(hc):
            for a in range(lanes):
                m[row + j, a] = m[row + j, a] / total[a] + eps
    # Sinkhorn-Knopp: columns first, then rows and columns, `iters` times in all; pass `it` normalises line x
    # (a row on odd passes, a column on even ones), whose y-th entry is m[_comb(c0, hc, x, y, it), lane].
    if lanes <= FEW_LANES:  # (one lane at a time: the same operations in the same order)
        for a in range(lanes):
            for it in range(2 * iters - 1):
                for x in range(hc):
                    s = np.float32(0.0)
                    for y in range(hc):
                        s += m[_comb_jit(c0, hc, x, y, it), a]
                    s += eps
                    for y in range(hc):
                        m[_comb_jit(c0, hc, x, y, it), a] /= s
        return
    for it in range(2 * iters - 1):
        for x in range(hc):
            total[:] = 0.0
            for y in range(hc):
                k = _comb_jit(c0, hc, x, y, it)
                for a in range(lanes):
                    total[a] += m[k, a]
            for a in range(lanes):
                total[a] += eps
            for y in range(hc):
                k = _comb_jit(c0, hc, x, y, it)
                for a in range(lanes):
                    m[k, a] /= total[a]


_mhc_lanes_jit = _jit(_mhc_lanes, fastmath=_EXACT)


def _hc_pre_rows(streams, t0, lanes, fn, scale, base, hc_eps, iters, norm_eps, norm_w, x_out, weights_out):
    # (compiled) hc_pre of tokens [t0, t0 + lanes) side by side (see _hc_pre)
    hc, d = streams.shape[1], streams.shape[2]
    width = fn.shape[0]
    flat = streams.reshape(streams.shape[0], hc * d)
    raw = np.empty((lanes, width), dtype=np.float32)
    _linear_rows_jit(flat[t0 : t0 + lanes], fn, raw, lanes)
    m = np.empty((width, lanes), dtype=np.float32)
    for a in range(lanes):
        t = t0 + a
        s = np.float32(0.0)
        for i in range(hc):
            for k in range(d):
                s += streams[t, i, k] * streams[t, i, k]
        r = np.float32(1.0) / np.float32(math.sqrt(s / np.float32(hc * d) + np.float32(norm_eps)))
        for j in range(width):
            m[j, a] = raw[a, j] * r
    _mhc_lanes_jit(m, scale, base, hc, hc_eps, iters)
    for a in range(lanes):
        t = t0 + a
        for j in range(width):
            weights_out[t, j] = m[j, a]
        pre = m[0, a]
        for k in range(d):
            x_out[t, k] = pre * streams[t, 0, k]
        for i in range(1, hc):
            pre = m[i, a]
            for k in range(d):
                x_out[t, k] += pre * streams[t, i, k]
        s = np.float32(0.0)
        for k in range(d):
            s += x_out[t, k] * x_out[t, k]
        r = np.float32(1.0) / np.float32(math.sqrt(s / np.float32(d) + np.float32(norm_eps)))
        for k in range(d):
            x_out[t, k] = x_out[t, k] * r * norm_w[k]


_hc_pre_rows_jit = _jit(_hc_pre_rows)


def _lane_block(n):  # pragma: no cover - compiled: tokens per block of hc_pre (at least two blocks from 16 on)
    return min(LANES, max(LANES // 4, (n + 1) // 2))


_lane_block_jit = _jit(_lane_block)


def _hc_pre(streams, fn, scale, base, hc_eps, iters, norm_eps, norm_w, x_out, weights_out, part,
            parts):  # fmt: skip  # pragma: no cover - compiled
    # streams [T, hc, D]; fn [M, hc*D], M = (2+hc)*hc (or hc: hc_head, pre only): the mixes are
    # RMSNorm(flat streams) @ fn^T, computed as (flat streams @ fn^T) * the row's RMS scale (one number per row).
    # weights_out [T, M]: pre | post | comb (see _mhc_lanes); x_out [T, D]: RMSNorm_w(sum_i pre_i * streams_i).
    n = streams.shape[0]
    size = _lane_block_jit(n)
    lo, hi = _share_jit((n + size - 1) // size, part, parts)
    for blk in range(lo, hi):
        t0 = blk * size
        lanes = min(size, n - t0)
        _hc_pre_rows_jit(streams, t0, lanes, fn, scale, base, hc_eps, iters, norm_eps, norm_w, x_out, weights_out)


hc_pre = Threaded(_hc_pre, min_work=LANES // 2)


def _post_mix(block_out, streams, post, comb, out, t):  # pragma: no cover - compiled
    # out[t, j] = post[t, j] * block_out[t] + sum_i comb[t, i * hc + j] * streams[t, i] (comb [T, hc * hc], row-major)
    hc, d = streams.shape[1], streams.shape[2]
    for j in range(hc):
        p = post[t, j]
        for k in range(d):
            out[t, j, k] = p * block_out[t, k]
        for i in range(hc):
            c = comb[t, i * hc + j]
            for k in range(d):
                out[t, j, k] += c * streams[t, i, k]


_post_mix_jit = _jit(_post_mix)


def _hc_post(block_out, streams, post, comb, out, part, parts):  # pragma: no cover - compiled
    # every token's _post_mix (this part's tokens): the new streams out [T, hc, D]
    lo, hi = _share_jit(streams.shape[0], part, parts)
    for t in range(lo, hi):
        _post_mix_jit(block_out, streams, post, comb, out, t)


hc_post = Threaded(_hc_post, min_work=16)


def _hc_post_pre(block_out, streams, before, out, fn, scale, base, hc_eps, iters, norm_eps, norm_w, x_out,
                 weights_out):  # fmt: skip  # pragma: no cover - compiled
    # One site's hc_post into `out` (its post and comb weights read from `before`, that site's hc_pre weights
    # [T, M]: pre | post | comb) and the next site's hc_pre of it (x_out, weights_out): what hc_post then hc_pre
    # compute, in one call, on one thread (the decode path takes it for the few tokens where calls cost most).
    n, hc = streams.shape[0], streams.shape[1]
    post, comb = before[:, hc : 2 * hc], before[:, 2 * hc :]
    for t in range(n):
        _post_mix_jit(block_out, streams, post, comb, out, t)
    size = _lane_block_jit(n)
    for t0 in range(0, n, size):
        lanes = min(size, n - t0)
        _hc_pre_rows_jit(out, t0, lanes, fn, scale, base, hc_eps, iters, norm_eps, norm_w, x_out, weights_out)


hc_post_pre = _jit(_hc_post_pre)


# --- RoPE -------------------------------------------------------------------------------------------------
def _norm_rope(x, w, eps, normalize, freqs, inverse, out, part, parts):  # pragma: no cover - compiled
    # x, out [T, H, D]; freqs [T, R/2, 2] (real, imaginary) of scale * e^(i*theta). With `normalize`, each
    # head is first RMS-normalised over D (times w unless w is empty). Then the trailing R channels of every
    # head are rotated in interleaved pairs (by -theta if `inverse`); the channels before them are kept.
    n, h, d = x.shape
    half = freqs.shape[1]
    lead = d - 2 * half
    weighted = w.shape[0] > 0
    lo, hi = _share_jit(n, part, parts)
    for t in range(lo, hi):
        for a in range(h):
            r = np.float32(1.0)
            if normalize:
                s = np.float32(0.0)
                for k in range(d):
                    s += x[t, a, k] * x[t, a, k]
                r = np.float32(1.0) / np.float32(math.sqrt(s / np.float32(d) + np.float32(eps)))
            for k in range(d):
                out[t, a, k] = x[t, a, k] * r * w[k] if weighted else x[t, a, k] * r
            for p in range(half):
                c, s = freqs[t, p, 0], freqs[t, p, 1]
                if inverse:
                    s = -s
                re, im = out[t, a, lead + 2 * p], out[t, a, lead + 2 * p + 1]
                out[t, a, lead + 2 * p] = re * c - im * s
                out[t, a, lead + 2 * p + 1] = re * s + im * c


norm_rope = Threaded(_norm_rope, min_work=16)
