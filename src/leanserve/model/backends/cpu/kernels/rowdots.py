"""Row dot products for weights read as stored at a few rows of x (decode, verification), written in LLVM IR: FP8
rows as vectors of 16 bytes (decoded straight into float32 bits), 64 (the same, by byte permutes on AVX512-VBMI)
or 32 (through float16), one to four rows of x a call; FP4 rows on AVX-512 by a 16-entry table lookup (`vpermps`), on AVX2 by byte lookups (`vpshufb`) of each
value's bfloat16 bits. Those against bfloat16 inputs are in bf16dots.py, FP4's against 8-bit ones in int8dots.py."""

from __future__ import annotations

import functools
import struct

import numpy as np

from leanserve.model.backends.cpu.kernels.base import numba
from leanserve.model.backends.cpu.kernels.simd import PREFETCH_AHEAD, _lanes_sum, _prefetch, _splat
from leanserve.model.quant import FP4_VALUES, FP8_BLOCK

if numba is not None:
    from llvmlite import ir


def _store_sums(context, builder, o_t, oa, j, accs):
    """The row dots' last step: out[t, j + r] = the lanes sum (_lanes_sum) of the <16 x float> accumulator
    accs[(r, t)] (a pointer), for every (weight row r, row of x t)."""
    from numba.core import cgutils

    intp = context.get_value_type(numba.types.intp)
    for r, t in accs:
        col = builder.add(j, ir.Constant(intp, r))
        op = cgutils.get_item_pointer(context, builder, o_t, oa, [ir.Constant(intp, t), col], wraparound=False)
        builder.store(_lanes_sum(builder, builder.load(accs[(r, t)])), op)


@functools.cache
def fp8_row_dots(rows: int, xrows: int = 1, half: bool = False, permuted: bool | None = None):
    """The intrinsic `dots(q, row0, xs, full, out, j)`: out[t, j + r] = the float32 sum over the first `full`
    128-blocks of row row0 + r of the FP8 weight (q bytes) times x[t], for r < rows and t < xrows; xs = x times
    the rows' scale block's scales times 2^120 (quantized._fp8_scaled_x: exact powers of two, so each product is
    the exact one), q's and xs' last dimensions contiguous, the rows in one 128-row scale block. In vector
    registers: each row's 8 vectors of 16 bytes a block decoded as _e4m3_raw (a sign-extended byte shifted and
    masked) and multiplied into two running sums per lane over the whole row (no per-block step); the lanes summed
    at the end. The rows share each load of xs, the rows of x each decoded weight vector; each entry's arithmetic
    is the same for any `rows` and `xrows`.

    With `half`, the bytes are decoded 32 at a time through float16 (_e4m3_half) and xs is x times the scales
    times 2^8: the same products and sums, bit for bit, without the float32 subnormals _e4m3_raw makes of e4m3's
    (a product with a subnormal input takes a microcode assist on Intel cores: weights with 0.015% subnormal
    bytes, as the bench model's, made eight rows of x 1.2x slower).

    Without `half`, on hosts with AVX512-VBMI (`permuted`; by default at one or two rows of x, PERMUTED_XROWS) 64
    bytes are decoded at a time by byte permutes (_e4m3_permuted): the same values, so the same bits."""
    permuted = _AVX512_VBMI and xrows <= PERMUTED_XROWS if permuted is None else permuted
    return _make_fp8_dots(rows, xrows, half, permuted and not half) if numba is not None else None


# The byte-permute decode's four vectors a load, at more rows of x, hold more registers than AVX-512 has: one core
# of a Zen 4 EPYC, [256 x 4096] in cache, against 16 bytes a load (2026-12-07): 1.17x as fast at one row of x
# (26.9 against 22.9 GB/s; from memory 25.6 against 22.4), 1.17x at two, 0.96x at three, 0.46x at four
PERMUTED_XROWS = 2


def _e4m3_raw_vector(builder, ptr):
    """The 16 e4m3 bytes at ptr as the <16 x float> of their values times 2^-120 (quantized._e4m3_raw: a
    sign-extended byte shifted and masked; float32 subnormals for the e4m3 ones)."""
    i32, i8 = ir.IntType(32), ir.IntType(8)
    v16i, v16b = ir.VectorType(i32, 16), ir.VectorType(i8, 16)
    b = builder.sext(builder.load(builder.bitcast(ptr, v16b.as_pointer()), align=1), v16i)
    bits = builder.and_(builder.shl(b, ir.Constant(v16i, [20] * 16)), ir.Constant(v16i, [0x87F00000 - 2**32] * 16))
    return builder.bitcast(bits, ir.VectorType(ir.FloatType(), 16))


