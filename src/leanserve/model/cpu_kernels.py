"""Small CPU kernels compiled with numba, for float32 math on small tensors where each torch op would cost
more in dispatch than in arithmetic, and for elementwise chains that torch would run as many passes over
memory. Each kernel's math has a torch statement too (the torch
backend's, used for other dtypes and devices, and for autograd); tests/test_kernels.py compares the two.

Kernels take numpy views of contiguous float32 CPU tensors and write into an output array; the CPU backend
(cpu_backend.py) says when they apply, and decode.py calls them on numpy arrays.
"""

from __future__ import annotations

import contextlib
import math
import types

import numpy as np
import torch

from leanserve.model.quant import Fp4Weight, Fp8Experts, Fp8Weight

try:
    import numba
    import numba.extending
except ImportError:  # the torch path is used instead
    numba = None

# Rows are copied element by element in the kernels' loops: numba's slice assignment (a[i] = b[j]) checks the
# two for overlap at every call, which costs more than copying a row of 64 floats.
# Reassociation lets reductions vectorise; no "no-NaN/no-inf" flags, since masks use -inf.
_FLAGS = {"reassoc", "contract", "nsz", "arcp"}
EMPTY = np.empty(0, dtype=np.float32)  # "no weight"


_EXACT = {"contract"}  # (fused multiply-adds only: for kernels whose results must not depend on vectorisation)
# Division by zero gives inf or nan, as in torch, instead of numba's default ZeroDivisionError check: that check
# is a branch at every division, and a branch in a loop stops it from vectorising.
_OPTIONS = {"nogil": True, "error_model": "numpy"}


def _jit(fn, parallel: bool = False, fastmath=_FLAGS):
    if numba is None:
        return None
    if parallel:  # numba's on-disk cache tells builds apart by function name, not by options: rename
        fn = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_threaded", fn.__defaults__)
        fn.__qualname__ = fn.__name__
    return numba.njit(cache=True, parallel=parallel, fastmath=fastmath, **_OPTIONS)(fn)


def _inlined(fn):
    """A helper compiled into the kernels that call it."""
    return numba.njit(inline="always", fastmath=_FLAGS, **_OPTIONS)(fn)


prange = numba.prange if numba is not None else range


# --- e^x that vectorises ----------------------------------------------------------------------------------
# math.exp compiles to a libm call per element (~5 ns, and it stops a loop from vectorising). This one is
# plain float32 arithmetic: x = n*ln2 + r with |r| <= ln2/2, e^r by a degree-7 polynomial, 2^n put in the
# exponent bits; within 2 ulp of e^x over the clamped range [-87, 88] (e^-87 stands in for 0).
if numba is not None:
    from llvmlite import ir

    @numba.extending.intrinsic
    def _f32_from_bits(typingctx, bits):  # an int32's bits as a float32
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())

        return numba.types.float32(numba.types.int32), codegen


def _exp(x):  # pragma: no cover - compiled
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    n = np.floor(x * np.float32(1.44269504) + np.float32(0.5))
    r = x - n * np.float32(0.693359375) - n * np.float32(-2.12194440e-4)  # ln2 in two parts (Cody-Waite)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    return (p * r * r + r + np.float32(1.0)) * _f32_from_bits(np.int32((np.int32(n) + np.int32(127)) << np.int32(23)))


_exp_jit = _inlined(_exp) if numba is not None else None


def _copy_row(dst, src):  # pragma: no cover - compiled: dst[:] = src for two 1-D rows, as a plain loop
    for d in range(dst.shape[0]):
        dst[d] = src[d]


_copy_row_jit = _inlined(_copy_row) if numba is not None else None


class Threaded:
    """A kernel compiled twice: for one thread, and with its outer `prange` loop spread over all cores. A call
    `kernel(work, *args)` takes the threaded build when `work` (the caller's measure of the call's size, e.g.
    tokens or multiply-adds) reaches `min_work`: below that, waking the other cores costs more than it saves.
    Each iteration of a threaded loop writes only its own outputs: no races and no sums shared between threads.
    (The two builds are compiled separately and may vectorise a sum in a different order: float32 rounding.)"""

    def __init__(self, fn, min_work: int) -> None:
        self.one, self.min_work = _jit(fn), min_work
        self.all = _jit(fn, parallel=True) if numba is not None else None

    def __call__(self, work: int, *args):
        if work >= self.min_work and _threads_ok():
            return self.all(*args)
        return self.one(*args)


_threaded_ok: bool | None = None
_max_threads: int | None = None  # a cap (pipeline stages sharing the machine's cores), None = torch's count


def limit_threads(n: int | None) -> None:
    """Caps the kernels' threads in this process (None: follow torch's thread count)."""
    global _max_threads
    _max_threads = n


@contextlib.contextmanager
def one_thread():
    """Runs every kernel's one-thread build (tests compare it with the threaded one)."""
    global _max_threads
    before, _max_threads = _max_threads, 1
    try:
        yield
    finally:
        _max_threads = before


def _threads_ok() -> bool:
    """Whether threaded builds run: torch may use more than one thread (`--threads`, torch.set_num_threads),
    and numba has more than one and its OpenMP (or TBB) threading layer. Its fallback layer (workqueue) costs
    more to wake than these kernels take, so it is not used."""
    global _threaded_ok
    if torch.get_num_threads() < 2 or (_max_threads is not None and _max_threads < 2):
        return False
    if _threaded_ok is None:
        _threaded_ok = False
        if numba.config.NUMBA_NUM_THREADS > 1:
            _probe(np.zeros(2, dtype=np.float32))
            _threaded_ok = numba.threading_layer() in ("omp", "tbb")
    return _threaded_ok


def _probe_fn(x):  # pragma: no cover - compiled
    for i in prange(x.shape[0]):
        x[i] += np.float32(1.0)


