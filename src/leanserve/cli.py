"""The `leanserve` command: generate | serve | memory | make-random | bench."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from leanserve.bench import formats, hidden_copy, kv, long, pp, prefix, spec, spec_cost, step, structured, throughput
from leanserve.bench import serve as bench_serve
from leanserve.bench.options import int_list, prepare
from leanserve.errors import EngineDied, StageFailure
from leanserve.model.quant import FP8_INPUTS, INPUTS


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-pp", "--pipeline-parallel-size", type=int, default=1, help="pipeline stages (processes); default 1"
    )
    p.add_argument(
        "--pipeline-layer-counts",
        type=int_list,
        default=None,
        help="layers per stage, e.g. 3,2,2 (default: balanced by the bytes each layer reads per step)",
    )
    p.add_argument(
        "--no-pipeline-overlap",
        dest="pipeline_overlap",
        action="store_false",
        help="with -pp N: one step at a time through the stages (default: N micro-batches in flight)",
    )
    p.add_argument(
        "--speculative-config", default=None, help='JSON, e.g. \'{"method": "mtp", "num_speculative_tokens": 1}\''
    )
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument(
        "--kv-cache-memory",
        default=None,
        help="bytes of paged cache per stage, e.g. 20GiB (default: what --max-num-seqs sequences of "
        "--max-model-len take, at most half the memory free at start-up)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="start a request after the longest prefix kept from earlier ones (default: on, off with a draft model)",
    )
    p.add_argument(
        "--kv-block-size",
        type=int,
        default=None,
        help="tokens per cache block, a multiple of the compression rates (default: 128, rounded up to one)",
    )
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "torch", "cpu"],
        help="the model's math: the CPU kernels (cpu) or torch everywhere (torch); auto: the kernels where they run",
    )
    p.add_argument(
        "--fp4-inputs",
        default="float32",
        choices=list(INPUTS),
        help="what a published checkpoint's FP4 experts multiply: the activations as they are, rounded to "
        "bfloat16 (faster with AVX512-BF16), or to 8 bits a block of 32 (faster with AVX2; docs/checkpoints.md)",
    )
    p.add_argument(
        "--fp8-inputs",
        default="float32",
        choices=list(FP8_INPUTS),
        help="the same for its FP8 weights (attention, shared experts)",
    )


def _generate_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model directory (HF format: config.json + safetensors)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs tokenizer.json in the model dir)")
    src.add_argument("--prompt-token-ids", type=int_list, help="prompt as comma-separated token ids")
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
    _add_engine_options(p)


def _serve_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port; the one used is printed)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    p.add_argument(
        "--chat-template", default=None, metavar="FILE",
        help="a Jinja chat template that overrides the model's chat format (default: DeepSeek-V4's own encoding "
        "when the tokenizer has its chat tokens, else the model's template, else 'role: content' lines)",
    )  # fmt: skip
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    _add_engine_options(p)


def _serve(args: argparse.Namespace) -> int:
    from leanserve import LLM
    from leanserve.server import serve

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be between 0 and 65535, got {args.port}.")
    if args.chat_template is not None and not Path(args.chat_template).is_file():
        raise ValueError(f"--chat-template {args.chat_template}: no such file.")
    llm = LLM(model=args.model, dtype=args.dtype, **_engine_kwargs(args))
    serve(llm, args.host, args.port, args.served_model_name, args.api_key, args.chat_template)
    return 0


def _memory_options(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model directory: starts the engine and reports what it allocated")
    src.add_argument(
        "--config",
        help="with --plan: deepseek-v4-flash, deepseek-v4-pro (shipped), or a config.json path / model directory",
    )
    p.add_argument(
        "--plan", action="store_true", help="compute the ledger on the meta device: no weights, nothing allocated"
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="activations, caches and unquantized weights (fp8 / fp4 weights stay as stored); --plan: bfloat16",
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--output", default="table", choices=["table", "json"])
    _add_engine_options(p)


def _make_random_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="output directory")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--force", action="store_true", help="overwrite an existing checkpoint in DIR")
    p.add_argument(
        "--format",
        default="hf",
        choices=["hf", "published"],
        help="hf: transformers' layout in --dtype; published: DeepSeek's (FP8 linears, FP4 or FP8 experts)",
    )
    p.add_argument("--expert-dtype", default="fp4", choices=["fp4", "fp8"], help="routed experts (--format published)")
    p.add_argument("--max-shard-size", default=None, help="shard the published weights, e.g. 500MB")
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="copy DIR's tokenizer (and generation_config.json); the vocabulary becomes the tokenizer's",
    )
    p.add_argument(
        "--chat-tokens", action="store_true", help="add DeepSeek-V4's chat tokens to it (see add-chat-tokens)"
    )


def _add_chat_tokens_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="the source checkpoint directory (with tokenizer.json)")
    p.add_argument("dst", help="the output directory")
    p.add_argument("--seed", type=int, default=0, help="seed of the new rows' random values")
    p.add_argument("--force", action="store_true", help="write into an existing DST")


def _prebuild_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jobs", type=int, default=None, help="processes at a time (default: one per core, at most 2)")


def _quantize_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="the source checkpoint directory")
    p.add_argument("dst", help="the output directory (new or empty)")
    p.add_argument("--expert-dtype", default="fp4", choices=["fp4", "fp8"], help="routed experts' format")
    p.add_argument("--max-shard-size", default=None, help="shard the weights, e.g. 500MB")
    p.add_argument("--force", action="store_true", help="write into a non-empty DST")


# `leanserve bench NAME`: each module declares its HELP line, its options (add_arguments) and runs (run).
BENCHMARKS = {
    "throughput": throughput,
    "copy": hidden_copy,
    "step": step,
    "spec-cost": spec_cost,
    "serve": bench_serve,
    "formats": formats,
    "pp": pp,
    "spec": spec,
    "structured": structured,
    "kv": kv,
    "prefix": prefix,
    "long": long,
}


def _bench_options(p: argparse.ArgumentParser) -> None:
    kinds = p.add_subparsers(dest="bench", required=True)
    for name, module in BENCHMARKS.items():
        module.add_arguments(kinds.add_parser(name, help=module.HELP))


def _bench(args: argparse.Namespace) -> int:
    prepare(args)
    return BENCHMARKS[args.bench].run(args)


def _engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = {
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "pipeline_layer_counts": args.pipeline_layer_counts,
        "pipeline_overlap": args.pipeline_overlap,
        "speculative_config": args.speculative_config,
        "max_model_len": args.max_model_len,
        "backend": args.backend,
        "fp4_inputs": args.fp4_inputs,
        "fp8_inputs": args.fp8_inputs,
    }
    for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "kv_block_size", "enable_prefix_caching"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    return kwargs


def _memory(args: argparse.Namespace) -> int:
    from leanserve.engine.kv_budget import format_kv_summary
    from leanserve.memory import format_table

    if args.plan:
        from leanserve.plan import plan_deployment

        source = args.config or args.model
        kwargs = _engine_kwargs(args)
        stages, cache = plan_deployment(source, dtype=args.dtype or "bfloat16", **kwargs)
    else:
        if args.config:
            raise ValueError("--config needs --plan (a config alone has no weights to load); use --model DIR.")
        from leanserve import LLM

        with LLM(model=args.model, dtype=args.dtype or "auto", load_progress=False, **_engine_kwargs(args)) as llm:
            stages, cache = llm.memory_ledger(), llm.engine.kv_summary()
    if args.output == "json":
        print(json.dumps({"stages": [s.to_dict() for s in stages], "kv_cache": cache}))
    else:
        print(format_table(stages))
        print(format_kv_summary(cache))
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
    kwargs = _engine_kwargs(args)
    kwargs.setdefault("max_num_seqs", 1)
    llm = LLM(model=args.model, dtype=args.dtype, **kwargs)
    prompt = args.prompt if args.prompt is not None else {"prompt_token_ids": args.prompt_token_ids}
    with llm:
        out = llm.generate(prompt, params)[0]
        spec = llm.spec_decode_metrics() if llm.engine.config.speculative_config is not None else None
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
        if spec is not None:
            result["spec_decode"] = spec
        print(json.dumps(result))
    else:
        print((out.prompt or "") + completion.text if llm.get_tokenizer() else completion.token_ids)
        print(
            f"[{len(out.prompt_token_ids)} prompt tokens, {num_out} generated, finish: {completion.finish_reason}; "
            f"prefill {timing['prefill_ms']} ms, decode {timing['decode_tokens_per_s']} tokens/s]",
            file=sys.stderr,
        )
        if spec is not None:
            per_position = ", ".join(str(n) for n in spec["accepted_per_position"])
            print(
                f"[speculative decoding: {spec['num_accepted_tokens']} of {spec['num_draft_tokens']} draft tokens "
                f"accepted ({100 * spec['acceptance_rate']:.1f}%) in {spec['num_drafts']} drafts; mean acceptance "
                f"length {spec['mean_acceptance_length']:.2f}; accepted per position: {per_position}]",
                file=sys.stderr,
            )
    return 0


def _make_random(args: argparse.Namespace) -> int:
    from leanserve.make_random import make_random

    for name in ("model.safetensors", "model.safetensors.index.json"):
        target = Path(args.dir) / name
        if target.exists() and not args.force:
            raise ValueError(f"{target} already exists; pass --force to overwrite it.")
    make_random(
        args.dir,
        preset=args.preset,
        seed=args.seed,
        dtype=args.dtype,
        format=args.format,
        expert_dtype=args.expert_dtype,
        max_shard_size=args.max_shard_size,
        tokenizer=args.tokenizer,
        chat_tokens=args.chat_tokens,
    )
    kind = f" (published format, {args.expert_dtype} experts)" if args.format == "published" else ""
    extra = f", with {args.tokenizer}'s tokenizer" if args.tokenizer else ""
    extra += " and DeepSeek-V4's chat tokens" if args.chat_tokens else ""
    print(f"wrote a random {args.preset} DeepSeek-V4 checkpoint{kind}{extra} to {args.dir}")
    return 0


def _add_chat_tokens(args: argparse.Namespace) -> int:
    from leanserve.chat_tokens import DSV4_CHAT_TOKENS, add_chat_tokens

    ids = add_chat_tokens(args.src, args.dst, seed=args.seed, force=args.force)
    print(f"wrote {args.src} with DeepSeek-V4's chat tokens to {args.dst}: ids {ids[0]}..{ids[-1]}")
    for token, token_id in zip(DSV4_CHAT_TOKENS, ids, strict=True):
        print(f"  {token_id}\t{token}")
    return 0


def _prebuild(args: argparse.Namespace) -> int:
    from leanserve.model.backends.cpu.kernels import available
    from leanserve.prebuild import GROUPS, prebuild

    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {args.jobs}.")
    if not available():
        print("numba is not installed: there are no CPU kernels to compile (the torch path runs)")
        return 0
    try:
        seconds = prebuild(args.jobs)
    except RuntimeError as e:
        print(f"leanserve: error: {e}", file=sys.stderr)
        return 1
    formats = ", ".join(f for group in GROUPS for f in group)
    print(f"the CPU kernels for {formats} weights are compiled ({seconds:.0f} s); later processes load them")
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from leanserve.quantize import quantize_checkpoint

    quantize_checkpoint(args.src, args.dst, args.expert_dtype, force=args.force, max_shard_size=args.max_shard_size)
    print(f"wrote {args.src} in the published format ({args.expert_dtype} experts) to {args.dst}")
    return 0


# name: (help line, add its options to its parser, run it from the parsed arguments)
COMMANDS = {
    "generate": ("complete one prompt and print the result with timing", _generate_options, _generate),
    "serve": ("the OpenAI-compatible server (completions, chat, streaming, /metrics)", _serve_options, _serve),
    "memory": ("the memory ledger per pipeline stage: weights and every persistent buffer", _memory_options, _memory),
    "make-random": ("write a random-weight DeepSeek-V4 checkpoint", _make_random_options, _make_random),
    "add-chat-tokens": (
        "copy a checkpoint with DeepSeek-V4's chat tokens added to its tokenizer, embedding and head",
        _add_chat_tokens_options,
        _add_chat_tokens,
    ),
    "quantize": ("write a bf16 / float32 checkpoint in the published FP8 / FP4 format", _quantize_options, _quantize),
    "prebuild": (
        "compile the CPU kernels for every weight format once, in parallel processes",
        _prebuild_options,
        _prebuild,
    ),
    "bench": ("benchmarks that compare side by side in one run", _bench_options, _bench),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="leanserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="engine log level"
    )
    for name, (help_line, add_options, _) in COMMANDS.items():
        add_options(sub.add_parser(name, help=help_line))
    args = parser.parse_args(argv)
    logging.basicConfig(format="leanserve: %(message)s", level=args.log_level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # (the benchmarks' clients: a line per request at INFO)
    try:
        return COMMANDS[args.command][2](args)
    except ValueError as e:  # user errors: config, checkpoint, prompt, sampling parameters
        print(f"leanserve: error: {e}", file=sys.stderr)
        return 2
    except (StageFailure, EngineDied) as e:  # the engine stopped: say why, exit non-zero
        print(f"leanserve: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
