"""Linears on float32 or bfloat16 weights (batch-invariant register tiles), in L1-sized blocks of weight rows;
the threaded linear over a tuple of weights that read the same input; the grouped linear; attention's weighted
rows."""

from __future__ import annotations

import numpy as np

from leanserve.model.backends.cpu.kernels.base import _EXACT, Threaded, _empty64_f32, _inlined, _jit, _share_jit, numba
from leanserve.model.backends.cpu.kernels.rowdots import _HOST_CPU
from leanserve.model.backends.cpu.kernels.simd import tile_dot, weighted_rows

# --- Linear for a few rows --------------------------------------------------------------------------------
_T4x4, _T4x1, _T3x4, _T3x1, _T2x4, _T2x1, _T1x8, _T1x1 = [
    tile_dot(r, c) for r, c in ((4, 4), (4, 1), (3, 4), (3, 1), (2, 4), (2, 1), (1, 8), (1, 1))
]
_T1S, _T2S = tile_dot(1, 1, stream=True), tile_dot(2, 1, stream=True)


def _linear_tiles(x, w, out, n):  # pragma: no cover - compiled
    # out[:n] = x[:n] @ w^T for x [>=n, K], w [J, K] (float32, or bfloat16 bits widened as read), both with their
    # last dimension contiguous: bands of four rows of x, four weight rows at a time (sixteen sums in registers,
    # eight loads per sixteen multiply-adds); the last one to three rows in one more band, a single row against
    # eight weight rows (eight chains of additions in flight). Every entry gets the same arithmetic in every tile
    # shape (simd.tile_dot): a row's output does not depend on how many rows the step has.
    rows = w.shape[0]
    t = 0
    while t + 4 <= n:
        j = 0
        while j + 4 <= rows:
            _T4x4(x, w, out, t, j)
            j += 4
        while j < rows:
            _T4x1(x, w, out, t, j)
            j += 1
        t += 4
    j = 0
    if t + 3 == n:
        while j + 4 <= rows:
            _T3x4(x, w, out, t, j)
            j += 4
        while j < rows:
            _T3x1(x, w, out, t, j)
            j += 1
    elif t + 2 == n:
        while j + 4 <= rows:
            _T2x4(x, w, out, t, j)
            j += 4
        while j < rows:
            _T2x1(x, w, out, t, j)
            j += 1
    elif t + 1 == n:
        while j + 8 <= rows:
            _T1x8(x, w, out, t, j)
            j += 8
        while j < rows:
            _T1x1(x, w, out, t, j)
            j += 1


_linear_tiles_jit = _jit(_linear_tiles, fastmath=_EXACT)  # (no reassociation: the tiles keep their order)


# The longest rows of x that meet float32 and bfloat16 weights two at a time a weight row at a time (_few_rows):
# any length, but on Zen 4 cores 2048 (two rows of 2048 float32: half of L1), longer ones taking the tiles. On a
# Zen 4 EPYC, bfloat16 [5888 x 4096] from memory on two threads at two rows of x: the tiles 29.9 GB/s against 25.5
# streamed (a read of 35.0, the same bits); the shipped model's decode at batch 2 (192 inputs, its weights in
# cache) 1.41x the time with every length through the tiles in float32, 1.13x in bfloat16 (2026-12-07).
STREAM_TWO_INPUTS = 2048 if _HOST_CPU == "znver4" else 1 << 62


def _few_rows(x, w, out, n):  # pragma: no cover - compiled
    # out[:n] = x[:n] @ w^T for one to four rows of x against a weight read from memory, each weight entry read once
    # (decode at batch 1-4, verification). One or two rows meet it a weight row at a time (each row followed by the
    # next: one sequential stream, which the prefetchers follow best, where the tiles' four or eight rows at once
    # are as many streams), with a prefetch simd.STREAM_AHEAD bytes on; the tiles' arithmetic. bfloat16 [5888 x
    # 4096] from memory on two threads: 0.79x the tiles' time at one and two rows of x, 1.2x and 1.5x at three and
    # four (a load of x per multiply-add binds), which keep the tiles (docs/kernels.md). On Zen 4 cores two long rows
    # keep them too (STREAM_TWO_INPUTS): there two rows of x of 4096 (32 KB) leave L1 while a weight row streams.
    if n == 1:
        for j in range(w.shape[0]):
            _T1S(x, w, out, 0, j)
    elif n == 2 and x.shape[1] <= STREAM_TWO_INPUTS:
        for j in range(w.shape[0]):
            _T2S(x, w, out, 0, j)
    else:
        _linear_tiles_jit(x, w, out, n)


_few_rows_jit = _jit(_few_rows, fastmath=_EXACT)  # (no reassociation, as _linear_tiles_jit)


ROW_BLOCK = 16  # weight rows per block (16 KB at 256 inputs): it stays in L1 while every row of x passes over it


def _linear_rows(x, w, out, n):  # pragma: no cover - compiled through the overload below
    """out[:n] = x[:n] @ w^T for a float32 weight, or a bfloat16 one (its uint16 bits), ROW_BLOCK weight rows at a
    time through the float32 loops (a bfloat16 block is first widened: a bfloat16 is the top half of a
    float32). Read straight from memory, each row pass of x would stream the whole weight again."""