_probe = _jit(_probe_fn, parallel=True)


_enabled = numba is not None


@contextlib.contextmanager
def disabled():
    """As if numba were missing: models built meanwhile get the torch backend, and step metadata the general
    builder (the references the tests compare with)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def available() -> bool:
    """Whether the kernels run at all (numba installed and not disabled)."""
    return _enabled


def weight_np(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a tensor for the kernels; bfloat16 and float8 (which numpy lacks) as their raw bits."""
    t = t.detach()
    if t.dtype == torch.float8_e4m3fn:  # (FP8 weights: their bytes)
        return t.view(torch.uint8).numpy()
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def np_(t: torch.Tensor | None) -> np.ndarray:
    return EMPTY if t is None else t.detach().numpy()


# --- RMSNorm --------------------------------------------------------------------------------------------
def _rms_norm(x, w, eps, out):  # pragma: no cover - compiled
    # x, out [N, D]; w [D] or empty (unweighted)
    n, d = x.shape
    weighted = w.shape[0] > 0
    for t in prange(n):
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


def _hc_pre(streams, fn, scale, base, hc_eps, iters, norm_eps, norm_w, x_out, weights_out):  # pragma: no cover
    # streams [T, hc, D]; fn [M, hc*D], M = (2+hc)*hc (or hc: hc_head, pre only): the mixes are
    # RMSNorm(flat streams) @ fn^T, computed as (flat streams @ fn^T) * the row's RMS scale (one number per row).
    # weights_out [T, M]: pre | post | comb (see _mhc_lanes); x_out [T, D]: RMSNorm_w(sum_i pre_i * streams_i).
    n, hc, d = streams.shape
    width = fn.shape[0]
    flat = streams.reshape(n, hc * d)
    size = min(LANES, max(LANES // 4, (n + 1) // 2))  # (at least two blocks from 2 * LANES // 4 tokens on)
    for blk in prange((n + size - 1) // size):
        t0 = blk * size
        lanes = min(size, n - t0)
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


hc_pre = Threaded(_hc_pre, min_work=LANES // 2)


def _hc_post(block_out, streams, post, comb, out):  # pragma: no cover - compiled
    # out[t, j] = post[t, j] * block_out[t] + sum_i comb[t, i, j] * streams[t, i]
    n, hc, d = streams.shape
    for t in prange(n):
        for j in range(hc):
            p = post[t, j]
            for k in range(d):
                out[t, j, k] = p * block_out[t, k]
            for i in range(hc):
                c = comb[t, i, j]
                for k in range(d):
                    out[t, j, k] += c * streams[t, i, k]


hc_post = Threaded(_hc_post, min_work=16)


# --- RoPE -------------------------------------------------------------------------------------------------
def _norm_rope(x, w, eps, normalize, freqs, inverse, out):  # pragma: no cover - compiled
    # x, out [T, H, D]; freqs [T, R/2, 2] (real, imaginary) of scale * e^(i*theta). With `normalize`, each
    # head is first RMS-normalised over D (times w unless w is empty). Then the trailing R channels of every
    # head are rotated in interleaved pairs (by -theta if `inverse`); the channels before them are kept.
    n, h, d = x.shape
    half = freqs.shape[1]
    lead = d - 2 * half
    weighted = w.shape[0] > 0
    for t in prange(n):
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


class Matmuls:
    """x [T, in] @ w^T for each of `weights` ([out, in] float32, bfloat16 bits, or an Fp8Weight of numpy views),
    one kernel call per format, the calls worked out once (a decode plan keeps one per linear it runs):
    `matmuls(x)` -> new float32 arrays [T, out], one per weight."""

    def __init__(self, weights: tuple) -> None:
        self.widths = tuple([w.shape[0] for w in weights])
        groups: dict = {}
        for i, w in enumerate(weights):
            groups.setdefault("fp8" if isinstance(w, Fp8Weight) else w.dtype, []).append(i)
        self.calls = []  # (kernel, multiply-adds per row, its weight arguments, the outputs it writes)
        for kind, idx in groups.items():
            ws = [weights[i] for i in idx]
            work = sum([w.shape[0] * w.shape[1] for w in ws])
            if kind == "fp8":
                self.calls.append((linear_fp8, work, (tuple([w.q for w in ws]), tuple([w.scale for w in ws])), idx))
            else:
                self.calls.append((linear, work, (tuple(ws),), idx))

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, ...]:
        n = x.shape[0]
        outs = tuple([np.empty((n, w), dtype=np.float32) for w in self.widths])
        for kernel, work, args, idx in self.calls:
            kernel(n * work, x, *args, tuple([outs[i] for i in idx]) if len(idx) < len(outs) else outs)
        return outs


def matmuls(x: np.ndarray, weights: tuple) -> tuple[np.ndarray, ...]:
    """Matmuls(weights)(x), for a call made once."""
    return Matmuls(weights)(x)


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


# --- FP8 / FP4 weights, dequantized as they are read (see quant.py) -------------------------------------------
# A block of ROW_BLOCK weight rows is decoded into a float32 buffer (values times their block's scale, the same
# float32 products as quant.py's dequantization) and goes through the float32 loops: the same sums as on the
# dequantized weight. For one row of x (decode at batch 1) the decoded values meet x in registers instead, each
# scale block's sum then times its scale (exact: a power of two), a different float32 summation order. The
# decoders are integer arithmetic (they vectorise): an e4m3 byte's bits shifted into a float32's, the rebase folded
# into the block's scale (_e4m3_raw); FP4 codes by their exponent and mantissa bits, or a table lookup on AVX-512
# (_fp4_row_dot_avx512).
# The e4m3fn NaN bytes (0x7F, 0xFF) are not decoded as NaN (the quantizers never write them).
FP8_BLOCK = 128
FP4_GROUP = 32


def _ue8m0(e):  # pragma: no cover - compiled: a UE8M0 exponent byte -> 2^(e - 127)
    e = np.int32(e)
    return _f32_from_bits(e << np.int32(23)) if e > 0 else np.float32(2.0**-127)


def _e4m3(b):  # pragma: no cover - compiled: an e4m3fn byte -> float32 (the general decoder, see _e4m3_raw)
    b = np.int32(b)
    mag = b & np.int32(0x7F)
    normal = _f32_from_bits((mag << np.int32(20)) + np.int32(120 << 23))  # 2^(E-7) * (1 + m/8)
    v = normal if mag >= np.int32(8) else np.float32(mag) * np.float32(2.0**-9)
    return -v if b & np.int32(0x80) else v


def _e4m3_raw(b):  # pragma: no cover - compiled: an e4m3fn byte's value times 2^-120, exactly
    # Its bits (sign, E, m) shifted into a float32's sign, exponent and mantissa: 2^(E - 127) * (1 + m/8), or for
    # E = 0 the float32 subnormal m * 2^-129, i.e. the e4m3 value times 2^-120 (integer ops only, no select). Its
    # block scale 2^(e - 127) then comes times 2^120 (_raw_scale), which float32 holds for exponents e <= 134.
    # (As a sign-extended int8 shifted by 20, the sign fills bits 27-31: masked to bit 31, with E and m kept.)
    return _f32_from_bits((np.int32(np.int8(b)) << np.int32(20)) & np.int32(0x87F00000 - 2**32))


RAW_SCALE_MAX = 134  # the largest UE8M0 exponent whose scale times 2^120 is a float32


def _raw_scale(e):  # pragma: no cover - compiled: 2^(e - 127) * 2^120, for e <= RAW_SCALE_MAX
    return _f32_from_bits((np.int32(e) + np.int32(120)) << np.int32(23))


def _e2m1(c):  # pragma: no cover - compiled: an FP4 e2m1 code (0..15) -> float32
    c = np.int32(c)
    mag = c & np.int32(7)
    normal = _f32_from_bits((mag << np.int32(22)) + np.int32(126 << 23))  # 2^(E-1) * (1 + m/2)
    v = normal if mag >= np.int32(2) else np.float32(mag) * np.float32(0.5)
    return -v if c & np.int32(8) else v


if numba is not None:
    _ue8m0 = _inlined(_ue8m0)
    _e4m3 = _inlined(_e4m3)
    _e4m3_raw = _inlined(_e4m3_raw)
    _raw_scale = _inlined(_raw_scale)
    _e2m1 = _inlined(_e2m1)


def _fp8_row(q, s, row, buf, r):  # pragma: no cover - compiled: buf[r] = row `row` of the FP8 weight (q, s)
    k_dim = q.shape[1]
    full = k_dim // FP8_BLOCK
    srow = row // FP8_BLOCK
    for kb in range(full):  # (a fixed trip count: the loop vectorises)
        e = s[srow, kb]
        base = kb * FP8_BLOCK
        if e <= RAW_SCALE_MAX:  # (the same float32 products: both factors are the exact ones times 2^+-120)
            sc = _raw_scale(e)
            for i in range(FP8_BLOCK):
                buf[r, base + i] = _e4m3_raw(q[row, base + i]) * sc
        else:
            sc = _ue8m0(e)
            for i in range(FP8_BLOCK):
                buf[r, base + i] = _e4m3(q[row, base + i]) * sc
    if full * FP8_BLOCK < k_dim:
        sc = _ue8m0(s[srow, full])
        for k in range(full * FP8_BLOCK, k_dim):
            buf[r, k] = _e4m3(q[row, k]) * sc


def _fp4_row(packed, s, row, buf, r):  # pragma: no cover - compiled: buf[r] = row `row` of the FP4 weight
    step = FP4_GROUP // 2
    for g in range(s.shape[1]):
        sc = _ue8m0(s[row, g])
        base = g * step
        for i in range(step):
            byte = np.int32(packed[row, base + i])
            buf[r, 2 * (base + i)] = _e2m1(byte & np.int32(15)) * sc
            buf[r, 2 * (base + i) + 1] = _e2m1(byte >> np.int32(4)) * sc


if numba is not None:
    _fp8_row = _inlined(_fp8_row)
    _fp4_row = _inlined(_fp4_row)


if numba is not None:

    @numba.extending.intrinsic
    def _fp8_row_dot(typingctx, q, s, row, srow, x, full):
        # float32 sum over the first `full` 128-blocks of row `row` of the FP8 weight (q bytes, s UE8M0 grid, its
        # scale row srow) times x[0]; q's and x's last dimensions contiguous. In vector registers: per block, 8
        # vectors of 16 bytes decoded as _e4m3_raw (a sign-extended byte shifted and masked) and multiplied into
        # one block sum, which is then times 2^120 and times the block's scale (two exact power-of-two products,
        # no fast-math flags: never merged), added per lane; the lanes summed at the end.
        from numba.core import cgutils

        def codegen(context, builder, signature, args):
            q_t, s_t, _, _, x_t, _ = signature.args
            qa = context.make_array(q_t)(context, builder, args[0])
            sa = context.make_array(s_t)(context, builder, args[1])
            xa = context.make_array(x_t)(context, builder, args[4])
            row_, srow_, full_ = args[2], args[3], args[5]
            f32, i32, i8 = ir.FloatType(), ir.IntType(32), ir.IntType(8)
            v16f, v16i, v16b = ir.VectorType(f32, 16), ir.VectorType(i32, 16), ir.VectorType(i8, 16)
            intp = context.get_value_type(numba.types.intp)
            fast = ("contract",)
            total_ptr = cgutils.alloca_once_value(builder, ir.Constant(v16f, [0.0] * 16))
            zero = ir.Constant(i32, 0)
            undef = ir.Constant(v16f, ir.Undefined)

            def broadcast(v):
                return builder.shuffle_vector(
                    builder.insert_element(undef, v, zero), undef, ir.Constant(v16i, [0] * 16)
                )

            with cgutils.for_range(builder, full_) as loop:
                base = builder.mul(loop.index, ir.Constant(intp, FP8_BLOCK))
                accs = [ir.Constant(v16f, [0.0] * 16), ir.Constant(v16f, [0.0] * 16)]
                for v in range(FP8_BLOCK // 16):
                    k = builder.add(base, ir.Constant(intp, 16 * v))
                    qp = cgutils.get_item_pointer(context, builder, q_t, qa, [row_, k], wraparound=False)
                    b = builder.sext(builder.load(builder.bitcast(qp, v16b.as_pointer()), align=1), v16i)
                    bits = builder.and_(
                        builder.shl(b, ir.Constant(v16i, [20] * 16)), ir.Constant(v16i, [0x87F00000 - 2**32] * 16)
                    )
                    xp = cgutils.get_item_pointer(
                        context, builder, x_t, xa, [ir.Constant(intp, 0), k], wraparound=False
                    )
                    xv = builder.load(builder.bitcast(xp, v16f.as_pointer()), align=4)
                    prod = builder.fmul(builder.bitcast(bits, v16f), xv, flags=fast)
                    accs[v % 2] = builder.fadd(accs[v % 2], prod, flags=fast)
                block = builder.fadd(accs[0], accs[1], flags=fast)
                sp = cgutils.get_item_pointer(context, builder, s_t, sa, [srow_, loop.index], wraparound=False)
                e = builder.zext(builder.load(sp), i32)  # UE8M0: 2^(e - 127), e = 0 -> 2^-127
                sbits = builder.select(
                    builder.icmp_unsigned("==", e, zero),
                    ir.Constant(i32, 1 << 22),
                    builder.shl(e, ir.Constant(i32, 23)),
                )
                block = builder.fmul(block, broadcast(ir.Constant(f32, 2.0**120)))
                block = builder.fmul(block, broadcast(builder.bitcast(sbits, f32)))
                builder.store(builder.fadd(builder.load(total_ptr), block, flags=fast), total_ptr)
            v = builder.load(total_ptr)
            width = 16
            while width > 1:
                width //= 2
                a = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, width), list(range(width))))
                c = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, width), list(range(width, 2 * width))))
                v = builder.fadd(a, c)
            return builder.extract_element(v, zero)

        return numba.types.float32(q, s, row, srow, x, full), codegen


