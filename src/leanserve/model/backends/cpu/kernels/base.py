"""What every kernel module shares: numba's settings (fast-math flags, numpy's error model, the on-disk cache),
`Threaded` (a kernel run whole on one thread or in parts on every core), the thread cap (`limit_threads`, `one_thread`),
`disabled()` (as if numba were missing), an e^x that vectorises, and numpy views of tensors."""

from __future__ import annotations

import contextlib
import os
import types

import numpy as np
import torch

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

    @numba.extending.intrinsic
    def _bits_of_f32(typingctx, value):  # a float32's bits as an int32
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(32))

        return numba.types.int32(numba.types.float32), codegen

else:  # (nothing is compiled without numba)
    _f32_from_bits = _bits_of_f32 = None


def _bf16_bits(v):  # pragma: no cover - compiled
    # A float32's bfloat16 bits (0..65535), rounded to nearest, ties to even (torch's .to(torch.bfloat16)); a NaN
    # is 0x7FC0. (Kept in int64: bits 16-31 of the sum are those of the unsigned 32-bit one.)
    b = np.int64(_bits_of_f32(np.float32(v)))
    rounded = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    return np.uint16(0x7FC0 if (b & 0x7FFFFFFF) > 0x7F800000 else rounded)  # (a select, no branch)


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
_bf16_bits_jit = _inlined(_bf16_bits) if numba is not None else None


def _copy_row(dst, src):  # pragma: no cover - compiled: dst[:] = src for two 1-D rows, as a plain loop
    for d in range(dst.shape[0]):
        dst[d] = src[d]


_copy_row_jit = _inlined(_copy_row) if numba is not None else None


# Arrays the vector kernels load from are made on 64-byte boundaries: a 64-byte load that straddles two cache
# lines costs two (numba's own arrays start on 32 bytes, numpy's on 16).
def _on64(flat, rows, cols):  # pragma: no cover - compiled: [rows, cols] of a 1-D array 64 bytes longer, on 64 bytes
    skip = (64 - flat.ctypes.data % 64) % 64 // flat.itemsize
    return flat[skip : skip + rows * cols].reshape((rows, cols))


def _empty64_f32(rows, cols):  # pragma: no cover - compiled: an uninitialised float32 [rows, cols] on 64 bytes
    return _on64(np.empty(rows * cols + 16, dtype=np.float32), rows, cols)


def _empty64_u16(rows, cols):  # pragma: no cover - compiled: the same for uint16
    return _on64(np.empty(rows * cols + 32, dtype=np.uint16), rows, cols)


if numba is not None:
    _on64 = _inlined(_on64)
    _empty64_f32 = _inlined(_empty64_f32)
    _empty64_u16 = _inlined(_empty64_u16)


def cached(kernel) -> bool:
    """Whether numba's on-disk cache holds builds of `kernel` (a compiled function): an earlier process compiled
    it from these sources. True when that cannot be told (no numba, another cache layout)."""
    try:
        return os.path.exists(kernel._cache._cache_file._index_path)
    except AttributeError:
        return True


def _share(n, part, parts):  # pragma: no cover - compiled: tasks [lo, hi) of `part` of `parts` equal shares of n
    return n * part // parts, n * (part + 1) // parts


_share_jit = _inlined(_share) if numba is not None else None


# A kernel whose tasks differ in cost (the MoE's experts, by their tokens) takes them one at a time from a counter
# all its parts share, whichever part is free first, instead of in equal shares of the tasks: no part waits
# idle while another still holds several. Each task's arithmetic and outputs stay its own, whichever part runs it.
if numba is not None:

    @numba.extending.intrinsic
    def _claim(typingctx, counter):  # counter[0] (int64) before one is added to it, atomically: the next task
        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            return builder.atomic_rmw("add", data, ir.Constant(ir.IntType(64), 1), "monotonic")

        return numba.types.int64(counter), codegen

else:
    _claim = None