def _e4m3_raw_vectors(builder, ptr):
    """_e4m3_raw_vector's vector as a list of one (the decodes' common form)."""
    return [_e4m3_raw_vector(builder, ptr)]


def _byte_permute(builder):
    """AVX512-VBMI's byte permute (vpermb) as a function of (table, indices), <64 x i8> each: table[index & 63]."""
    from numba.core import cgutils

    v64b = ir.VectorType(ir.IntType(8), 64)
    return cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(v64b, [v64b, v64b]), "llvm.x86.avx512.permvar.qi.512"
    )


def _e4m3_permuted(builder, ptr):
    """The 64 e4m3 bytes at ptr as four <16 x float> of their values times 2^-120, the same as _e4m3_raw_vector's
    at ptr, ptr + 16, ... on AVX512-VBMI: for each 32 of them one byte permute (vpermb) puts bytes j and 16 + j in
    the high bytes of dword j's two words; an arithmetic shift of the words by 4 and a mask (which clears what the
    low bytes held) make each word the bfloat16 bits of its byte's value times 2^-120, and the low word shifted up
    or the high one masked is its float32. Per 32 bytes: 5 operations against _e4m3_raw_vector's 6, whose sign
    extensions cost more on Zen 4 (one core in cache at one row of x, a C model of both loops: 27.7 against 23.0
    GB/s)."""
    i32, i16, i8 = ir.IntType(32), ir.IntType(16), ir.IntType(8)
    v16i, v32h, v64b = (ir.VectorType(t, c) for t, c in ((i32, 16), (i16, 32), (i8, 64)))
    loaded = builder.load(builder.bitcast(ptr, v64b.as_pointer()), align=1)
    permute = _byte_permute(builder)
    out = []
    for half in (0, 32):
        order = [b for j in range(16) for b in (0, half + j, 0, half + 16 + j)]
        words = builder.bitcast(builder.call(permute, [loaded, ir.Constant(v64b, order)]), v32h)
        bits = builder.and_(builder.ashr(words, ir.Constant(v32h, [4] * 32)), ir.Constant(v32h, [0x87F0 - 2**16] * 32))
        dwords = builder.bitcast(bits, v16i)
        low = builder.shl(dwords, ir.Constant(v16i, [16] * 16))
        high = builder.and_(dwords, ir.Constant(v16i, [0xFFFF0000 - 2**32] * 16))
        out += [builder.bitcast(v, ir.VectorType(ir.FloatType(), 16)) for v in (low, high)]
    return out


def _e4m3_half(builder, ptr):
    """The 32 e4m3 bytes at ptr as two <16 x float> of their values times 2^-8: each byte's bits shifted into a
    float16's sign, exponent and mantissa (a sign-extended byte shifted by 7, bit 14 cleared), whose subnormals are
    e4m3's, then widened to float32 (vcvtph2ps), where every such value is a normal number."""
    i32, i16, i8 = ir.IntType(32), ir.IntType(16), ir.IntType(8)
    v32h, v32b = ir.VectorType(i16, 32), ir.VectorType(i8, 32)
    b = builder.sext(builder.load(builder.bitcast(ptr, v32b.as_pointer()), align=1), v32h)
    bits = builder.and_(builder.shl(b, ir.Constant(v32h, [7] * 32)), ir.Constant(v32h, [0xBF80 - 2**16] * 32))
    halves = builder.bitcast(bits, ir.VectorType(ir.HalfType(), 32))
    out = []
    for lo in (0, 16):
        part = builder.shuffle_vector(
            halves,
            ir.Constant(halves.type, ir.Undefined),
            ir.Constant(ir.VectorType(i32, 16), list(range(lo, lo + 16))),
        )
        out.append(builder.fpext(part, ir.VectorType(ir.FloatType(), 16)))
    return out