def _fp8_rows(x, q, s, r0, out, n):  # pragma: no cover - compiled
    # out[:n, :m] = x[:n] @ W[r0 : r0 + m]^T, m = out.shape[1], for the FP8 weight W: q [J, K] (e4m3 bytes),
    # s [ceil(J / 128), ceil(K / 128)] UE8M0 exponents
    m, k_dim = out.shape[1], q.shape[1]
    full = k_dim // FP8_BLOCK
    if n == 1:  # one row (decode at batch 1): each block's sum of products in registers, then times its scale
        vector = q.strides[1] == 1 and x.strides[1] == 4  # (_fp8_row_dot's contiguous loads)
        for j in range(m):
            row = r0 + j
            srow = row // FP8_BLOCK
            total = np.float32(0.0)
            if vector:
                total = _fp8_row_dot(q, s, row, srow, x, full)
            for kb in range(0 if not vector else full, full):
                base = kb * FP8_BLOCK
                e = s[srow, kb]
                acc = np.float32(0.0)
                if e <= RAW_SCALE_MAX:
                    for i in range(FP8_BLOCK):
                        acc += _e4m3_raw(q[row, base + i]) * x[0, base + i]
                    total += acc * _raw_scale(e)
                else:
                    for i in range(FP8_BLOCK):
                        acc += _e4m3(q[row, base + i]) * x[0, base + i]
                    total += acc * _ue8m0(e)
            if full * FP8_BLOCK < k_dim:
                acc = np.float32(0.0)
                for k in range(full * FP8_BLOCK, k_dim):
                    acc += _e4m3(q[row, k]) * x[0, k]
                total += acc * _ue8m0(s[srow, full])
            out[0, j] = total
        return
    buf = np.empty((ROW_BLOCK, k_dim), dtype=np.float32)
    for j0 in range(0, m, ROW_BLOCK):
        block = min(ROW_BLOCK, m - j0)
        for r in range(block):
            _fp8_row(q, s, r0 + j0 + r, buf, r)
        _linear_tiles_jit(x, buf[:block], out[:, j0 : j0 + block], n)


