"""What this host can do, measured, and the floor that sets for a decode step (`bench formats`): its memory read
(`memory_bandwidth`), its kernels' float32 peak (`kernel_peak_gflops`), each weight format's decode rate on one
core with the weight in its cache (`decode_rates`), and the floor of a step's weight reads (`floor_seconds`).

The floor reads every weight at the slower of two rates, the machine's measured read and what the kernels' cores
decode of its format with the weight in cache (one core's rate times the cores). A step reads every weight once,
so it can take no less than the sum; the share of that floor a step reaches is what its kernels leave, once the
host's arithmetic is counted. Where every format decodes faster than the cores' share of the read, the floor is
the read alone. Formats are named as `decode_rates` names them: FP4 and FP8 (values and scales), each also with
bfloat16 inputs (`--fp4-inputs` / `--fp8-inputs`), FP4 also with int8 inputs, bfloat16 and float32; bytes of any
other kind (the hash-routing row) count at the read."""

from __future__ import annotations

import time

import numpy as np
import torch

from leanserve.model.config import ModelConfig


def seconds(fn) -> float:
    """The wall-clock time of one call of fn()."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _read_sum(a, parts):  # pragma: no cover - compiled: a's sum, as `parts` slices (spread over numba's threads)
    out = np.zeros(parts, dtype=np.float32)
    step = a.shape[0] // parts
    for p in _prange(parts):
        part = a[p * step : (p + 1) * step]
        s = np.float32(0.0)
        for i in range(part.shape[0]):  # (vectorised: a read at full speed, unlike numpy's pairwise sum)
            s += part[i]
        out[p] = s
    return out.sum()


try:
    import numba

    from leanserve.model.backends.cpu.kernels import _jit, threads

    _prange = numba.prange
    _read_sum_one, _read_sum_par = _jit(_read_sum), _jit(_read_sum, parallel=True)
except ImportError:  # pragma: no cover
    numba = None


BANDWIDTH_REPEATS = 9  # reads of each kind before and after a batch size's timings (bench formats)


def cores() -> int:
    """The cores the kernels' threaded parts spread over (1 without numba)."""
    return threads() if numba is not None else 1


def _read_all_threads(a):
    """a's vectorised sum spread over all of numba's threads (memory_bandwidth's, ReadProbe's read)."""
    return _read_sum_par(a, 64)


def memory_bandwidth(gib: float = 1.0, repeats: int = BANDWIDTH_REPEATS) -> dict[str, float]:
    """Read bandwidth in GB/s over a `gib` GiB float32 array, best of `repeats`: numpy's sum (one thread; it is
    bound by its pairwise summation, not by memory), a vectorised sum on one thread and one spread over all of
    numba's threads; "machine": the largest."""
    a = np.ones(int(gib * 2**30) // 4, dtype=np.float32)
    runs = {"numpy sum, 1 thread": a.sum}
    if numba is not None:
        threads = numba.get_num_threads()
        _read_sum_one(a[:1024], 1), _read_sum_par(a[:1024], 8)
        runs["vectorised sum, 1 thread"] = lambda: _read_sum_one(a, 1)
        runs[f"vectorised sum, {threads} threads"] = lambda: _read_all_threads(a)
    out = {name: a.nbytes / min(seconds(fn) for _ in range(repeats)) / 1e9 for name, fn in runs.items()}
    out["machine"] = max(out.values())
    return out


PAIRED_READ_GIB = 0.5  # the read set beside each step (ReadProbe): about what a published Flash-shaped step reads


class ReadProbe:
    """A two-thread vectorised read of one array of `gib` GiB (allocated once), in GB/s per call: the read timed
    just before and after each decode step, so that the step is set beside the memory speed of that moment (the
    host's read moves within minutes, and the best read of a run need not be there when the step runs)."""

    def __init__(self, gib: float = PAIRED_READ_GIB) -> None:
        self.a = np.ones(int(gib * 2**30) // 4, dtype=np.float32)
        _read_sum_par(self.a[:1024], 8)  # (compiles)

    def __call__(self) -> float:
        return self.a.nbytes / seconds(lambda: _read_all_threads(self.a)) / 1e9


def share_of_reads_then(mb: float, steps: list[tuple[float, float, float]]) -> float:
    """The median over `steps` (each: a step's seconds, the GB/s of the read just before it and just after it) of
    the step's GB/s (`mb` MB a step) against the mean of its two reads."""
    if not steps:
        raise ValueError("no steps to set beside their reads.")
    return float(np.median([mb / t / 1e3 / ((before + after) / 2) for t, before, after in steps]))


def kernel_peak_gflops(rows: int = 64, width: int = 4096, repeats: int = 5) -> float:
    """The CPU kernels' float32 arithmetic rate on a shape bound by it: `rows` rows through a width x width float32
    linear (the weight stays in cache between the rows' passes), best of `repeats`, in GFLOP/s."""
    from leanserve.model.backends.cpu import kernels as ck

    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, width), dtype=np.float32)
    w = rng.standard_normal((width, width), dtype=np.float32)
    ck.matmuls(x, (w,))
    return 2 * rows * width * width / min(seconds(lambda: ck.matmuls(x, (w,))) for _ in range(repeats)) / 1e9


