#!/usr/bin/env python
"""The CPU kernels on FP8 / FP4 weights against bfloat16 ones, in one process, calls alternating: a few-row linear
(default 4096 x 4096) and the few-token MoE (experts 2048 x 4096, every expert routed, an FP8 / bf16 shared
expert), at batch 1 and 8. Prints each one's median time and its effective bandwidth (weight bytes read / time)
beside the machine's read bandwidth, measured here (bench.formats.memory_bandwidth: one thread's vectorised sum
with --threads 1, else the best of all):

    PYTHONPATH=src .venv/bin/python scripts/bench_quant.py --threads 1 --rounds 15

Nothing here is a test: timings on a shared machine are noisy; compare figures from one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from leanserve.bench.host import memory_bandwidth
from leanserve.model.backends.cpu import arrays
from leanserve.model.backends.cpu import kernels as ck
from leanserve.model.backends.cpu.views import numpy_views
from leanserve.model.quant import Fp4Weight, Fp8Experts, quantize_fp4, quantize_fp8
from leanserve.model.weights import MoEWeights


def nbytes(w) -> int:
    return sum(v.nbytes for v in ck.stored(w))


def timed(cases: dict, rounds: int) -> dict[str, float]:
    """Median seconds per case, the cases alternating within each round."""
    times: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():
        fn()  # (compiles)
    for _ in range(rounds):
        for k, fn in cases.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=int, default=4096)
    ap.add_argument("--in", dest="in_", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.threads == 1:
        ck.limit_threads(1)
    gen = torch.Generator().manual_seed(0)

    bw = memory_bandwidth()
    read = bw["vectorised sum, 1 thread"] if args.threads == 1 else bw["machine"]
    print("memory bandwidth: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in bw.items()) + f"; shares of {read:.1f}")

    w = torch.randn(args.out, args.in_, generator=gen) * 0.02
    lin = {"bf16": ck.weight_np(w.to(torch.bfloat16)), "fp8": numpy_views(quantize_fp8(w))}
    h, inter, e = args.hidden, args.inter, args.experts
    w13 = torch.randn(e, 2 * inter, h, generator=gen) * 0.02
    w2 = torch.randn(e, h, inter, generator=gen) * 0.02
    sw = [torch.randn(inter, h, generator=gen) * 0.02, torch.randn(inter, h, generator=gen) * 0.02]
    sw.append(torch.randn(h, inter, generator=gen) * 0.02)

    def fp4(stack):
        parts = [quantize_fp4(m) for m in stack]
        return Fp4Weight(np.stack([p.packed.numpy() for p in parts]), np.stack([p.scale.numpy() for p in parts]))

    def fp8_experts(stack, halves):
        qs, scales = [], []
        for m in stack:
            parts = [quantize_fp8(x) for x in m.chunk(halves)]
            qs.append(torch.cat([p.q for p in parts]))
            scales.append(torch.stack([p.scale for p in parts]))
        return numpy_views(Fp8Experts(torch.stack(qs), torch.stack(scales)))

    bf = lambda t: ck.weight_np(t.to(torch.bfloat16))  # noqa: E731
    gate = np.ascontiguousarray((torch.randn(e, h, generator=gen) * 0.02).numpy())
    shared_fp8 = [numpy_views(quantize_fp8(t)) for t in sw]
    moes = {
        "bf16": (bf(w13), bf(w2), [bf(t) for t in sw]),
        "fp4": (fp4(w13), fp4(w2), shared_fp8),
        "fp8": (fp8_experts(w13, 2), fp8_experts(w2, 1), shared_fp8),
    }
    del w13, w2

    def moe_weights(w13_, w2_, shared):
        return MoEWeights(gate, np.zeros(e, dtype=np.float32), None, e, "sqrtsoftplus", 1.0, w13_, w2_, *shared, 10.0)

    moe_w = {k: moe_weights(*v) for k, v in moes.items()}
    moe_bytes = {k: nbytes(v[0]) + nbytes(v[1]) + sum(nbytes(s) for s in v[2]) + gate.nbytes for k, v in moes.items()}

    print(f"linear {args.out} x {args.in_}; MoE {e} experts (all routed) of {inter} x {h} + a shared one")
    print(f"{'case':<18}{'batch':>6}{'ms':>9}{'MB read':>9}{'GB/s':>8}{'of bw':>8}")
    moe_a = {k: arrays.moe_args(w) for k, w in moe_w.items()}  # (the MoE kernel's weight arguments)
    for batch in [int(b) for b in args.batches.split(",")]:
        x = np.ascontiguousarray(torch.randn(batch, args.in_, generator=gen).numpy())
        xm = np.ascontiguousarray(torch.randn(batch, h, generator=gen).numpy())
        ids = np.zeros(batch, dtype=np.int64)
        cases = {f"linear {k}": (lambda w=w, x=x: ck.matmuls(x, (w,))) for k, w in lin.items()}
        cases |= {f"moe {k}": (lambda a=a, xm=xm, ids=ids: arrays.moe_arrays(xm, ids, a)) for k, a in moe_a.items()}
        sizes = {f"linear {k}": nbytes(w) for k, w in lin.items()} | {f"moe {k}": b for k, b in moe_bytes.items()}
        for k, s in timed(cases, args.rounds).items():
            gbs = sizes[k] / s / 1e9
            print(f"{k:<18}{batch:>6}{s * 1e3:>9.2f}{sizes[k] / 1e6:>9.1f}{gbs:>8.1f}{gbs / read:>7.0%}")


if __name__ == "__main__":
    main()