# FP4 at batch 1, on AVX-512: each row's dot product in vector registers (LLVM IR below: 16-byte groups of 32
# values, 16 groups and their 16 scales per iteration), the codes decoded by a 16-entry table lookup in one instruction (vpermps) instead of the
# bit arithmetic the compiled loops need: x is split into its even and odd elements once per call (byte j holds
# element 2j in its low nibble, 2j + 1 in its high one), so the products of the low and high nibbles meet
# contiguous halves of x; each group's products times its scale are summed per lane over the row, and the lanes
# at the end (a float32 summation order of its own). Elsewhere the loop in _fp4_rows does the same math.
_AVX512 = False
if numba is not None:
    import llvmlite.binding as _llvm

    _AVX512 = bool(_llvm.get_host_cpu_features().get("avx512f", False))

    @numba.extending.intrinsic
    def _fp4_row_dot_avx512(typingctx, packed, s, row, xe, xo):
        # float32 sum_k W[row, k] * x[k], W FP4 (packed [J, K / 2] C-contiguous uint8, s [J, K / 32] UE8M0)
        from numba.core import cgutils

        def codegen(context, builder, signature, args):
            pk_t, s_t, _, xe_t, xo_t = signature.args
            pk, sc = (
                context.make_array(pk_t)(context, builder, args[0]),
                context.make_array(s_t)(context, builder, args[1]),
            )
            xe_a = context.make_array(xe_t)(context, builder, args[3])
            xo_a = context.make_array(xo_t)(context, builder, args[4])
            row_ = args[2]
            f32, i32, i8 = ir.FloatType(), ir.IntType(32), ir.IntType(8)
            v16f, v16i, v16b = ir.VectorType(f32, 16), ir.VectorType(i32, 16), ir.VectorType(i8, 16)
            intp = context.get_value_type(numba.types.intp)
            lut = ir.Constant(
                v16f, [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
            )
            perm = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(v16f, [v16f, v16i]), "llvm.x86.avx512.permvar.sf.512"
            )
            groups = builder.udiv(builder.extract_value(pk.shape, 1), ir.Constant(intp, 16))
            acc_ptr = cgutils.alloca_once_value(builder, ir.Constant(v16f, [0.0] * 16))
            zero = ir.Constant(i32, 0)

            def scales(e):  # UE8M0 exponents (i32 or <16 x i32>) -> 2^(e - 127), e = 0 -> 2^-127
                like = e.type
                return builder.select(
                    builder.icmp_unsigned("==", e, ir.Constant(like, 0 if like == i32 else [0] * 16)),
                    ir.Constant(like, 1 << 22 if like == i32 else [1 << 22] * 16),
                    builder.shl(e, ir.Constant(like, 23 if like == i32 else [23] * 16)),
                )

            def group(g, sv, acc):  # acc + the 32 products of group g times its scale (sv, broadcast)
                base = builder.mul(g, ir.Constant(intp, 16))
                bp = cgutils.get_item_pointer(context, builder, pk_t, pk, [row_, base], wraparound=False)
                b = builder.zext(builder.load(builder.bitcast(bp, v16b.as_pointer()), align=1), v16i)
                lo = builder.call(perm, [lut, builder.and_(b, ir.Constant(v16i, [15] * 16))])
                hi = builder.call(perm, [lut, builder.lshr(b, ir.Constant(v16i, [4] * 16))])
                ep = cgutils.get_item_pointer(context, builder, xe_t, xe_a, [base], wraparound=False)
                op = cgutils.get_item_pointer(context, builder, xo_t, xo_a, [base], wraparound=False)
                xev = builder.load(builder.bitcast(ep, v16f.as_pointer()), align=4)
                xov = builder.load(builder.bitcast(op, v16f.as_pointer()), align=4)
                fast = ("contract",)
                part = builder.fadd(builder.fmul(lo, xev, flags=fast), builder.fmul(hi, xov, flags=fast), flags=fast)
                return builder.fadd(acc, builder.fmul(part, sv, flags=fast), flags=fast)

            # 16 groups per iteration, their 16 scales decoded as one vector; then the groups left one by one.
            blocks = builder.udiv(groups, ir.Constant(intp, 16))
            with cgutils.for_range(builder, blocks) as loop:
                g0 = builder.mul(loop.index, ir.Constant(intp, 16))
                sp = cgutils.get_item_pointer(context, builder, s_t, sc, [row_, g0], wraparound=False)
                sv16 = builder.bitcast(
                    scales(builder.zext(builder.load(builder.bitcast(sp, v16b.as_pointer()), align=1), v16i)), v16f
                )
                accs = [builder.load(acc_ptr), ir.Constant(v16f, [0.0] * 16)]  # two chains of additions
                for j in range(16):
                    sv = builder.shuffle_vector(sv16, ir.Constant(v16f, ir.Undefined), ir.Constant(v16i, [j] * 16))
                    accs[j % 2] = group(builder.add(g0, ir.Constant(intp, j)), sv, accs[j % 2])
                builder.store(builder.fadd(accs[0], accs[1], flags=("contract",)), acc_ptr)
            done = builder.mul(blocks, ir.Constant(intp, 16))
            with cgutils.for_range(builder, builder.sub(groups, done)) as loop:
                g = builder.add(done, loop.index)
                sp = cgutils.get_item_pointer(context, builder, s_t, sc, [row_, g], wraparound=False)
                scale = builder.bitcast(scales(builder.zext(builder.load(sp), i32)), f32)
                sv = builder.shuffle_vector(
                    builder.insert_element(ir.Constant(v16f, ir.Undefined), scale, zero),
                    ir.Constant(v16f, ir.Undefined),
                    ir.Constant(v16i, [0] * 16),
                )
                builder.store(group(g, sv, builder.load(acc_ptr)), acc_ptr)
            v = builder.load(acc_ptr)
            width = 16
            while width > 1:  # lanes summed pairwise: halves added until one is left
                width //= 2
                a = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, width), list(range(width))))
                c = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, width), list(range(width, 2 * width))))
                v = builder.fadd(a, c)
            return builder.extract_element(v, zero)

        return numba.types.float32(packed, s, row, xe, xo), codegen


