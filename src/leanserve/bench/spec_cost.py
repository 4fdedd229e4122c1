"""`leanserve bench spec-cost`: what the parts of a one-token MTP speculative step cost, in plain decode
steps, on the same caches, and the speed-up ceiling that bounds MTP k = 1."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from leanserve.bench.common import mtp_runner, prefill, random_prompts, timed


@dataclass
class SpecCostRow:
    batch_size: int
    plain_ms: float  # a plain decode step: the trunk over one token per sequence, the head, sampling
    verify: float  # the trunk over two tokens per sequence (the token and its draft) and verification, x plain
    propose_rejected: float  # the MTP layer's proposal after a rejected draft (over one position), x plain
    propose_accepted: float  # ... after an accepted draft (over two positions), x plain
    step_all_accepted: float  # verify + propose_accepted: a speculative step when every draft is accepted
    ceiling: float  # 2 / step_all_accepted: the speed-up of k = 1 if every draft were accepted


SPEC_COST_HEADERS = {
    "batch_size": "batch",
    "plain_ms": "plain step ms",
    "verify": "verify (x plain)",
    "propose_rejected": "MTP after reject",
    "propose_accepted": "MTP after accept",
    "step_all_accepted": "k=1 step, all accepted",
    "ceiling": "k=1 ceiling",
}


def spec_cost_bench(
    model: str, batch_sizes: list[int], repeats: int = 50, prompt_len: int = 32, dtype: str = "float32"
) -> list[SpecCostRow]:
    """Times the parts of a one-token MTP speculative step against a plain decode step on the same caches,
    interleaved at the same positions (each arm rewrites the last one's: a rollback), medians over `repeats`.
    A step yields at most 2 tokens, so 2 / (its cost in plain steps) bounds MTP k = 1's speed-up. The tokens are
    varied (seeded), as in text: a token and its draft route to different experts, which is what verifying costs."""
    from leanserve.engine.proposers import ProposeItem
    from leanserve.engine.runner import SampleSpec, StepPlan
    from leanserve.model.batch import Chunk
    from leanserve.sampling_params import SamplingParams

    most = max(batch_sizes)
    runner = mtp_runner(model, most, prompt_len + repeats + 8, max(2048, most * prompt_len), dtype)
    greedy = SamplingParams(temperature=0.0, max_tokens=1 << 20)
    rows = []
    ids = random_prompts(most, repeats + 8, runner.cfg.vocab_size, 0).tolist()  # ids[slot][round + i]
    for batch in batch_sizes:
        prefill(runner, batch, prompt_len, tuple(ids[s][0] for s in range(batch)))

        def trunk(position: int, drafts: int, batch: int = batch) -> float:
            # The trunk alone (the proposal is timed apart); the verify arm keeps its streams for the proposals.
            r = position - prompt_len
            chunks = tuple(Chunk(s, position, tuple(ids[s][r : r + 1 + drafts])) for s in range(batch))
            samples = tuple(SampleSpec(s, greedy, 0, 0, s, tuple(ids[s][r + 1 : r + 1 + drafts])) for s in range(batch))
            plan = StepPlan(chunks, tuple(range(batch * (1 + drafts))), samples, (-1,) * batch)
            return timed(runner.execute, plan, propose=False, capture_hidden=bool(drafts))[0]

        def propose(position: int, accepted: bool, batch: int = batch) -> float:
            # After a verify step at `position`: catch up over 1 (rejected) or 2 (accepted) positions, then draft.
            r = position - prompt_len
            items = [
                ProposeItem(s, position, tuple(ids[s][r : r + (3 if accepted else 2)]), 2 * s, s, greedy, 1, 1)
                for s in range(batch)
            ]
            return timed(runner.proposer.propose, items, dict.fromkeys(range(batch), 0))[0]

        times: dict[str, list[float]] = {"plain": [], "verify": [], "rejected": [], "accepted": []}
        for r in range(repeats + 2):
            position = prompt_len + r
            for name, drafts in (("plain", 0), ("verify", 1)) if r % 2 else (("verify", 1), ("plain", 0)):
                times[name].append(trunk(position, drafts))
            # the proposals read the verify step's streams (any order of the two)
            for name in ("rejected", "accepted") if r % 2 else ("accepted", "rejected"):
                times[name].append(propose(position, name == "accepted"))
        med = {k: statistics.median(v[2:]) for k, v in times.items()}  # (the first two rounds warm up)
        plain = med["plain"]
        step = (med["verify"] + med["accepted"]) / plain
        rows.append(
            SpecCostRow(
                batch, round(plain * 1e3, 3), round(med["verify"] / plain, 2), round(med["rejected"] / plain, 2),
                round(med["accepted"] / plain, 2), round(step, 2), round(2 / step, 2),
            )
        )  # fmt: skip
    return rows
