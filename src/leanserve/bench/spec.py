"""`leanserve bench spec`: greedy tokens/s of speculative decoding (MTP k = 1, 2, 3; n-gram) against none, on
held-out code, with the acceptance figures and what a speculative step costs in plain steps."""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

from leanserve.bench.common import print_rows, timed
from leanserve.bench.options import add_output, add_threads, int_list
from leanserve.bench.prompts import code_prompts

SPEC_CONFIGS: dict[str, dict | None] = {
    "none": None,
    "mtp k=1": {"method": "mtp", "num_speculative_tokens": 1},
    "mtp k=2": {"method": "mtp", "num_speculative_tokens": 2},
    "mtp k=3": {"method": "mtp", "num_speculative_tokens": 3},
    "ngram k=3": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
}


@dataclass
class SpecRow:
    batch_size: int
    method: str
    tok_s: float
    speedup: float
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    # What a speculative step costs in plain decode steps: mean accepted length / speedup (the prefill, the
    # same for every method, counts in both, so this slightly understates it).
    step_cost: float | None
    same_tokens: str


SPEC_HEADERS = {
    "batch_size": "batch",
    "method": "method",
    "tok_s": "tok/s",
    "speedup": "vs none",
    "acceptance_rate": "acceptance",
    "mean_acceptance_length": "mean accepted len",
    "step_cost": "step cost (plain steps)",
    "same_tokens": "same tokens",
}


def spec_bench(
    model: str,
    batch_sizes: list[int],
    max_tokens: int = 64,
    prompt_tokens: int = 48,
    repeats: int = 3,
    dtype: str = "float32",
    configs: dict[str, dict | None] | None = None,
) -> list[SpecRow]:
    """Greedy output tokens/s of each speculative method against none, on the same held-out code prompts,
    alternating the order of the methods over `repeats` rounds (median round), with the acceptance figures
    and how many sequences came out identical to no speculation."""
    from leanserve import LLM, SamplingParams

    configs = configs or SPEC_CONFIGS
    engines = {
        name: LLM(model, dtype=dtype, max_num_seqs=max(batch_sizes), load_progress=False, speculative_config=c)
        for name, c in configs.items()
    }
    first = next(iter(engines.values()))
    if first.get_tokenizer() is None:
        raise ValueError(f"{model} has no tokenizer.json; bench spec prompts with held-out code text.")
    prompts = code_prompts(first.get_tokenizer(), max(batch_sizes) + 1, prompt_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for llm in engines.values():  # warm-up
        llm.generate({"prompt_token_ids": prompts[-1]}, params)
    rows = []
    for batch in batch_sizes:
        batch_prompts = [{"prompt_token_ids": p} for p in prompts[:batch]]
        times: dict[str, list[float]] = {name: [] for name in engines}
        tokens: dict[str, list[list[int]]] = {}
        accepted = {}
        for r in range(repeats):
            names = list(engines) if r % 2 == 0 else list(engines)[::-1]
            for name in names:
                llm = engines[name]
                before = llm.spec_decode_metrics()
                dt, outs = timed(llm.generate, batch_prompts, params)
                times[name].append(dt)
                tokens[name] = [o.outputs[0].token_ids for o in outs]
                after = llm.spec_decode_metrics()
                prev = accepted.get(name, (0, 0, 0))
                accepted[name] = (
                    prev[0] + after["num_accepted_tokens"] - before["num_accepted_tokens"],
                    prev[1] + after["num_draft_tokens"] - before["num_draft_tokens"],
                    prev[2] + after["num_drafts"] - before["num_drafts"],
                )
        base = batch * max_tokens / statistics.median(times["none"])
        for name in engines:
            tps = batch * max_tokens / statistics.median(times[name])
            acc, drafted, drafts = accepted[name]
            same = sum(a == b for a, b in zip(tokens[name], tokens["none"], strict=True))
            length = 1 + acc / drafts if drafts else None
            rows.append(
                SpecRow(
                    batch, name, round(tps, 1), round(tps / base, 2),
                    round(acc / drafted, 3) if drafted else None, round(length, 2) if length else None,
                    round(length * base / tps, 2) if length else None, f"{same}/{batch}",
                )
            )  # fmt: skip
    for llm in engines.values():
        llm.shutdown()
    return rows


HELP = "tokens/s without speculation vs mtp (k=1, 2, 3) vs ngram, on held-out code"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--batch-sizes", type=int_list, default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=3)
    add_threads(p)
    add_output(p)


def run(args: argparse.Namespace) -> int:
    if args.max_tokens < 1 or args.prompt_len < 1:
        raise ValueError("--prompt-len and --max-tokens must be positive.")
    rows = spec_bench(args.model, args.batch_sizes, args.max_tokens, args.prompt_len, args.repeats, args.dtype)
    print_rows(rows, args.output, SPEC_HEADERS)
    return 0
