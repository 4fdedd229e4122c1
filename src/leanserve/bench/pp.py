"""`leanserve bench pp`: output tokens/s of one stage, of N stages one step at a time, and of N stages with
N micro-batches in flight, at each concurrency, side by side in one run, with each stage's busy fraction.

Every arm is one engine, loaded once and warmed up on the workload before it is timed; the three are loaded
together and their rounds alternate (an idle engine's stages wait in a read, using no CPU), with this
process's threads set to what the arm's stage 0 runs with. A round submits `concurrency` requests at once
(held-out code prompts, greedy, `max_tokens` each, eos ignored) and waits for all of them; the median of
`repeats` rounds is reported. A stage's busy fraction is the time it spent
computing in a round over the round's wall time (stage 0's includes none of its scheduling): with N stages
one step at a time they add up to at most 1; overlap is what lets each approach 1. The greedy tokens of
every arm are compared with one stage's as a check that the work is the same.

What overlap could give at best (`overlap_bound`): its round is at least as long as its busiest stage's compute,
so overlap/serial is at most the serial round's wall time over that compute (both medians). Splitting the
requests into micro-batches makes each stage read its weights once per micro-batch instead of once per step,
so a stage computes longer with overlap than one step at a time for the same tokens.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from leanserve.bench.common import print_rows, random_prompts
from leanserve.bench.options import add_output, int_list
from leanserve.bench.prompts import code_prompts

ARMS = ("pp1", "serial", "overlap")


@dataclass
class PPRow:
    concurrency: int
    pp1_tok_s: float
    serial_tok_s: float  # N stages, one step at a time (--no-pipeline-overlap)
    overlap_tok_s: float  # N stages, N micro-batches in flight
    overlap_vs_pp1: float
    overlap_vs_serial: float
    overlap_bound: float  # overlap/serial if the busiest stage with overlap computed all the time
    serial_busy: str  # each stage's busy fraction, first to last
    overlap_busy: str
    same_tokens: bool


PP_HEADERS = {
    "concurrency": "concurrent",
    "pp1_tok_s": "PP=1 tok/s",
    "serial_tok_s": "PP=N serial tok/s",
    "overlap_tok_s": "PP=N overlap tok/s",
    "overlap_vs_pp1": "overlap/PP=1",
    "overlap_vs_serial": "overlap/serial",
    "overlap_bound": "overlap/serial bound",
    "serial_busy": "serial busy",
    "overlap_busy": "overlap busy",
    "same_tokens": "same tokens",
}


def pp_bench(
    model: str,
    concurrency: list[int],
    stages: int = 2,
    max_tokens: int = 64,
    prompt_len: int = 32,
    repeats: int = 3,
    dtype: str = "float32",
    layer_counts: list[int] | None = None,
) -> list[PPRow]:
    import torch

    from leanserve import LLM, SamplingParams
    from leanserve.engine.llm_engine import stage_threads
    from leanserve.model.backends.cpu import kernels as cpu_kernels

    if stages < 2:
        raise ValueError(f"--stages must be at least 2, got {stages}.")
    most = max(concurrency)
    common = dict(dtype=dtype, max_num_seqs=most, max_model_len=prompt_len + max_tokens + 8, load_progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    split = dict(pipeline_parallel_size=stages, pipeline_layer_counts=layer_counts)
    full = torch.get_num_threads()
    share = stage_threads(full, stages)

    def threads_of(arm: str) -> None:  # this process's threads as the arm's engine runs them (stage 0: its share)
        torch.set_num_threads(full if arm == "pp1" else share)
        cpu_kernels.limit_threads(None if arm == "pp1" else share)

    engines = {}
    try:
        for arm, kwargs in (("pp1", {}), ("serial", dict(split, pipeline_overlap=False)), ("overlap", split)):
            threads_of("pp1")
            engines[arm] = LLM(model, **common, **kwargs)
        prompts = [{"prompt_token_ids": p} for p in _prompts(engines["pp1"], most, prompt_len)]
        # results[arm][concurrency] = the median round: (tok/s, wall seconds, each stage's busy seconds, token ids)
        results: dict[str, dict[int, tuple[float, float, list[float], list]]] = {arm: {} for arm in ARMS}
        for c in concurrency:
            rounds: dict[str, list] = {arm: [] for arm in ARMS}
            for arm in ARMS:  # warm-up at this batch shape
                threads_of(arm)
                engines[arm].generate(prompts[:c], params)
            for r in range(repeats):  # the arms alternate, so that the machine's drift hits them alike
                for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
                    threads_of(arm)
                    rounds[arm].append(_round(engines[arm], prompts[:c], params))
            for arm in ARMS:
                rounds[arm].sort(key=lambda r: r[0])
                results[arm][c] = rounds[arm][len(rounds[arm]) // 2]
    finally:
        for llm in engines.values():
            llm.shutdown()
        threads_of("pp1")
    rows = []
    for c in concurrency:
        (one, _, _, want), (ser, ser_wall, ser_busy, a), (ovl, ovl_wall, ovl_busy, b) = (
            results[arm][c] for arm in ARMS
        )
        rows.append(
            PPRow(
                c, one, ser, ovl, ovl / one, ovl / ser, ser_wall / max(ovl_busy),
                _fractions(ser_busy, ser_wall), _fractions(ovl_busy, ovl_wall), a == want and b == want,
            )
        )  # fmt: skip
    return rows


def _prompts(llm, count: int, length: int) -> list[list[int]]:
    """Held-out code; for a checkpoint without a tokenizer, token ids from a fixed seed."""
    if llm.engine.tokenizer is not None:
        return code_prompts(llm.engine.tokenizer, count, length)
    return random_prompts(count, length, llm.engine.model_config.vocab_size, seed=0).tolist()


def _round(llm, prompts: list[dict], params) -> tuple[float, float, list[float], list]:
    """(output tokens/s, wall seconds, each stage's busy seconds, the token ids) of one round."""
    executor = llm.engine.executor
    before = executor.stage_busy_s()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    busy = [b - a for a, b in zip(before, executor.stage_busy_s(), strict=True)]
    tokens = [o.outputs[0].token_ids for o in outs]
    return sum(len(t) for t in tokens) / wall, wall, busy, tokens


def _fractions(busy: list[float], wall: float) -> str:
    return "/".join(f"{b / wall:.2f}" for b in busy)


HELP = "tokens/s of PP=1, PP=N one step at a time and PP=N with overlap, with each stage's busy fraction"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--concurrency", type=int_list, default=[1, 8, 32])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--pipeline-layer-counts", type=int_list, default=None, help="layers per stage (default: even)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=3)
    add_output(p)


def run(args: argparse.Namespace) -> int:
    if args.max_tokens < 1 or args.prompt_len < 1:
        raise ValueError("--prompt-len and --max-tokens must be positive.")
    rows = pp_bench(
        args.model, args.concurrency, args.stages, args.max_tokens, args.prompt_len, args.repeats, args.dtype,
        args.pipeline_layer_counts,
    )  # fmt: skip
    print_rows(rows, args.output, PP_HEADERS)
    return 0
