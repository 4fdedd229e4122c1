"""The cost of grammar-constrained decoding per engine step: decode steps of the same batch with no constrained
request, with half of them constrained and with all of them, the arms interleaved round by round in one engine.

    .venv/bin/python scripts/structured_cost.py [--model models/dsv4-stdlib-12l] [--batch 8] [--steps 24]

Each arm adds `batch` requests (greedy; the constrained ones ask for a JSON object with one long string, so they
run on), steps until every prompt is in, then times `steps` decode steps and the part of them spent in the
grammar's masks (filling and applying them, advancing the matchers). Prints one JSON row per arm: the median
step, the median grammar time and its share of the step, and the step's difference from the unconstrained arm
(which also holds the noise of different tokens routing to different experts)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from leanserve import LLM, SamplingParams, StructuredOutput

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = {"type": "object", "properties": {"code": {"type": "string", "minLength": 400}}, "required": ["code"]}
# Different prompts: identical rows would pick the same experts, a cheaper step than a real batch's.
PROMPTS = [
    "def parse_config(path):\n    ",
    "class Cache:\n    def __init__(self",
    "import os\n\n\ndef walk(",
    "def merge(a, b):\n",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "dsv4-stdlib-12l"))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()
    llm = LLM(args.model, max_model_len=1024, max_num_seqs=args.batch, load_progress=False)
    engine, grammars = llm.engine, llm.engine.executor.runner.grammars
    spent = [0.0]
    for name in ("mask", "record"):  # the time the grammar's work takes inside a step
        inner = getattr(grammars, name)

        def timed(*a, _inner=inner):
            start = time.perf_counter()
            try:
                return _inner(*a)
            finally:
                spent[0] += time.perf_counter() - start

        setattr(grammars, name, timed)
    prompts = [engine.tokenizer.encode(f"# {i}\n" + PROMPTS[i % len(PROMPTS)]) for i in range(args.batch)]
    bound = StructuredOutput("json", schema=SCHEMA)
    arms = {"none": 0, "half": args.batch // 2, "all": args.batch}
    steps: dict[str, list[float]] = {a: [] for a in arms}
    masks: dict[str, list[float]] = {a: [] for a in arms}
    for _ in range(args.rounds):
        for arm, constrained in arms.items():
            seqs = set()
            for i in range(args.batch):
                more = dict(structured=bound) if i < constrained else dict(ignore_eos=True)
                seqs.add(
                    engine.add_request(prompts[i], SamplingParams(temperature=0, max_tokens=args.steps + 8, **more))
                )
            started: set[int] = set()
            while started != seqs:  # the prefills
                started |= {u.seq.seq_id for u in engine.step() if u.new_tokens}
            for _ in range(args.steps):
                spent[0] = 0.0
                start = time.perf_counter()
                if any(u.finished for u in engine.step()):
                    break  # (a constrained request finished: the batch shrinks)
                steps[arm].append(time.perf_counter() - start)
                masks[arm].append(spent[0])
            for seq_id in seqs:
                engine.abort(seq_id)
            while engine.has_unfinished:
                engine.step()
    base = statistics.median(steps["none"])
    for arm in arms:
        step = statistics.median(steps[arm])
        row = {
            "arm": arm,
            "constrained": arms[arm],
            "batch": args.batch,
            "steps": len(steps[arm]),
            "step_ms": round(step * 1e3, 3),
            "grammar_ms": round(statistics.median(masks[arm]) * 1e3, 3),
            "grammar_pct": round(100 * statistics.median(masks[arm]) / step, 1),
            "extra_ms": round((step - base) * 1e3, 3),
            "extra_pct": round(100 * (step - base) / base, 1),
        }
        print(json.dumps(row))
    llm.shutdown()


if __name__ == "__main__":
    main()
