"""`leanserve bench spec-cost`: what the parts of an MTP speculative step (one draft, and two) cost, in plain
decode steps, on the same caches; the speed-up ceilings that bound MTP k = 1 and k = 2, and the acceptance each
needs for 1.5x; and the two ceilings an engine bound by memory would have (`byte_ceilings`)."""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass

from leanserve.bench.common import mtp_runner, prefill, print_rows, random_prompts, timed
from leanserve.bench.options import add_inputs, add_output, add_threads, inputs_of, int_list

TARGET = 1.5  # the speed-up the acceptance columns are for


@dataclass
class SpecCostRow:
    batch_size: int
    plain_ms: float  # a plain decode step: the trunk over one token per sequence, the head, sampling
    verify: float  # the trunk over two tokens per sequence (the token and its draft) and verification, x plain
    propose_rejected: float  # the MTP layer's proposal after a rejected draft (over one position), x plain
    propose_accepted: float  # ... after an accepted draft (over two positions), x plain
    step_all_accepted: float  # verify + propose_accepted: a speculative step when every draft is accepted
    ceiling: float  # 2 / step_all_accepted: the speed-up of k = 1 if every draft were accepted
    # Two drafts: the trunk over three tokens per sequence, and the MTP layer's two drafts after both were
    # accepted (over three positions, then one more), x plain; 3 / their sum bounds k = 2.
    verify2: float
    propose2: float
    ceiling2: float
    # The acceptance of each draft a step needs for TARGET x at the all-accepted cost (a proposal after a
    # rejection costs about the same): k = 1 yields 1 + a tokens a step, k = 2 about 1 + a + a^2. Above 1:
    # out of reach at any acceptance.
    need_k1: float
    need_k2: float
    # The two ceilings if every part of a step cost the weight bytes it reads (byte_ceilings): what an engine
    # bound by memory could reach at best with this model and batch, whatever its kernels.
    bytes_ceiling: float
    bytes_ceiling2: float
    # Each part's byte price (byte_prices), x plain: a part bound by memory costs about its price.
    verify_bytes: float
    accepted_bytes: float
    verify2_bytes: float
    propose2_bytes: float


SPEC_COST_HEADERS = {
    "batch_size": "batch",
    "plain_ms": "plain step ms",
    "verify": "verify (x plain)",
    "propose_rejected": "MTP after reject",
    "propose_accepted": "MTP after accept",
    "step_all_accepted": "k=1 step, all accepted",
    "ceiling": "k=1 ceiling",
    "verify2": "verify 2 drafts",
    "propose2": "MTP 2 drafts",
    "ceiling2": "k=2 ceiling",
    "need_k1": f"k=1 acceptance for {TARGET}x",
    "need_k2": f"k=2 acceptance for {TARGET}x",
    "bytes_ceiling": "k=1 ceiling, bytes",
    "bytes_ceiling2": "k=2 ceiling, bytes",
    "verify_bytes": "verify, bytes",
    "accepted_bytes": "MTP after accept, bytes",
    "verify2_bytes": "verify 2, bytes",
    "propose2_bytes": "MTP 2 drafts, bytes",
}


def needed_acceptance(step_cost: float, drafts: int, target: float = TARGET) -> float:
    """The acceptance a of each draft for which a step of `step_cost` plain steps, yielding 1 + a + ... + a^drafts
    tokens, runs `target` times as fast as plain decoding (1 and 2 drafts)."""
    tokens = target * step_cost
    if drafts == 1:
        return tokens - 1
    return (-1 + math.sqrt(max(0.0, 4 * tokens - 3))) / 2  # a^2 + a + 1 = tokens


def byte_prices(cfg, batch: int) -> dict[str, float]:
    """What each part of a step would cost, in plain steps, if it cost the weight bytes it reads (engine/costs.py,
    as the checkpoint stores them), for `batch` sequences: "verify" and "verify2", the trunk over 2 and 3 tokens a
    sequence (more of each layer's routed experts); "accepted", the MTP layer over the two positions it catches up
    on; "two", over three positions and once more for the second draft; each MTP pass with the whole shared head,
    and the routed experts of one position a sequence (the one it drafts from: the others only go through its
    attention, torch_math.blocks.mtp)."""
    from leanserve.engine.costs import token_read_bytes

    reads = {n: token_read_bytes(cfg, n, with_mtp=True) for n in (batch, 2 * batch, 3 * batch)}  # (one model each)

    def trunk(tokens: int) -> float:
        return sum(b for n, b in reads[tokens].items() if not n.startswith("mtp."))

    def mtp(positions: int) -> float:
        read, drafting = reads[positions * batch], reads[batch]
        layer = sum((drafting if ".experts." in n else read)[n] for n in read if n.startswith("mtp."))
        return layer + read["head.weight"] + read["embed.weight"]

    plain = trunk(batch)
    return {
        "verify": trunk(2 * batch) / plain,
        "accepted": mtp(2) / plain,
        "verify2": trunk(3 * batch) / plain,
        "two": (mtp(3) + mtp(1)) / plain,
    }


def byte_ceilings(cfg, batch: int) -> tuple[float, float]:
    """The k = 1 and k = 2 ceilings of `batch` sequences if each part of a step cost the weight bytes it reads
    (byte_prices): what an engine bound by memory could reach at best, whatever its kernels."""
    return ceilings(byte_prices(cfg, batch))


