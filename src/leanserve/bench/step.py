"""`leanserve bench step`: one decode step of a model's last stage with the target-hidden buffer on (MTP on:
the forward copies the pre-hc_head streams into it) vs off, side by side on the same caches."""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

from leanserve.bench.common import mtp_runner, prefill, print_rows, timed
from leanserve.bench.options import add_output, add_threads, int_list


@dataclass
class StepRow:
    batch_size: int
    off_us: float
    on_us: float
    copy_us: float
    ratio: float
    buffer_bytes: int


STEP_HEADERS = {
    "batch_size": "batch",
    "off_us": "buffer off us",
    "on_us": "buffer on us",
    "copy_us": "paired diff us",
    "ratio": "on/off",
    "buffer_bytes": "buffer bytes",
}


def step_bench(
    model: str, batch_sizes: list[int], max_num_batched_tokens: int = 8192, repeats: int = 50, prompt_len: int = 16
) -> list[StepRow]:
    """Times one decode step of the model's last stage with the target-hidden buffer present (MTP on: the
    forward copies the pre-hc_head streams into it) and absent, alternating on the same caches."""
    from leanserve.engine.runner import SampleSpec, StepPlan
    from leanserve.model.batch import Chunk
    from leanserve.sampling_params import SamplingParams

    most = max(batch_sizes)
    runner = mtp_runner(model, most, prompt_len + repeats + 8, max(max_num_batched_tokens, most * prompt_len))
    greedy = SamplingParams(temperature=0.0)
    rows = []
    for batch in batch_sizes:
        prefill(runner, batch, prompt_len)

        def decode(on: bool, position: int, batch: int = batch) -> float:
            chunks = tuple(Chunk(s, position, (5,)) for s in range(batch))
            plan = StepPlan(chunks, tuple(range(batch)), tuple(SampleSpec(s, greedy, 0, 0) for s in range(batch)))
            # time the trunk step alone (no proposal): the two arms differ only by the copy
            return timed(runner.execute, plan, propose=False, capture_hidden=on)[0]

        decode(True, prompt_len), decode(False, prompt_len)  # warm-up
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(repeats):
            # Both arms decode at the same position (the second rewrites the first's: a rollback by one), so
            # they do identical work apart from the copy; which goes first alternates.
            for on in (True, False) if r % 2 else (False, True):
                times[on].append(decode(on, prompt_len + r))
        off, on = statistics.median(times[False]) * 1e6, statistics.median(times[True]) * 1e6
        # The copy's cost: the median of the per-position differences, robust to drift over the run.
        diff = statistics.median(a - b for a, b in zip(times[True], times[False], strict=True)) * 1e6
        nbytes = runner.target_hidden.nbytes
        rows.append(StepRow(batch, round(off, 1), round(on, 1), round(diff, 1), round(on / off, 3), nbytes))
    return rows


HELP = "one decode step with the target-hidden buffer on vs off, side by side"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a model directory with MTP weights")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 8, 32])
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=50)
    add_threads(p)
    add_output(p)


def run(args: argparse.Namespace) -> int:
    rows = step_bench(args.model, args.batch_sizes, args.max_num_batched_tokens, args.repeats)
    print_rows(rows, args.output, STEP_HEADERS)
    return 0
