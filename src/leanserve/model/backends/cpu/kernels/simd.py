"""Row dot products written in LLVM IR, for weights read as stored at batch 1: FP8 rows as 16-byte vectors, FP4
rows on AVX-512 by a 16-entry table lookup (`vpermps`)."""

from __future__ import annotations

from leanserve.model.backends.cpu.kernels.base import numba
from leanserve.model.quant import FP8_BLOCK

_fp8_row_dot = _fp4_row_dot_avx512 = None  # (nothing is compiled without numba)
if numba is not None:
    from llvmlite import ir

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
