"""Kernels written in LLVM IR: the linear tiles and weighted rows, whose entries get the same float32 operations
in every shape (batch invariance), and row dot products for weights read as stored at batch 1: FP8 rows as
16-byte vectors, FP4 rows on AVX-512 by a 16-entry table lookup (`vpermps`)."""

from __future__ import annotations

from leanserve.model.backends.cpu.kernels.base import numba
from leanserve.model.quant import FP8_BLOCK

if numba is not None:
    from llvmlite import ir


def _lanes_sum(builder, v):
    """A <16 x float>'s lanes summed pairwise, halves added until one is left, in that order (no fast-math
    flags): the scalar."""
    i32 = ir.IntType(32)
    width = 16
    while width > 1:
        width //= 2
        a = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, width), list(range(width))))
        c = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, width), list(range(width, 2 * width))))
        v = builder.fadd(a, c)
    return builder.extract_element(v, ir.Constant(i32, 0))


def _store_sums(context, builder, o_t, oa, j, accs):
    """The row dots' last step: out[t, j + r] = the lanes sum (_lanes_sum) of the <16 x float> accumulator
    accs[(r, t)] (a pointer), for every (weight row r, row of x t)."""
    from numba.core import cgutils

    intp = context.get_value_type(numba.types.intp)
    for r, t in accs:
        col = builder.add(j, ir.Constant(intp, r))
        op = cgutils.get_item_pointer(context, builder, o_t, oa, [ir.Constant(intp, t), col], wraparound=False)
        builder.store(_lanes_sum(builder, builder.load(accs[(r, t)])), op)


_FP8_DOTS: dict = {}


def fp8_row_dots(rows: int, xrows: int = 1):
    """The intrinsic `dots(q, s, row0, x, full, out, j)`: out[t, j + r] = the float32 sum over the first `full`
    128-blocks of row row0 + r of the FP8 weight (q bytes, s UE8M0 grid) times x[t], for r < rows and t < xrows;
    q's and x's last dimensions contiguous. In vector registers: per block and row, 8 vectors of 16 bytes decoded as _e4m3_raw
    (a sign-extended byte shifted and masked) and multiplied into one block sum, which is then times 2^120 and
    times the block's scale (two exact power-of-two products), added per lane; the lanes summed at the end. The
    rows share each block's loads of x, the rows of x each decoded weight vector; each entry's arithmetic is the
    same for any `rows` and `xrows`."""
    if (rows, xrows) not in _FP8_DOTS and numba is not None:
        _FP8_DOTS[(rows, xrows)] = _make_fp8_dots(rows, xrows)
    return _FP8_DOTS.get((rows, xrows))