def ceilings(prices: dict[str, float]) -> tuple[float, float]:
    """The k = 1 and k = 2 ceilings of steps whose parts cost `prices` (byte_prices' keys), in plain steps."""
    return 2 / (prices["verify"] + prices["accepted"]), 3 / (prices["verify2"] + prices["two"])


def spec_cost_bench(
    model: str,
    batch_sizes: list[int],
    repeats: int = 50,
    prompt_len: int = 32,
    dtype: str = "float32",
    inputs: dict[str, str] | None = None,
) -> list[SpecCostRow]:
    """Times the parts of MTP speculative steps against a plain decode step on the same caches, interleaved at the
    same positions (each arm rewrites the last one's: a rollback), medians over `repeats`. A step with k drafts
    yields at most k + 1 tokens, so (k + 1) / (its cost in plain steps) bounds MTP k's speed-up. The tokens are
    varied (seeded), as in text: a token and its drafts route to different experts, which is what verifying costs.
    `inputs`: EngineConfig's fp4_inputs / fp8_inputs."""
    from leanserve.engine.proposers import ProposeItem
    from leanserve.engine.runner import SampleSpec, StepPlan
    from leanserve.model.batch import Chunk
    from leanserve.sampling_params import SamplingParams

    most = max(batch_sizes)
    runner = mtp_runner(
        model, most, prompt_len + repeats + 8, max(2048, most * prompt_len), dtype, k=2, **(inputs or {})
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=1 << 20)
    rows = []
    ids = random_prompts(most, repeats + 8, runner.cfg.vocab_size, 0).tolist()  # ids[slot][round + i]
    for batch in batch_sizes:
        prefill(runner, batch, prompt_len, tuple(ids[s][0] for s in range(batch)))

        def trunk(position: int, drafts: int, batch: int = batch) -> float:
            # The trunk alone (the proposal is timed apart); the verify arms keep their streams for the proposals.
            r = position - prompt_len
            chunks = tuple(Chunk(s, position, tuple(ids[s][r : r + 1 + drafts])) for s in range(batch))
            samples = tuple(SampleSpec(s, greedy, 0, 0, s, tuple(ids[s][r + 1 : r + 1 + drafts])) for s in range(batch))
            plan = StepPlan(chunks, tuple(range(batch * (1 + drafts))), samples, (-1,) * batch)
            return timed(runner.execute, plan, propose=False, capture_hidden=bool(drafts))[0]

        def propose(position: int, fed: int, accepted: int, drafts: int, batch: int = batch) -> float:
            # After a verify step of `fed` tokens a sequence at `position`, `accepted` drafts of it accepted: catch
            # up over the committed positions, then draft `drafts` tokens.
            r = position - prompt_len
            known = 2 + accepted  # the fed tokens now committed, and the one the step sampled
            items = [
                ProposeItem(s, position, tuple(ids[s][r : r + known]), fed * s, s, greedy, 1, drafts)
                for s in range(batch)
            ]
            return timed(runner.proposer.propose, items, dict.fromkeys(range(batch), 0))[0]

        times: dict[str, list[float]] = {k: [] for k in ("plain", "verify", "rejected", "accepted", "verify2", "two")}
        for r in range(repeats + 2):
            position = prompt_len + r
            for name, drafts in (("plain", 0), ("verify", 1)) if r % 2 else (("verify", 1), ("plain", 0)):
                times[name].append(trunk(position, drafts))
            # the proposals read the verify step's streams (any order of the two)
            for name in ("rejected", "accepted") if r % 2 else ("accepted", "rejected"):
                times[name].append(propose(position, 2, int(name == "accepted"), 1))
            times["verify2"].append(trunk(position, 2))
            times["two"].append(propose(position, 3, 2, 2))
        med = {k: statistics.median(v[2:]) for k, v in times.items()}  # (the first two rounds warm up)
        plain = med.pop("plain")
        x = {k: v / plain for k, v in med.items()}  # in plain steps
        step, step2 = x["verify"] + x["accepted"], x["verify2"] + x["two"]
        prices = byte_prices(runner.cfg, batch)
        rows.append(
            SpecCostRow(
                batch, round(plain * 1e3, 3), round(x["verify"], 2), round(x["rejected"], 2), round(x["accepted"], 2),
                round(step, 2), round(2 / step, 2), round(x["verify2"], 2), round(x["two"], 2), round(3 / step2, 2),
                round(needed_acceptance(step, 1), 2), round(needed_acceptance(step2, 2), 2),
                *[round(c, 2) for c in ceilings(prices)],
                *[round(v, 2) for v in prices.values()],
            )
        )  # fmt: skip
    return rows


HELP = "what a one-token MTP speculative step costs in plain decode steps, and its ceiling"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a model directory with MTP weights")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 8])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                   help="auto: the checkpoint's own (a published one's)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=50)
    add_inputs(p, "in every part timed")
    add_threads(p)
    add_output(p)


def run(args: argparse.Namespace) -> int:
    rows = spec_cost_bench(args.model, args.batch_sizes, args.repeats, dtype=args.dtype, inputs=inputs_of(args))
    print_rows(rows, args.output, SPEC_COST_HEADERS)
    return 0