# --- weights' formats and their decode rates ------------------------------------------------------------------------------------
BF16_SUFFIX = ", bfloat16 inputs"  # (suffix of a quantized format whose weights meet inputs rounded to bfloat16)
INT8_SUFFIX = ", int8 inputs"  # (and to 8 bits a block: FP4's int8 inputs)


def format_name(base: str, inputs: torch.dtype) -> str:
    """A quantized format's name for decode rates: `base` (FP4 or FP8), with BF16_SUFFIX or INT8_SUFFIX where its
    inputs are rounded to bfloat16 or to 8 bits a block."""
    return base + {torch.bfloat16: BF16_SUFFIX, torch.int8: INT8_SUFFIX}.get(inputs, "")


def weight_arrays(w) -> list:
    """A weight's arrays (numpy or torch): itself, or a quantized weight's values and scales."""
    if isinstance(w, np.ndarray | torch.Tensor):
        return [w]
    return [v for v in vars(w).values() if isinstance(v, np.ndarray | torch.Tensor)] if hasattr(w, "__dict__") else []


def weight_bytes(w) -> int:
    """Bytes of a weight as stored (an array, or a quantized weight's values and scales)."""
    return sum(int(a.nbytes) for a in weight_arrays(w))


def format_bytes(w) -> dict[str, int]:
    """{the format name decode_rates gives its rate under: a weight's bytes as stored}."""
    from leanserve.model.quant import Fp4Weight

    if isinstance(w, np.ndarray | torch.Tensor):
        return {array_format(w): weight_bytes(w)}
    return {format_name("FP4" if isinstance(w, Fp4Weight) else "FP8", w.inputs): weight_bytes(w)}


def array_format(a) -> str:
    """A plain weight's format: bfloat16 (a tensor of it, or its bits as a numpy uint16 view), else float32."""
    return "bfloat16" if a.dtype in (np.uint16, torch.bfloat16) else "float32"


IN_CACHE_BYTES = 1 << 20  # each format's weight in decode_rates: 1 MB, in a core's L2


