"""`leanserve bench copy`: latency of the target-hidden copy the last stage does each step when MTP is on
(the pre-hc_head streams into a preallocated buffer), at DeepSeek-V4-Pro width by default, beside the
device's peak copy bandwidth."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from leanserve.bench.common import median_timer, print_rows
from leanserve.bench.options import add_output, int_list

PRO_HC_DIM = 4 * 7168  # DeepSeek-V4-Pro: hc_mult * hidden_size
COPY_TOKENS = (1, 8, 32, 128, 512, 2048, 8192)


@dataclass
class CopyRow:
    tokens: int
    bytes: int
    latency_us: float
    gbps: float
    peak_gbps: float


COPY_HEADERS = {
    "tokens": "tokens",
    "bytes": "bytes",
    "latency_us": "latency us",
    "gbps": "GB/s",
    "peak_gbps": "peak GB/s",
}


def copy_bench(
    device: str = "cpu",
    dtype: str = "bfloat16",
    hc_dim: int = PRO_HC_DIM,
    tokens: tuple[int, ...] = COPY_TOKENS,
    repeats: int = 20,
) -> list[CopyRow]:
    """Latency of copying `tokens` rows of pre-hc_head streams [T, hc_dim] into a preallocated
    [max(tokens), hc_dim] buffer (what the last stage does each step when the buffer exists), beside the
    device's peak copy bandwidth (the best of a few copies of the largest size)."""
    dev, dt = torch.device(device), getattr(torch, dtype)
    most = max(tokens)
    src = torch.randn(most, hc_dim, device=dev).to(dt)
    buffer = torch.empty(most, hc_dim, device=dev, dtype=dt)
    median_s = median_timer(dev)
    peak = max(src.numel() * src.element_size() / median_s(lambda: buffer.copy_(src), 3) for _ in range(3)) / 1e9
    rows = []
    for t in tokens:
        nbytes = t * hc_dim * src.element_size()
        reps = max(3, min(repeats * 50, int(2e9 / max(nbytes, 1))))  # many repeats for small copies
        secs = median_s(lambda t=t: buffer[:t].copy_(src[:t]), min(reps, 2000))
        rows.append(CopyRow(t, nbytes, round(secs * 1e6, 2), round(nbytes / secs / 1e9, 2), round(peak, 2)))
    return rows


HELP = "latency of the target-hidden copy per step, at DeepSeek-V4-Pro width"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--hc-dim", type=int, default=PRO_HC_DIM, help="hc_mult * hidden_size (default: V4-Pro's 28672)")
    p.add_argument("--tokens", type=int_list, default=list(COPY_TOKENS))
    p.add_argument("--repeats", type=int, default=20)
    add_output(p)


def run(args: argparse.Namespace) -> int:
    if args.hc_dim < 1:
        raise ValueError("--hc-dim must be positive.")
    rows = copy_bench(args.device, args.dtype, args.hc_dim, tuple(args.tokens), args.repeats)
    print_rows(rows, args.output, COPY_HEADERS)
    return 0