def _make_fp8_dots(rows: int, xrows: int):
    @numba.extending.intrinsic
    def dots(typingctx, q, s, row0, x, full, out, j):
        from numba.core import cgutils

        def codegen(context, builder, signature, args):
            q_t, s_t, _, x_t, _, o_t, _ = signature.args
            qa = context.make_array(q_t)(context, builder, args[0])
            sa = context.make_array(s_t)(context, builder, args[1])
            xa = context.make_array(x_t)(context, builder, args[3])
            oa = context.make_array(o_t)(context, builder, args[5])
            row0_, full_, j_ = args[2], args[4], args[6]
            f32, i32, i8 = ir.FloatType(), ir.IntType(32), ir.IntType(8)
            v16f, v16i, v16b = ir.VectorType(f32, 16), ir.VectorType(i32, 16), ir.VectorType(i8, 16)
            intp = context.get_value_type(numba.types.intp)
            fast = ("contract",)
            zero = ir.Constant(i32, 0)
            undef = ir.Constant(v16f, ir.Undefined)
            row = [builder.add(row0_, ir.Constant(intp, r)) for r in range(rows)]
            srow = [builder.udiv(rw, ir.Constant(intp, FP8_BLOCK)) for rw in row]
            pairs = [(r, t) for r in range(rows) for t in range(xrows)]
            totals = {p: cgutils.alloca_once_value(builder, ir.Constant(v16f, [0.0] * 16)) for p in pairs}

            def broadcast(v):
                return builder.shuffle_vector(
                    builder.insert_element(undef, v, zero), undef, ir.Constant(v16i, [0] * 16)
                )

            with cgutils.for_range(builder, full_) as loop:
                base = builder.mul(loop.index, ir.Constant(intp, FP8_BLOCK))
                accs = {p: [ir.Constant(v16f, [0.0] * 16), ir.Constant(v16f, [0.0] * 16)] for p in pairs}
                for v in range(FP8_BLOCK // 16):
                    k = builder.add(base, ir.Constant(intp, 16 * v))
                    xvs = []
                    for t in range(xrows):
                        xp = cgutils.get_item_pointer(
                            context, builder, x_t, xa, [ir.Constant(intp, t), k], wraparound=False
                        )
                        xvs.append(builder.load(builder.bitcast(xp, v16f.as_pointer()), align=4))
                    for r in range(rows):
                        qp = cgutils.get_item_pointer(context, builder, q_t, qa, [row[r], k], wraparound=False)
                        b = builder.sext(builder.load(builder.bitcast(qp, v16b.as_pointer()), align=1), v16i)
                        bits = builder.and_(
                            builder.shl(b, ir.Constant(v16i, [20] * 16)), ir.Constant(v16i, [0x87F00000 - 2**32] * 16)
                        )
                        wv = builder.bitcast(bits, v16f)
                        for t in range(xrows):
                            prod = builder.fmul(wv, xvs[t], flags=fast)
                            accs[(r, t)][v % 2] = builder.fadd(accs[(r, t)][v % 2], prod, flags=fast)
                for r in range(rows):
                    sp = cgutils.get_item_pointer(context, builder, s_t, sa, [srow[r], loop.index], wraparound=False)
                    e = builder.zext(builder.load(sp), i32)  # UE8M0: 2^(e - 127), e = 0 -> 2^-127
                    sbits = builder.select(
                        builder.icmp_unsigned("==", e, zero),
                        ir.Constant(i32, 1 << 22),
                        builder.shl(e, ir.Constant(i32, 23)),
                    )
                    for t in range(xrows):
                        block = builder.fadd(accs[(r, t)][0], accs[(r, t)][1], flags=fast)
                        block = builder.fmul(block, broadcast(ir.Constant(f32, 2.0**120)))
                        block = builder.fmul(block, broadcast(builder.bitcast(sbits, f32)))
                        total = totals[(r, t)]
                        builder.store(builder.fadd(builder.load(total), block, flags=fast), total)
            _store_sums(context, builder, o_t, oa, j_, totals)
            return context.get_dummy_value()

        return numba.types.void(q, s, row0, x, full, out, j), codegen

    return dots


# FP4 at one to four rows, on AVX-512: each weight row's dot products in vector registers (LLVM IR below: 16-byte
# groups of 32 values, 16 groups and their 16 scales per iteration), the codes decoded by a 16-entry table lookup
# in one instruction (vpermps) instead of the bit arithmetic the compiled loops need: x is split into its even and
# odd elements once per call (byte j holds element 2j in its low nibble, 2j + 1 in its high one), so the products
# of the low and high nibbles meet contiguous halves of x; each group's products times its scale are summed per
# lane over the row, and the lanes at the end (a float32 summation order of its own). Elsewhere the loop in
# _fp4_rows does the same math.
_AVX512 = False
if numba is not None:
    import llvmlite.binding as _llvm

    _AVX512 = bool(_llvm.get_host_cpu_features().get("avx512f", False))


_FP4_DOTS: dict = {}


def fp4_row_dots(rows: int, xrows: int = 1):
    """The intrinsic `dots(packed, s, row0, xe, xo, out, j)` on AVX-512: out[t, j + r] = sum_k W[row0 + r, k] *
    x[t, k] for r < rows and t < xrows, W FP4 (packed [J, K / 2] C-contiguous uint8, s [J, K / 32] UE8M0), x as
    its even and odd elements xe, xo [xrows, K / 2]; the rows share the loads of x, the rows of x each decoded
    group; each entry's arithmetic the same for any `rows` and `xrows`."""
    if (rows, xrows) not in _FP4_DOTS and _AVX512:
        _FP4_DOTS[(rows, xrows)] = _make_fp4_dots(rows, xrows)
    return _FP4_DOTS.get((rows, xrows))


def _make_fp4_dots(rows: int, xrows: int):
    @numba.extending.intrinsic
    def dots(typingctx, packed, s, row0, xe, xo, out, j):
        from numba.core import cgutils

        def codegen(context, builder, signature, args):
            pk_t, s_t, _, xe_t, xo_t, o_t, _ = signature.args
            pk = context.make_array(pk_t)(context, builder, args[0])
            sc = context.make_array(s_t)(context, builder, args[1])
            xe_a = context.make_array(xe_t)(context, builder, args[3])
            xo_a = context.make_array(xo_t)(context, builder, args[4])
            oa = context.make_array(o_t)(context, builder, args[5])
            row0_, j_ = args[2], args[6]
            f32, i32, i8 = ir.FloatType(), ir.IntType(32), ir.IntType(8)
            v16f, v16i, v16b = ir.VectorType(f32, 16), ir.VectorType(i32, 16), ir.VectorType(i8, 16)
            intp = context.get_value_type(numba.types.intp)
            fast = ("contract",)
            lut = ir.Constant(
                v16f, [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
            )
            perm = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(v16f, [v16f, v16i]), "llvm.x86.avx512.permvar.sf.512"
            )
            groups = builder.udiv(builder.extract_value(pk.shape, 1), ir.Constant(intp, 16))
            row = [builder.add(row0_, ir.Constant(intp, r)) for r in range(rows)]
            pairs = [(r, t) for r in range(rows) for t in range(xrows)]
            acc_ptrs = {p: cgutils.alloca_once_value(builder, ir.Constant(v16f, [0.0] * 16)) for p in pairs}
            zero = ir.Constant(i32, 0)

            def scales(e):  # UE8M0 exponents (i32 or <16 x i32>) -> 2^(e - 127), e = 0 -> 2^-127
                like = e.type
                return builder.select(
                    builder.icmp_unsigned("==", e, ir.Constant(like, 0 if like == i32 else [0] * 16)),
                    ir.Constant(like, 1 << 22 if like == i32 else [1 << 22] * 16),
                    builder.shl(e, ir.Constant(like, 23 if like == i32 else [23] * 16)),
                )

            def x_at(g, t):  # the group's even and odd elements of x[t]
                base = builder.mul(g, ir.Constant(intp, 16))
                tt = ir.Constant(intp, t)
                ep = cgutils.get_item_pointer(context, builder, xe_t, xe_a, [tt, base], wraparound=False)
                op = cgutils.get_item_pointer(context, builder, xo_t, xo_a, [tt, base], wraparound=False)
                return (
                    builder.load(builder.bitcast(ep, v16f.as_pointer()), align=4),
                    builder.load(builder.bitcast(op, v16f.as_pointer()), align=4),
                )

            def decode(r, g):  # row r's group g: its 32 values, low nibbles and high ones
                base = builder.mul(g, ir.Constant(intp, 16))
                bp = cgutils.get_item_pointer(context, builder, pk_t, pk, [row[r], base], wraparound=False)
                b = builder.zext(builder.load(builder.bitcast(bp, v16b.as_pointer()), align=1), v16i)
                lo = builder.call(perm, [lut, builder.and_(b, ir.Constant(v16i, [15] * 16))])
                hi = builder.call(perm, [lut, builder.lshr(b, ir.Constant(v16i, [4] * 16))])
                return lo, hi

            def group(values, xs, sv, acc):  # acc + the group's 32 products times its scale (sv)
                lo, hi = values
                part = builder.fadd(
                    builder.fmul(lo, xs[0], flags=fast), builder.fmul(hi, xs[1], flags=fast), flags=fast
                )
                return builder.fadd(acc, builder.fmul(part, sv, flags=fast), flags=fast)

            def splat(vec, lane):
                return builder.shuffle_vector(vec, ir.Constant(v16f, ir.Undefined), ir.Constant(v16i, [lane] * 16))

            # 16 groups per iteration, each row's 16 scales decoded as one vector; then the groups left one by one.
            blocks = builder.udiv(groups, ir.Constant(intp, 16))
            with cgutils.for_range(builder, blocks) as loop:
                g0 = builder.mul(loop.index, ir.Constant(intp, 16))
                svs = []
                for r in range(rows):
                    sp = cgutils.get_item_pointer(context, builder, s_t, sc, [row[r], g0], wraparound=False)
                    e16 = builder.zext(builder.load(builder.bitcast(sp, v16b.as_pointer()), align=1), v16i)
                    svs.append(builder.bitcast(scales(e16), v16f))
                accs = {p: [builder.load(acc_ptrs[p]), ir.Constant(v16f, [0.0] * 16)] for p in pairs}  # two chains
                for k in range(16):
                    g = builder.add(g0, ir.Constant(intp, k))
                    xs = [x_at(g, t) for t in range(xrows)]
                    for r in range(rows):
                        values, sv = decode(r, g), splat(svs[r], k)
                        for t in range(xrows):
                            accs[(r, t)][k % 2] = group(values, xs[t], sv, accs[(r, t)][k % 2])
                for p in pairs:
                    builder.store(builder.fadd(accs[p][0], accs[p][1], flags=fast), acc_ptrs[p])
            done = builder.mul(blocks, ir.Constant(intp, 16))
            with cgutils.for_range(builder, builder.sub(groups, done)) as loop:
                g = builder.add(done, loop.index)
                xs = [x_at(g, t) for t in range(xrows)]
                for r in range(rows):
                    sp = cgutils.get_item_pointer(context, builder, s_t, sc, [row[r], g], wraparound=False)
                    scale = builder.bitcast(scales(builder.zext(builder.load(sp), i32)), f32)
                    sv = splat(builder.insert_element(ir.Constant(v16f, ir.Undefined), scale, zero), 0)
                    values = decode(r, g)
                    for t in range(xrows):
                        builder.store(group(values, xs[t], sv, builder.load(acc_ptrs[(r, t)])), acc_ptrs[(r, t)])
            _store_sums(context, builder, o_t, oa, j_, acc_ptrs)
            return context.get_dummy_value()

        return numba.types.void(packed, s, row0, xe, xo, out, j), codegen

    return dots


# Linear tiles: out[t + r, j + c] = x[t + r] . w[j + c] for a tile of R rows of x and C weight rows (float32, or
# bfloat16 bits widened as read), written in LLVM IR so that every entry gets the same float32 operations in the
# same order whatever the tile's shape: one 16-lane chain of fused multiply-adds over x's length in order, the
# lanes summed pairwise (halves added until one is left), then the last k % 16 products added one by one. No
# reassociation flag is set, and the functions that call the tiles are compiled without one (numba's fast-math
# pass would set it on every instruction of the function). A row of a step therefore gets the same output whether
# it is computed alone, as the tail of a batch or inside a 4-row tile (batch invariance); the shapes only trade
# registers for loads (a tile's R x C chains keep the multiply-add units busy).
_TILES: dict = {}


def tile_dot(rows: int, cols: int):
    """The intrinsic `tile(x, w, out, t, j)` for a tile of `rows` rows of x (float32 [N, K], last dimension
    contiguous) and `cols` rows of w ([J, K] float32 or uint16 bfloat16 bits, last dimension contiguous)."""
    key = (rows, cols)
    if key not in _TILES and numba is not None:
        _TILES[key] = _make_tile(rows, cols)
    return _TILES.get(key)


def _make_tile(rows: int, cols: int):
    @numba.extending.intrinsic
    def tile(typingctx, x, w, out, t, j):
        from numba.core import cgutils

        def codegen(context, builder, signature, args):
            x_t, w_t, o_t = signature.args[:3]
            xa = context.make_array(x_t)(context, builder, args[0])
            wa = context.make_array(w_t)(context, builder, args[1])
            oa = context.make_array(o_t)(context, builder, args[2])
            t_, j_ = args[3], args[4]
            f32, i32, i16 = ir.FloatType(), ir.IntType(32), ir.IntType(16)
            v16f = ir.VectorType(f32, 16)
            intp = context.get_value_type(numba.types.intp)
            widen = w_t.dtype != numba.types.float32
            fast = ("contract",)
            k_dim = builder.extract_value(xa.shape, 1)
            chunks = builder.udiv(k_dim, ir.Constant(intp, 16))
            zero_v = ir.Constant(v16f, [0.0] * 16)
            accs = [[cgutils.alloca_once_value(builder, zero_v) for _ in range(cols)] for _ in range(rows)]
            xrow = [builder.add(t_, ir.Constant(intp, r)) for r in range(rows)]
            wrow = [builder.add(j_, ir.Constant(intp, c)) for c in range(cols)]

            def load_w(c, k, width=16):
                p = cgutils.get_item_pointer(context, builder, w_t, wa, [wrow[c], k], wraparound=False)
                if not widen:
                    return builder.load(builder.bitcast(p, ir.VectorType(f32, width).as_pointer()), align=4)
                bits = builder.load(builder.bitcast(p, ir.VectorType(i16, width).as_pointer()), align=2)
                wide = builder.shl(
                    builder.zext(bits, ir.VectorType(i32, width)), ir.Constant(ir.VectorType(i32, width), [16] * width)
                )
                return builder.bitcast(wide, ir.VectorType(f32, width))

            def load_x(r, k):
                p = cgutils.get_item_pointer(context, builder, x_t, xa, [xrow[r], k], wraparound=False)
                return builder.load(builder.bitcast(p, v16f.as_pointer()), align=4)

            def chunk(k):
                ws = [load_w(c, k) for c in range(cols)]
                for r in range(rows):
                    xv = load_x(r, k)
                    for c in range(cols):
                        ptr = accs[r][c]
                        prod = builder.fmul(ws[c], xv, flags=fast)
                        builder.store(builder.fadd(builder.load(ptr), prod, flags=fast), ptr)

            with cgutils.for_range(builder, chunks) as loop:
                chunk(builder.mul(loop.index, ir.Constant(intp, 16)))
            done = builder.mul(chunks, ir.Constant(intp, 16))
            for r in range(rows):
                for c in range(cols):
                    total = cgutils.alloca_once_value(builder, _lanes_sum(builder, builder.load(accs[r][c])))
                    with cgutils.for_range(builder, builder.sub(k_dim, done)) as loop:
                        k = builder.add(done, loop.index)
                        xp = cgutils.get_item_pointer(context, builder, x_t, xa, [xrow[r], k], wraparound=False)
                        wp = cgutils.get_item_pointer(context, builder, w_t, wa, [wrow[c], k], wraparound=False)
                        wv = builder.load(wp)
                        if widen:
                            wv = builder.bitcast(builder.shl(builder.zext(wv, i32), ir.Constant(i32, 16)), f32)
                        prod = builder.fmul(wv, builder.load(xp), flags=fast)
                        builder.store(builder.fadd(builder.load(total), prod, flags=fast), total)
                    op = cgutils.get_item_pointer(context, builder, o_t, oa, [xrow[r], wrow[c]], wraparound=False)
                    builder.store(builder.load(total), op)
            return context.get_dummy_value()

        return numba.types.void(x, w, out, t, j), codegen

    return tile


# Weighted rows: out[r0 + r, d0 : d0 + 32] = sum_k p[r0 + r, k] * v[k, d0 : d0 + 32] for `rows` rows, each entry
# one chain of multiply-adds in key order (attention's probabilities times its values: the same sum whichever
# rows share the call, and keys of probability 0 add exact zeros).
_WEIGHTED: dict = {}


def weighted_rows(rows: int):
    """The intrinsic `weighted(p, v, out, r0, d0)`: p [N, K], v [K, D], out [N, D] float32, last dimensions
    contiguous, d0 + 32 <= D."""
    if rows not in _WEIGHTED and numba is not None:
        _WEIGHTED[rows] = _make_weighted(rows)
    return _WEIGHTED.get(rows)


def _make_weighted(rows: int):
    @numba.extending.intrinsic
    def weighted(typingctx, p, v, out, r0, d0):
        from numba.core import cgutils

        def codegen(context, builder, signature, args):
            p_t, v_t, o_t = signature.args[:3]
            pa = context.make_array(p_t)(context, builder, args[0])
            va = context.make_array(v_t)(context, builder, args[1])
            oa = context.make_array(o_t)(context, builder, args[2])
            r0_, d0_ = args[3], args[4]
            f32, i32 = ir.FloatType(), ir.IntType(32)
            v16f, v16i = ir.VectorType(f32, 16), ir.VectorType(i32, 16)
            intp = context.get_value_type(numba.types.intp)
            fast = ("contract",)
            zero_v = ir.Constant(v16f, [0.0] * 16)
            accs = [[cgutils.alloca_once_value(builder, zero_v) for _ in range(2)] for _ in range(rows)]
            prow = [builder.add(r0_, ir.Constant(intp, r)) for r in range(rows)]
            dcol = [builder.add(d0_, ir.Constant(intp, 16 * c)) for c in range(2)]
            keys = builder.extract_value(va.shape, 0)
            with cgutils.for_range(builder, keys) as loop:
                k = loop.index
                vs = []
                for c in range(2):
                    ptr = cgutils.get_item_pointer(context, builder, v_t, va, [k, dcol[c]], wraparound=False)
                    vs.append(builder.load(builder.bitcast(ptr, v16f.as_pointer()), align=4))
                for r in range(rows):
                    pp = cgutils.get_item_pointer(context, builder, p_t, pa, [prow[r], k], wraparound=False)
                    pk = builder.load(pp)
                    pb = builder.shuffle_vector(
                        builder.insert_element(ir.Constant(v16f, ir.Undefined), pk, ir.Constant(i32, 0)),
                        ir.Constant(v16f, ir.Undefined),
                        ir.Constant(v16i, [0] * 16),
                    )
                    for c in range(2):
                        prod = builder.fmul(pb, vs[c], flags=fast)
                        builder.store(builder.fadd(builder.load(accs[r][c]), prod, flags=fast), accs[r][c])
            for r in range(rows):
                for c in range(2):
                    op = cgutils.get_item_pointer(context, builder, o_t, oa, [prow[r], dcol[c]], wraparound=False)
                    builder.store(builder.load(accs[r][c]), builder.bitcast(op, v16f.as_pointer()), align=4)
            return context.get_dummy_value()

        return numba.types.void(p, v, out, r0, d0), codegen

    return weighted
