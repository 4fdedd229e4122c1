"""FP4 row dot products against x rounded to 8 bits a block of 32 (`--fp4-inputs int8`, quant.int8_rounded), at
one to four rows of x, in LLVM IR on AVX-512 with VNNI or on AVX2: byte lookups of each code's value and integer
multiply-adds (`vpdpbusd`; `vpmaddubsw`, `vpmaddwd`), exact within a group; each group's integer sum times its two
scales in float32, the same bits either way."""

from __future__ import annotations

import functools

import numpy as np

from leanserve.model.backends.cpu.kernels.base import _inlined, numba
from leanserve.model.backends.cpu.kernels.rowdots import (
    _AVX2,
    _AVX512_INT8,
    _byte_permute,
    _masked_load,
    _store_sums,
    _ue8m0_bits,
)
from leanserve.model.backends.cpu.kernels.simd import _prefetch, _splat
from leanserve.model.quant import FP4_GROUP, FP4_VALUES, INT8_MAX

if numba is not None:
    from llvmlite import ir

# x comes as int8_x writes it, once per call: each 32-input block of x rounded to q * d (q an integer of at most
# INT8_MAX in magnitude, d its largest magnitude / INT8_MAX: quant.int8_rounded), q in the order the lookups make
# values, d / 2 and -12 times the group's sum of q. A row is read 8 groups (128 bytes) a step: its 8 scale bytes as
# 2^(e - 127), then its code bytes a vector at a time (AVX2: 32 bytes, two groups; AVX-512: 64 bytes, four), split
# into low and high nibbles, each nibble looked up as 2v + 12 for the e2m1 value v (0 to 24: unsigned, as the
# multiply-adds take their first operand) and multiplied by q (signed), four adjacent products added into each
# 32-bit lane: on AVX2 pairs into 16-bit sums (vpmaddubsw; at most 2 * 24 * 127 each, and the low and high nibbles'
# sums added: at most 12192), then pairs of those (vpmaddwd by ones); on AVX-512 with VNNI straight into the lane
# (vpdpbusd, the lane starting from -12 * sum(q) and taking the high nibbles' products after the low ones). A
# group's four lanes then hold its sum of 2v * q exactly (the offset taken back, in its first lane); converted to
# float32 (exact: at most 12 * 127 * 32 in magnitude), times d / 2 (rounded once), then times 2^(e - 127) (exact,
# unless the product is subnormal), they are added to a running float32 sum per lane: on AVX2 two chains of 8
# lanes, a pair of groups to each in turn, on AVX-512 one of 16 lanes holding the same two chains side by side
# (lanes 0-7 the first pair of four groups, 8-15 the second), so both give the same bits; the lanes are summed at
# the end. A last step of fewer than 8 groups reads its codes and scales with masked loads.
INT8_OFFSET = 12  # (added to 2v so that every looked-up value is unsigned)
STEP_GROUPS = 8  # groups a step: one load of scale bytes


