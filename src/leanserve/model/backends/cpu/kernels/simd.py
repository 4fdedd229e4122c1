"""Kernels written in LLVM IR: the linear tiles and weighted rows, whose entries get the same float32 operations
in every shape (batch invariance), and the IR helpers the row dot products (rowdots.py) share."""

from __future__ import annotations

import functools

from leanserve.model.backends.cpu.kernels.base import numba

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


def _splat(builder, v, width=16):
    """A scalar value (of any type) in every lane of a <width x its type>."""
    i32 = ir.IntType(32)
    vt = ir.VectorType(v.type, width)
    return builder.shuffle_vector(
        builder.insert_element(ir.Constant(vt, ir.Undefined), v, ir.Constant(i32, 0)),
        ir.Constant(vt, ir.Undefined),
        ir.Constant(ir.VectorType(i32, width), [0] * width),
    )


# Bytes ahead of each weight load that the row dots ask the caches for (llvm.prefetch), and into which level
# (locality 2: L2, prefetcht1). A call reads a few rows of 1-2 KB at short row lengths (FP8 [1024 -> ...], FP4
# experts): every call starts a new 4 KB page, where the hardware's stream prefetchers stop and start again, so
# without this the loads wait on memory. Into L2 and further ahead than the 4 KB into L1 that came before: the
# published step 0.94x at float32 inputs and 0.79-0.91x with bfloat16 inputs (docs/kernels.md).
PREFETCH_AHEAD = 16384
PREFETCH_LOCALITY = 2


def _prefetch(builder, ptr, ahead=PREFETCH_AHEAD):
    """Ask for the cache line `ahead` bytes (a number, or an i64 value) after ptr (a hint: no fault past an array's
    end)."""
    from numba.core import cgutils

    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0"
    )
    offset = ahead if isinstance(ahead, ir.Value) else ir.Constant(ir.IntType(64), ahead)
    at = builder.gep(builder.bitcast(ptr, i8p), [offset])
    builder.call(fn, [at, ir.Constant(i32, 0), ir.Constant(i32, PREFETCH_LOCALITY), ir.Constant(i32, 1)])


# Linear tiles: out[t + r, j + c] = x[t + r] . w[j + c] for a tile of R rows of x and C weight rows (float32, or
# bfloat16 bits widened as read), written in LLVM IR so that every entry gets the same float32 operations in the
# same order whatever the tile's shape: one 16-lane chain of fused multiply-adds over x's length in order, the
# lanes summed pairwise (halves added until one is left), then the last k % 16 products added one by one. No
# reassociation flag is set, and the functions that call the tiles are compiled without one (numba's fast-math
# pass would set it on every instruction of the function). A row of a step therefore gets the same output whether
# it is computed alone, as the tail of a batch or inside a 4-row tile (batch invariance); the shapes only trade
# registers for loads (a tile's R x C chains keep the multiply-add units busy).
@functools.cache
def tile_dot(rows: int, cols: int, stream: bool = False):
    """The intrinsic `tile(x, w, out, t, j)` for a tile of `rows` rows of x (float32 [N, K], last dimension
    contiguous) and `cols` rows of w ([J, K] float32 or uint16 bfloat16 bits, last dimension contiguous). With
    `stream` (one weight row), the weight row is read a line at a time with a prefetch STREAM_AHEAD bytes on: the
    same arithmetic as the other tiles."""
    assert not stream or cols == 1
    return _make_tile(rows, cols, stream) if numba is not None else None


# Bytes ahead of the streaming tiles' weight loads that they ask L2 for (linear._few_rows: weight rows one at a
# time, each followed by the next, are one sequential stream). One row of x against bfloat16 [5888 x 4096] from
# memory on two threads: 34.7 GB/s against 26.2 (eight rows without a prefetch) and 31.0 (eight rows, the next
# eight prefetched), of a 36.0 GB/s read; 4 KB ahead 33.8.
STREAM_AHEAD = 8192


def _make_tile(rows: int, cols: int, stream: bool = False):
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

            per = 64 // 16 // (2 if widen else 4) if stream else 1  # (chunks a step: a 64-byte line of w streamed)
            steps = builder.udiv(chunks, ir.Constant(intp, per))
            with cgutils.for_range(builder, steps) as loop:
                k0 = builder.mul(loop.index, ir.Constant(intp, 16 * per))
                if stream:
                    p = cgutils.get_item_pointer(context, builder, w_t, wa, [wrow[0], k0], wraparound=False)
                    _prefetch(builder, p, STREAM_AHEAD)
                for c in range(per):
                    chunk(builder.add(k0, ir.Constant(intp, 16 * c)))
            stepped = builder.mul(steps, ir.Constant(intp, per))
            with cgutils.for_range(builder, builder.sub(chunks, stepped)) as loop:  # (a last chunk short of a line)
                chunk(builder.mul(builder.add(stepped, loop.index), ir.Constant(intp, 16)))
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
