"""Row dot products against x rounded to bfloat16 (a weight's `inputs`, quant.py), at a few rows of x (FP4 one
to four, FP8 up to eight), in LLVM IR on AVX512-BF16: FP4 rows by `vpermw` lookups of bfloat16 values, FP8 rows
by 128-entry byte lookups (`vpermi2b`), both meeting x in `vdpbf16ps` (32 products per instruction). Each product of a weight's value and
a bfloat16 is exact in float32; the instruction adds them in float32 (subnormal bfloat16 inputs and float32
results read as 0)."""

from __future__ import annotations

import functools

import numpy as np

from leanserve.model.backends.cpu.kernels.base import _bf16_bits_jit, numba
from leanserve.model.backends.cpu.kernels.rowdots import (
    _AVX512_BF16,
    FP4_CHUNK,
    _fp4_operands,
    _fp8_operands,
    _group_scales,
    _masked_load,
    _store_sums,
    _tail_lanes,
    _ue8m0_bits,
)
from leanserve.model.backends.cpu.kernels.simd import _prefetch, _splat
from leanserve.model.quant import FP4_VALUES, FP8_BLOCK

if numba is not None:
    from llvmlite import ir


# FP4 rows meeting x rounded to bfloat16 (Fp4Weight.inputs, on AVX512-BF16): a chunk of 64 bytes read as 32 words,
# word i holding values 4i .. 4i + 3, one per nibble; nibble p of every word is one shift and one 32-entry lookup
# of bfloat16 bits (vpermw, which reads an index's low 5 bits: the table holds the 16 values twice) away from 32
# values, which meet x's bfloat16 in `vdpbf16ps`: lane l of the float32 sum gets the products of words 2l and
# 2l + 1, values 8l + p and 8l + 4 + p, of group l // 4 as in fp4_row_dots (a row's scale bytes are loaded four
# chunks at a time, one shuffle spreading each chunk's over its lanes). Each product of two bfloat16 numbers
# is exact in float32; the instruction adds them in float32 (subnormal bfloat16 inputs and float32 results read
# as 0). x comes rounded and permuted once per call (fp4_bf16_x: its element 4i + p of a chunk at 32p + i).
def fp4_bf16_x(x, xb, n):  # pragma: no cover - compiled (jitted in quantized.py)
    """xb[t, 128c + 32p + i] = bfloat16 bits of x[t, 128c + 4i + p] (0 past x's end) for t < n."""
    k_dim, width = x.shape[1], xb.shape[1]
    for t in range(n):
        for c0 in range(0, width, FP4_CHUNK):
            for p in range(4):
                for i in range(32):
                    k = c0 + 4 * i + p
                    xb[t, c0 + 32 * p + i] = _bf16_bits_jit(x[t, k]) if k < k_dim else 0


