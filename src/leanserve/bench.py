"""`leanserve bench throughput`: offline output tokens/s of leanserve and of transformers' `generate` on the
same checkpoint, prompts and greedy workload, side by side in one run, with the ratio.

Each batch size runs both engines on identical prompts (equal length, so transformers needs no padding),
alternating which goes first over `--repeats` rounds; the median round is reported. Greedy tokens of the two
engines are compared as a check that the work is the same.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch


@dataclass
class ThroughputRow:
    batch_size: int
    leanserve_tok_s: float
    transformers_tok_s: float
    speedup: float
    identical_sequences: int


def _prompts(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=gen)


def throughput(
    model: str,
    batch_sizes: list[int],
    prompt_len: int = 64,
    max_tokens: int = 32,
    dtype: str = "float32",
    repeats: int = 3,
    seed: int = 0,
) -> list[ThroughputRow]:
    try:
        from transformers import DeepseekV4ForCausalLM
    except ImportError:
        raise ValueError("bench throughput needs transformers (pip install 'transformers>=5.24').") from None
    from leanserve import LLM, SamplingParams

    torch_dtype = getattr(torch, dtype)
    hf = DeepseekV4ForCausalLM.from_pretrained(model, dtype=torch_dtype).eval()
    hf.generation_config.eos_token_id = None  # both engines generate exactly max_tokens
    llm = LLM(
        model,
        dtype=dtype,
        max_model_len=prompt_len + max_tokens,
        max_num_seqs=max(batch_sizes),
        max_num_batched_tokens=max(2048, max(batch_sizes) * prompt_len),
        load_progress=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    vocab = llm.engine.model_config.vocab_size

    def run_hf(ids: torch.Tensor) -> tuple[float, list[list[int]]]:
        with torch.inference_mode():
            start = time.perf_counter()
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
            return time.perf_counter() - start, out[:, ids.shape[1] :].tolist()

    def run_lean(ids: torch.Tensor) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": row} for row in ids.tolist()], params)
        return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]

    warm = _prompts(1, prompt_len, vocab, seed + 999)
    run_hf(warm)
    run_lean(warm)
    rows = []
    for batch in batch_sizes:
        ids = _prompts(batch, prompt_len, vocab, seed + batch)
        lean_times, hf_times = [], []
        for r in range(repeats):
            order = (run_lean, run_hf) if r % 2 == 0 else (run_hf, run_lean)
            for fn in order:
                dt, tokens = fn(ids)
                (lean_times if fn is run_lean else hf_times).append(dt)
                if fn is run_lean:
                    lean_tokens = tokens
                else:
                    hf_tokens = tokens
        lean_tps = batch * max_tokens / statistics.median(lean_times)
        hf_tps = batch * max_tokens / statistics.median(hf_times)
        same = sum(a == b for a, b in zip(lean_tokens, hf_tokens, strict=True))
        rows.append(ThroughputRow(batch, round(lean_tps, 1), round(hf_tps, 1), round(lean_tps / hf_tps, 2), same))
    return rows


def print_rows(rows: list[ThroughputRow], output: str) -> None:
    if output == "json":
        print(json.dumps([asdict(r) for r in rows]))
        return
    print(f"{'batch':>5}  {'leanserve tok/s':>15}  {'transformers tok/s':>18}  {'speedup':>7}  {'same tokens':>11}")
    for r in rows:
        same = f"{r.identical_sequences}/{r.batch_size}"
        print(
            f"{r.batch_size:>5}  {r.leanserve_tok_s:>15.1f}  {r.transformers_tok_s:>18.1f}  "
            f"{r.speedup:>6.2f}x  {same:>11}"
        )
