"""FP8 (e4m3, UE8M0 scale per 128x128 block) and FP4 (e2m1, scale per 32 inputs) weights read as stored: the
decoders, rows of x times a block of decoded rows, whole matrices dequantized (prefill), the linears and
grouped linear on FP8 weights, the plain / FP8 / FP4 row readers the MoE calls, and `Matmuls` (one kernel call
per weight format)."""

from __future__ import annotations

import numpy as np

from leanserve.model.backends.cpu.kernels.base import (
    EMPTY,
    Threaded,
    _bf16_bits_jit,
    _empty64_f32,
    _empty64_u16,
    _f32_from_bits,
    _inlined,
    _jit,
    _share_jit,
    numba,
)
from leanserve.model.backends.cpu.kernels.bf16dots import (
    fp4_bf16_row_dots,
    fp4_bf16_x,
    fp8_bf16_row_dots,
    fp8_bf16_x,
)
from leanserve.model.backends.cpu.kernels.int8dots import (
    fp4_int8_row_dots,
    group_lane,
    int8_x,
    int8_x_shapes,
    q_slot,
)
from leanserve.model.backends.cpu.kernels.linear import (
    ROW_BLOCK,
    _chunk_ends_jit,
    _chunk_of_jit,
    _linear_rows,
    _linear_tiles_jit,
    linear,
)
from leanserve.model.backends.cpu.kernels.rowdots import (
    _AVX512,
    _AVX512_BF16,
    _AVX512_VBMI,
    _F16C,
    _HOST_CPU,
    _SUBNORMALS_CHEAP,
    FP4_CHUNK,
    fp4_order,
    fp4_permuted_x,
    fp4_row_dots,
    fp8_row_dots,
)
from leanserve.model.quant import (
    BF16_CODE,
    FP4_GROUP,
    FP8_BLOCK,
    INT8_CODE,
    Fp4Weight,
    Fp8Experts,
    Fp8Weight,
    bf16_inputs,
)

# --- FP8 / FP4 weights, dequantized as they are read (see quant.py) -------------------------------------------
# A block of ROW_BLOCK weight rows is decoded into a float32 buffer (values times their block's scale, the same
# float32 products as quant.py's dequantization) and goes through the float32 loops: the same sums as on the
# dequantized weight. For a few rows of x (decode, verification: FP8 one to sixteen, FP4 one to four) the decoded
# values meet x in registers instead:
# FP8 values meet x times their block's scale (exact: a power of two), FP4 groups' sums are times their scale;
# a different float32 summation order. The decoders are integer arithmetic (they vectorise): an e4m3 byte's bits
# shifted into a float32's, the rebase folded into the block's scale (_e4m3_raw); FP4 codes by their exponent and
# mantissa bits, or table lookups on AVX-512 and AVX2 (rowdots.fp4_row_dots).
# The e4m3fn NaN bytes (0x7F, 0xFF) are not decoded as NaN (the quantizers never write them).


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
RAW_REBASE = 120  # (the power of two x comes times in the row dots that decode as _e4m3_raw)
HALF_REBASE = 8  # (and in those that decode through float16: rowdots.fp8_row_dots' `half`)


def _rebased_scale(e, rebase):  # pragma: no cover - compiled: 2^(e - 127) * 2^rebase (a float32 while e + rebase < 255)
    return _f32_from_bits((np.int32(e) + np.int32(rebase)) << np.int32(23))


def _raw_scale(e):  # pragma: no cover - compiled: 2^(e - 127) * 2^120, for e <= RAW_SCALE_MAX
    return _rebased_scale(e, RAW_REBASE)


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
    _rebased_scale = _inlined(_rebased_scale)
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


# The row dots' loops over a weight's rows, one per count of rows of x: the count is chosen once per call, outside
# the loop. (With it chosen per row, the loop held all four row dots' code, and the MoE's FP4 experts read 15%
# slower from memory: 3.16 against 2.67 ms for six experts on two threads.)
def _fp4_walk(dots):
    """out[:, row] for every row < m of an FP4 weight (packed, s), by the row dots `dots` (fp4_row_dots(1, t),
    fp4_bf16_row_dots(t) or fp4_int8_row_dots(t)) against x as they take it (xq: an array, or int8_x's three)."""
    if dots is None:
        return None

    def walk(packed, s, xq, out, m):  # pragma: no cover - compiled
        for row in range(m):
            dots(packed, s, row, xq, out, row)

    return _inlined(walk)