if numba is not None:

    @numba.extending.overload(_linear_rows)
    def _linear_rows_typed(x, w, out, n):
        if w.dtype == numba.types.float32:

            def blocked(x, w, out, n):
                if n <= 4:  # (a single band of rows: every weight row is read once anyway)
                    _few_rows_jit(x, w, out, n)
                    return
                for j0 in range(0, w.shape[0], ROW_BLOCK):
                    j1 = min(w.shape[0], j0 + ROW_BLOCK)
                    _linear_tiles_jit(x, w[j0:j1], out[:, j0:j1], n)

            return blocked

        def widened(x, w, out, n):
            if n <= 4:  # (decode at batch 1-4, verification): each weight entry widened in registers, once
                _few_rows_jit(x, w, out, n)
                return
            k_dim = w.shape[1]
            buf = _empty64_f32(ROW_BLOCK, k_dim).view(np.uint32)
            for j0 in range(0, w.shape[0], ROW_BLOCK):
                block = min(ROW_BLOCK, w.shape[0] - j0)
                for r in range(block):
                    for k in range(k_dim):
                        buf[r, k] = np.uint32(w[j0 + r, k]) << np.uint32(16)
                _linear_tiles_jit(x, buf[:block].view(np.float32), out[:, j0 : j0 + block], n)

        return widened


def _linear_rows_any(x, w, out, n):  # pragma: no cover - compiled
    _linear_rows(x, w, out, n)


_linear_rows_jit = _jit(_linear_rows_any)


_W4, _W3, _W2, _W1 = [weighted_rows(r) for r in (4, 3, 2, 1)]


def _weighted_rows(p, v, out, n):  # pragma: no cover - compiled
    # out[:n] = p[:n] @ v for p [>=n, K], v [K, D] (last dimensions contiguous): every entry one chain of
    # multiply-adds in k order (simd.weighted_rows, and the last D % 32 columns one by one): a row's output
    # does not depend on the other rows, and zero weights add exact zeros.
    # Column strips outermost: a strip of v (32 columns of every key) stays in L2 while every row passes over it.
    keys, dim = v.shape
    wide = dim - dim % 32
    for d0 in range(0, wide, 32):
        r = 0
        while r < n:
            left = n - r
            if left >= 4:
                _W4(p, v, out, r, d0)
            elif left == 3:
                _W3(p, v, out, r, d0)
            elif left == 2:
                _W2(p, v, out, r, d0)
            else:
                _W1(p, v, out, r, d0)
            r += 4
    for i in range(n):
        for d in range(wide, dim):
            s = np.float32(0.0)
            for k in range(keys):
                s += p[i, k] * v[k, d]
            out[i, d] = s


_weighted_rows_jit = _jit(_weighted_rows, fastmath=_EXACT)


LINEAR_CHUNK = 64  # weight rows per task of the threaded linear, for rows of CHUNK_INPUTS inputs or more
# Shorter rows go more to a task, so that a task reads about as much of the weight: each has a fixed cost (its
# copy of x made, for FP8 x times the scales) that a task of 64 rows of 1024 inputs (wq_b) paid 512 times a call.
CHUNK_INPUTS = 16384


def _chunk_rows(w):  # pragma: no cover - compiled: weight rows per task of w [J, K]
    return LINEAR_CHUNK * max(1, CHUNK_INPUTS // max(1, w.shape[1]))


def _chunk_ends(ws):  # pragma: no cover - compiled
    # The tasks of a tuple of weights split in chunks of _chunk_rows rows: weight i's are [ends[i], ends[i+1])
    ends = np.zeros(len(ws) + 1, dtype=np.int64)
    for i in range(len(ws)):
        rows = _chunk_rows(ws[i])
        ends[i + 1] = ends[i] + (ws[i].shape[0] + rows - 1) // rows
    return ends


def _chunk_of(ws, ends, task):  # pragma: no cover - compiled
    # (the weight a task belongs to, its first row, the row after its last)
    i = 0
    while ends[i + 1] <= task:
        i += 1
    rows = _chunk_rows(ws[i])
    j0 = (task - ends[i]) * rows
    return i, j0, min(ws[i].shape[0], j0 + rows)


_chunk_rows = _inlined(_chunk_rows) if numba is not None else None
_chunk_ends_jit = _jit(_chunk_ends)
_chunk_of_jit = _jit(_chunk_of)


def _linear(x, ws, outs, part, parts):  # pragma: no cover - compiled
    # outs[i] = x @ ws[i]^T for a tuple of weights of one dtype (the linears that read the same input), the
    # weights' rows in chunks (_chunk_rows), one task each (this part's share of them: see base.Threaded)
    ends = _chunk_ends_jit(ws)
    lo, hi = _share_jit(ends[len(ws)], part, parts)
    for task in range(lo, hi):
        i, j0, j1 = _chunk_of_jit(ws, ends, task)
        w, out = ws[i], outs[i]
        _linear_rows_jit(x, w[j0:j1], out[:, j0:j1], x.shape[0])


# work = multiply-adds; below ~0.25M, one core finishes before a second would start
linear = Threaded(_linear, min_work=1 << 18)


def _grouped_linear(x, w, out, part, parts):  # pragma: no cover - compiled
    # out [T, G, J] = per group g: x[:, g] [T, K] @ w[g] [J, K]^T
    n, groups = x.shape[0], x.shape[1]
    lo, hi = _share_jit(groups, part, parts)
    for g in range(lo, hi):
        xg = np.empty((n, x.shape[2]), dtype=np.float32)
        res = np.empty((n, w.shape[1]), dtype=np.float32)
        xg[:] = x[:, g]
        _linear_rows_jit(xg, w[g], res, n)
        out[:, g] = res


# work = multiply-adds
grouped_linear = Threaded(_grouped_linear, min_work=1 << 18)