def decode_rates(repeats: int = 200) -> dict[str, float]:
    """GB/s at which one core reads each weight format at one row of x with the weight in its cache (L2): what the
    kernels' arithmetic allows, apart from memory. Each is a [rows x 4096] weight of IN_CACHE_BYTES through the
    compiled rows kernel that the decode step's tasks call for it (FP4 experts, FP8 and plain linears; FP4 and FP8
    also with inputs rounded to bfloat16, BF16_SUFFIX; FP4 to 8 bits a block, INT8_SUFFIX), best of `repeats`
    calls."""
    from leanserve.model.backends.cpu.kernels.linear import _linear_rows_jit
    from leanserve.model.backends.cpu.kernels.quantized import _fp4_rows_jit, _fp8_rows_jit
    from leanserve.model.backends.cpu.views import numpy_views
    from leanserve.model.quant import BF16_CODE, INT8_CODE, quantize_fp4, quantize_fp8

    width = 4096
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, width, generator=gen).numpy()
    sizes = (("FP4", 0.5), ("FP8", 1), ("bfloat16", 2), ("float32", 4))
    rows = {name: int(IN_CACHE_BYTES / size) // width for name, size in sizes}

    def weight(name: str) -> torch.Tensor:
        return torch.randn(rows[name], width, generator=gen) * 0.02

    fp4, fp8 = numpy_views(quantize_fp4(weight("FP4"))), numpy_views(quantize_fp8(weight("FP8")))
    bf16 = numpy_views(weight("bfloat16").to(torch.bfloat16))  # (its bits, as uint16)
    f32 = weight("float32").numpy()
    out = {name: np.empty((1, n), dtype=np.float32) for name, n in rows.items()}
    runs = {}
    for suffix, code in (("", 0), (BF16_SUFFIX, BF16_CODE), (INT8_SUFFIX, INT8_CODE)):
        runs["FP4" + suffix] = (lambda c=code: _fp4_rows_jit(x, fp4.packed, fp4.scale, out["FP4"], 1, c), fp4)
    for suffix, rounded in (("", False), (BF16_SUFFIX, True)):  # (FP8 takes no int8 inputs)
        runs["FP8" + suffix] = (lambda r=rounded: _fp8_rows_jit(x, fp8.q, fp8.scale, 0, out["FP8"], 1, r), fp8)
    runs["bfloat16"] = (lambda: _linear_rows_jit(x, bf16, out["bfloat16"], 1), bf16)
    runs["float32"] = (lambda: _linear_rows_jit(x, f32, out["float32"], 1), f32)
    rates = {}
    for name in ("FP4", "FP8", "bfloat16", "float32", "FP4" + BF16_SUFFIX, "FP8" + BF16_SUFFIX, "FP4" + INT8_SUFFIX):
        fn, w = runs[name]
        fn()  # (compiles, and brings the weight into cache)
        rates[name] = weight_bytes(w) / min(seconds(fn) for _ in range(repeats)) / 1e9
    return rates


def decode_note(rates: dict[str, float], read_per_core: float) -> str:
    """The `bench formats` note on decode_rates: each format's rate and its ratio to a core's share of the
    machine's read (`read_per_core`, GB/s); a format one core decodes slower than that is bound by arithmetic on
    this host, and one just above it streams the read only where its decoding and its loads overlap."""
    slower = [name for name, r in rates.items() if r < read_per_core]
    rated = ", ".join(f"{name} {r:.1f} GB/s ({r / read_per_core:.2f}x)" for name, r in rates.items())
    return (
        f"one core decoding one row of x, the weight in its cache, against a core's share of the read "
        f"({read_per_core:.1f} GB/s): {rated}; slower than that share, bound by arithmetic here: "
        + (", ".join(slower) if slower else "none")
    )


# --- the floor --------------------------------------------------------------------------------------------
def token_format_bytes(cfg: ModelConfig, published: bool, fp4_inputs: str = "float32", fp8_inputs: str = "float32"):
    """Format name -> the bytes a batch-1 decode token of `cfg` (plain weights: bf16) or of its published form reads
    in that format (engine/costs.token_read_bytes), its FP4 and FP8 weights meeting the inputs named."""
    import dataclasses

    from leanserve.engine.costs import model_tensors, stored_dtype, token_read_bytes
    from leanserve.quantize import quantized_config

    cfg = quantized_config(cfg) if published else dataclasses.replace(cfg, quantization=None)
    quant = cfg.quantization
    fp4, fp8 = format_name("FP4", _dtype(fp4_inputs)), format_name("FP8", _dtype(fp8_inputs))
    reads = token_read_bytes(cfg)
    out: dict[str, float] = {}
    for name, t in model_tensors(cfg).items():
        if ".experts." in name and quant is not None:
            fmt = fp4 if quant.experts == "fp4" else fp8
        elif t.dtype == torch.float8_e4m3fn or (quant is not None and name.endswith(".scale")):
            fmt = fp8  # (an FP8 linear's values and its block scales)
        else:
            fmt = {torch.bfloat16: "bfloat16", torch.float32: "float32"}.get(stored_dtype(name, t), "other")
        out[fmt] = out.get(fmt, 0) + reads[name]
    return out


def _dtype(inputs: str) -> torch.dtype:
    from leanserve.model.quant import INPUTS

    return INPUTS[inputs]


def floor_seconds(by_format: dict, read_gb_s: float, cores: int, rates: dict) -> float:
    """The least time reading `by_format` (format name -> bytes) can take: each format's bytes at the slower of
    `read_gb_s` and `cores` times its one-core decode rate `rates[format]` (GB/s; a format without a rate at the
    read), summed."""
    return sum(nbytes / 1e9 / min(read_gb_s, cores * rates.get(fmt, read_gb_s)) for fmt, nbytes in by_format.items())


def floor_note(floors: dict, read_seconds: dict, cores: int) -> str:
    """`bench formats`' note on the floor at batch 1: per row, the floor and the share of the read it allows."""
    rows = "; ".join(
        f"{row} {floors[row] * 1e3:.2f} ms (the read alone {read_seconds[row] * 1e3:.2f} ms: at most "
        f"{read_seconds[row] / floors[row]:.0%} of the read)"
        for row in floors
    )
    return (
        f"floor at batch 1, each weight at the slower of the read and {cores} cores' in-cache decode of its format: "
        f"{rows}; 'of floor' is the floor / the step"
    )
