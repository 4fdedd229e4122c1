"""Linears of a few rows (decode, verification) on float32 or bfloat16 weights, in L1-sized blocks of weight rows;
the threaded linear over a tuple of weights that read the same input; the grouped linear."""

from __future__ import annotations

import numpy as np

from leanserve.model.backends.cpu.kernels.base import Threaded, _f32_from_bits, _jit, numba, prange


# --- Linear for a few rows --------------------------------------------------------------------------------
def _weight(w, j, k):  # pragma: no cover - compiled through the overload below
    """w[j, k] as a float32: a float32 weight's entry, or a bfloat16 one (its uint16 bits) widened in registers
    (a bfloat16 is the top half of a float32)."""


if numba is not None:

    @numba.extending.overload(_weight, inline="always")
    def _weight_typed(w, j, k):
        if w.dtype == numba.types.float32:
            return lambda w, j, k: w[j, k]
        return lambda w, j, k: _f32_from_bits(np.int32(np.uint32(w[j, k]) << np.uint32(16)))


def _linear_tiles(x, w, out, n):  # pragma: no cover - compiled
    # out[:n] = x[:n] @ w^T for x [>=n, K], w [J, K] (float32, or bfloat16 bits widened as read): four rows of x
    # per pass over w, two weight rows at a time (eight sums in registers, six loads per eight multiply-adds);
    # the last one to three rows in one more pass (speculative verification: two to four tokens a sequence).
    # x and w must be C-contiguous for the inner loops to vectorise.
    k_dim = x.shape[1]
    rows = w.shape[0]
    t = 0
    while t + 4 <= n:
        j = 0
        while j + 2 <= rows:
            a0 = np.float32(0.0)
            a1 = np.float32(0.0)
            a2 = np.float32(0.0)
            a3 = np.float32(0.0)
            b0 = np.float32(0.0)
            b1 = np.float32(0.0)
            b2 = np.float32(0.0)
            b3 = np.float32(0.0)
            for k in range(k_dim):
                v, u = _weight(w, j, k), _weight(w, j + 1, k)
                x0, x1, x2, x3 = x[t, k], x[t + 1, k], x[t + 2, k], x[t + 3, k]
                a0 += v * x0
                a1 += v * x1
                a2 += v * x2
                a3 += v * x3
                b0 += u * x0
                b1 += u * x1
                b2 += u * x2
                b3 += u * x3
            out[t, j], out[t + 1, j], out[t + 2, j], out[t + 3, j] = a0, a1, a2, a3
            out[t, j + 1], out[t + 1, j + 1], out[t + 2, j + 1], out[t + 3, j + 1] = b0, b1, b2, b3
            j += 2
        if j < rows:
            s0 = np.float32(0.0)
            s1 = np.float32(0.0)
            s2 = np.float32(0.0)
            s3 = np.float32(0.0)
            for k in range(k_dim):
                v = _weight(w, j, k)
                s0 += v * x[t, k]
                s1 += v * x[t + 1, k]
                s2 += v * x[t + 2, k]
                s3 += v * x[t + 3, k]
            out[t, j] = s0
            out[t + 1, j] = s1
            out[t + 2, j] = s2
            out[t + 3, j] = s3
        t += 4
    if t + 3 == n:
        for j in range(rows):
            s0 = np.float32(0.0)
            s1 = np.float32(0.0)
            s2 = np.float32(0.0)
            for k in range(k_dim):
                v = _weight(w, j, k)
                s0 += v * x[t, k]
                s1 += v * x[t + 1, k]
                s2 += v * x[t + 2, k]
            out[t, j] = s0
            out[t + 1, j] = s1
            out[t + 2, j] = s2
    elif t + 2 == n:
        for j in range(rows):
            s0 = np.float32(0.0)
            s1 = np.float32(0.0)
            for k in range(k_dim):
                v = _weight(w, j, k)
                s0 += v * x[t, k]
                s1 += v * x[t + 1, k]
            out[t, j] = s0
            out[t + 1, j] = s1
    elif t + 1 == n:
        for j in range(rows):
            s = np.float32(0.0)
            for k in range(k_dim):
                s += _weight(w, j, k) * x[t, k]
            out[t, j] = s


_linear_tiles_jit = _jit(_linear_tiles)


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
                for j0 in range(0, w.shape[0], ROW_BLOCK):
                    j1 = min(w.shape[0], j0 + ROW_BLOCK)
                    _linear_tiles_jit(x, w[j0:j1], out[:, j0:j1], n)

            return blocked

        def widened(x, w, out, n):
            if n <= 4:  # (decode at batch 1, verification): each weight entry widened in registers, once
                _linear_tiles_jit(x, w, out, n)
                return
            k_dim = w.shape[1]
            buf = np.empty((ROW_BLOCK, k_dim), dtype=np.uint32)
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


LINEAR_CHUNK = 64  # weight rows per task of the threaded linear


def _chunk_ends(ws):  # pragma: no cover - compiled
    # The tasks of a tuple of weights split in chunks of LINEAR_CHUNK rows: weight i's are [ends[i], ends[i+1])
    ends = np.zeros(len(ws) + 1, dtype=np.int64)
    for i in range(len(ws)):
        ends[i + 1] = ends[i] + (ws[i].shape[0] + LINEAR_CHUNK - 1) // LINEAR_CHUNK
    return ends


def _chunk_of(ends, task):  # pragma: no cover - compiled
    # (the weight a task belongs to, its first row)
    i = 0
    while ends[i + 1] <= task:
        i += 1
    return i, (task - ends[i]) * LINEAR_CHUNK


_chunk_ends_jit = _jit(_chunk_ends)
_chunk_of_jit = _jit(_chunk_of)


def _linear(x, ws, outs):  # pragma: no cover - compiled
    # outs[i] = x @ ws[i]^T for a tuple of weights of one dtype (the linears that read the same input), the
    # weights' rows in chunks of LINEAR_CHUNK, one task each
    ends = _chunk_ends_jit(ws)
    for task in prange(ends[len(ws)]):
        i, j0 = _chunk_of_jit(ends, task)
        w, out = ws[i], outs[i]
        j1 = min(w.shape[0], j0 + LINEAR_CHUNK)
        _linear_rows_jit(x, w[j0:j1], out[:, j0:j1], x.shape[0])


# work = multiply-adds; below ~0.25M, one core finishes before a second would start
linear = Threaded(_linear, min_work=1 << 18)


def _grouped_linear(x, w, out):  # pragma: no cover - compiled
    # out [T, G, J] = per group g: x[:, g] [T, K] @ w[g] [J, K]^T
    n, groups = x.shape[0], x.shape[1]
    for g in prange(groups):
        part = np.empty((n, x.shape[2]), dtype=np.float32)
        res = np.empty((n, w.shape[1]), dtype=np.float32)
        part[:] = x[:, g]
        _linear_rows_jit(part, w[g], res, n)
        out[:, g] = res


# work = multiply-adds
grouped_linear = Threaded(_grouped_linear, min_work=1 << 18)