class _BFloat(ir.types.Type if numba is not None else object):
    """LLVM's bfloat, which llvmlite's IR builder does not name (vdpbf16ps' intrinsic takes <32 x bfloat>)."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


@functools.cache
def fp4_bf16_row_dots(xrows: int = 1):
    """The intrinsic `dots(packed, s, row0, xb, out, j)` on AVX512-BF16: out[t, j] = sum_k W[row0, k] *
    bf16(x[t, k]) for t < xrows, W FP4 as for fp4_row_dots, xb as fp4_bf16_x writes it (uint16 [xrows, >= K
    rounded up to 128]); the rows of x share each decoded chunk."""
    return _make_fp4_bf16_dots(xrows) if _AVX512_BF16 else None


def _make_fp4_bf16_dots(xrows: int):
    @numba.extending.intrinsic
    def dots(typingctx, packed, s, row0, xb, out, j):
        from numba.core import cgutils

        def codegen(context, builder, signature, args):
            pk_t, s_t, _, xb_t, o_t, _ = signature.args
            pk, sc, xa, oa, row, j_ = _fp4_operands(context, builder, signature, args)
            f32, i16, i8 = ir.FloatType(), ir.IntType(16), ir.IntType(8)
            v16f, v32h, v32bf = (ir.VectorType(t, n) for t, n in ((f32, 16), (i16, 32), (_BFloat(), 32)))
            intp = context.get_value_type(numba.types.intp)
            fast = ("contract",)
            zeros = ir.Constant(v16f, [0.0] * 16)
            lut = ir.Constant(v32h, [_bf16_of(v) for v in FP4_VALUES * 2])
            fnty = ir.FunctionType
            perm = cgutils.get_or_insert_function(
                builder.module, fnty(v32h, [v32h, v32h]), "llvm.x86.avx512.permvar.hi.512"
            )
            dp = cgutils.get_or_insert_function(
                builder.module, fnty(v16f, [v16f, v32bf, v32bf]), "llvm.x86.avx512bf16.dpbf16ps.512"
            )
            groups = builder.extract_value(sc.shape, 1)
            full = builder.udiv(groups, ir.Constant(intp, 4))
            left = builder.trunc(builder.sub(groups, builder.mul(full, ir.Constant(intp, 4))), ir.IntType(32))
            totals = {(0, t): cgutils.alloca_once_value(builder, zeros) for t in range(xrows)}
            lanes32, lanes4 = _tail_lanes(builder, left, 32)  # (8 words, 16 bytes of codes, per group)

            def scales(c, count, lanes=None):  # the scale bytes of chunks c .. c + count // 4 - 1, or masked
                sp = cgutils.get_item_pointer(
                    context, builder, s_t, sc, [row, builder.mul(c, ir.Constant(intp, 4))], wraparound=False
                )
                vt = ir.VectorType(i8, count)
                if lanes is not None:
                    return _masked_load(builder, sp, vt, lanes)
                return builder.load(builder.bitcast(sp, vt.as_pointer()), align=1)

            def chunk(c, tail, sv=None):  # chunk c of the row; `tail`: the last one, of `left` groups; sv: its scales
                bp = cgutils.get_item_pointer(
                    context, builder, pk_t, pk, [row, builder.mul(c, ir.Constant(intp, 64))], wraparound=False
                )
                if tail:
                    codes = _masked_load(builder, bp, v32h, lanes32)
                    sv = _group_scales(builder, scales(c, 4, lanes4))
                else:
                    _prefetch(builder, bp)
                    codes = builder.load(builder.bitcast(bp, v32h.as_pointer()), align=1)
                    if sv is None:
                        sv = _group_scales(builder, scales(c, 4))
                parts = [zeros] * xrows
                for p in range(4):
                    idx = codes if p == 0 else builder.lshr(codes, ir.Constant(v32h, [4 * p] * 32))
                    vals = builder.bitcast(builder.call(perm, [lut, idx]), v32bf)
                    k = builder.add(builder.mul(c, ir.Constant(intp, FP4_CHUNK)), ir.Constant(intp, 32 * p))
                    for t in range(xrows):
                        xp = cgutils.get_item_pointer(
                            context, builder, xb_t, xa, [ir.Constant(intp, t), k], wraparound=False
                        )
                        xv = builder.load(builder.bitcast(xp, v32bf.as_pointer()), align=2)
                        parts[t] = builder.call(dp, [parts[t], vals, xv])
                for t in range(xrows):
                    total = totals[(0, t)]
                    builder.store(
                        builder.fadd(builder.load(total), builder.fmul(parts[t], sv, flags=fast), flags=fast), total
                    )

            quads = builder.mul(builder.udiv(full, ir.Constant(intp, 4)), ir.Constant(intp, 4))
            with cgutils.for_range_slice(builder, ir.Constant(intp, 0), quads, ir.Constant(intp, 4)) as (c0, _):
                both = _group_scales(builder, scales(c0, 16))  # four chunks' scales in one load
                for q in range(4):
                    lanes = ir.Constant(ir.VectorType(ir.IntType(32), 16), [4 * q + i // 4 for i in range(16)])
                    sv = builder.shuffle_vector(both, ir.Constant(v16f, ir.Undefined), lanes)
                    chunk(builder.add(c0, ir.Constant(intp, q)), False, sv)
            with cgutils.for_range_slice(builder, quads, full, ir.Constant(intp, 1)) as (c, _):
                chunk(c, False)
            with builder.if_then(builder.icmp_unsigned("!=", left, ir.Constant(ir.IntType(32), 0))):
                chunk(full, True)
            _store_sums(context, builder, o_t, oa, j_, totals)
            return context.get_dummy_value()

        return numba.types.void(packed, s, row0, xb, out, j), codegen

    return dots


def _bf16_of(v: float) -> int:
    """A float's bfloat16 bits (exact for the FP4 values)."""
    return int(np.array([v], dtype=np.float32).view(np.uint32)[0]) >> 16