def _fp4_walks(row_dots):
    """out[:n, row] for every row < m of an FP4 weight, n = 1 to 4, by the walk of row_dots(n): one call, the count
    of rows of x chosen once (row_dots(n): fp4_row_dots(1, n), fp4_bf16_row_dots(n) or fp4_int8_row_dots(n))."""
    walks = [_fp4_walk(row_dots(t)) for t in (1, 2, 3, 4)]
    if walks[0] is None:
        return None
    one, two, three, four = walks

    def walk(packed, s, xq, out, m, n):  # pragma: no cover - compiled
        if n == 1:
            one(packed, s, xq, out, m)
        elif n == 2:
            two(packed, s, xq, out, m)
        elif n == 3:
            three(packed, s, xq, out, m)
        else:
            four(packed, s, xq, out, m)

    return _inlined(walk)


def _fp8_walk(wide_dots, width, one_dots):
    """out[:, :m] (m = out's width) for FP8 weight rows r0 .. r0 + m by the row dots (fp8_row_dots or
    fp8_bf16_row_dots): `width` rows at a time by `wide_dots` within a 128-row scale block where `wide`, else one
    at a time by `one_dots`; x as they take it (xq), over `full` 128-blocks."""
    if one_dots is None:
        return None

    def walk(q, s, r0, xq, full, out, wide):  # pragma: no cover - compiled
        m = out.shape[1]
        j = 0
        while j < m:
            if wide and min(m - j, FP8_BLOCK - (r0 + j) % FP8_BLOCK) >= width:  # (rows left in its block)
                wide_dots(q, s, r0 + j, xq, full, out, j)
                j += width
            else:
                one_dots(q, s, r0 + j, xq, full, out, j)
                j += 1

    return _inlined(walk)


def _fp8_scaled_x(x, s, srow, full, n, xs, rebase=RAW_REBASE):  # pragma: no cover - compiled
    # xs[t, k] = x[t, k] times the scale of block (srow, k // 128) times 2^rebase, over the first `full` 128-blocks,
    # for t < n: what fp8_row_dots take for the rows of scale block srow (its scales <= RAW_SCALE_MAX), rebase
    # RAW_REBASE (_raw_scale), or HALF_REBASE for those that decode through float16
    for kb in range(full):
        scale = _rebased_scale(s[srow, kb], rebase)
        for t in range(n):
            for i in range(kb * FP8_BLOCK, (kb + 1) * FP8_BLOCK):
                xs[t, i] = x[t, i] * scale


