"""FP4 row dot products against x rounded to 8 bits a block of 32 (`--fp4-inputs int8`, quant.int8_rounded), at
one to four rows of x, in LLVM IR on AVX2: byte lookups of each code's value and integer multiply-adds
(`vpmaddubsw`, `vpmaddwd`), exact within a group; each group's integer sum times its two scales in float32."""

from __future__ import annotations

import functools

import numpy as np

from leanserve.model.backends.cpu.kernels.base import _inlined, numba
from leanserve.model.backends.cpu.kernels.rowdots import _AVX2, _masked_load, _store_sums, _ue8m0_bits
from leanserve.model.backends.cpu.kernels.simd import _prefetch, _splat
from leanserve.model.quant import FP4_GROUP, FP4_VALUES, INT8_MAX

if numba is not None:
    from llvmlite import ir

# x comes as int8_x writes it, once per call: each 32-input block of x rounded to q * d (q an integer of at most
# INT8_MAX in magnitude, d its largest magnitude / INT8_MAX: quant.int8_rounded), q in the order the lookups make
# values, d / 2 and 12 times the group's sum of q. A row is read 8 groups (128 bytes) a step: its 8 scale bytes as
# 2^(e - 127), then each pair of groups' 32 code bytes split into low and high nibbles, each nibble looked up
# (vpshufb) as 2v + 12 for the e2m1 value v (0 to 24: unsigned, as vpmaddubsw takes its first operand), multiplied
# by q (signed) and added in pairs to 16-bit sums (at most 2 * 24 * 127 each, and the low and high nibbles' sums
# added: at most 12192), widened and added in fours (vpmaddwd by ones) to 32-bit sums: lanes 0-3 hold the first
# group's, lanes 4-7 the second's. Minus 12 times the group's sum of q (in lanes 0 and 4), the four lanes hold the
# group's sum of 2v * q exactly; converted to float32 (exact: at most 12 * 127 * 32 in magnitude), times d / 2
# (rounded once), then times 2^(e - 127) (exact, unless the product is subnormal), they are added to a running
# float32 sum per lane, two chains by pairs; the lanes are summed at the end. A last step of fewer than 8 groups
# reads its codes and scales with masked loads.
INT8_OFFSET = 12  # (added to 2v so that every looked-up value is unsigned)
STEP_GROUPS = 8  # groups a step: one load of scale bytes


