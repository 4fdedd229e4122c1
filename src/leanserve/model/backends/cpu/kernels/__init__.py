"""Small CPU kernels compiled with numba, for float32 math on small tensors where each torch op would cost
more in dispatch than in arithmetic, and for elementwise chains that torch would run as many passes over
memory. Each kernel's math has a torch statement too (the torch backend's, used for other dtypes and devices,
and for autograd); tests/test_kernels.py compares the two.

Kernels take numpy views of contiguous float32 CPU tensors and write into an output array; the CPU backend
(../backend.py) says when they apply, and ../arrays.py and ../decode.py call them on numpy arrays. One module per
job: `base` (compiler settings, builds, threads), `mix` (norms, mHC, RoPE), `linear` (few-row linears), `simd`
(LLVM IR linear tiles), `rowdots` (LLVM IR row dot products of FP8 / FP4 weights), `bf16dots` (the same against
bfloat16 inputs), `int8dots` (FP4's against inputs rounded to 8 bits), `quantized` (FP8 / FP4 weights as stored),
`moe`, `attention` (compressor, attention, indexer).
"""

from leanserve.model.backends.cpu.kernels import (
    attention,
    base,
    bf16dots,
    int8dots,
    linear,
    mix,
    moe,
    quantized,
    rowdots,
    simd,
)
from leanserve.model.backends.cpu.kernels.attention import attend, attend_splits, compress, index_select
from leanserve.model.backends.cpu.kernels.base import (
    EMPTY,
    Threaded,
    _exp_jit,
    _jit,
    available,
    disabled,
    limit_threads,
    np_,
    numba,
    one_thread,
    threads,
    weight_np,
)
from leanserve.model.backends.cpu.kernels.linear import grouped_linear
from leanserve.model.backends.cpu.kernels.mix import hc_post, hc_post_pre, hc_pre, norm_rope, rms_norm
from leanserve.model.backends.cpu.kernels.moe import moe_tokens, moe_work
from leanserve.model.backends.cpu.kernels.quantized import (
    Matmuls,
    dequantized,
    grouped_linear_fp8,
    matmuls,
    stored,
)

MODULES = (base, mix, linear, simd, rowdots, bf16dots, int8dots, quantized, moe, attention)


def compiled_before() -> bool:
    """Whether an earlier process compiled the kernels into numba's cache (that of the threaded attention, which
    every engine's warm-up builds), so that this one loads them instead of compiling."""
    return not available() or base.cached(attention.attend.kernel)


__all__ = [
    "EMPTY", "MODULES", "Matmuls", "Threaded", "_exp_jit", "_jit", "attend", "attend_splits", "available",
    "compiled_before", "compress", "dequantized",
    "disabled", "grouped_linear", "grouped_linear_fp8", "hc_post", "hc_post_pre", "hc_pre", "index_select",
    "limit_threads", "matmuls", "moe_tokens", "moe_work", "norm_rope", "np_", "numba", "one_thread", "rms_norm",
    "stored", "threads", "weight_np",
]  # fmt: skip