class Threaded:
    """A kernel compiled once, `fn(*args, part, parts)`, that does share `part` of `parts` equal shares of its tasks,
    or takes them in turn with the other parts (_claim); each task writes only its own outputs: no races, no sums
    shared between threads. A call `kernel(work, *args)` runs it whole on this thread (part 0 of 1) while `work`
    (the caller's measure of the call's size, e.g. tokens or multiply-adds) is below `min_work`, where waking other
    cores costs more than it saves; from there on, one part per core at once (`_run_parts`). The parts call the
    kernel's compiled code by its address, so the threaded path compiles only a small launcher per argument types
    instead of a second build of the kernel and of all it calls (numba's parallel builds cost 2-5x their one-thread
    builds), and a task gets the same arithmetic on any number of threads."""

    def __init__(self, fn, min_work: int) -> None:
        self.kernel, self.min_work = _jit(fn), min_work
        self._launchers: dict = {}  # argument types' fingerprint -> (the launcher's build, the kernel's address)

    def __call__(self, work: int, *args):
        parts = self.parts(work)
        if parts < 2:
            return self.kernel(*args, 0, 1)
        return self._parallel(args, parts)

    def parts(self, work: int) -> int:
        """How many parts a call of this size runs in (1: whole, on the calling thread)."""
        return threads() if work >= self.min_work else 1

    def _parallel(self, args: tuple, parts: int) -> None:
        launch, address = self.launcher(args)
        if not launch(address, args, parts):
            raise RuntimeError(f"{self.kernel.py_func.__name__} failed in a thread")

    def launcher(self, args: tuple) -> tuple:
        """(_run_parts' build for these arguments' types, the address of the kernel's native code for them), each
        compiled or loaded from the cache on first use: a call then skips numba's matching of argument types."""
        key = _fingerprint(args)
        found = self._launchers.get(key)
        if found is None:
            types = tuple([self.kernel.typeof_pyval(a) for a in args])
            sig = (*types, numba.types.intp, numba.types.intp)
            self.kernel.compile(sig)
            kernel = self.kernel.overloads[sig]
            launch_sig = (numba.types.intp, _run_parts.typeof_pyval(args), numba.types.intp)
            _run_parts.compile(launch_sig)
            address = kernel.library.get_pointer_to_function(kernel.fndesc.llvm_func_name)
            found = self._launchers[key] = (_run_parts.overloads[launch_sig].entry_point, address)
        return found


if numba is not None:
    from numba._dispatcher import compute_fingerprint as _fingerprint
    from numba.core import cgutils as _cgutils
    from numba.extending import models as _models

    class _ArgsRef(numba.types.Type):
        """A pointer to a tuple of a kernel's arguments (of type `tup`) on the launcher's stack: what the parts
        get instead of the tuple itself, which numba's parallel loops cannot take when it holds tuples."""

        def __init__(self, tup) -> None:
            self.tup = tup
            super().__init__(name=f"ArgsRef({tup})")

    numba.extending.register_model(_ArgsRef)(_models.OpaqueModel)

    @numba.extending.intrinsic
    def _args_ref(typingctx, args):
        def codegen(context, builder, signature, llargs):
            slot = _cgutils.alloca_once_value(builder, llargs[0])
            return builder.bitcast(slot, ir.IntType(8).as_pointer())

        return _ArgsRef(args)(args), codegen

    @numba.extending.intrinsic
    def _call_part(typingctx, address, ref, part, parts):
        # kernel(*args, part, parts) for the kernel's native code at `address`; True unless it raised
        def codegen(context, builder, signature, llargs):
            address_, ref_, part_, parts_ = llargs
            tup = ref.tup
            values = builder.load(builder.bitcast(ref_, context.get_value_type(tup).as_pointer()))
            argtys = [*tup.types, signature.args[2], signature.args[3]]
            vals = [builder.extract_value(values, i) for i in range(len(tup))] + [part_, parts_]
            fnty = context.call_conv.get_function_type(numba.types.none, argtys)
            fn = builder.inttoptr(address_, fnty.as_pointer())
            status, _ = context.call_conv.call_function(builder, fn, numba.types.none, argtys, vals)
            return builder.not_(status.is_error)

        return numba.types.boolean(address, ref, part, parts), codegen

    def _run_parts_fn(address, args, parts):  # pragma: no cover - compiled: every part at once, True if all ran
        ref = _args_ref(args)
        ok = np.ones(parts, dtype=np.bool_)
        for c in prange(parts):
            ok[c] = _call_part(address, ref, c, parts)
        return ok.all()

    _run_parts = _jit(_run_parts_fn, parallel=True)


_threaded_ok: bool | None = None
_numba_threads = numba.config.NUMBA_NUM_THREADS if numba is not None else 1  # (numba's pool, fixed at its start)
_max_threads: int | None = None  # a cap (pipeline stages sharing the machine's cores), None = torch's count


def limit_threads(n: int | None) -> None:
    """Caps the kernels' threads in this process (None: follow torch's thread count)."""
    global _max_threads
    _max_threads = n


@contextlib.contextmanager
def one_thread():
    """Runs every kernel whole on the calling thread (tests compare it with threaded parts)."""
    global _max_threads
    before, _max_threads = _max_threads, 1
    try:
        yield
    finally:
        _max_threads = before


def threads() -> int:
    """How many cores a threaded kernel spreads over here (1 where threaded parts do not run). Asked before each
    threaded call, often right after a weight's stream has swept the caches: one call into torch, the rest
    module globals (with two calls into torch and numba's config it cost 12 us there, against 0.6 us warm)."""
    n = min(torch.get_num_threads(), _numba_threads)
    if _max_threads is not None:
        n = min(n, _max_threads)
    return n if n > 1 and _threads_ok() else 1


def _threads_ok() -> bool:
    """Whether threaded parts run: numba has more than one thread and its OpenMP (or TBB) threading layer (torch
    may use more than one thread too: `--threads`, torch.set_num_threads, see threads()). Its fallback layer
    (workqueue) costs more to wake than these kernels take, so it is not used."""
    global _threaded_ok
    if _threaded_ok is None:
        _threaded_ok = False
        if _numba_threads > 1:
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
