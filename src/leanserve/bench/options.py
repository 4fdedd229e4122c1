"""The command-line options the benchmarks share, and the checks `leanserve bench NAME` makes before any of them
runs. Each benchmark module declares its own options (`add_arguments`) and runs from them (`run`)."""

from __future__ import annotations

import argparse

from leanserve.model.quant import FP8_INPUTS, INPUTS

SHIPPED_MODEL = "models/dsv4-stdlib-12l"  # the shipped model, from the repo root


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated integers (spaces ignored), e.g. 1,8,32."""
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_threads(p: argparse.ArgumentParser, help: str | None = None) -> None:
    p.add_argument("--threads", type=int, default=None, help=help)


FLOAT32_INPUTS = {"fp4_inputs": "float32", "fp8_inputs": "float32"}  # (EngineConfig's defaults)


def add_inputs(p: argparse.ArgumentParser, what: str) -> None:
    """--fp4-inputs / --fp8-inputs (EngineConfig's), for `what` (the help's end)."""
    for fmt, weights, names in (("fp4", "FP4 experts", list(INPUTS)), ("fp8", "FP8 weights", list(FP8_INPUTS))):
        p.add_argument(
            f"--{fmt}-inputs", default="float32", choices=names,
            help=f"the published checkpoint's {weights} meet their inputs rounded to this ({what})",
        )  # fmt: skip


def inputs_of(args: argparse.Namespace) -> dict[str, str]:
    """The engine's fp4_inputs / fp8_inputs from add_inputs' options."""
    return {name: getattr(args, name) for name in FLOAT32_INPUTS}


def add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", default="table", choices=["table", "json"])


def require_positive(args: argparse.Namespace, *names: str) -> None:
    """ValueError naming the first of these options that is not positive."""
    for name in names:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive.")


def prepare(args: argparse.Namespace) -> None:
    """Sets --threads (where the benchmark has it) and checks the options every benchmark shares: batch sizes,
    token counts and concurrency levels, --repeats and --requests must be positive."""
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    sizes = getattr(args, "batch_sizes", None) or getattr(args, "tokens", None) or getattr(args, "concurrency", None)
    if min(sizes or [1]) < 1 or getattr(args, "repeats", 1) < 1 or getattr(args, "requests", 1) < 1:
        raise ValueError("batch sizes / token counts / concurrency levels, --repeats and --requests must be positive.")