def q_slot(g, i):  # pragma: no cover - compiled: where int8_x puts input i of group g in a row of xq
    return 64 * (g // 2) + 16 * (g % 2) + 32 * (i % 2) + i // 2


def group_lane(g):  # pragma: no cover - compiled: group g's first of its four lanes in a row of xd and xc
    return 8 * (g // 2) + 4 * (g % 2)


if numba is not None:
    q_slot = _inlined(q_slot)
    group_lane = _inlined(group_lane)


def int8_x(x, xq, xd, xc, n):  # pragma: no cover - compiled (jitted, without fast-math, in quantized.py)
    """For t < n and every group g (32 inputs) of x[t]: its q (quant.int8_rounded) in xq[t] (int8; per pair of
    groups 64 bytes: the first group's even inputs, the second's even, the first's odd, the second's odd), d / 2 in
    the four lanes xd[t, 8 * (g // 2) + 4 * (g % 2) + l] (float32, l < 4) and 12 * sum(q) in the first of the same
    four of xc[t] (int32; the other three 0). Past x's groups, up to the arrays' ends: zeros."""
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
            xc[t, lane] = INT8_OFFSET * total


def int8_x_shapes(k_dim):  # pragma: no cover - compiled
    """The widths of int8_x's xq, xd and xc for rows of x of k_dim inputs: whole steps of STEP_GROUPS groups."""
    steps = (k_dim + FP4_GROUP * STEP_GROUPS - 1) // (FP4_GROUP * STEP_GROUPS)
    return steps * STEP_GROUPS * FP4_GROUP, steps * STEP_GROUPS * 4, steps * STEP_GROUPS * 4


if numba is not None:
    int8_x_shapes = _inlined(int8_x_shapes)


@functools.cache
def fp4_int8_row_dots(xrows: int = 1):
    """The intrinsic `dots(packed, s, row, xq, xd, xc, out, j)` on AVX2: out[t, j] = sum over the groups g of W's
    row `row` of 2^(e - 127) * d_g * sum_i v_i * q_i for t < xrows, W FP4 as for rowdots.fp4_row_dots, x as
    int8_x writes it; the rows of x share each looked-up pair of groups. None without AVX2."""
    return _make_dots(xrows) if numba is not None and _AVX2 else None


def _make_dots(xrows: int):
    @numba.extending.intrinsic
    def dots(typingctx, packed, s, row, xq, xd, xc, out, j):
        from numba.core import cgutils

        def codegen(context, builder, signature, args):
            pk_t, s_t, _, xq_t, xd_t, xc_t, o_t, _ = signature.args
            pk, sc, qa, da, ca, oa = [
                context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1, 3, 4, 5, 6)
            ]
            row_, j_ = args[2], args[7]
            f32, i32, i16, i8 = ir.FloatType(), ir.IntType(32), ir.IntType(16), ir.IntType(8)
            v8f, v8i, v16h, v32b = (ir.VectorType(t, c) for t, c in ((f32, 8), (i32, 8), (i16, 16), (i8, 32)))
            intp = context.get_value_type(numba.types.intp)
            fast = ("contract",)
            fn = ir.FunctionType

            def intrinsic(name, ret, *params):
                return cgutils.get_or_insert_function(builder.module, fn(ret, list(params)), name)

            lookup = intrinsic("llvm.x86.avx2.pshuf.b", v32b, v32b, v32b)
            madd_bytes = intrinsic("llvm.x86.avx2.pmadd.ub.sw", v16h, v32b, v32b)
            madd_words = intrinsic("llvm.x86.avx2.pmadd.wd", v8i, v16h, v16h)
            spread = intrinsic("llvm.x86.avx2.permps", v8f, v8f, v8i)
            table = [int(2 * v) + INT8_OFFSET for v in FP4_VALUES] * 2
            lut = ir.Constant(v32b, table)
            nibble = ir.Constant(v32b, [15] * 32)
            ones = ir.Constant(v16h, [1] * 16)
            picks = [ir.Constant(v8i, [2 * p] * 4 + [2 * p + 1] * 4) for p in range(STEP_GROUPS // 2)]

            groups = builder.extract_value(sc.shape, 1)
            steps = builder.udiv(groups, ir.Constant(intp, STEP_GROUPS))
            left = builder.trunc(builder.sub(groups, builder.mul(steps, ir.Constant(intp, STEP_GROUPS))), i32)
            chains = {
                (t, c): cgutils.alloca_once_value(builder, ir.Constant(v8f, [0.0] * 8))
                for t in range(xrows)
                for c in range(2)
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
                if tail:
                    mask = builder.icmp_unsigned("<", ir.Constant(v8i, list(range(8))), _splat(builder, left, 8))
                    e = _masked_load(builder, sp, ir.VectorType(i8, 8), mask)
                else:
                    e = vector(sp, ir.VectorType(i8, 8))
                w_scales = builder.bitcast(_ue8m0_bits(builder, builder.zext(e, v8i)), v8f)
                accs = {key: builder.load(chains[key]) for key in chains}
                for p in range(STEP_GROUPS // 2):
                    g = builder.add(g0, ir.Constant(intp, 2 * p))
                    bp = at(pk_t, pk, row_, builder.mul(g, ir.Constant(intp, FP4_GROUP // 2)))
                    if tail:  # (4 dwords a group: those of the first `left` groups)
                        lanes = builder.icmp_unsigned(
                            "<",
                            ir.Constant(v8i, [2 * p * 4 + i for i in range(8)]),
                            builder.mul(_splat(builder, left, 8), ir.Constant(v8i, [4] * 8)),
                        )
                        codes = builder.bitcast(_masked_load(builder, bp, v8i, lanes), v32b)
                    else:
                        if p % 2 == 0:  # (once per 64-byte line)
                            _prefetch(builder, bp)
                        codes = vector(bp, v32b)
                    low = builder.call(lookup, [lut, builder.and_(codes, nibble)])
                    high_nibbles = builder.and_(
                        builder.bitcast(builder.lshr(builder.bitcast(codes, v16h), ir.Constant(v16h, [4] * 16)), v32b),
                        nibble,
                    )
                    high = builder.call(lookup, [lut, high_nibbles])
                    xk = builder.mul(g, ir.Constant(intp, FP4_GROUP))
                    lanes4 = builder.mul(g, ir.Constant(intp, 4))
                    w_scale = builder.call(spread, [w_scales, picks[p]])  # (each group's over its four lanes)
                    for t in range(xrows):
                        evens = vector(at(xq_t, qa, t, xk), v32b)
                        odds = vector(at(xq_t, qa, t, builder.add(xk, ir.Constant(intp, 32))), v32b)
                        words = builder.add(
                            builder.call(madd_bytes, [low, evens]), builder.call(madd_bytes, [high, odds])
                        )
                        sums = builder.call(madd_words, [words, ones])
                        exact = builder.sub(sums, vector(at(xc_t, ca, t, lanes4), v8i))
                        times_d = builder.fmul(builder.sitofp(exact, v8f), vector(at(xd_t, da, t, lanes4), v8f))
                        c = (t, p % 2)
                        accs[c] = builder.fadd(accs[c], builder.fmul(times_d, w_scale, flags=fast), flags=fast)
                for key in chains:
                    builder.store(accs[key], chains[key])

            with cgutils.for_range(builder, steps) as loop:
                step(builder.mul(loop.index, ir.Constant(intp, STEP_GROUPS)), False)
            with builder.if_then(builder.icmp_unsigned("!=", left, ir.Constant(i32, 0))):
                step(builder.mul(steps, ir.Constant(intp, STEP_GROUPS)), True)
            totals = {}
            for t in range(xrows):  # (the two chains side by side as one <16 x float>)
                both = [builder.load(chains[(t, c)]) for c in range(2)]
                totals[(0, t)] = cgutils.alloca_once_value(
                    builder, builder.shuffle_vector(*both, ir.Constant(ir.VectorType(i32, 16), list(range(16))))
                )
            _store_sums(context, builder, o_t, oa, j_, totals)
            return context.get_dummy_value()

        return numba.types.void(packed, s, row, xq, xd, xc, out, j), codegen

    return dots