# FP8 rows meeting x rounded to bfloat16 (Fp8Weight.inputs): a row is read in chunks of 64 bytes, two per 128-value
# scale block. Every e4m3 value (normal or subnormal) is a normal bfloat16, so two 128-entry lookups of a byte's
# low 7 bits (vpermi2b, which ignores bit 7) give its magnitude's two bfloat16 bytes, the sign byte is or-ed into
# the high one, and one byte interleave each way (vpunpcklbw / vpunpckhbw, within 16-byte lanes) makes the two
# vectors of 32 bfloat16s that meet x in `vdpbf16ps`. A block's products add up in two float32 chains, and their
# sum times the block's scale (a power of two) goes into the row's total. x comes rounded and in the interleave's
# order once per call (fp8_bf16_x).
FP8_CHUNK = 64  # bytes (values) per load of the FP8 bfloat16 row dots


def fp8_bf16_x(x, xb, n):  # pragma: no cover - compiled (jitted in quantized.py)
    """xb[t, 64c + 32h + j] = bfloat16 bits of x[t, 64c + 16 (j // 8) + 8h + j % 8] for t < n, h < 2, j < 32, over
    xb's width (x's whole 128-blocks)."""
    for t in range(n):
        for c0 in range(0, xb.shape[1], FP8_CHUNK):
            for h in range(2):
                for j in range(32):
                    xb[t, c0 + 32 * h + j] = _bf16_bits_jit(x[t, c0 + 16 * (j // 8) + 8 * h + j % 8])


def _e4m3_bf16_bytes() -> tuple[list[int], list[int]]:
    """The bfloat16 bits of the e4m3fn magnitudes 0..127 (0x7F, NaN, as 480: never written), as (low, high) bytes."""
    values = [(2.0 ** ((m >> 3) - 7)) * (1 + (m & 7) / 8) if m >> 3 else (m & 7) * 2.0**-9 for m in range(128)]
    bits = [_bf16_of(v) for v in values]
    return [b & 0xFF for b in bits], [b >> 8 for b in bits]


@functools.cache
def fp8_bf16_row_dots(rows: int, xrows: int = 1):
    """The intrinsic `dots(q, s, row0, xb, full, out, j)` on AVX512-BF16: out[t, j + r] = the float32 sum over the
    first `full` 128-blocks of row row0 + r of the FP8 weight (q bytes, s UE8M0 grid) times bf16(x[t]), for r <
    rows and t < xrows; xb as fp8_bf16_x writes it; the rows in one 128-row scale block; the rows share the loads
    of x, the rows of x each decoded chunk."""
    return _make_fp8_bf16_dots(rows, xrows) if _AVX512_BF16 else None


def _make_fp8_bf16_dots(rows: int, xrows: int):
    @numba.extending.intrinsic
    def dots(typingctx, q, s, row0, xb, full, out, j):
        from numba.core import cgutils

        def codegen(context, builder, signature, args):
            q_t, s_t, _, xb_t, _, o_t, _ = signature.args
            qa, sa, xa, oa, row0_, full_, j_ = _fp8_operands(context, builder, signature, args)
            f32, i32, i8 = ir.FloatType(), ir.IntType(32), ir.IntType(8)
            v16f, v64b, v32bf = (ir.VectorType(t, n) for t, n in ((f32, 16), (i8, 64), (_BFloat(), 32)))
            intp = context.get_value_type(numba.types.intp)
            fast = ("contract",)
            zeros = ir.Constant(v16f, [0.0] * 16)
            fnty = ir.FunctionType
            lookup = cgutils.get_or_insert_function(
                builder.module, fnty(v64b, [v64b, v64b, v64b]), "llvm.x86.avx512.vpermi2var.qi.512"
            )
            dp = cgutils.get_or_insert_function(
                builder.module, fnty(v16f, [v16f, v32bf, v32bf]), "llvm.x86.avx512bf16.dpbf16ps.512"
            )
            low, high = _e4m3_bf16_bytes()
            tables = [(ir.Constant(v64b, b[:64]), ir.Constant(v64b, b[64:])) for b in (low, high)]
            sign = ir.Constant(v64b, [0x80] * 64)
            interleave = [
                ir.Constant(
                    ir.VectorType(i32, 64),
                    [16 * (w // 8) + 8 * h + w % 8 + 64 * (i % 2) for w in range(32) for i in range(2)],
                )
                for h in range(2)
            ]
            row = [builder.add(row0_, ir.Constant(intp, r)) for r in range(rows)]
            srow = builder.udiv(row0_, ir.Constant(intp, FP8_BLOCK))
            pairs = [(r, t) for r in range(rows) for t in range(xrows)]
            totals = {p: cgutils.alloca_once_value(builder, zeros) for p in pairs}

            with cgutils.for_range(builder, full_) as loop:
                base = builder.mul(loop.index, ir.Constant(intp, FP8_BLOCK))
                sp = cgutils.get_item_pointer(context, builder, s_t, sa, [srow, loop.index], wraparound=False)
                e = builder.zext(builder.load(sp), i32)
                scale = _splat(builder, builder.bitcast(_ue8m0_bits(builder, e), f32))
                chains = {p: [zeros, zeros] for p in pairs}
                for c in range(FP8_BLOCK // FP8_CHUNK):
                    k = builder.add(base, ir.Constant(intp, FP8_CHUNK * c))
                    xv = {}
                    for t in range(xrows):
                        for h in range(2):
                            xp = cgutils.get_item_pointer(
                                context, builder, xb_t, xa,
                                [ir.Constant(intp, t), builder.add(k, ir.Constant(intp, 32 * h))], wraparound=False,
                            )  # fmt: skip
                            xv[(t, h)] = builder.load(builder.bitcast(xp, v32bf.as_pointer()), align=2)
                    for r in range(rows):
                        qp = cgutils.get_item_pointer(context, builder, q_t, qa, [row[r], k], wraparound=False)
                        _prefetch(builder, qp)
                        raw = builder.load(builder.bitcast(qp, v64b.as_pointer()), align=1)
                        lo, hi = (builder.call(lookup, [t0, raw, t1]) for t0, t1 in tables)
                        hi = builder.or_(hi, builder.and_(raw, sign))
                        for h in range(2):
                            w = builder.bitcast(builder.shuffle_vector(lo, hi, interleave[h]), v32bf)
                            for t in range(xrows):
                                chains[(r, t)][h] = builder.call(dp, [chains[(r, t)][h], w, xv[(t, h)]])
                for p in pairs:
                    part = builder.fadd(chains[p][0], chains[p][1], flags=fast)
                    total = totals[p]
                    builder.store(
                        builder.fadd(builder.load(total), builder.fmul(part, scale, flags=fast), flags=fast), total
                    )
            _store_sums(context, builder, o_t, oa, j_, totals)
            return context.get_dummy_value()

        return numba.types.void(q, s, row0, xb, full, out, j), codegen

    return dots