def q_slot(g, i):  # pragma: no cover - compiled: where int8_x puts input i of group g in a row of xq
    return 128 * (g // 4) + 16 * (g % 4) + 64 * (i % 2) + i // 2


def group_lane(g):  # pragma: no cover - compiled: group g's first of its four lanes in a row of xd and xc
    return 4 * g


if numba is not None:
    q_slot = _inlined(q_slot)
    group_lane = _inlined(group_lane)


def int8_x(x, xq, xd, xc, n):  # pragma: no cover - compiled (jitted, without fast-math, in quantized.py)
    """For t < n and every group g (32 inputs) of x[t]: its q (quant.int8_rounded) in xq[t] (int8; per four groups
    128 bytes: each group's 16 even inputs in turn, then their odd ones), d / 2 in the four lanes xd[t, 4g + l]
    (float32, l < 4) and -12 * sum(q) in the first of the same four of xc[t] (int32; the other three 0). Past x's
    groups, up to the arrays' ends: zeros."""
    groups = x.shape[1] // FP4_GROUP
    xq[:n] = 0
    xd[:n] = 0.0
    xc[:n] = 0
    for t in range(n):
        for g in range(groups):
            base = g * FP4_GROUP
            amax = np.float32(0.0)
            for i in range(FP4_GROUP):
                amax = max(amax, abs(x[t, base + i]))
            d = np.float32(amax / np.float32(INT8_MAX))
            inv = np.float32(np.float32(INT8_MAX) / amax) if amax > 0 else np.float32(0.0)
            total = 0
            for i in range(FP4_GROUP):
                q = min(INT8_MAX, max(-INT8_MAX, int(np.rint(np.float32(x[t, base + i] * inv)))))
                total += q
                xq[t, q_slot(g, i)] = q
            lane = group_lane(g)
            for lane_ in range(lane, lane + 4):
                xd[t, lane_] = d * np.float32(0.5)
            xc[t, lane] = -INT8_OFFSET * total


def int8_x_shapes(k_dim):  # pragma: no cover - compiled
    """The widths of int8_x's xq, xd and xc for rows of x of k_dim inputs: whole steps of STEP_GROUPS groups."""
    steps = (k_dim + FP4_GROUP * STEP_GROUPS - 1) // (FP4_GROUP * STEP_GROUPS)
    return steps * STEP_GROUPS * FP4_GROUP, steps * STEP_GROUPS * 4, steps * STEP_GROUPS * 4


if numba is not None:
    int8_x_shapes = _inlined(int8_x_shapes)


@functools.cache
def fp4_int8_row_dots(xrows: int = 1, wide: bool | None = None):
    """The intrinsic `dots(packed, s, row, xs, out, j)` on AVX-512 with VNNI (`wide`, the host's choice by default)
    or AVX2: out[t, j] = sum over the groups g of W's row `row` of 2^(e - 127) * d_g * sum_i v_i * q_i for
    t < xrows, W FP4 as for rowdots.fp4_row_dots, x as int8_x writes it (xs = (xq, xd, xc)); the rows of x share
    each looked-up vector of codes; the same bits either way. None where the host has neither."""
    wide = _AVX512_INT8 if wide is None else wide
    if numba is None or not (_AVX512_INT8 if wide else _AVX2):
        return None
    return _make_dots(xrows, wide)


def _make_dots(xrows: int, wide: bool):
    lanes_ = 16 if wide else 8  # (32-bit lanes a vector)
    per = lanes_ // 4  # (groups a vector)

    @numba.extending.intrinsic
    def dots(typingctx, packed, s, row, xs, out, j):
        from numba.core import cgutils

        def codegen(context, builder, signature, args):
            pk_t, s_t, _, xs_t, o_t, _ = signature.args
            pk, sc, oa = [context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1, 4)]
            xq_t, xd_t, xc_t = xs_t.types
            qa, da, ca = [
                context.make_array(xs_t.types[i])(context, builder, builder.extract_value(args[3], i)) for i in range(3)
            ]
            row_, j_ = args[2], args[5]
            f32, i32, i16, i8 = ir.FloatType(), ir.IntType(32), ir.IntType(16), ir.IntType(8)
            vf, vi, vh, vb = (
                ir.VectorType(t, c) for t, c in ((f32, lanes_), (i32, lanes_), (i16, 2 * lanes_), (i8, 4 * lanes_))
            )
            intp = context.get_value_type(numba.types.intp)
            fast = ("contract",)

            def intrinsic(name, ret, *params):
                return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, list(params)), name)

            table = [int(2 * v) + INT8_OFFSET for v in FP4_VALUES]
            four = ir.Constant(vh, [4] * (2 * lanes_))
            if wide:  # (vpermb reads an index's low 6 bits: a 64-entry table of the 16 values four times over)
                permute = _byte_permute(builder)
                lut = ir.Constant(vb, table * 4)
                multiply_add = intrinsic("llvm.x86.avx512.vpdpbusd.512", vi, vi, vb, vb)

                def values(codes):  # (the low nibbles, then the high ones shifted down: other bits above them)
                    high = builder.bitcast(builder.lshr(builder.bitcast(codes, vh), four), vb)
                    return builder.call(permute, [lut, codes]), builder.call(permute, [lut, high])

                def sums(low, high, evens, odds, start):
                    return builder.call(multiply_add, [builder.call(multiply_add, [start, low, evens]), high, odds])
            else:
                lookup = intrinsic("llvm.x86.avx2.pshuf.b", vb, vb, vb)
                madd_bytes = intrinsic("llvm.x86.avx2.pmadd.ub.sw", vh, vb, vb)
                madd_words = intrinsic("llvm.x86.avx2.pmadd.wd", vi, vh, vh)
                lut = ir.Constant(vb, table * 2)
                nibble = ir.Constant(vb, [15] * 32)
                ones = ir.Constant(vh, [1] * 16)

                def values(codes):
                    high = builder.and_(builder.bitcast(builder.lshr(builder.bitcast(codes, vh), four), vb), nibble)
                    return builder.call(lookup, [lut, builder.and_(codes, nibble)]), builder.call(lookup, [lut, high])

                def sums(low, high, evens, odds, start):
                    words = builder.add(builder.call(madd_bytes, [low, evens]), builder.call(madd_bytes, [high, odds]))
                    return builder.add(builder.call(madd_words, [words, ones]), start)

            groups = builder.extract_value(sc.shape, 1)
            steps = builder.udiv(groups, ir.Constant(intp, STEP_GROUPS))
            left = builder.trunc(builder.sub(groups, builder.mul(steps, ir.Constant(intp, STEP_GROUPS))), i32)
            chains = {  # (AVX2: a chain for each of a step's even and odd pairs of groups; AVX-512: both as one)
                (t, c): cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * lanes_))
                for t in range(xrows)
                for c in range(2 if per == 2 else 1)
            }

            def at(arr_t, arr, *idx):
                return cgutils.get_item_pointer(
                    context,
                    builder,
                    arr_t,
                    arr,
                    [i if isinstance(i, ir.Value) else ir.Constant(intp, i) for i in idx],
                    wraparound=False,
                )

            def vector(ptr, vt):
                return builder.load(builder.bitcast(ptr, vt.as_pointer()), align=1)

            def step(g0, tail):  # groups g0 .. g0 + 7 (`tail`: the row's last `left` of them)
                sp = at(s_t, sc, row_, g0)
                v8i = ir.VectorType(i32, 8)
                if tail:
                    mask = builder.icmp_unsigned("<", ir.Constant(v8i, list(range(8))), _splat(builder, left, 8))
                    e = _masked_load(builder, sp, ir.VectorType(i8, 8), mask)
                else:
                    e = vector(sp, ir.VectorType(i8, 8))
                w_scales = builder.bitcast(_ue8m0_bits(builder, builder.zext(e, v8i)), ir.VectorType(f32, 8))
                accs = {key: builder.load(chains[key]) for key in chains}
                for v in range(STEP_GROUPS // per):
                    g = builder.add(g0, ir.Constant(intp, per * v))  # (the vector's first group)
                    bp = at(pk_t, pk, row_, builder.mul(g, ir.Constant(intp, FP4_GROUP // 2)))
                    if tail:  # (4 dwords a group: those of the first `left` groups)
                        lanes = builder.icmp_unsigned(
                            "<",
                            ir.Constant(vi, [per * v * 4 + i for i in range(lanes_)]),
                            builder.mul(_splat(builder, left, lanes_), ir.Constant(vi, [4] * lanes_)),
                        )
                        codes = builder.bitcast(_masked_load(builder, bp, vi, lanes), vb)
                    else:
                        if wide or v % 2 == 0:  # (once per 64-byte line)
                            _prefetch(builder, bp)
                        codes = vector(bp, vb)
                    low, high = values(codes)
                    # (q_slot: the vector's evens at 128 * (g // 4) + 16 * (g % 4), its odds 64 bytes on)
                    evens_at = builder.add(
                        builder.mul(g0, ir.Constant(intp, FP4_GROUP)),
                        ir.Constant(intp, 128 * (per * v // 4) + 16 * (per * v % 4)),
                    )
                    lanes_at = builder.mul(g, ir.Constant(intp, 4))
                    spread = [per * v + lane // 4 for lane in range(lanes_)]  # (each group's scale over its lanes)
                    w_scale = builder.shuffle_vector(w_scales, w_scales, ir.Constant(vi, spread))
                    for t in range(xrows):
                        evens = vector(at(xq_t, qa, t, evens_at), vb)
                        odds = vector(at(xq_t, qa, t, builder.add(evens_at, ir.Constant(intp, 64))), vb)
                        exact = sums(low, high, evens, odds, vector(at(xc_t, ca, t, lanes_at), vi))
                        times_d = builder.fmul(builder.sitofp(exact, vf), vector(at(xd_t, da, t, lanes_at), vf))
                        c = (t, v % 2 if per == 2 else 0)
                        accs[c] = builder.fadd(accs[c], builder.fmul(times_d, w_scale, flags=fast), flags=fast)
                for key in chains:
                    builder.store(accs[key], chains[key])

            with cgutils.for_range(builder, steps) as loop:
                step(builder.mul(loop.index, ir.Constant(intp, STEP_GROUPS)), False)
            with builder.if_then(builder.icmp_unsigned("!=", left, ir.Constant(i32, 0))):
                step(builder.mul(steps, ir.Constant(intp, STEP_GROUPS)), True)
            if wide:
                totals = {(0, t): chains[(t, 0)] for t in range(xrows)}
            else:
                totals = {}
                for t in range(xrows):  # (the two chains side by side as one <16 x float>)
                    both = [builder.load(chains[(t, c)]) for c in range(2)]
                    totals[(0, t)] = cgutils.alloca_once_value(
                        builder, builder.shuffle_vector(*both, ir.Constant(ir.VectorType(i32, 16), list(range(16))))
                    )
            _store_sums(context, builder, o_t, oa, j_, totals)
            return context.get_dummy_value()

        return numba.types.void(packed, s, row, xs, out, j), codegen

    return dots
