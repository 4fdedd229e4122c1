"""`leanserve bench structured`: what grammar-constrained requests cost the plain requests batched with them.

One engine (float32, greedy; the shipped model by default) runs three arms at each batch size B of plain
requests, the arms' order alternating over `repeats` rounds (after one warm-up round):

- "plain": B plain requests (held-out code prompts, `max_tokens` each, eos ignored), submitted at once;
- "plain + constrained": the same B beside C constrained requests (eos not ignored; a JSON schema of bounded
  content: an array of small records with more items than `max_tokens` can write, so they are cut by
  max_tokens and run as long as the plain ones);
- "plain + unconstrained": the same B beside the same C prompts without the schema: a batch of the same size,
  the control that tells the grammar's cost from that of a bigger batch.

Each arm's row (medians over the rounds): the plain requests' output tokens/s (their tokens over the time from
submitting the batch to the last plain request's end, prefill included); the decode step they share (the median
step while every request decodes); that tokens/s over the plain arm's (`vs_plain`: b/a) and, for the
constrained arm, over the unconstrained one's (`vs_same_batch`); the constrained requests' tokens/s; the
grammar's own time per decode step (the engine's `GrammarState` calls on the last stage, timed from outside:
matchers made, masks filled and applied, matchers advanced); whether the plain requests' greedy tokens are the
plain arm's. Where a core is free of the model's threads (`--threads` below the cores) the masks are filled on a
worker thread while the model runs; else on the step's thread after it (`engine.grammar.overlap_fills`), and
their time is in every request's step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from leanserve.bench.common import print_rows
from leanserve.bench.options import SHIPPED_MODEL, add_output, add_threads, int_list
from leanserve.bench.prompts import code_prompts

ARMS = ("plain", "plain + constrained", "plain + unconstrained")


def records_schema(max_tokens: int) -> dict:
    """An object holding an array of small records, each bounded, with more items than `max_tokens` tokens can
    write (a record takes more than 4 tokens), so a constrained request is cut by max_tokens, not finished."""
    items = max_tokens // 4 + 1
    record = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "line": {"type": "integer", "minimum": 0, "maximum": 9999},
            "kind": {"enum": ["def", "class", "import", "assign"]},
        },
        "required": ["name", "line", "kind"],
        "additionalProperties": False,
    }
    array = {"type": "array", "items": record, "minItems": items, "maxItems": items}
    return {"type": "object", "properties": {"records": array}, "required": ["records"], "additionalProperties": False}


@dataclass
class StructuredRow:
    arm: str
    plain: int  # plain requests
    beside: int  # requests beside them
    plain_tok_s: float
    plain_step_ms: float
    vs_plain: float  # plain_tok_s over the plain arm's
    vs_same_batch: float | None  # the constrained arm's plain_tok_s over the unconstrained arm's
    constrained_tok_s: float | None
    grammar_ms: float  # the grammar's own time per decode step (its calls in a step without one: next to 0)
    plain_tokens_identical: bool


STRUCTURED_HEADERS = {
    "arm": "arm",
    "plain": "plain",
    "beside": "beside",
    "plain_tok_s": "plain tok/s",
    "plain_step_ms": "plain step ms",
    "vs_plain": "vs plain",
    "vs_same_batch": "vs same batch",
    "constrained_tok_s": "constrained tok/s",
    "grammar_ms": "grammar ms/step",
    "plain_tokens_identical": "plain tokens identical",
}


class _GrammarTimer:
    """Adds up the time of the last stage's grammar calls (one engine, one stage: its `GrammarState`)."""

    def __init__(self, state) -> None:
        self.spent = 0.0
        for name in ("begin", "mask", "record"):
            setattr(state, name, self._timed(getattr(state, name)))

    def _timed(self, fn):
        def timed(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.spent += time.perf_counter() - start

        return timed


@dataclass
class _Round:
    plain_s: float  # submit -> the last plain request's end
    beside_s: float  # submit -> the last request beside them's end
    step_s: float  # median decode step
    grammar_s: float  # median grammar time per decode step
    plain_tokens: list[list[int]]
    beside_tokens: int


def _round(engine, plain: list[tuple], beside: list[tuple], timer: _GrammarTimer) -> _Round:
    """Submits every (prompt, params) at once and steps until all are done."""
    start = time.perf_counter()
    plain_ids = [engine.add_request(p, params) for p, params in plain]
    beside_ids = [engine.add_request(p, params) for p, params in beside]
    tokens: dict[int, list[int]] = {i: [] for i in plain_ids + beside_ids}
    ends: dict[int, float] = {}
    steps, grammar = [], []
    while engine.has_unfinished:
        decoding = all(tokens.values()) and not ends  # every request has its first token, none has ended
        timer.spent, before = 0.0, time.perf_counter()
        updates = engine.step()
        now = time.perf_counter()
        if decoding:
            steps.append(now - before)
            grammar.append(timer.spent)
        for u in updates:
            tokens[u.seq.seq_id] += [t.token_id for t in u.new_tokens]
            if u.finished:
                ends[u.seq.seq_id] = now
    return _Round(
        max(ends[i] for i in plain_ids) - start,
        max((ends[i] for i in beside_ids), default=start) - start,
        statistics.median(steps) if steps else float("nan"),
        statistics.median(grammar) if grammar else 0.0,
        [tokens[i] for i in plain_ids],
        sum(len(tokens[i]) for i in beside_ids),
    )


def structured_bench(
    model: str,
    batch_sizes: list[int],
    constrained: int = 8,
    max_tokens: int = 64,
    prompt_len: int = 16,
    repeats: int = 5,
    dtype: str = "float32",
) -> list[StructuredRow]:
    """The three arms at each batch size of plain requests, beside `constrained` others (see the module)."""
    from leanserve import LLM, SamplingParams, StructuredOutput

    most = max(batch_sizes)
    llm = LLM(model, dtype=dtype, max_num_seqs=most + constrained, load_progress=False)
    rows = []
    try:
        engine = llm.engine
        if engine.tokenizer is None:
            raise ValueError(f"{model} has no tokenizer.json; bench structured needs one (prompts, the grammar).")
        timer = _GrammarTimer(engine.executor.runner.grammars)  # (LLM's defaults: one stage, in this process)
        prompts = code_prompts(engine.tokenizer, most + constrained, prompt_len)
        free = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        spec = StructuredOutput("json", schema=records_schema(max_tokens), strict=True)
        bound = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured=spec)
        others = prompts[most:]
        arms = {
            "plain": [],
            "plain + constrained": [(p, bound) for p in others],
            "plain + unconstrained": [(p, free) for p in others],
        }
        for batch in batch_sizes:
            plain = [(p, free) for p in prompts[:batch]]
            for beside in arms.values():  # warm-up: the grammar compiler built, every step shape run
                _round(engine, plain, beside, timer)
            rounds: dict[str, list[_Round]] = {arm: [] for arm in ARMS}
            for r in range(repeats):
                for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
                    rounds[arm].append(_round(engine, plain, arms[arm], timer))
            rows += _rows(rounds, batch, constrained, max_tokens)
    finally:
        llm.shutdown()
    return rows