def _fp8_scaled_walk(wide_dots, width, one_dots, xrows, many=False, rebase=RAW_REBASE):
    """out[:, :m] (m = out's width) for FP8 weight rows r0 .. r0 + m by fp8_row_dots of `xrows` rows of x against
    the first n rows of x, over `full` 128-blocks, a 128-row scale block at a time: x times the block's scales and
    2^rebase once (_fp8_scaled_x), then `width` rows at a time by `wide_dots` where `wide` and the block has them
    left, else one by `one_dots`. With `many`, n rows of x in passes of xrows (the last padded with zeros; out has
    as many rows), one after the other on the same weight rows, which are still in L1 for the passes after the
    first."""

    def rows_at(q, row, xs, full, out, j, step):  # pragma: no cover - compiled: weight rows row .. row + step
        if step == width:
            wide_dots(q, row, xs, full, out, j)
        else:
            one_dots(q, row, xs, full, out, j)

    def in_passes(q, row, xs, full, out, j, step):  # pragma: no cover - compiled: the same, xrows rows of x a pass
        for p in range(xs.shape[0] // xrows):
            rows_at(q, row, xs[p * xrows : (p + 1) * xrows], full, out[p * xrows : (p + 1) * xrows], j, step)

    rows_at = _inlined(rows_at)
    visit = _inlined(in_passes) if many else rows_at  # (a loop of one pass slowed the 1-4 row walks: 1.2x a step)

    def walk(q, s, r0, x, full, out, wide, n):  # pragma: no cover - compiled
        m = out.shape[1]
        xs = _empty64_f32((n + xrows - 1) // xrows * xrows if many else xrows, full * FP8_BLOCK)
        xs[n:] = 0.0  # (a last pass's padding; _fp8_scaled_x writes the rest)
        j = 0
        while j < m:
            srow = (r0 + j) // FP8_BLOCK
            _fp8_scaled_x(x, s, srow, full, n, xs, rebase)
            end = min(m, (srow + 1) * FP8_BLOCK - r0)
            while j < end:
                step = width if wide and end - j >= width else 1
                visit(q, r0 + j, xs, full, out, j, step)
                j += step

    return _inlined(walk)


def _float32_walk(width, xrows, half, permuted=None, many=False):
    """_fp8_scaled_walk of fp8_row_dots(width, xrows, half, permuted) for float32 x, one weight row at a time where
    a scale block has fewer than `width` left, x rebased as that decode takes it."""
    return _fp8_scaled_walk(
        fp8_row_dots(width, xrows, half, permuted), width, fp8_row_dots(1, xrows, half, permuted), xrows,
        many=many, rebase=HALF_REBASE if half else RAW_REBASE,
    )  # fmt: skip


def _fp8_walks(row_dots):
    # the walks for 1-4 rows of x: four weight rows at a time for one or two, two for three or four
    return [_fp8_walk(row_dots(4 if t <= 2 else 2, t), 4 if t <= 2 else 2, row_dots(1, t)) for t in (1, 2, 3, 4)]


if numba is not None:
    _fp8_scaled_x = _inlined(_fp8_scaled_x)
    # float32 x: the bytes decoded through float16 (fp8_row_dots' `half`; on Intel cores against the raw decode
    # 0.81-0.97x at two to twelve rows of x) or, on Zen 3 and Zen 4 cores, where the few subnormals cost nothing,
    # straight into float32 bits (on Zen 4 in cache 0.76-0.93x the time of the float16 decode at one to sixteen rows
    # of x), as on x86 cores without F16C (from before 2012). With AVX-512's 32 vector registers, four weight rows
    # at a time for two rows of x, three for three or four (against two: the published step 0.98x at batch 3 and 4),
    # two for more, in passes of four (three: 1.05x at batch 8, through float16), but three on Zen 4 (and Zen 5,
    # below) cores, whose raw decode makes one vector a load instead of two (one core in L2 at eight and sixteen
    # rows of x: 106 against 94-95 GFLOP/s; the Flash-shaped published step at batch 8 0.96x, its verification
    # 0.975x); with AVX2's 16 the several rows' sums spill, so there one weight row at a time (one core of a Zen 3
    # EPYC, [4096 x 4096] from memory, against the AVX-512 widths: 1.03-1.15x as fast at two rows of x, 1.35x at
    # four, 1.4-1.8x at eight)
    _WIDE = [4, 3, 3, 3 if _HOST_CPU in ("znver4", "znver5") else 2] if _AVX512 else [1, 1, 1, 1]  # (2, 3, 4, 5-16)
    # The float16 decode at five to sixteen rows of x (_MANY_HALF) and at one to four (_HALF). On Zen 5 cores the
    # raw decode pays only from five rows, three weight rows at a time: through the linears from memory on two
    # threads 0.75-0.87x the time of the float16 decode two rows at a time at eight and sixteen rows (raw two at a
    # time 0.95-1.04x; at one row 0.98-1.10x, at three 0.94-1.23x: noise or worse, so one to four keep float16;
    # 2026-12-08)
    _MANY_HALF = _F16C and not _SUBNORMALS_CHEAP
    _HALF = _MANY_HALF or (_F16C and _HOST_CPU == "znver5")

    # one row of x, a weight row at a time (_FP8_1), decoded as at more rows; but on Zen 4 cores, where x does not
    # fit half of L1 (_FP8_1_LONG_X: the [4096 x 8192] output projection), two weight rows at a time decoded by byte
    # permutes, which reads x from L2 once for both rows: from memory on two threads 31.1 GB/s against 28.1 through
    # float16 a row at a time and 20.4 by byte permutes a row at a time (sums 35.2; 2026-12-07); the raw decode had
    # read at 0.69-0.70x the float16 rate (four weight rows at a time 0.94x); on Zen 3 at 1.15x
    _FP8_1 = _float32_walk(1, 1, _HALF)
    _FP8_1_LONG_X = _FP8_1
    if _HOST_CPU == "znver4" and not _HALF:
        if _AVX512_VBMI:
            _FP8_1_LONG_X = _float32_walk(2, 1, False, permuted=True)
        elif _F16C:  # (a Zen 4 whose byte permutes are hidden from it)
            _FP8_1_LONG_X = _float32_walk(1, 1, True)
    _FP8_2, _FP8_3, _FP8_4 = [_float32_walk(w, t, _HALF) for t, w in zip((2, 3, 4), _WIDE[:3], strict=True)]
    _FP8_MANY = _float32_walk(_WIDE[3], 4, _MANY_HALF, many=True)  # (5 to FEW_FP8_ROWS rows)
else:
    _FP8_1 = _FP8_1_LONG_X = _FP8_2 = _FP8_3 = _FP8_4 = _FP8_MANY = None
_FP8B_1, _FP8B_2, _FP8B_3, _FP8B_4 = _fp8_walks(fp8_bf16_row_dots) if numba is not None else [None] * 4
# and eight rows of x, a weight row at a time (five to seven come padded with rows of zeros: _fp8_inputs)
_FP8B_8 = _fp8_walk(fp8_bf16_row_dots(1, 8), 1, fp8_bf16_row_dots(1, 8)) if numba is not None else None
_FP4_FEW = _fp4_walks(lambda t: fp4_row_dots(1, t))  # (None without AVX2)
_FP4_ORDER = fp4_order(_AVX512)  # (the order of x they read)
_FP4B_FEW = _fp4_walks(fp4_bf16_row_dots)  # (None without AVX512-BF16)
_FP4I_FEW = _fp4_walks(fp4_int8_row_dots)  # (None without AVX2)
_fp4_permuted_x_jit = _jit(fp4_permuted_x)
_int8_x_jit = _jit(int8_x, fastmath=False)  # (x * (127 / amax) and its rounding as written: quant.int8_rounded)
_fp4_bf16_x_jit = _jit(fp4_bf16_x)
_fp8_bf16_x_jit = _jit(fp8_bf16_x)


def _bf16_rounded(x, n):  # pragma: no cover - compiled: x[:n] rounded to bfloat16 (as float32, a new array)
    out = np.empty((n, x.shape[1]), dtype=np.float32)
    for t in range(n):
        for k in range(x.shape[1]):
            out[t, k] = _f32_from_bits(np.int32(np.int32(_bf16_bits_jit(x[t, k])) << np.int32(16)))
    return out


_bf16_rounded_jit = _jit(_bf16_rounded)


def _int8_inputs(x, n):  # pragma: no cover - compiled: (xq, xd, xc), x[:n] as int8_x lays it out (new arrays)
    wq, wd, wc = int8_x_shapes(x.shape[1])
    xq = np.empty((n, wq), dtype=np.int8)
    xd = np.empty((n, wd), dtype=np.float32)
    xc = np.empty((n, wc), dtype=np.int32)
    _int8_x_jit(x, xq, xd, xc, n)
    return xq, xd, xc


if numba is not None:
    _int8_inputs = _inlined(_int8_inputs)


def _int8_rounded(x, n):  # pragma: no cover - compiled: x[:n] rounded to 8 bits a block (quant.int8_rounded; new)
    xq, xd, _ = _int8_inputs(x, n)
    out = np.empty((n, x.shape[1]), dtype=np.float32)
    for t in range(n):
        for k in range(x.shape[1]):
            g = k // FP4_GROUP
            out[t, k] = np.float32(xq[t, q_slot(g, k % FP4_GROUP)]) * (xd[t, group_lane(g)] * np.float32(2.0))
    return out


_int8_rounded_jit = _jit(_int8_rounded, fastmath=False)


# FP8 rows of at most this many inputs are read one per call: several adjacent rows of 1-2 KB read in step are
# as many short streams, which the hardware prefetchers follow badly ([32768 x 1024] from memory on two threads:
# 26 GB/s a row at a time against 17 four at a time; [16384 x 2048] 33 against 21; equal at 4096 inputs, and at
# 8192 four at a time is faster, 26 against 19). Each entry's arithmetic is the same either way.
SHORT_FP8_ROW = 2048
# Longer rows are read one per call too at one row of x, and at more while the rows of x they meet fit in half the
# L1 cache (n rows of K float32, or bfloat16 for the bfloat16 row dots): x then stays in L1 while one row streams.
# Two runs of the same kernel in one process, from memory on two threads, one row per call against four: [8192 x
# 4096] 1.09x at one float32 row of x (16 KB), 1.23x at two bfloat16 rows; [4096 x 8192] 1.08x at one bfloat16 row;
# and where x is larger, 0.67-0.77x (two float32 rows of 4096, two of 8192). One float32 row of 8192 (32 KB) goes
# one at a time all the same, through the float16 decode: [4096 x 8192] from memory on two threads 27.0-27.2 GB/s
# against 25.1-25.7 four rows at a time (two runs, Intel, 2026-12-06); on Zen 4 two at a time (_FP8_1_LONG_X).
X_IN_L1 = 16384  # bytes
# FP8 weights meet up to this many rows of x rounded to bfloat16 in the bfloat16 row dots (the MTP layer's h_proj
# takes its four mHC streams per token: eight rows after an accepted draft). More take the float32 row dots with x
# rounded (the same products, summed in another order), then the dequantized blocks and tiles. On Zen 4 cores the
# float32 row dots are the faster from four rows of x (one core in L2, [256 x 4096]: 0.92x the time at four rows,
# 0.71-0.75x at five to eight; the same at two and three, 0.86x the other way at one); on Zen 5 from five rows
# (one core from memory, [4096 x 4096]: 0.70-0.84x the time at five to eight, the same at four; the bfloat16 dots
# are the faster in cache there, 1.14-1.57x at five to eight, but x's eight bfloat16 rows, 64 KB, leave L1).
FEW_BF16_ROWS = {"znver4": 3, "znver5": 4}.get(_HOST_CPU, 8)
# FP8 weights meet up to this many rows of float32 x (or x rounded to bfloat16 beyond FEW_BF16_ROWS) in the row dots,
# four at a time: each row's sums the same bits at any count (batch invariance). More take the dequantized blocks
# and tiles.
FEW_FP8_ROWS = 16


def _fp8_inputs(x, n, bf16):  # pragma: no cover - compiled
    # x[:n] as the bfloat16 FP8 row dots take it (fp8_bf16_x, over its whole 128-blocks) where they run: bf16 (the
    # weight's inputs), at most FEW_BF16_ROWS rows, AVX512-BF16, x contiguous; else an empty array. Five to seven
    # rows come padded to eight with rows of zeros (the eight-row dots). Made once per call of a linear and shared
    # by its tasks (each would otherwise redo it).
    full = x.shape[1] // FP8_BLOCK
    if not (bf16 and n <= FEW_BF16_ROWS and _AVX512_BF16 and x.strides[1] == 4 and full > 0):
        return np.empty((0, 0), dtype=np.uint16)
    xb = _empty64_u16(n if n <= 4 else 8, full * FP8_BLOCK)
    xb[n:] = 0
    _fp8_bf16_x_jit(x, xb, n)
    return xb


def _fp8_rows(x, q, s, r0, out, n, bf16):  # pragma: no cover - compiled
    # out[:n, :m] = x[:n] @ W[r0 : r0 + m]^T, m = out.shape[1], for the FP8 weight W: q [J, K] (e4m3 bytes),
    # s [ceil(J / 128), ceil(K / 128)] UE8M0 exponents; with `bf16`, x rounded to bfloat16 first (Fp8Weight.inputs)
    _fp8_rows_x_jit(x, _fp8_inputs(x, n, bf16), q, s, r0, out, n, bf16)


def _fp8_rows_x(x, xb, q, s, r0, out, n, bf16):  # pragma: no cover - compiled
    # _fp8_rows with xb = _fp8_inputs(x, n, bf16) made by the caller
    m, k_dim = out.shape[1], q.shape[1]
    full = k_dim // FP8_BLOCK
    contiguous = q.strides[1] == 1 and x.strides[1] == 4 and m > 0  # (the row dots' contiguous loads)
    fits = k_dim <= SHORT_FP8_ROW or n * k_dim * (2 if xb.shape[0] > 0 else 4) <= X_IN_L1
    one = n == 1 or fits  # (a row a call)
    if _AVX512_BF16 and xb.shape[0] > 0 and contiguous:  # x rounded and interleaved (_fp8_inputs)
        if n == 1:
            _FP8B_1(q, s, r0, xb, full, out, not one)
        elif n == 2:
            _FP8B_2(q, s, r0, xb, full, out, not one)
        elif n == 3:
            _FP8B_3(q, s, r0, xb, full, out, not one)
        elif n == 4:
            _FP8B_4(q, s, r0, xb, full, out, not one)
        else:  # (five to eight: eight rows, the padding's sums dropped)
            eight = np.empty((8, m), dtype=np.float32)
            _FP8B_8(q, s, r0, xb, full, eight, False)
            for t in range(n):
                for j in range(m):
                    out[t, j] = eight[t, j]
        if full * FP8_BLOCK < k_dim:  # (a last partial block: below, with x rounded)
            _fp8_rest(_bf16_rounded_jit(x, n), q, s, r0, out, n, full)
        return
    if bf16:  # (the same products in float32 elsewhere)
        x = _bf16_rounded_jit(x, n)
    if n <= FEW_FP8_ROWS:  # a few rows (decode, verification): products in registers, x times each block's scale
        vector = q.strides[1] == 1 and m > 0  # (x is read through _fp8_scaled_x, in any layout)
        if vector:  # (and scales whose rebased power of two is a float32)
            for sr in range(r0 // FP8_BLOCK, (r0 + m - 1) // FP8_BLOCK + 1):
                for kb in range(full):
                    vector = vector and s[sr, kb] <= RAW_SCALE_MAX
        if vector:  # (weight rows at a time, within one 128-row scale block, share the loads of x; rows of x
            # each decoded weight vector; short rows, and rows whose x fits L1, one at a time: SHORT_FP8_ROW)
            if n == 1:
                if fits:
                    _FP8_1(q, s, r0, x, full, out, False, n)
                else:  # (_FP8_1 itself but on Zen 4 cores, two weight rows at a time there)
                    _FP8_1_LONG_X(q, s, r0, x, full, out, True, n)
            elif n == 2:
                _FP8_2(q, s, r0, x, full, out, not one, n)
            elif n == 3:
                _FP8_3(q, s, r0, x, full, out, not one, n)
            elif n == 4:
                _FP8_4(q, s, r0, x, full, out, not one, n)
            else:  # (five to FEW_FP8_ROWS: in passes of four, the padding's sums dropped; the weight rows two at
                # a time whatever their length: against the tiles, the step at batch 8 0.90x, 12 0.93-0.95x, 16 1.01x;
                # with bfloat16 inputs 12 0.94x, 16 1.04-1.07x)
                padded = np.empty(((n + 3) // 4 * 4, m), dtype=np.float32)
                _FP8_MANY(q, s, r0, x, full, padded, True, n)
                out[:n] = padded[:n]
        _fp8_rest(x, q, s, r0, out, n, full if vector else 0)
        return
    buf = _empty64_f32(ROW_BLOCK, k_dim)
    for j0 in range(0, m, ROW_BLOCK):
        block = min(ROW_BLOCK, m - j0)
        for r in range(block):
            _fp8_row(q, s, r0 + j0 + r, buf, r)
        _linear_tiles_jit(x, buf[:block], out[:, j0 : j0 + block], n)


def _fp8_rest(x, q, s, r0, out, n, done):  # pragma: no cover - compiled
    # _fp8_rows' few-row sums from 128-block `done` on (the row dots wrote the blocks before it into out)
    m, k_dim = out.shape[1], q.shape[1]
    full = k_dim // FP8_BLOCK
    for t in range(n):
        for j in range(m):
            row = r0 + j
            srow = row // FP8_BLOCK
            total = out[t, j] if done > 0 else np.float32(0.0)
            for kb in range(done, full):
                base = kb * FP8_BLOCK
                e = s[srow, kb]
                acc = np.float32(0.0)
                if e <= RAW_SCALE_MAX:
                    for i in range(FP8_BLOCK):
                        acc += _e4m3_raw(q[row, base + i]) * x[t, base + i]
                    total += acc * _raw_scale(e)
                else:
                    for i in range(FP8_BLOCK):
                        acc += _e4m3(q[row, base + i]) * x[t, base + i]
                    total += acc * _ue8m0(e)
            if full * FP8_BLOCK < k_dim:
                acc = np.float32(0.0)
                for k in range(full * FP8_BLOCK, k_dim):
                    acc += _e4m3(q[row, k]) * x[t, k]
                total += acc * _ue8m0(s[srow, full])
            out[t, j] = total


if numba is not None:
    _fp8_rest = _inlined(_fp8_rest)
    _fp8_inputs = _inlined(_fp8_inputs)


def _fp4_rows(x, packed, s, out, n, inputs):  # pragma: no cover - compiled
    # out[:n, :m] = x[:n] @ W[:m]^T for the FP4 weight W: packed [J, K / 2] (element 2i in the low nibble of byte
    # i), s [J, K / 32] UE8M0 exponents; x rounded first as `inputs` says (quant.INPUT_CODES: to bfloat16, or to 8
    # bits a block; Fp4Weight.inputs)
    m, half = out.shape[1], packed.shape[1]
    step = FP4_GROUP // 2
    padded = (2 * half + FP4_CHUNK - 1) // FP4_CHUNK * FP4_CHUNK  # (x's length rounded up to whole chunks)
    if inputs == INT8_CODE and n <= 4 and _FP4I_FEW is not None:  # x rounded and laid out once (int8_x)
        _FP4I_FEW(packed, s, _int8_inputs(x, n), out, m, n)
        return
    if inputs == INT8_CODE:  # (the same rounding, then float32 products elsewhere)
        x = _int8_rounded_jit(x, n)
    bf16 = inputs == BF16_CODE
    if bf16 and n <= 4 and _AVX512_BF16:  # x rounded and permuted once (fp4_bf16_x), then a row at a time
        xb = _empty64_u16(n, padded)
        _fp4_bf16_x_jit(x, xb, n)
        _FP4B_FEW(packed, s, xb, out, m, n)
        return
    if bf16:  # (the same products in float32 elsewhere)
        x = _bf16_rounded_jit(x, n)
    if n <= 4 and _FP4_FEW is not None:  # a few rows: x permuted once (fp4_permuted_x), then a weight row at a time,
        # each decoded chunk meeting every row of x
        xp = _empty64_f32(n, padded)
        _fp4_permuted_x_jit(x, xp, n, _FP4_ORDER)
        _FP4_FEW(packed, s, xp, out, m, n)
        return
    if n <= 4:  # the same without AVX2: x's even and odd elements apart, then per row its groups' sums
        xe = np.empty((n, half), dtype=np.float32)
        xo = np.empty((n, half), dtype=np.float32)
        for t in range(n):
            for j in range(half):
                xe[t, j] = x[t, 2 * j]
                xo[t, j] = x[t, 2 * j + 1]
        for t in range(n):
            for row in range(m):
                total = np.float32(0.0)
                for g in range(half // step):
                    base = g * step
                    acc = np.float32(0.0)
                    for i in range(step):
                        byte = np.int32(packed[row, base + i])
                        acc += (_e2m1(byte & np.int32(15)) * xe[t, base + i]
                                + _e2m1(byte >> np.int32(4)) * xo[t, base + i])  # fmt: skip
                    total += acc * _ue8m0(s[row, g])
                out[t, row] = total
        return
    buf = _empty64_f32(ROW_BLOCK, 2 * half)
    for j0 in range(0, m, ROW_BLOCK):
        block = min(ROW_BLOCK, m - j0)
        for r in range(block):
            _fp4_row(packed, s, j0 + r, buf, r)
        _linear_tiles_jit(x, buf[:block], out[:, j0 : j0 + block], n)


_fp8_rows_x_jit = _jit(_fp8_rows_x)
_fp8_rows_jit = _jit(_fp8_rows)
_fp4_rows_jit = _jit(_fp4_rows)


def _fp8_dense(q, s, out, part, parts):  # pragma: no cover - compiled: out [J, K] float32 = the FP8 weight dequantized
    lo, hi = _share_jit(q.shape[0], part, parts)
    for row in range(lo, hi):
        _fp8_row(q, s, row, out, row)


def _fp4_dense(packed, s, out, part, parts):  # pragma: no cover - compiled: out [J, K] = the FP4 weight dequantized
    lo, hi = _share_jit(packed.shape[0], part, parts)
    for row in range(lo, hi):
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


def _matrix_rows(x, w, s, out, n, r0, c0, bf16):  # pragma: no cover - compiled through the overload below
    """out[:n] = x[:n] @ W[r0 : r0 + m, c0 : c0 + k]^T (m = out's width, k = x's) for a plain weight w (float32 or
    bfloat16 bits; s empty, 1-d) or an FP8 one (w its bytes, s its 2-d scale grid; c0 a multiple of 128; x
    rounded to bfloat16 first with `bf16`)."""


def _expert_rows(x, w, s, e, out, n, inputs):  # pragma: no cover - compiled through the overload below
    """out[:n] = x[:n] @ W_e^T for expert e of stacked experts: plain (s empty, 1-d), FP4 (s [E, out, in / 32]; x
    rounded first as `inputs` says, quant.INPUT_CODES) or FP8 (s [E, halves, ...]: each half of the rows with its
    own scale grid; x rounded to bfloat16 first where `inputs` says so)."""


if numba is not None:

    @numba.extending.overload(_matrix_rows)
    def _matrix_rows_typed(x, w, s, out, n, r0, c0, bf16):
        if s.ndim == 1:

            def plain(x, w, s, out, n, r0, c0, bf16):
                _linear_rows(x, w[r0 : r0 + out.shape[1], c0 : c0 + x.shape[1]], out, n)

            return plain

        def fp8(x, w, s, out, n, r0, c0, bf16):
            c1 = c0 + x.shape[1]
            _fp8_rows_jit(x, w[:, c0:c1], s[:, c0 // FP8_BLOCK : (c1 + FP8_BLOCK - 1) // FP8_BLOCK], r0, out, n, bf16)

        return fp8

    @numba.extending.overload(_expert_rows)
    def _expert_rows_typed(x, w, s, e, out, n, inputs):
        if s.ndim == 1:
            return lambda x, w, s, e, out, n, inputs: _linear_rows(x, w[e], out, n)
        if s.ndim == 3:
            return lambda x, w, s, e, out, n, inputs: _fp4_rows_jit(x, w[e], s[e], out, n, inputs)

        def fp8_halves(x, w, s, e, out, n, inputs):
            halves = s.shape[1]
            m = w.shape[1] // halves
            bf16 = inputs == BF16_CODE
            for h in range(halves):
                _fp8_rows_jit(x, w[e, h * m : (h + 1) * m], s[e, h], 0, out[:, h * m : (h + 1) * m], n, bf16)

        return fp8_halves


def _linear_fp8(x, qs, ss, bf16, outs, part, parts):  # pragma: no cover - compiled
    # outs[i] = x @ W_i^T for a tuple of FP8 weights (bytes qs[i], scales ss[i]), in chunks of rows (_chunk_of);
    # with `bf16`, x rounded to bfloat16 first (Fp8Weight.inputs)
    ends = _chunk_ends_jit(qs)
    lo, hi = _share_jit(ends[len(qs)], part, parts)
    xb = _fp8_inputs(x, x.shape[0], bf16)
    for task in range(lo, hi):
        i, j0, j1 = _chunk_of_jit(qs, ends, task)
        q, out = qs[i], outs[i]
        _fp8_rows_x_jit(x, xb, q, ss[i], j0, out[:, j0:j1], x.shape[0], bf16)


linear_fp8 = Threaded(_linear_fp8, min_work=1 << 18)


def _grouped_linear_fp8(x, q, s, bf16, out, part, parts):  # pragma: no cover - compiled
    # out [T, G, J] = per group g: x[:, g] [T, K] @ W[g * J : (g + 1) * J]^T for the FP8 weight W [G * J, K]
    # (x rounded to bfloat16 first with `bf16`)
    n, groups, rows = x.shape[0], x.shape[1], out.shape[2]
    lo, hi = _share_jit(groups, part, parts)
    for g in range(lo, hi):
        xg = np.empty((n, x.shape[2]), dtype=np.float32)
        res = np.empty((n, rows), dtype=np.float32)
        xg[:] = x[:, g]
        _fp8_rows_jit(xg, q, s, g * rows, res, n, bf16)
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


CALL_WEIGHTS = 8  # weights per linear call, the tuples padded to it: one compiled build per format, not per count
_NO_OUT = np.empty((0, 0), dtype=np.float32)  # (a padding weight's output: it has no rows, so nothing is written)


class Matmuls:
    """x [T, in] @ w^T for each of `weights` ([out, in] float32, bfloat16 bits, or an Fp8Weight of numpy views),
    one kernel call per format (per CALL_WEIGHTS weights), the calls worked out once (a decode plan keeps one per
    linear it runs): `matmuls(x)` -> new float32 arrays [T, out], one per weight. Each call's tuples of weights
    are padded to CALL_WEIGHTS with weights of no rows, so that numba compiles a kernel once per format instead
    of once per number of weights (compiling is most of a fresh checkout's first minutes)."""

    def __init__(self, weights: tuple) -> None:
        self.widths = tuple([w.shape[0] for w in weights])
        groups: dict = {}
        for i, w in enumerate(weights):
            groups.setdefault(("fp8", bf16_inputs(w)) if isinstance(w, Fp8Weight) else w.dtype, []).append(i)
        self.calls = []  # (kernel, multiply-adds per row, its weight arguments, the outputs it writes)
        for kind, every in groups.items():
            for start in range(0, len(every), CALL_WEIGHTS):
                idx = every[start : start + CALL_WEIGHTS]
                ws = [weights[i] for i in idx]
                work = sum([w.shape[0] * w.shape[1] for w in ws])
                pad = CALL_WEIGHTS - len(ws)
                if isinstance(kind, tuple):  # (FP8, and whether its inputs are rounded to bfloat16)
                    k = ws[0].q.shape[1]
                    qs = [w.q for w in ws] + [np.empty((0, k), dtype=np.uint8)] * pad
                    scales = [w.scale for w in ws] + [np.empty((0, ws[0].scale.shape[1]), dtype=np.uint8)] * pad
                    self.calls.append((linear_fp8, work, (tuple(qs), tuple(scales), kind[1]), idx))
                else:
                    plain = list(ws) + [np.empty((0, ws[0].shape[1]), dtype=kind)] * pad
                    self.calls.append((linear, work, (tuple(plain),), idx))

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, ...]:
        n = x.shape[0]
        outs = tuple([np.empty((n, w), dtype=np.float32) for w in self.widths])
        for kernel, work, args, idx in self.calls:
            kernel(n * work, x, *args, tuple([outs[i] for i in idx] + [_NO_OUT] * (CALL_WEIGHTS - len(idx))))
        return outs


def matmuls(x: np.ndarray, weights: tuple) -> tuple[np.ndarray, ...]:
    """Matmuls(weights)(x), for a call made once."""
    return Matmuls(weights)(x)
