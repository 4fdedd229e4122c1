"""`leanserve bench kv`: what the paged cache buys in the same cache memory, side by side in one run.

The same workload, a mix of many short chats and a few long documents all queued at once, runs on:
  - static: the layout without paging, `--static-seqs` slots each holding a whole max_model_len sequence (the
    pools full: every slot's blocks its own);
  - paged: `--max-num-seqs` slots, and pools of what is left of the static arm's cache memory (its `kv_cache`
    ledger entries) once the paged arm's per-slot windows are paid for, a sequence holding the blocks for its
    tokens.
Reported per arm: the most and the mean sequences running per step, the share of the blocks in use that holds
tokens (mean over steps: the rest is the unfilled end of each sequence's last block), output tokens per second,
the wall time, preemptions, and whether the greedy tokens match the static arm's; then paged / static ratios.
`--block-sizes` runs the paged arm once per block size (the choice docs/paged-cache.md explains).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

import torch

from leanserve.bench.common import print_rows
from leanserve.bench.options import SHIPPED_MODEL, add_output, int_list, require_positive
from leanserve.memory import KV_CACHE, format_bytes


@dataclass
class KvRow:
    layout: str
    block_tokens: int
    max_num_seqs: int
    kv_cache: str
    most_running: int
    mean_running: float
    block_use: str
    output_tok_s: float
    wall_s: float
    preemptions: int
    same_tokens: str


HEADERS = {
    "layout": "layout",
    "block_tokens": "block",
    "max_num_seqs": "slots",
    "kv_cache": "kv_cache",
    "most_running": "most running",
    "mean_running": "mean running",
    "block_use": "block use",
    "output_tok_s": "output tok/s",
    "wall_s": "wall s",
    "preemptions": "preemptions",
    "same_tokens": "same tokens",
}


def workload(short: int, long: int, max_model_len: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) pairs: `short` chats (prompts of 64-512 tokens, 32-128 out) and `long` documents
    (prompts of 1/2 to 7/8 of max_model_len, 64 out), shuffled together."""
    rng = random.Random(seed)
    out = []
    for _ in range(short):
        out.append((rng.randint(64, 512), rng.randint(32, 128)))
    for _ in range(long):
        out.append((rng.randint(max_model_len // 2, max_model_len * 7 // 8), 64))
    rng.shuffle(out)
    return [([rng.randrange(3, vocab) for _ in range(n)], m) for n, m in out]


def _run(llm, requests) -> tuple[float, int, float, float, list[list[int]]]:
    from leanserve import SamplingParams

    engine = llm.engine
    order = {}
    for i, (prompt, max_tokens) in enumerate(requests):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        order[engine.add_request(prompt, params)] = i
    tokens: list[list[int]] = [[] for _ in requests]
    sched, pool = engine.scheduler, engine.scheduler.blocks
    most, total, steps, use = 0, 0, 0, 0.0
    start = time.perf_counter()
    while engine.has_unfinished:
        running = sched.num_running
        held = sched.num_computed_tokens / max(pool.num_used * pool.block_tokens, 1)
        for u in engine.step():
            if u.finished:
                tokens[order[u.seq.seq_id]] = u.seq.output_token_ids
        steps += 1
        running = max(running, sched.num_running)
        most, total, use = max(most, running), total + running, use + held
    return time.perf_counter() - start, most, total / max(steps, 1), use / max(steps, 1), tokens


def bench_kv(
    model: str,
    max_model_len: int,
    static_seqs: int,
    max_num_seqs: int,
    short: int,
    long: int,
    dtype: str = "auto",
    seed: int = 0,
    block_sizes: list[int] | None = None,
) -> list[KvRow]:
    from leanserve import LLM
    from leanserve.engine.kv_budget import window_bytes

    common = dict(max_model_len=max_model_len, dtype=dtype, load_progress=False)
    rows, first, requests, budget = [], None, None, 0
    arms = [("static", None, static_seqs)] + [("paged", size, max_num_seqs) for size in block_sizes or [None]]
    for layout, size, seqs in arms:
        options = {} if layout == "static" else {"kv_cache_memory": budget, "kv_block_size": size}
        llm = LLM(model, max_num_seqs=seqs, **common, **options)
        try:
            engine = llm.engine
            ledger = llm.memory_ledger()
            cache = sum(s.by_feature().get(KV_CACHE, 0) for s in ledger)
            if layout == "static":  # the same cache memory for the paged arms: pools and their slots' windows
                per_slot = window_bytes(ledger) / seqs
                table = engine.kv.num_blocks // seqs * 4 * max_num_seqs  # (a slot's row of int32 block ids)
                budget = int(cache - per_slot * max_num_seqs - table)
                requests = workload(short, long, max_model_len, engine.model_config.vocab_size, seed)
            _run(llm, requests[:2])  # (warm: first-call costs billed to neither arm)
            wall, most, mean, use, out = _run(llm, requests)
            preempted, block = engine.scheduler.num_preemptions, engine.kv.block_tokens
        finally:
            llm.shutdown()
        first = first or out
        same = sum(a == b for a, b in zip(first, out, strict=True))
        produced = sum(len(t) for t in out)
        rows.append(KvRow(layout, block, seqs, format_bytes(cache), most, round(mean, 1), f"{use:.0%}",
                          round(produced / wall, 1), round(wall, 2), preempted, f"{same}/{len(requests)}"))  # fmt: skip
    static = rows[0]
    for paged in rows[1:]:
        rows.append(
            KvRow("paged/static", paged.block_tokens, 0, "", round(paged.most_running / static.most_running, 2),
                  round(paged.mean_running / static.mean_running, 2), "",
                  round(paged.output_tok_s / static.output_tok_s, 2), round(paged.wall_s / static.wall_s, 2), 0, "")
        )  # fmt: skip
    return rows


HELP = "paged cache vs the static layout at one cache budget: concurrency and throughput on a mix of lengths"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=SHIPPED_MODEL)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--static-seqs", type=int, default=8, help="slots the default budget buys in the static layout")
    p.add_argument("--max-num-seqs", type=int, default=32, help="the paged arm's slots")
    p.add_argument("--short", type=int, default=56, help="short chats: prompts of 64-512 tokens, 32-128 out")
    p.add_argument("--long", type=int, default=4, help="long documents: prompts of 1/2 to 7/8 of max_model_len")
    p.add_argument(
        "--block-sizes", type=int_list, default=None, help="the paged arm's block sizes (default: the model's)"
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    add_output(p)


def run(args: argparse.Namespace) -> int:
    require_positive(args, "max_model_len", "static_seqs", "max_num_seqs")
    if args.short < 0 or args.long < 0 or args.short + args.long < 3:
        raise ValueError("--short and --long must not be negative, and make at least 3 requests.")
    torch.manual_seed(args.seed)
    rows = bench_kv(args.model, args.max_model_len, args.static_seqs, args.max_num_seqs, args.short, args.long,
                    args.dtype, args.seed, args.block_sizes)  # fmt: skip
    print_rows(rows, args.output, HEADERS)
    return 0
