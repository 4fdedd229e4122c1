"""`leanserve bench throughput`: offline output tokens/s of leanserve and of transformers' `generate` on the
same checkpoint, prompts and greedy workload, side by side in one run, with the ratio.

Each batch size runs both engines on identical prompts (equal length, so transformers needs no padding),
alternating which goes first over `--repeats` rounds; the median round is reported. Greedy tokens of the two
engines are compared as a check that the work is the same.

Each dtype loads both engines in it. In bfloat16, transformers rounds every activation to bfloat16, while
leanserve on the CPU keeps the weights in bfloat16 and computes in float32 (deepseek_v4.activation_dtype):
its tokens are then its float32 tokens, and may differ from transformers' bfloat16 ones.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

import torch

from leanserve.bench.common import print_rows, random_prompts, timed
from leanserve.bench.options import add_output, add_threads, int_list


@dataclass
class ThroughputRow:
    dtype: str
    batch_size: int
    leanserve_tok_s: float
    transformers_tok_s: float
    speedup: float
    identical_sequences: int


THROUGHPUT_HEADERS = {
    "dtype": "dtype",
    "batch_size": "batch",
    "leanserve_tok_s": "leanserve tok/s",
    "transformers_tok_s": "transformers tok/s",
    "speedup": "speedup",
    "identical_sequences": "same tokens",
}


def throughput(
    model: str,
    batch_sizes: list[int],
    prompt_len: int = 64,
    max_tokens: int = 32,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    repeats: int = 3,
    seed: int = 0,
) -> list[ThroughputRow]:
    try:
        from transformers import DeepseekV4ForCausalLM  # noqa: F401
    except ImportError:
        raise ValueError("bench throughput needs transformers (pip install 'transformers>=5.24').") from None
    rows = []
    for dtype in dtypes:
        rows += _throughput(model, batch_sizes, prompt_len, max_tokens, dtype, repeats, seed)
    return rows


def _throughput(
    model: str, batch_sizes: list[int], prompt_len: int, max_tokens: int, dtype: str, repeats: int, seed: int
) -> list[ThroughputRow]:
    from transformers import DeepseekV4ForCausalLM

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
            mask = torch.ones_like(ids)
            dt, out = timed(hf.generate, ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False)
            return dt, out[:, ids.shape[1] :].tolist()

    def run_lean(ids: torch.Tensor) -> tuple[float, list[list[int]]]:
        dt, outs = timed(llm.generate, [{"prompt_token_ids": row} for row in ids.tolist()], params)
        return dt, [o.outputs[0].token_ids for o in outs]

    warm = random_prompts(1, prompt_len, vocab, seed + 999)
    run_hf(warm)
    run_lean(warm)
    rows = []
    for batch in batch_sizes:
        ids = random_prompts(batch, prompt_len, vocab, seed + batch)
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
        speedup = round(lean_tps / hf_tps, 2)
        rows.append(ThroughputRow(dtype, batch, round(lean_tps, 1), round(hf_tps, 1), speedup, same))
    llm.shutdown()
    return rows


HELP = "offline tokens/s: leanserve vs transformers' generate"


def dtype_list(text: str) -> list[str]:
    """An argparse type: comma-separated dtypes from float32, bfloat16."""
    names = [t for t in text.replace(" ", "").split(",") if t]
    bad = [n for n in names if n not in ("float32", "bfloat16")]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated dtypes from float32, bfloat16; got {text!r}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--batch-sizes", type=int_list, default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--dtype", type=dtype_list, default=["float32", "bfloat16"], help="comma-separated: float32, bfloat16"
    )
    p.add_argument("--repeats", type=int, default=3)
    add_threads(p, "torch threads (default: torch's own choice)")
    add_output(p)


def run(args: argparse.Namespace) -> int:
    if args.max_tokens < 1 or args.prompt_len < 1:
        raise ValueError("--prompt-len and --max-tokens must be positive.")
    rows = throughput(args.model, args.batch_sizes, args.prompt_len, args.max_tokens, tuple(args.dtype), args.repeats)
    print_rows(rows, args.output, THROUGHPUT_HEADERS)
    return 0
