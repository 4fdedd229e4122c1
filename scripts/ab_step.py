#!/usr/bin/env python
"""Same-process A/B of one stage's step time: this checkout's leanserve against the code at a git ref, both
loaded in one process (the old one as a renamed copy, `leanserve_ab`), their steps alternating on caches of
their own, so that the machine's drift hits both alike. Prints medians and new/old ratios:

    .venv/bin/python scripts/ab_step.py --ref c53250c --model models/dsv4-stdlib-8m --batch-sizes 1,8,32 \
        --dtypes float32,bfloat16 --prefill 2048

A decode step rewrites the same position each round (a rollback by one), so every round does the same work.

With `--linears`, it times the decode linears of DeepSeek-V4-Flash's shapes instead (the bench model's head in
bfloat16, its FP8 projections) through each code's `Matmuls`, one or more rows of x (`--batch-sizes`), each weight
copied to 640 MB and the copies cycled so that every call reads from memory, and says whether both codes give
the same bits. Step times of two models loaded in one process also differ by where each one's weights landed
(up to 8% between two copies of the same code on a 2-core VM); a linear's copies share one allocation per code.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

OLD = "leanserve_ab"


def load_old(ref: str, repo: Path, into: Path):
    """The package at `ref`, unpacked under `into` as OLD, its imports renamed; imported."""
    archive = into / "old.tar"
    subprocess.run(["git", "-C", str(repo), "archive", "-o", str(archive), ref, "src/leanserve"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    src = into / "src" / "leanserve"
    for path in src.rglob("*.py"):
        text = path.read_text()
        path.write_text(
            re.sub(r"\bleanserve\.", f"{OLD}.", re.sub(r"from leanserve import", f"from {OLD} import", text))
        )
    src.rename(into / OLD)
    sys.path.insert(0, str(into))
    return importlib.import_module(OLD)


def _module(pkg: str, *names: str):
    """The first of `names` (submodules of pkg) that exists: the configs moved between refs."""
    for name in names:
        if importlib.util.find_spec(f"{pkg}.{name}") is not None:
            return importlib.import_module(f"{pkg}.{name}")
    raise ModuleNotFoundError(f"none of {names} in {pkg}")


def runner(pkg: str, model: str, dtype: str, batch: int, max_len: int, tokens: int, options: dict):
    cfg_mod = _module(pkg, "model.config", "config")
    run_mod = importlib.import_module(f"{pkg}.engine.runner")
    topo = importlib.import_module(f"{pkg}.engine.topology")
    eng = importlib.import_module(f"{pkg}.engine.llm_engine")
    cfg = cfg_mod.ModelConfig.from_hf(model)
    config = _module(pkg, "engine.config", "config").EngineConfig(
        model, max_model_len=max_len, max_num_seqs=batch, max_num_batched_tokens=tokens, **options
    )
    layout = topo.PipelineTopology.build(cfg, 1).layout(0)
    r = run_mod.StageRunner(cfg, config, layout, eng.resolve_dtype(dtype, model), max_len, progress=False)
    r.warmup()
    return r


def plans(pkg: str, batch: int, start: int, prompt: int):
    run_mod = importlib.import_module(f"{pkg}.engine.runner")
    chunk = importlib.import_module(f"{pkg}.model.batch").Chunk
    greedy = importlib.import_module(f"{pkg}.sampling_params").SamplingParams(temperature=0.0)
    prefill = run_mod.StepPlan(tuple(chunk(s, 0, tuple(range(3, 3 + prompt))) for s in range(batch)), (), ())
    chunks = tuple(chunk(s, start, (5,)) for s in range(batch))
    samples = tuple(run_mod.SampleSpec(s, greedy, 0, 0, s) for s in range(batch))
    return prefill, run_mod.StepPlan(chunks, tuple(range(batch)), samples)


def ab(pair, plans_pair, repeats: int) -> tuple[float, float]:
    times = ([], [])
    for r in range(repeats):
        for i in (0, 1) if r % 2 else (1, 0):
            start = time.perf_counter()
            pair[i].execute(plans_pair[i])
            times[i].append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


LINEAR_SHAPES = {  # name: (out, in, format): the Flash-shaped bench model's decode linears
    "head bf16 [4096 -> 5888]": (5888, 4096, "bf16"),
    "wq_b fp8 [1024 -> 32768]": (32768, 1024, "fp8"),
    "wo_b fp8 [8192 -> 4096]": (4096, 8192, "fp8"),
    "fp8 [4096 -> 4096]": (4096, 4096, "fp8"),
}
COPIES_BYTES = 640 << 20


def linears_ab(rows: int, repeats: int) -> None:
    """Prints each LINEAR_SHAPES linear's GB/s in both codes at `rows` rows of x, medians of `repeats` passes over
    its copies (alternating which code goes first)."""
    import numpy as np
    import torch

    gen = torch.Generator().manual_seed(0)
    pkgs = {"old": OLD, "new": "leanserve"}
    kernels = {k: importlib.import_module(f"{p}.model.backends.cpu.kernels.quantized") for k, p in pkgs.items()}
    quant = {k: importlib.import_module(f"{p}.model.quant") for k, p in pkgs.items()}
    for name, (out_f, in_f, fmt) in LINEAR_SHAPES.items():
        w = torch.randn(out_f, in_f, generator=gen) * 0.02
        if fmt == "bf16":
            one = w.to(torch.bfloat16).view(torch.uint16).numpy()
            copies = np.concatenate([one] * max(2, COPIES_BYTES // one.nbytes))
            weights = {k: [copies[i : i + out_f] for i in range(0, len(copies), out_f)] for k in pkgs}
        else:
            q8 = quant["new"].quantize_fp8(w)
            q, sc = q8.q.view(torch.uint8).numpy(), q8.scale.numpy()
            n = max(2, COPIES_BYTES // q.nbytes)
            copies, scales = np.concatenate([q] * n), np.concatenate([sc] * n)
            blocks = sc.shape[0]
            weights = {
                k: [
                    quant[k].Fp8Weight(
                        q=copies[i * out_f : (i + 1) * out_f], scale=scales[i * blocks : (i + 1) * blocks]
                    )
                    for i in range(n)
                ]
                for k in pkgs
            }
        calls = {k: [kernels[k].Matmuls((wt,)) for wt in weights[k]] for k in pkgs}
        x = torch.randn(rows, in_f, generator=gen).numpy()
        same = np.array_equal(calls["old"][0](x)[0], calls["new"][0](x)[0])
        times = {"old": [], "new": []}
        for r in range(repeats):
            for k in ("old", "new") if r % 2 else ("new", "old"):
                start = time.perf_counter()
                for call in calls[k]:
                    call(x)
                times[k].append(time.perf_counter() - start)
        old, new = statistics.median(times["old"]), statistics.median(times["new"])
        print(
            f"{name:>26} {rows:>4} {copies.nbytes / old / 1e9:8.1f} {copies.nbytes / new / 1e9:8.1f} "
            f"{new / old:8.3f} {'yes' if same else 'no':>9}"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ref", required=True, help="the git ref to compare with (the old code)")
    p.add_argument("--model", default="models/dsv4-stdlib-8m")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prefill", type=int, default=2048, help="tokens of the prefill timed (0: none)")
    p.add_argument("--repeats", type=int, default=60, help="decode rounds per arm (prefill: a tenth)")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens before the decode steps")
    p.add_argument("--threads", type=int, default=None, help="torch (and kernel) threads; default torch's")
    p.add_argument("--linears", action="store_true", help="time the Flash-shaped decode linears instead (see above)")
    p.add_argument(
        "--option", action="append", default=[], metavar="NAME=VALUE",
        help="an EngineConfig option for both arms, e.g. fp8_inputs=bfloat16 (repeatable; both codes must take it)",
    )  # fmt: skip
    a = p.parse_args()
    options = dict(o.split("=", 1) for o in a.option)
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)

    repo = Path(__file__).resolve().parents[1]
    # numba tells a cached build apart by its own file's time stamp: after a change to one kernel file, the builds
    # of kernels in other files that compile it in would still hold its old code, and this checkout's arm run it
    from leanserve.prebuild import clear_stale_builds

    if clear_stale_builds():
        print("(this checkout's kernel files changed since its cached builds: they compile again)")
    with tempfile.TemporaryDirectory() as tmp:
        load_old(a.ref, repo, Path(tmp))
        if a.linears:
            print(f"{'linear':>26} {'rows':>4} {'old GB/s':>8} {'new GB/s':>8} {'new/old':>8} {'same bits':>9}")
            for batch in [int(b) for b in a.batch_sizes.split(",")]:
                linears_ab(batch, max(4, a.repeats // 10))
            return 0
        print(f"{'dtype':>9} {'step':>12} {'old ms':>9} {'new ms':>9} {'new/old':>8}")
        for dtype in a.dtypes.split(","):
            for batch in [int(b) for b in a.batch_sizes.split(",")]:
                length = a.prompt + 8
                pair = [
                    runner(pkg, a.model, dtype, batch, length, max(256, batch * a.prompt), options)
                    for pkg in (OLD, "leanserve")
                ]
                both = [plans(pkg, batch, a.prompt, a.prompt) for pkg in (OLD, "leanserve")]
                with torch.inference_mode():
                    for r, (pre, _) in zip(pair, both, strict=True):
                        r.execute(pre)
                    old, new = ab(pair, [d for _, d in both], a.repeats)
                print(f"{dtype:>9} {f'decode b={batch}':>12} {old * 1e3:9.3f} {new * 1e3:9.3f} {new / old:8.3f}")
            if a.prefill:
                n = a.prefill
                pair = [runner(pkg, a.model, dtype, 1, n + 1, n, options) for pkg in (OLD, "leanserve")]
                both = [plans(pkg, 1, 0, n)[0] for pkg in (OLD, "leanserve")]
                with torch.inference_mode():
                    old, new = ab(pair, both, max(4, a.repeats // 10))
                print(f"{dtype:>9} {f'prefill {n}':>12} {old * 1e3:9.3f} {new * 1e3:9.3f} {new / old:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
