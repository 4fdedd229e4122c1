"""What the benchmarks share: printing rows as a table or JSON, timers, a one-stage MTP runner to time parts
of a step directly, a one-stage runner with a greedy decoder (bench formats and its peer), and random prompts (prompts from held-out code are prompts.py's)."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch


def print_rows(rows: list, output: str, headers: dict[str, str] | None = None) -> None:
    """Rows of one dataclass as JSON, or as a table with `headers` (field -> column title; all fields if None)."""
    dicts = [asdict(r) for r in rows]
    if output == "json":
        print(json.dumps(dicts))
        return
    if not dicts:
        return
    headers = headers or {k: k for k in dicts[0]}
    cells = [[_cell(d[k]) for k in headers] for d in dicts]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers.values())]
    print("  ".join(h.rjust(w) for h, w in zip(headers.values(), widths, strict=True)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths, strict=True)))


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def timed(fn, *args, **kwargs) -> tuple[float, object]:
    """(wall-clock seconds of fn(*args, **kwargs), its result)."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result


def median_timer(device: torch.device):
    """fn, repeats -> median seconds per call (CUDA: timed with events after a synchronize)."""

    def median_s(fn, repeats: int) -> float:
        if device.type == "cuda":  # pragma: no cover - needs a GPU
            torch.cuda.synchronize(device)
            times = []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1000)
            return statistics.median(times)
        return statistics.median(timed(fn)[0] for _ in range(repeats))

    return median_s


def mtp_runner(
    model: str, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int, dtype: str = "auto", k: int = 1,
    **inputs: str,
):  # fmt: skip
    """A one-stage runner of `model` with the MTP drafter (`k` drafts), for timing its parts directly (`inputs`:
    EngineConfig's fp4_inputs / fp8_inputs)."""
    from leanserve.engine.config import EngineConfig
    from leanserve.engine.llm_engine import check_speculative, resolve_dtype
    from leanserve.engine.runner import StageRunner
    from leanserve.engine.topology import PipelineTopology
    from leanserve.model.config import ModelConfig

    cfg = ModelConfig.from_hf(model)
    config = EngineConfig(
        model, max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        speculative_config={"method": "mtp", "num_speculative_tokens": k}, **inputs,
    )  # fmt: skip
    check_speculative(config.speculative_config, cfg, model)
    return StageRunner(
        cfg, config, PipelineTopology.build(cfg, 1).layout(0), resolve_dtype(dtype, model),
        config.resolved_max_model_len(cfg), progress=False,
    )  # fmt: skip


def prefill(runner, batch: int, prompt_len: int, next_tokens: tuple[int, ...] = (), prompts=None) -> None:
    """Writes one `prompt_len`-token prompt into each of the runner's slots 0..batch-1: no sampling, no proposal.
    `prompts`: each slot's token ids; by default tokens 3 .. 3 + prompt_len in every slot."""
    from leanserve.engine.runner import StepPlan
    from leanserve.model.batch import Chunk

    rows = prompts if prompts is not None else [range(3, 3 + prompt_len)] * batch
    chunks = tuple(Chunk(s, 0, tuple(rows[s][:prompt_len])) for s in range(batch))
    runner.execute(StepPlan(chunks, (), (), next_tokens), propose=False)


def varied_prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """Each slot's prompt and first token (prompt_len + 1 ids): slot 0 tokens 3 .. 3 + prompt_len and then 5 (the
    prompt bench/peer.py gives llama.cpp too), the others seeded random ids. So a batch's sequences differ and
    their tokens route to different experts, as a server's requests do; the same prompt in every slot would send
    every token of a step to the same experts."""
    others = random_prompts(batch, prompt_len + 1, vocab, 1).tolist()
    return [list(range(3, 3 + prompt_len)) + [5]] + others[1:batch]


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """[batch, length] token ids from a fixed seed, past the special tokens (ids 0-2)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=gen)


def stage_runner(
    model_dir: Path, max_seqs: int, max_len: int, fp4_inputs: str = "float32", fp8_inputs: str = "float32"
):
    """A one-stage runner of a checkpoint as stored (dtype auto), for `max_seqs` sequences of up to `max_len`
    (`fp4_inputs`, `fp8_inputs`: EngineConfig's)."""
    from leanserve.engine.config import EngineConfig
    from leanserve.engine.llm_engine import resolve_dtype
    from leanserve.engine.runner import StageRunner
    from leanserve.engine.topology import PipelineTopology
    from leanserve.model.config import ModelConfig

    cfg = ModelConfig.from_hf(model_dir)
    config = EngineConfig(
        str(model_dir), max_model_len=max_len, max_num_seqs=max_seqs, max_num_batched_tokens=max_len,
        fp4_inputs=fp4_inputs, fp8_inputs=fp8_inputs,
    )  # fmt: skip
    dtype = resolve_dtype("auto", str(model_dir))
    return StageRunner(cfg, config, PipelineTopology.build(cfg, 1).layout(0), dtype, max_len, progress=False)


class GreedyDecoder:
    """Greedy decode of `batch` sequences on a runner, one step per call (each sampled token fed back), from the
    prompts varied_prompts gives."""

    def __init__(self, runner, batch: int, prompt_len: int) -> None:
        prompts = varied_prompts(batch, prompt_len, runner.cfg.vocab_size)
        prefill(runner, batch, prompt_len, prompts=prompts)
        self.runner, self.batch, self.position, self.steps = runner, batch, prompt_len, 0
        self.tokens = [p[prompt_len] for p in prompts]

    def __call__(self) -> float:
        from leanserve.engine.runner import SampleSpec, StepPlan
        from leanserve.model.batch import Chunk
        from leanserve.sampling_params import SamplingParams

        greedy = SamplingParams(temperature=0.0, max_tokens=1 << 20)
        chunks = tuple(Chunk(s, self.position, (self.tokens[s],)) for s in range(self.batch))
        samples = tuple(SampleSpec(s, greedy, 0, self.steps, s) for s in range(self.batch))
        start = time.perf_counter()
        outs = self.runner.execute(StepPlan(chunks, tuple(range(self.batch)), samples), propose=False)
        seconds = time.perf_counter() - start
        self.tokens = [outs[s].tokens[-1].token_id for s in range(self.batch)]
        self.position += 1
        self.steps += 1
        return seconds
