"""Where a CPU decode step's time goes, kernel by kernel, against the bytes each one reads (`bench formats
--profile`): the step's pieces on the CPU backend's decode path (model/backends/cpu/decode.py) and the linears
(kernels `Matmuls`, the head's too) are timed while the step runs, each call in wall-clock time, and so are the
step's metadata, the head's mix and sampling; the rest of the step (the Python between the calls, the runner's
bookkeeping) is reported as one row.

Bytes are the weights a call reads (every byte of a linear's weight; for the MoE its router, the top-k routed
experts per token and the shared expert, as `token_bytes` counts them); kernels whose reads are activations or
caches (attention, norms, RoPE, mHC) show none.

`decode_rates` times each weight format's decode on one core with the weight in cache (what the kernels'
arithmetic allows, apart from memory), and `decode_note` says which formats that makes slower than a core's share
of the machine's read."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class ProfileRow:
    kernel: str
    calls: float  # per step
    ms: float  # per step
    share: float  # of the step
    mb: float | None  # weight bytes read per step
    gb_s: float | None
    of_floor: float | None = None  # the floor of its reads (bench/floor.py) / ms


PROFILE_HEADERS = {
    "kernel": "kernel",
    "calls": "calls/step",
    "ms": "ms/step",
    "share": "of step",
    "mb": "MB/step",
    "gb_s": "GB/s",
    "of_floor": "of floor",
}


def _arrays(w) -> list:
    """A weight's arrays (numpy or torch): itself, or a quantized weight's values and scales."""
    if isinstance(w, np.ndarray | torch.Tensor):
        return [w]
    return [v for v in vars(w).values() if isinstance(v, np.ndarray | torch.Tensor)] if hasattr(w, "__dict__") else []


def weight_bytes(w) -> int:
    """Bytes of a weight as stored (an array, or a quantized weight's values and scales)."""
    return sum(int(a.nbytes) for a in _arrays(w))


def _expert_count(w) -> int:
    return _arrays(w)[0].shape[0]


def moe_bytes(w) -> int:
    """A batch-1 token's MoE reads: the router, top_k of the routed experts, the shared expert."""
    return sum(moe_format_bytes(w).values())


def moe_format_bytes(w) -> dict[str, int]:
    """moe_bytes by format (format_bytes)."""
    out = format_bytes(w.gate)
    for x in (w.shared_w1, w.shared_w3, w.shared_w2):
        if x is not None:
            _add(out, format_bytes(x))
    routed = {f: b * w.top_k // _expert_count(w.w13) for f, b in format_bytes(w.w13).items()}
    _add(out, routed)
    _add(out, {f: b * w.top_k // _expert_count(w.w2) for f, b in format_bytes(w.w2).items()})
    return out


def format_bytes(w) -> dict[str, int]:
    """{the format name decode_rates gives its rate under (bench/floor.py): a weight's bytes as stored}."""
    from leanserve.bench.floor import format_name
    from leanserve.model.quant import Fp4Weight

    if isinstance(w, np.ndarray | torch.Tensor):
        return {array_format(w): weight_bytes(w)}
    return {format_name("FP4" if isinstance(w, Fp4Weight) else "FP8", w.inputs): weight_bytes(w)}


def array_format(a) -> str:
    """A plain weight's format: bfloat16 (a tensor of it, or its bits as a numpy uint16 view), else float32."""
    return "bfloat16" if a.dtype in (np.uint16, torch.bfloat16) else "float32"


def _add(into: dict, more: dict) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0) + v


@contextlib.contextmanager
def kernel_profile():
    """Times the decode path's pieces while the block runs; yields the totals {name: [calls, seconds, bytes]}."""
    from leanserve.bench.floor import format_name
    from leanserve.engine import runner
    from leanserve.model.backends.cpu import decode
    from leanserve.model.backends.cpu.backend import CpuBackend
    from leanserve.model.backends.cpu.kernels import quantized

    totals: dict[str, list] = defaultdict(lambda: [0, 0.0, 0, {}])
    patched = []

    def timed(owner, name: str, label, nbytes=None):
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            entry = totals[label(*args) if callable(label) else label]
            entry[0] += 1
            entry[1] += time.perf_counter() - start
            if nbytes is not None:
                by_format = nbytes(*args)
                entry[2] += sum(by_format.values())
                _add(entry[3], by_format)
            return out

        patched.append((owner, name, fn))
        setattr(owner, name, wrapper)

    def linear_label(self, x):
        kinds = sorted({"fp8" if k is quantized.linear_fp8 else "float" for k, _, _, _ in self.calls})
        return f"linear {'+'.join(kinds)} [{x.shape[1]} -> {sum(self.widths)}]"

    def linear_bytes(self, x):  # (a call's arguments: tuples of weight arrays, and an FP8 call's input flag)
        out: dict[str, int] = {}
        for kernel, _, args, _ in self.calls:
            arrays = sum([weight_bytes(a) for part in args if isinstance(part, tuple) for a in part])
            if kernel is quantized.linear_fp8:
                _add(out, {format_name("FP8", torch.bfloat16 if args[2] else torch.float32): arrays})
            else:
                _add(out, {array_format(args[0][0]): arrays})
        return out

    timed(quantized.Matmuls, "__call__", linear_label, linear_bytes)
    timed(decode, "moe", "moe (router, experts, shared expert)", lambda p, x, ids: moe_format_bytes(p.w.moe))
    timed(decode, "grouped_linear_arrays", "grouped linear (wo_a)", lambda x, w: format_bytes(w))
    timed(decode, "attend_arrays", "attention (window, compressed rows, indexer)")
    timed(decode, "compress_arrays", "compressors")
    timed(decode, "rms_norm_arrays", "rms norm")
    timed(decode, "rope_arrays", "rope")
    timed(decode, "mixed_in", "mHC")
    timed(decode, "settled", "mHC")
    timed(decode, "embedded", "embedding")
    # (the step outside the model's blocks: what the rest of the step holds besides the Python between the calls)
    timed(runner, "build_forward_batch", "step metadata (build_forward_batch)")
    timed(CpuBackend, "hc_head", "hc_head (the head's mix and norm)")
    timed(runner.StageRunner, "_verify", "sampling (logits to tokens)")
    try:
        yield totals
    finally:
        for owner, name, fn in reversed(patched):
            setattr(owner, name, fn)


def profile_rows(totals: dict, steps: int, step_seconds: float, floor=None) -> list[ProfileRow]:
    """Rows per kernel (slowest first), then what the step spent elsewhere, from `steps` steps of `step_seconds`;
    with `floor` (the least seconds reading {format: bytes} can take, floor.floor_seconds), each kernel's floor
    for its reads over its time."""
    rows = []
    for name, (calls, seconds, nbytes, by_format) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        ms = seconds / steps * 1e3
        mb = nbytes / steps / 1e6 if nbytes else None
        gb_s = round(nbytes / seconds / 1e9, 1) if nbytes else None
        share = round(ms / (step_seconds * 1e3), 3)
        of_floor = round(floor(by_format) / seconds, 2) if floor is not None and nbytes else None
        rows.append(ProfileRow(name, round(calls / steps, 1), round(ms, 3), share, mb and round(mb, 1), gb_s,
                               of_floor))  # fmt: skip
    inside = sum(entry[1] for entry in totals.values()) / steps
    rows.append(ProfileRow("rest of the step", 0, round((step_seconds - inside) * 1e3, 3),
                           round(1 - inside / step_seconds, 3), None, None))  # fmt: skip
    return rows


IN_CACHE_BYTES = 1 << 20  # each format's weight in decode_rates: 1 MB, in a core's L2


def decode_rates(repeats: int = 200) -> dict[str, float]:
    """GB/s at which one core reads each weight format at one row of x with the weight in its cache (L2): what the
    kernels' arithmetic allows, apart from memory. Each is a [rows x 4096] weight of IN_CACHE_BYTES through the
    compiled rows kernel that the decode step's tasks call for it (FP4 experts, FP8 and plain linears; FP4 and FP8
    also with inputs rounded to bfloat16, floor.BF16_INPUTS), best of `repeats` calls."""
    from leanserve.bench.floor import BF16_INPUTS
    from leanserve.model.backends.cpu.kernels.linear import _linear_rows_jit
    from leanserve.model.backends.cpu.kernels.quantized import _fp4_rows_jit, _fp8_rows_jit
    from leanserve.model.backends.cpu.views import numpy_views
    from leanserve.model.quant import quantize_fp4, quantize_fp8

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
    for suffix, rounded in (("", False), (BF16_INPUTS, True)):
        runs["FP4" + suffix] = (lambda r=rounded: _fp4_rows_jit(x, fp4.packed, fp4.scale, out["FP4"], 1, r), fp4)
        runs["FP8" + suffix] = (lambda r=rounded: _fp8_rows_jit(x, fp8.q, fp8.scale, 0, out["FP8"], 1, r), fp8)
    runs["bfloat16"] = (lambda: _linear_rows_jit(x, bf16, out["bfloat16"], 1), bf16)
    runs["float32"] = (lambda: _linear_rows_jit(x, f32, out["float32"], 1), f32)
    rates = {}
    for name in ("FP4", "FP8", "bfloat16", "float32", "FP4" + BF16_INPUTS, "FP8" + BF16_INPUTS):
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


def seconds(fn) -> float:
    """The wall-clock time of one call of fn()."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