def _rows(rounds: dict[str, list[_Round]], batch: int, beside: int, max_tokens: int) -> list[StructuredRow]:
    def med(arm: str, field: str) -> float:
        return statistics.median(getattr(x, field) for x in rounds[arm])

    tok_s = {arm: batch * max_tokens / med(arm, "plain_s") for arm in ARMS}
    reference = rounds["plain"][0].plain_tokens
    rows = []
    for arm in ARMS:
        bound = arm == "plain + constrained"
        bound_tok_s = statistics.median(x.beside_tokens / x.beside_s for x in rounds[arm]) if bound else None
        rows.append(
            StructuredRow(
                arm, batch, beside if arm != "plain" else 0, round(tok_s[arm], 1),
                round(med(arm, "step_s") * 1e3, 3), round(tok_s[arm] / tok_s["plain"], 3),
                round(tok_s[arm] / tok_s["plain + unconstrained"], 3) if bound else None,
                round(bound_tok_s, 1) if bound else None, round(med(arm, "grammar_s") * 1e3, 3),
                all(x.plain_tokens == reference for x in rounds[arm]),
            )
        )  # fmt: skip
    return rows


HELP = "tokens/s of plain requests beside grammar-constrained ones vs beside none, side by side"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=SHIPPED_MODEL, help="default: the shipped model (from the repo root)")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 8, 32], help="plain requests (B) per batch")
    p.add_argument("--constrained", type=int, default=8, help="constrained requests beside them (C)")
    p.add_argument("--max-tokens", type=int, default=64, help="per request")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=5, help="rounds of the alternating arms")
    add_threads(p)
    add_output(p)


def run(args: argparse.Namespace) -> int:
    if min(args.constrained, args.prompt_len) < 1 or args.max_tokens < 2:
        raise ValueError("--constrained and --prompt-len must be positive and --max-tokens at least 2.")
    rows = structured_bench(
        args.model, args.batch_sizes, args.constrained, args.max_tokens, args.prompt_len, args.repeats, args.dtype
    )
    print_rows(rows, args.output, STRUCTURED_HEADERS)
    return 0
