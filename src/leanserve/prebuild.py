"""`leanserve prebuild`: the CPU kernels compiled into numba's on-disk cache (beside their sources) for every weight
format, in several processes at once, so that later processes load them instead of compiling them one after the
other (on a 2-core machine the first engine of a checkout otherwise spends about two minutes compiling).

Each process starts engines, with MTP speculation, on small random checkpoints of its weight formats: their
warm-up runs every step shape a request takes (StageRunner.warmup), which compiles each kernel variant those
formats use. Formats are grouped so that kernels every format shares are compiled by as few processes as
possible: float32 with FP8 experts, bfloat16 with FP4 experts.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GROUPS = (("float32", "fp8"), ("bfloat16", "fp4"))


def warm(fmt: str) -> None:
    """One engine's start-up (its warm-up) and a short generation on a random `tiny` checkpoint in `fmt`:
    float32 or bfloat16 weights, or the published format with fp4 or fp8 experts."""
    from leanserve import LLM, SamplingParams
    from leanserve.make_random import make_random

    plain = fmt in ("float32", "bfloat16")
    with tempfile.TemporaryDirectory() as d:
        if plain:
            make_random(d, "tiny", 0, fmt)
        else:
            make_random(d, "tiny", 0, format="published", expert_dtype=fmt)
        dtype = fmt if plain else "auto"
        spec = {"method": "mtp", "num_speculative_tokens": 2}
        llm = LLM(d, dtype=dtype, load_progress=False, speculative_config=spec)
        llm.generate({"prompt_token_ids": list(range(3, 40))}, SamplingParams(max_tokens=4))
        llm.shutdown()


KERNELS = Path(__file__).resolve().parent / "model" / "backends" / "cpu" / "kernels"
STAMP = "leanserve-kernels.sha256"  # (beside the cached builds: the kernels' sources they were built from)


def clear_stale_builds(kernels: Path = KERNELS) -> bool:
    """numba tells a cached build apart by its own source file's time stamp, not by the files of the kernels and
    intrinsics compiled into it, so after a change to one kernel file the others' builds may hold its old code.
    When the kernel files differ from those the cache was built from, every cached build there is removed (they
    are compiled again); True if it did."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(kernels.glob("*.py")))).hexdigest()
    cache, stamp = kernels / "__pycache__", kernels / "__pycache__" / STAMP
    if stamp.is_file() and stamp.read_text() == digest:
        return False
    for built in [*cache.glob("*.nbi"), *cache.glob("*.nbc")]:
        built.unlink(missing_ok=True)
    cache.mkdir(exist_ok=True)
    stamp.write_text(digest)
    return True


def prebuild(jobs: int | None = None) -> float:
    """Runs the groups of formats in up to `jobs` processes at a time (default: one per core, at most one per
    group), after clearing builds made from other kernel sources; returns the seconds it took. A process that fails
    raises, with the end of its output."""
    clear_stale_builds()
    jobs = min(jobs or os.cpu_count() or 1, len(GROUPS))
    start, pending, running = time.perf_counter(), list(GROUPS), []
    while pending or running:
        while pending and len(running) < jobs:
            group = pending.pop(0)
            cmd = [sys.executable, "-m", "leanserve.prebuild", *group]
            running.append((group, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        group, proc = running.pop(0)
        output, _ = proc.communicate()
        if proc.returncode != 0:
            for _, other in running:
                other.kill()
            tail = "\n".join(output.strip().splitlines()[-20:])
            raise RuntimeError(f"compiling the kernels for {', '.join(group)} weights failed:\n{tail}")
    return time.perf_counter() - start


if __name__ == "__main__":
    for fmt in sys.argv[1:]:
        warm(fmt)