def _make_fp8_dots(rows: int, xrows: int, half: bool, permuted: bool):
    @numba.extending.intrinsic
    def dots(typingctx, q, row0, xs, full, out, j):
        from numba.core import cgutils

        def codegen(context, builder, signature, args):
            q_t, _, x_t, _, o_t, _ = signature.args
            qa, xa, oa = [context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 4)]
            row0_, full_, j_ = args[1], args[3], args[5]
            v16f = ir.VectorType(ir.FloatType(), 16)
            intp = context.get_value_type(numba.types.intp)
            fast = ("contract",)
            row = [builder.add(row0_, ir.Constant(intp, r)) for r in range(rows)]
            pairs = [(r, t) for r in range(rows) for t in range(xrows)]
            chains = {
                (p, c): cgutils.alloca_once_value(builder, ir.Constant(v16f, [0.0] * 16))
                for p in pairs
                for c in range(2)
            }
            # Several weight rows at a time whose rows span more than PREFETCH_AHEAD bytes (three or four of 8192)
            # ask for the same offset in the next group of rows instead: PREFETCH_AHEAD lands in a row being read
            ahead = PREFETCH_AHEAD
            if rows > 1:
                group = builder.mul(builder.extract_value(qa.strides, 0), ir.Constant(intp, rows))
                least = ir.Constant(intp, PREFETCH_AHEAD)
                ahead = builder.select(builder.icmp_signed(">", group, least), group, least)
            decode, per = (  # (and how many vectors of 16 values it decodes a load)
                (_e4m3_half, 2) if half else (_e4m3_permuted, 4) if permuted else (_e4m3_raw_vectors, 1)
            )

            with cgutils.for_range(builder, full_) as loop:
                base = builder.mul(loop.index, ir.Constant(intp, FP8_BLOCK))
                accs = {p: [builder.load(chains[(p, 0)]), builder.load(chains[(p, 1)])] for p in pairs}
                for v0 in range(0, FP8_BLOCK // 16, per):
                    xvs = {}
                    for v in range(v0, v0 + per):
                        k = builder.add(base, ir.Constant(intp, 16 * v))
                        for t in range(xrows):  # (x times the block's scale: _fp8_scaled_x)
                            xp = cgutils.get_item_pointer(
                                context, builder, x_t, xa, [ir.Constant(intp, t), k], wraparound=False
                            )
                            xvs[(v, t)] = builder.load(builder.bitcast(xp, v16f.as_pointer()), align=4)
                    k = builder.add(base, ir.Constant(intp, 16 * v0))
                    for r in range(rows):
                        qp = cgutils.get_item_pointer(context, builder, q_t, qa, [row[r], k], wraparound=False)
                        if v0 % 4 == 0:  # (once per 64-byte line)
                            _prefetch(builder, qp, ahead)
                        for v, wv in zip(range(v0, v0 + per), decode(builder, qp), strict=True):
                            for t in range(xrows):
                                prod = builder.fmul(wv, xvs[(v, t)], flags=fast)
                                accs[(r, t)][v % 2] = builder.fadd(accs[(r, t)][v % 2], prod, flags=fast)
                for p in pairs:
                    for c in range(2):
                        builder.store(accs[p][c], chains[(p, c)])
            totals = {p: chains[(p, 0)] for p in pairs}  # (the two chains' sum, into the first)
            for p in pairs:
                builder.store(
                    builder.fadd(builder.load(chains[(p, 0)]), builder.load(chains[(p, 1)]), flags=fast), totals[p]
                )
            _store_sums(context, builder, o_t, oa, j_, totals)
            return context.get_dummy_value()

        return numba.types.void(q, row0, xs, full, out, j), codegen

    return dots


# FP4 at one to four rows, on AVX-512 or AVX2: each weight row's dot products in vector registers (LLVM IR below).
# The row is read in chunks of 64 bytes, 128 values, loaded as 16 dwords straight from memory, and decoded into 8
# vectors of 16 values (_fp4_values): on AVX-512 dword i holds values 8i .. 8i + 7, one per nibble, so nibble p of
# every dword is one shift (p * 4 bits) and one 16-entry table lookup (vpermps, which reads only an index's low 4
# bits) away from 16 values, with no byte shuffles; on AVX2 byte lookups give each value's bfloat16 bits
# (_fp4_values_avx2). x comes permuted to match once per call (fp4_permuted_x, in fp4_order). Lane i of a chunk
# holds values of group i // 4 only (32 values, one scale): its 8 products (two chains) times its group's scale
# are added to the lane's running sum; the lanes are summed at the end (at one row of x, a row's scale bytes loaded
# four chunks at a time, one shuffle spreading each chunk's over its lanes). A last chunk of 1-3 groups is read
# with masked loads (missing codes read as 0, x padded with zeros). Without AVX2 the loop in _fp4_rows does the
# same math in an order of its own.
_AVX512 = _AVX512_BF16 = _AVX512_INT8 = _AVX512_VBMI = _AVX2 = _F16C = _SUBNORMALS_CHEAP = False
_HOST_CPU = ""  # (LLVM's name for this host's CPU kind)
if numba is not None:
    import llvmlite.binding as _llvm

    _HOST_CPU = _llvm.get_host_cpu_name()
    _features = _llvm.get_host_cpu_features()
    _AVX512 = bool(_features.get("avx512f", False))
    _AVX2 = bool(_features.get("avx2", False))
    _AVX512_BF16 = _AVX512 and bool(_features.get("avx512bf16", False))
    # byte permutes (vpermb: Ice Lake and later Intel cores, AMD's Zen 4 and later), and with VNNI (vpdpbusd) what
    # int8dots' AVX-512 form takes
    _AVX512_VBMI = _AVX512 and all(_features.get(f, False) for f in ("avx512bw", "avx512vbmi"))
    _AVX512_INT8 = _AVX512_VBMI and bool(_features.get("avx512vnni", False))
    _F16C = bool(_features.get("f16c", False))  # (vcvtph2ps, which fp8_row_dots' `half` decode needs)
    # AMD's Zen 3, Zen 4 and Zen 5 cores multiply the few float32 subnormals of FP8 weights without a measurable
    # cost (Intel's take a microcode assist for each): there the FP8 row dots may decode straight into float32 bits
    # (docs/kernels.md; quantized._HALF and _MANY_HALF say at how many rows of x)
    _SUBNORMALS_CHEAP = _HOST_CPU in ("znver3", "znver4", "znver5")

FP4_CHUNK = 128  # values per chunk of the FP4 row dots: 64 bytes, 4 groups


def fp4_order(wide: bool):
    """Which value of a 128-value chunk each slot of x's chunk holds for the FP4 row dots (fp4_permuted_x): slot
    16p + i meets lane i of the chunk's p-th decoded <16 x float> (_fp4_values); lane i holds values of group
    i // 4 only, either way."""
    if wide:  # (nibble p of dword i: value 8i + p)
        return np.array([8 * i + p for p in range(8) for i in range(16)], dtype=np.int64)
    # (half h of the chunk; lo / hi nibbles s; q: which of the four vectors _fp4_values_avx2 makes of them)
    order = [
        64 * h + 2 * (16 * (i // 4) + 8 * (q // 2) + 2 * (i % 4) + q % 2) + s
        for s in (0, 1)
        for q in range(4)
        for h in (0, 1)
        for i in range(8)
    ]
    return np.array(order, dtype=np.int64)


def fp4_permuted_x(x, xp, n, order):  # pragma: no cover - compiled (jitted in quantized.py)
    """xp[t, 128c + slot] = x[t, 128c + order[slot]] (0 past x's end) for t < n: x in the order fp4_row_dots read
    it (fp4_order)."""
    k_dim, width = x.shape[1], xp.shape[1]
    for t in range(n):
        for c0 in range(0, width, FP4_CHUNK):
            for slot in range(FP4_CHUNK):
                k = c0 + order[slot]
                xp[t, c0 + slot] = x[t, k] if k < k_dim else 0.0


@functools.cache
def fp4_row_dots(rows: int, xrows: int = 1, wide: bool | None = None):
    """The intrinsic `dots(packed, s, row0, xp, out, j)` on AVX-512 (`wide`, the host's choice by default) or
    AVX2: out[t, j + r] = sum_k W[row0 + r, k] * x[t, k] for r < rows and t < xrows, W FP4 (packed [J, K / 2]
    uint8 with K a multiple of 32, s [J, K / 32] UE8M0; last dimensions contiguous), x as fp4_permuted_x writes it
    in fp4_order(wide) (xp [xrows, >= K rounded up to 128]); the rows share the loads of x, the rows of x each
    decoded chunk; each entry's arithmetic the same for any `rows` and `xrows`. None where the host has neither."""
    wide = _AVX512 if wide is None else wide
    if numba is None or not (_AVX512 if wide else _AVX2):
        return None
    return _make_fp4_dots(rows, xrows, wide)


def _fp4_values(builder, codes, wide):
    """A chunk's 64 code bytes (<16 x i32> `codes`) as the 8 <16 x float> of their e2m1 values that meet x's
    slots 16p .. 16p + 15 (fp4_order): on AVX-512 nibble p of every dword by one 16-entry lookup (vpermps)."""
    from numba.core import cgutils

    v16f, v16i = ir.VectorType(ir.FloatType(), 16), ir.VectorType(ir.IntType(32), 16)
    if not wide:
        return _fp4_values_avx2(builder, codes)
    perm = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(v16f, [v16f, v16i]), "llvm.x86.avx512.permvar.sf.512"
    )
    lut = ir.Constant(v16f, list(FP4_VALUES))
    return [
        builder.call(perm, [lut, codes if p == 0 else builder.lshr(codes, ir.Constant(v16i, [4 * p] * 16))])
        for p in range(8)
    ]


def _fp4_values_avx2(builder, codes):
    """_fp4_values on AVX2, whose vpermps takes 8 entries: every e2m1 value is a bfloat16 whose two bytes are one
    16-entry byte lookup each (vpshufb) of its code; the two bytes are interleaved into words (vpunpck*bw), and a
    dword of two such words gives two float32s, its low word shifted up and its high word masked. Per 32 code
    bytes (64 values): the nibbles apart (a shift, two masks), then four lookups, four interleaves, four shifts and
    four masks."""
    from numba.core import cgutils

    i32, i8 = ir.IntType(32), ir.IntType(8)
    v8f, v8i, v32b, v64b = (ir.VectorType(t, c) for t, c in ((ir.FloatType(), 8), (i32, 8), (i8, 32), (i8, 64)))

    def lanes(values):
        return ir.Constant(ir.VectorType(i32, len(values)), values)

    shuffle = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(v32b, [v32b, v32b]), "llvm.x86.avx2.pshuf.b"
    )
    bits = [struct.unpack("<I", struct.pack("<f", v))[0] for v in FP4_VALUES]
    tables = [ir.Constant(v32b, [(b >> shift) & 0xFF for b in bits] * 2) for shift in (16, 24)]  # (low, high byte)
    nibbles = ir.Constant(v64b, [15] * 64)
    b = builder.bitcast(codes, v64b)
    out = []  # (for the low nibbles, then the high: q = 0 .. 3 of fp4_order)
    low_nibbles = builder.and_(b, nibbles)
    high_nibbles = builder.and_(builder.lshr(b, ir.Constant(v64b, [4] * 64)), nibbles)
    for nib in (low_nibbles, high_nibbles):
        halves = []
        for h in (0, 32):
            idx = builder.shuffle_vector(nib, nib, lanes(list(range(h, h + 32))))
            low, high = (builder.call(shuffle, [t, idx]) for t in tables)
            vectors = []
            for first in (0, 8):  # (bytes first .. first + 7 of each 16-byte lane, as words)
                pairs = [j for lane in (0, 16) for k in range(first + lane, first + lane + 8) for j in (k, 32 + k)]
                words = builder.bitcast(builder.shuffle_vector(low, high, lanes(pairs)), v8i)
                vectors.append(builder.shl(words, ir.Constant(v8i, [16] * 8)))
                vectors.append(builder.and_(words, ir.Constant(v8i, [-(1 << 16)] * 8)))
            halves.append([builder.bitcast(v, v8f) for v in vectors])
        out += [builder.shuffle_vector(halves[0][q], halves[1][q], lanes(list(range(16)))) for q in range(4)]
    return out


def _make_fp4_dots(rows: int, xrows: int, wide: bool):
    @numba.extending.intrinsic
    def dots(typingctx, packed, s, row0, xp, out, j):
        from numba.core import cgutils

        def codegen(context, builder, signature, args):
            pk_t, s_t, _, xp_t, o_t, _ = signature.args
            pk, sc, xa, oa, row0_, j_ = _fp4_operands(context, builder, signature, args)
            f32, i32, i8 = ir.FloatType(), ir.IntType(32), ir.IntType(8)
            v16f, v16i = ir.VectorType(f32, 16), ir.VectorType(i32, 16)
            intp = context.get_value_type(numba.types.intp)
            fast = ("contract",)
            groups = builder.extract_value(sc.shape, 1)
            full = builder.udiv(groups, ir.Constant(intp, 4))
            left = builder.trunc(builder.sub(groups, builder.mul(full, ir.Constant(intp, 4))), i32)
            row = [builder.add(row0_, ir.Constant(intp, r)) for r in range(rows)]
            pairs = [(r, t) for r in range(rows) for t in range(xrows)]
            # On AVX2, whose registers hold 8 lanes, a chunk's vectors are taken by halves at three or four rows of
            # x, each half's products for every row of x before the other's: the same sums per lane, with fewer
            # registers live at once (one core, [4096 x 4096] from memory: 1.03-1.09x as fast at three rows,
            # 1.13-1.16x at four; 0.93x at one row, 0.98-1.03x at two, so those keep whole vectors)
            width = 8 if not wide and xrows >= 3 else 16
            halves = range(16 // width)
            vw = ir.VectorType(f32, width)
            totals = {
                (q, h): cgutils.alloca_once_value(builder, ir.Constant(vw, [0.0] * width))
                for q in pairs
                for h in halves
            }

            def half(v, h):  # lanes width * h .. width * h + width - 1 of a <16 x ...> vector
                if width == 16:
                    return v
                return builder.shuffle_vector(
                    v, v, ir.Constant(ir.VectorType(i32, width), [width * h + i for i in range(width)])
                )

            lanes16, lanes4 = _tail_lanes(builder, left, 16)  # (4 dwords, 16 bytes of codes, per group)

            def scales(r, c, count, lanes=None):  # row r's scale bytes of chunks c .. c + count // 4 - 1 (<count x
                # i8>), or those of `lanes` only
                sp = cgutils.get_item_pointer(
                    context, builder, s_t, sc, [row[r], builder.mul(c, ir.Constant(intp, 4))], wraparound=False
                )
                vt = ir.VectorType(i8, count)
                if lanes is not None:
                    return _masked_load(builder, sp, vt, lanes)
                return builder.load(builder.bitcast(sp, vt.as_pointer()), align=1)

            def chunk(c, tail, svs=None):  # chunk c of every row; `tail`: the last one, of `left` groups; svs: the
                # rows' scales of it (else loaded here)
                xv = {}
                for t in range(xrows):
                    for p in range(8):
                        for h in halves:
                            k = builder.add(
                                builder.mul(c, ir.Constant(intp, FP4_CHUNK)), ir.Constant(intp, 16 * p + width * h)
                            )
                            ptr = cgutils.get_item_pointer(
                                context, builder, xp_t, xa, [ir.Constant(intp, t), k], wraparound=False
                            )
                            xv[(t, p, h)] = builder.load(builder.bitcast(ptr, vw.as_pointer()), align=4)
                for r in range(rows):
                    bp = cgutils.get_item_pointer(
                        context, builder, pk_t, pk, [row[r], builder.mul(c, ir.Constant(intp, 64))], wraparound=False
                    )
                    if tail:
                        codes = _masked_load(builder, bp, v16i, lanes16)
                        sv = _group_scales(builder, scales(r, c, 4, lanes4))
                    else:
                        _prefetch(builder, bp)
                        codes = builder.load(builder.bitcast(bp, v16i.as_pointer()), align=1)
                        sv = svs[r] if svs is not None else _group_scales(builder, scales(r, c, 4))
                    values = _fp4_values(builder, codes, wide)
                    for h in halves:
                        accs = {t: [None, None] for t in range(xrows)}
                        for p, vals in enumerate(values):
                            vh = half(vals, h)
                            for t in range(xrows):
                                prod = builder.fmul(vh, xv[(t, p, h)], flags=fast)
                                a = accs[t][p % 2]
                                accs[t][p % 2] = prod if a is None else builder.fadd(a, prod, flags=fast)
                        svh = half(sv, h)
                        for t in range(xrows):
                            part = builder.fadd(accs[t][0], accs[t][1], flags=fast)
                            total = totals[((r, t), h)]
                            scaled = builder.fmul(part, svh, flags=fast)
                            builder.store(builder.fadd(builder.load(total), scaled, flags=fast), total)

            # At one row of x, four chunks' scale bytes in one load (the batch-1 published step 0.98x); at more, the
            # loop's four copies of the chunk's code cost more than they save (1.02-1.03x at batch 4).
            quads = ir.Constant(intp, 0)
            if xrows == 1:
                quads = builder.mul(builder.udiv(full, ir.Constant(intp, 4)), ir.Constant(intp, 4))
            with cgutils.for_range_slice(builder, ir.Constant(intp, 0), quads, ir.Constant(intp, 4)) as (c0, _):
                both = [_group_scales(builder, scales(r, c0, 16)) for r in range(rows)]  # (four chunks' in one load)
                for q in range(4):
                    lanes = ir.Constant(v16i, [4 * q + i // 4 for i in range(16)])
                    svs = [builder.shuffle_vector(b, ir.Constant(v16f, ir.Undefined), lanes) for b in both]
                    chunk(builder.add(c0, ir.Constant(intp, q)), False, svs)
            with cgutils.for_range_slice(builder, quads, full, ir.Constant(intp, 1)) as (c, _):
                chunk(c, False)
            with builder.if_then(builder.icmp_unsigned("!=", left, ir.Constant(i32, 0))):
                chunk(full, True)
            whole = {q: totals[(q, 0)] for q in pairs}
            if width < 16:  # (each pair's halves as one <16 x float> again)
                for q in pairs:
                    both = [builder.load(totals[(q, h)]) for h in halves]
                    whole[q] = cgutils.alloca_once_value(
                        builder, builder.shuffle_vector(*both, ir.Constant(v16i, list(range(16))))
                    )
            _store_sums(context, builder, o_t, oa, j_, whole)
            return context.get_dummy_value()

        return numba.types.void(packed, s, row0, xp, out, j), codegen

    return dots


def _fp8_operands(context, builder, signature, args):
    """An FP8 dots intrinsic's call `dots(q, s, row0, x, full, out, j)` as (q, s, x, out) numba arrays, row0, full
    and j."""
    arrays = [context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1, 3, 5)]
    return (*arrays, args[2], args[4], args[6])


def _fp4_operands(context, builder, signature, args):
    """An FP4 dots intrinsic's call `dots(packed, s, row0, x, out, j)` as (packed, s, x, out) numba arrays, row0
    and j."""
    arrays = [context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1, 3, 4)]
    return (*arrays, args[2], args[5])


def _masked_load(builder, ptr, vt, lanes):
    """The lanes of a vector of type vt at ptr where the <n x i1> `lanes` holds, 0 elsewhere (llvm.masked.load)."""
    from numba.core import cgutils

    i1, i32 = ir.IntType(1), ir.IntType(32)
    name = f"llvm.masked.load.v{vt.count}i{vt.element.width}.p0"
    load = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vt, [vt.as_pointer(), i32, ir.VectorType(i1, vt.count), vt]), name
    )
    return builder.call(
        load, [builder.bitcast(ptr, vt.as_pointer()), ir.Constant(i32, 1), lanes, ir.Constant(vt, [0] * vt.count)]
    )


