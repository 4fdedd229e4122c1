"""The `leanserve` command: generate | make-random | bench."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete one prompt and print the result with timing")
    p.add_argument("--model", required=True, help="model directory (HF format: config.json + safetensors)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs tokenizer.json in the model dir)")
    src.add_argument("--prompt-token-ids", type=_int_list, help="prompt as comma-separated token ids")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None, help="also return the top-N logprobs per token")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--output", default="text", choices=["text", "json"])


def _add_make_random(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-random", help="write a random-weight DeepSeek-V4 checkpoint")
    p.add_argument("dir", help="output directory")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--force", action="store_true", help="overwrite an existing checkpoint in DIR")


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks that compare side by side in one run")
    kinds = p.add_subparsers(dest="bench", required=True)
    t = kinds.add_parser("throughput", help="offline tokens/s: leanserve vs transformers' generate")
    t.add_argument("--model", required=True)
    t.add_argument("--batch-sizes", type=_int_list, default=[1, 8, 32])
    t.add_argument("--prompt-len", type=int, default=64)
    t.add_argument("--max-tokens", type=int, default=32)
    t.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    t.add_argument("--repeats", type=int, default=3)
    t.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    t.add_argument("--output", default="table", choices=["table", "json"])


def _bench(args: argparse.Namespace) -> int:
    import torch

    from leanserve.bench import print_rows, throughput

    if args.threads:
        torch.set_num_threads(args.threads)
    if min(args.batch_sizes, default=0) < 1 or args.max_tokens < 1 or args.prompt_len < 1 or args.repeats < 1:
        raise ValueError("batch sizes, --prompt-len, --max-tokens and --repeats must be positive.")
    rows = throughput(args.model, args.batch_sizes, args.prompt_len, args.max_tokens, args.dtype, args.repeats)
    print_rows(rows, args.output)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from leanserve import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=1)
    prompt = args.prompt if args.prompt is not None else {"prompt_token_ids": args.prompt_token_ids}
    out = llm.generate(prompt, params)[0]
    completion, m = out.outputs[0], out.metrics
    num_out = len(completion.token_ids)
    decode_s = (m.finished_time or 0) - (m.first_token_time or 0)
    timing = {
        "prefill_ms": round(1000 * (m.time_to_first_token or 0.0), 2),
        "decode_tokens_per_s": round((num_out - 1) / decode_s, 2) if num_out > 1 and decode_s > 0 else None,
        "total_s": round((m.finished_time or 0) - m.arrival_time, 4),
    }
    if args.output == "json":
        result = {
            "prompt_token_ids": out.prompt_token_ids,
            "token_ids": completion.token_ids,
            "text": completion.text,
            "finish_reason": completion.finish_reason,
            "timing": timing,
        }
        if completion.logprobs is not None:
            result["logprobs"] = [{str(t): lp.logprob for t, lp in step.items()} for step in completion.logprobs]
        print(json.dumps(result))
    else:
        print((out.prompt or "") + completion.text if llm.get_tokenizer() else completion.token_ids)
        print(
            f"[{len(out.prompt_token_ids)} prompt tokens, {num_out} generated, finish: {completion.finish_reason}; "
            f"prefill {timing['prefill_ms']} ms, decode {timing['decode_tokens_per_s']} tokens/s]",
            file=sys.stderr,
        )
    return 0


def _make_random(args: argparse.Namespace) -> int:
    from leanserve.make_random import make_random

    target = Path(args.dir) / "model.safetensors"
    if target.exists() and not args.force:
        raise ValueError(f"{target} already exists; pass --force to overwrite it.")
    make_random(args.dir, preset=args.preset, seed=args.seed, dtype=args.dtype)
    print(f"wrote a random {args.preset} DeepSeek-V4 checkpoint to {args.dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="leanserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_make_random(sub)
    _add_bench(sub)
    args = parser.parse_args(argv)
    handlers = {"generate": _generate, "make-random": _make_random, "bench": _bench}
    try:
        return handlers[args.command](args)
    except ValueError as e:  # user errors: config, checkpoint, prompt, sampling parameters
        print(f"leanserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