def _fp4_rows(x, packed, s, out, n):  # pragma: no cover - compiled
    # out[:n, :m] = x[:n] @ W[:m]^T for the FP4 weight W: packed [J, K / 2] (element 2i in the low nibble of byte
    # i), s [J, K / 32] UE8M0 exponents
    m, half = out.shape[1], packed.shape[1]
    step = FP4_GROUP // 2
    if n == 1:  # one row: x's even and odd elements apart, then per row its groups' sums times their scales
        xe = np.empty(half, dtype=np.float32)
        xo = np.empty(half, dtype=np.float32)
        for j in range(half):
            xe[j] = x[0, 2 * j]
            xo[j] = x[0, 2 * j + 1]
        if _AVX512:
            for row in range(m):
                out[0, row] = _fp4_row_dot_avx512(packed, s, row, xe, xo)
            return
        for row in range(m):
            total = np.float32(0.0)
            for g in range(half // step):
                base = g * step
                acc = np.float32(0.0)
                for i in range(step):
                    byte = np.int32(packed[row, base + i])
                    acc += _e2m1(byte & np.int32(15)) * xe[base + i] + _e2m1(byte >> np.int32(4)) * xo[base + i]
                total += acc * _ue8m0(s[row, g])
            out[0, row] = total
        return
    buf = np.empty((ROW_BLOCK, 2 * half), dtype=np.float32)
    for j0 in range(0, m, ROW_BLOCK):
        block = min(ROW_BLOCK, m - j0)
        for r in range(block):
            _fp4_row(packed, s, j0 + r, buf, r)
        _linear_tiles_jit(x, buf[:block], out[:, j0 : j0 + block], n)


_fp8_rows_jit = _jit(_fp8_rows)
_fp4_rows_jit = _jit(_fp4_rows)


def _fp8_dense(q, s, out):  # pragma: no cover - compiled: out [J, K] float32 = the FP8 weight (q, s) dequantized
    for row in prange(q.shape[0]):
        _fp8_row(q, s, row, out, row)


def _fp4_dense(packed, s, out):  # pragma: no cover - compiled: out [J, K] float32 = the FP4 weight dequantized
    for row in prange(packed.shape[0]):
        _fp4_row(packed, s, row, out, row)


# work = weight elements
fp8_dense = Threaded(_fp8_dense, min_work=1 << 18)
fp4_dense = Threaded(_fp4_dense, min_work=1 << 18)


def dequantized(w, out: np.ndarray | None = None) -> np.ndarray:
    """One FP8 or FP4 matrix (an Fp8Weight / Fp4Weight of numpy views) dequantized into float32 `out` (new when
    None): the values of quant.py's dequantize, for torch matmuls over many rows (prefill)."""
    values, scale = stored(w)
    rows = values.shape[0]
    if isinstance(w, Fp8Weight):
        out = np.empty((rows, values.shape[1]), dtype=np.float32) if out is None else out
        fp8_dense(out.size, values, scale, out)
    else:
        out = np.empty((rows, 2 * values.shape[1]), dtype=np.float32) if out is None else out
        fp4_dense(out.size, values, scale, out)
    return out


def _matrix_rows(x, w, s, out, n):  # pragma: no cover - compiled through the overload below
    """out[:n] = x[:n] @ W^T for a plain weight w (float32 or bfloat16 bits; s empty, 1-d) or an FP8 one (w its
    bytes, s its 2-d scale grid)."""


def _expert_rows(x, w, s, e, out, n):  # pragma: no cover - compiled through the overload below
    """out[:n] = x[:n] @ W_e^T for expert e of stacked experts: plain (s empty, 1-d), FP4 (s [E, out, in / 32]) or
    FP8 (s [E, halves, ...]: each half of the rows with its own scale grid)."""


if numba is not None:

    @numba.extending.overload(_matrix_rows)
    def _matrix_rows_typed(x, w, s, out, n):
        if s.ndim == 1:
            return lambda x, w, s, out, n: _linear_rows(x, w, out, n)
        return lambda x, w, s, out, n: _fp8_rows_jit(x, w, s, 0, out, n)

    @numba.extending.overload(_expert_rows)
    def _expert_rows_typed(x, w, s, e, out, n):
        if s.ndim == 1:
            return lambda x, w, s, e, out, n: _linear_rows(x, w[e], out, n)
        if s.ndim == 3:
            return lambda x, w, s, e, out, n: _fp4_rows_jit(x, w[e], s[e], out, n)

        def fp8_halves(x, w, s, e, out, n):
            halves = s.shape[1]
            m = w.shape[1] // halves
            for h in range(halves):
                _fp8_rows_jit(x, w[e, h * m : (h + 1) * m], s[e, h], 0, out[:, h * m : (h + 1) * m], n)

        return fp8_halves


def _linear_fp8(x, qs, ss, outs):  # pragma: no cover - compiled
    # outs[i] = x @ W_i^T for a tuple of FP8 weights (bytes qs[i], scales ss[i]), in chunks of LINEAR_CHUNK rows
    ends = _chunk_ends_jit(qs)
    for task in prange(ends[len(qs)]):
        i, j0 = _chunk_of_jit(ends, task)
        q, out = qs[i], outs[i]
        j1 = min(q.shape[0], j0 + LINEAR_CHUNK)
        _fp8_rows_jit(x, q, ss[i], j0, out[:, j0:j1], x.shape[0])


linear_fp8 = Threaded(_linear_fp8, min_work=1 << 18)


def _grouped_linear_fp8(x, q, s, out):  # pragma: no cover - compiled
    # out [T, G, J] = per group g: x[:, g] [T, K] @ W[g * J : (g + 1) * J]^T for the FP8 weight W [G * J, K]
    n, groups, rows = x.shape[0], x.shape[1], out.shape[2]
    for g in prange(groups):
        part = np.empty((n, x.shape[2]), dtype=np.float32)
        res = np.empty((n, rows), dtype=np.float32)
        part[:] = x[:, g]
        _fp8_rows_jit(part, q, s, g * rows, res, n)
        out[:, g] = res


grouped_linear_fp8 = Threaded(_grouped_linear_fp8, min_work=1 << 18)


def stored(w) -> tuple[np.ndarray, np.ndarray]:
    """A weight's numpy view (plain, or an Fp8Weight / Fp4Weight / Fp8Experts of numpy views) as the kernels take
    it: (values, scale), the scale EMPTY for a plain weight."""
    if isinstance(w, Fp8Weight | Fp8Experts):
        return w.q, w.scale
    if isinstance(w, Fp4Weight):
        return w.packed, w.scale
    return w, EMPTY


# --- MoE for a few tokens --------------------------------------------------------------------------------
def _silu_glu(g, u, limit):  # pragma: no cover - compiled
    g = min(g, limit)
    u = min(max(u, -limit), limit)
    return g / (np.float32(1.0) + _exp_jit(-g)) * u


_silu_glu_jit = _jit(_silu_glu)


def _moe_tokens(x, ids, gate_w, bias, tid2eid, top_k, scoring, route_scale, w13, w13_s, w2, w2_s, sw1, sw1_s, sw3,
                sw3_s, sw2, sw2_s, limit, out):  # fmt: skip
    # (compiled) The whole MoE for a decode-sized batch: per token, router scores (0 = sqrt(softplus),
    # 1 = sigmoid, 2 = softmax) and top-k by score + bias (or the hash table when tid2eid is not empty),
    # weights normalised and times route_scale; then per expert, its tokens through its SwiGLU (each expert's
    # weights read once), and the shared expert over all tokens.
    # x, out [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; sw1/sw3 [I', H]; sw2 [H, I'], each with its scale (stored():
    # EMPTY for plain weights; the experts FP4 or FP8, the shared expert FP8, see _expert_rows / _matrix_rows).
    n, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    chosen = np.empty((n, top_k), dtype=np.int64)
    weight = np.empty((n, top_k), dtype=np.float32)
    scores = np.empty((n, num_experts), dtype=np.float32)  # the router's logits, then its scores
    keyed = np.empty((n, num_experts) if tid2eid.shape[0] == 0 else (0, 0), dtype=np.float32)  # scores + bias
    _linear_rows_jit(x, gate_w, scores, n)
    for t in prange(n):  # (each token's routing is its own: threaded over tokens)
        for e in range(num_experts):
            z = scores[t, e]
            if scoring == 0:
                sp = z + np.float32(math.log1p(math.exp(-z))) if z > 0 else np.float32(math.log1p(math.exp(z)))
                scores[t, e] = np.float32(math.sqrt(sp))
            elif scoring == 1:
                scores[t, e] = np.float32(1.0) / (np.float32(1.0) + np.float32(math.exp(-z)))
        if scoring == 2:
            top = scores[t].max()
            total = np.float32(0.0)
            for e in range(num_experts):
                scores[t, e] = np.float32(math.exp(scores[t, e] - top))
                total += scores[t, e]
            for e in range(num_experts):
                scores[t, e] /= total
        if tid2eid.shape[0] > 0:
            for j in range(top_k):
                chosen[t, j] = tid2eid[ids[t], j]
        else:
            for e in range(num_experts):
                keyed[t, e] = scores[t, e] + bias[e]
            for j in range(top_k):  # the largest remaining, lowest index first on ties
                best = 0
                for e in range(1, num_experts):
                    if keyed[t, e] > keyed[t, best]:
                        best = e
                chosen[t, j] = best
                keyed[t, best] = -np.inf
        total = np.float32(0.0)
        for j in range(top_k):
            total += scores[t, chosen[t, j]]
        for j in range(top_k):
            weight[t, j] = scores[t, chosen[t, j]] / (total + np.float32(1e-20)) * np.float32(route_scale)
    counts = np.zeros(num_experts + 1, dtype=np.int64)
    for t in range(n):
        for j in range(top_k):
            counts[chosen[t, j] + 1] += 1
    # Bucket the (token, k) pairs by expert.
    for e in range(num_experts):
        counts[e + 1] += counts[e]
    fill = counts[:num_experts].copy()
    token_of = np.empty(n * top_k, dtype=np.int64)
    weight_of = np.empty(n * top_k, dtype=np.float32)
    for t in range(n):
        for j in range(top_k):
            e = chosen[t, j]
            token_of[fill[e]] = t
            weight_of[fill[e]] = weight[t, j]
            fill[e] += 1
    # Tasks, spread over the cores: each expert that has tokens, and the shared expert in two halves of the
    # tokens (more chunks would read its weights more often), each half ahead of half the experts: the threads
    # take equal runs of tasks, and so get equal work when the experts' loads are even. Each task writes only
    # its own rows: the routed experts' outputs go to ys (one row per (token, k) pair), the shared expert's
    # straight to out.
    shared = sw1.shape[0]
    chunks = min(n, 2)
    active = 0
    for e in range(num_experts):
        active += counts[e + 1] > counts[e]
    tasks = np.empty(active + chunks, dtype=np.int64)
    num_tasks, seen, half = 0, 0, 0
    for e in range(num_experts):
        if counts[e + 1] > counts[e]:
            if half < chunks and seen >= half * active // chunks:
                tasks[num_tasks] = num_experts + half
                num_tasks += 1
                half += 1
            tasks[num_tasks] = e
            num_tasks += 1
            seen += 1
    for c in range(half, chunks):
        tasks[num_tasks] = num_experts + c
        num_tasks += 1
    pairs = n * top_k
    rows = np.empty((pairs, hidden), dtype=np.float32)
    both = np.empty((pairs, 2 * inter), dtype=np.float32)
    act = np.empty((pairs, inter), dtype=np.float32)
    ys = np.empty((pairs, hidden), dtype=np.float32)
    for job in prange(num_tasks):
        e = tasks[job]
        if e >= num_experts:  # a chunk of tokens through the shared expert
            c = e - num_experts
            t0, t1 = c * n // chunks, (c + 1) * n // chunks
            gates, ups = np.empty((t1 - t0, shared), dtype=np.float32), np.empty((t1 - t0, shared), dtype=np.float32)
            _matrix_rows(x[t0:t1], sw1, sw1_s, gates, t1 - t0)
            _matrix_rows(x[t0:t1], sw3, sw3_s, ups, t1 - t0)
            for t in range(t1 - t0):
                for i in range(shared):
                    gates[t, i] = _silu_glu_jit(gates[t, i], ups[t, i], limit)
            _matrix_rows(gates, sw2, sw2_s, out[t0:t1], t1 - t0)
            continue
        first, last = counts[e], counts[e + 1]
        for r in range(first, last):
            for k in range(hidden):
                rows[r, k] = x[token_of[r], k]
        _expert_rows(rows[first:last], w13, w13_s, e, both[first:last], last - first)
        for r in range(first, last):
            for i in range(inter):
                act[r, i] = _silu_glu_jit(both[r, i], both[r, inter + i], limit) * weight_of[r]
        _expert_rows(act[first:last], w2, w2_s, e, ys[first:last], last - first)
    # Add the routed experts' outputs in expert order.
    for r in range(pairs):
        t = token_of[r]
        for k in range(hidden):
            out[t, k] += ys[r, k]


moe_tokens = Threaded(_moe_tokens, min_work=2)


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
ATTEND_SUM_ROWS = 32  # (query, head) rows of a block up to which _attend sums key rows instead of transposing


def _attend(q, ring, new_kv, q_rows, q_valid, key_index, key_mask, slot, rows, visible, chosen, sink, scale,
            freqs, out):  # fmt: skip
    # (compiled) Shared-KV attention (keys = values) for one group of query blocks, see model/batch.py:
    #   q [T, H, D] RoPE'd queries; window keys are store rows key_index[b, :] masked by key_mask[b, i, :],
    #   where the store is ring [Rr, D] followed by new_kv [T, D]; then the compressed rows rows[slot[b], :n]
    #   with n = visible[b, i], restricted to chosen[b, i, :] when chosen is not empty (the indexer's top-k:
    #   the block then reads only the rows some query of it chose).
    # Each head has a sink logit (probability mass, no value). The output is rotated back by RoPE (the
    # inverse of freqs at the query's token) and written to out[q_rows[b, i]].
    # Per block, its keys are gathered once for all its queries and heads (the KV is shared); the scores are a
    # small matmul through the few-row linear's register tiles (rows are (query, head) pairs), masked keys get
    # probability 0. The weighted values: for a block of a few rows (decode, verification) the key rows summed
    # as each row's probabilities weigh them (keys of probability 0 skipped), for more rows (prefill) a second
    # matmul through the tiles, on the keys transposed once.
    num_blocks, block = q_rows.shape
    heads, dim = q.shape[1], q.shape[2]
    ring_rows = ring.shape[0]
    width = key_index.shape[1]
    half = freqs.shape[1]
    lead = dim - 2 * half
    picked = chosen.shape[0] > 0
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
            _copy_row_jit(kv[span + j], rows[slot[b], sel[j]])
        qh = np.zeros((block * heads, dim), dtype=np.float32)  # rows (query i, head h) at i * heads + h
        for i in range(block):
            if q_valid[b, i]:
                for h in range(heads):
                    _copy_row_jit(qh[i * heads + h], q[q_rows[b, i], h])
        scores = np.empty((block * heads, keys), dtype=np.float32)
        _linear_tiles_jit(qh, kv, scores, block * heads)
        for i in range(block):
            if not q_valid[b, i]:
                continue
            n = visible[b, i]
            for h in range(heads):
                row = scores[i * heads + h]
                top = sink[h]
                for k in range(keys):
                    row[k] *= scale
                    if k < span:
                        seen = key_mask[b, i, lo + k]
                    else:
                        c = sel[k - span]
                        seen = c < n and (not picked or chosen[b, i, c])
                    if seen:
                        top = max(top, row[k])
                    else:
                        row[k] = -np.inf
                total = _exp_jit(sink[h] - top)
                for k in range(keys):  # (e^-inf: the clamp gives 1e-38, so masked keys are zeroed explicitly)
                    e = _exp_jit(row[k] - top)
                    row[k] = e if row[k] != -np.inf else np.float32(0.0)
                    total += row[k]
                inv = np.float32(1.0) / total
                for k in range(keys):
                    row[k] *= inv
        values = np.zeros((block * heads, dim), dtype=np.float32)
        if block * heads <= ATTEND_SUM_ROWS:  # a few queries: probabilities @ keys a key row at a time
            for i in range(block):
                if not q_valid[b, i]:
                    continue
                for h in range(heads):
                    r = i * heads + h
                    for k in range(keys):
                        p = scores[r, k]
                        if p != np.float32(0.0):
                            for d in range(dim):
                                values[r, d] += p * kv[k, d]
        else:  # many: through the register tiles, the keys transposed once
            kv_t = np.empty((dim, keys), dtype=np.float32)
            for k in range(keys):
                for d in range(dim):
                    kv_t[d, k] = kv[k, d]
            _linear_tiles_jit(scores, kv_t, values, block * heads)
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


# work = query blocks
attend = Threaded(_attend, min_work=2)


def _index_select(q, head_w, q_rows, q_valid, slot, keys, visible, topk, scale, out):  # pragma: no cover
    # (compiled) The Lightning Indexer's choice for one group of query blocks: score each visible compressed row
    # c < visible[b, i] as sum_h head_w[t, h] * relu(q[t, h] . keys[slot[b], c]) * scale and keep the `topk`
    # best (ties to the lower row: the stable sort's choice, kept by insertion into the topk best so far, no
    # sort), out [NB, Bq, n] bool. q [T, H, d], head_w [T, H], keys [slots, rows, d].
    num_blocks, block = q_rows.shape
    heads, dim = q.shape[1], q.shape[2]
    n = out.shape[2]
    for b in prange(num_blocks):
        best = np.empty(topk, dtype=np.float32)  # the topk best scores so far, best first, and their rows
        rows = np.empty(topk, dtype=np.int64)
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
                total = np.float32(0.0)
                for h in range(heads):
                    s = np.float32(0.0)
                    for d in range(dim):
                        s += q[t, h, d] * keys[slot[b], c, d]
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


# work = query blocks
index_select = Threaded(_index_select, min_work=2)