def _tail_lanes(builder, left, count):
    """A last FP4 chunk of `left` (an i32, 1-3) groups: the lanes of its <count x ...> codes vector (count / 4 a
    group) and of its 4 scale bytes that hold them."""
    i32 = ir.IntType(32)
    vc, v4i = ir.VectorType(i32, count), ir.VectorType(i32, 4)
    per = ir.Constant(vc, [count // 4] * count)
    codes = builder.icmp_unsigned(
        "<", ir.Constant(vc, list(range(count))), builder.mul(_splat(builder, left, count), per)
    )
    return codes, builder.icmp_unsigned("<", ir.Constant(v4i, [0, 1, 2, 3]), _splat(builder, left, 4))


def _group_scales(builder, e):
    """UE8M0 scale bytes as the <16 x float> of 2^(e - 127) (e = 0 -> 2^-127): a chunk's 4 (<4 x i8>) each spread
    over its group's lanes (lane i gets byte i // 4), or four chunks' 16 (<16 x i8>) one a lane."""
    i32 = ir.IntType(32)
    v16i, count = ir.VectorType(i32, 16), e.type.count
    e = builder.zext(e, ir.VectorType(i32, count))
    if count == 4:
        e = builder.shuffle_vector(e, ir.Constant(e.type, ir.Undefined), ir.Constant(v16i, [i // 4 for i in range(16)]))
    return builder.bitcast(_ue8m0_bits(builder, e), ir.VectorType(ir.FloatType(), 16))


def _ue8m0_bits(builder, e):
    """UE8M0 exponents (an i32, or a vector of them) as the bits of the float32 2^(e - 127); e = 0 -> 2^-127."""
    t = e.type

    def const(v):
        return ir.Constant(t, [v] * t.count) if isinstance(t, ir.VectorType) else ir.Constant(t, v)

    return builder.select(builder.icmp_unsigned("==", e, const(0)), const(1 << 22), builder.shl(e, const(23)))
