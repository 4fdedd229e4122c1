"""Where a CPU decode step's time goes, kernel by kernel, against the bytes each one reads (`bench formats
--profile`): the step's pieces on the CPU backend's decode path (model/backends/cpu/decode.py) and the linears
(kernels `Matmuls`, the head's too) are timed while the step runs, each call in wall-clock time, and so are the
step's metadata, the head's mix and sampling; the rest of the step (the Python between the calls, the runner's
bookkeeping) is reported as one row.

Bytes are the weights a call reads (every byte of a linear's weight; for the MoE its router, the top-k routed
experts per token and the shared expert, as `token_bytes` counts them); kernels whose reads are activations or
caches (attention, norms, RoPE, mHC) show none.

Each call's bytes are also counted by format (host.py's names), so that `profile_rows` can set a kernel's time
against the host's floor for its reads."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from leanserve.bench.host import array_format, format_bytes, format_name, weight_arrays, weight_bytes


@dataclass
class ProfileRow:
    kernel: str
    calls: float  # per step
    ms: float  # per step
    share: float  # of the step
    mb: float | None  # weight bytes read per step
    gb_s: float | None
    of_floor: float | None = None  # the floor of its reads (host.floor_seconds) / ms


PROFILE_HEADERS = {
    "kernel": "kernel",
    "calls": "calls/step",
    "ms": "ms/step",
    "share": "of step",
    "mb": "MB/step",
    "gb_s": "GB/s",
    "of_floor": "of floor",
}


def _expert_count(w) -> int:
    return weight_arrays(w)[0].shape[0]


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


def _add(into: dict, more: dict) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0) + v


@contextlib.contextmanager
def kernel_profile():
    """Times the decode path's pieces while the block runs; yields the totals {name: [calls, seconds, bytes]}."""
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
