"""What the stages after training share (MTP self-distillation, the repetition fine-tune): the model directory
they read, checked before any work, and the directory they write, assembled beside the output and moved into
place only when complete, so an output that is also the input is never left half-written."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from leanserve.model.config import ConfigError

SUMMARY = "train_summary.json"


def check_model_dir(src: Path, why_tokenizer: str) -> None:
    """Refuses a directory without a model's config, weights or tokenizer (a ConfigError naming what is missing)."""
    if not (src / "config.json").is_file() or not (src / "model.safetensors").is_file():
        raise ConfigError(f"{src} is not a model directory (config.json and model.safetensors are needed).")
    if not (src / "tokenizer.json").is_file():
        raise ConfigError(f"{src} has no tokenizer.json; {why_tokenizer}")


@contextmanager
def staged_output(src: Path, out: Path) -> Iterator[Path]:
    """A scratch directory beside `out` holding the source's files except its weights and config (the caller
    writes those); when the block ends without an error its files replace those of `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as scratch:
        tmp = Path(scratch)
        for f in src.iterdir():
            if f.is_file() and f.name not in ("model.safetensors", "config.json"):
                shutil.copy2(f, tmp / f.name)
        yield tmp
        out.mkdir(exist_ok=True)
        for f in tmp.iterdir():
            os.replace(f, out / f.name)


def learn_only(model, learns: Callable[[str], bool]) -> list:
    """Turns gradients on for the parameters whose names `learns` accepts, off for the others; returns those."""
    params = []
    for name, p in model.named_parameters():
        p.requires_grad_(learns(name))
        if learns(name):
            params.append(p)
    return params


def finish_stage(
    tmp: Path,
    out: Path,
    key: str,
    record: dict[str, Any],
    log_name: str,
    log_records: list[dict[str, Any]],
    measure: Callable[[Path], dict[str, Any]] | None,
    log: Callable[[str], None],
    argv: list[str] | None,
) -> dict[str, Any]:
    """Writes the stage's per-step log, its held-out figures after (`measure(tmp)`, when given: the figures of the
    model as `out` will hold it) and its record under `key` of the summary (whose "heldout" becomes the figures
    after); returns the record."""
    from train.evaluate import format_eval

    (tmp / log_name).write_text("".join(json.dumps(r) + "\n" for r in log_records))
    after = None
    if measure is not None:
        after = measure(tmp)
        after["model"] = str(out)
        log("after: " + format_eval(after))
    record["heldout_after"] = after
    if argv is not None:
        record["argv"] = list(argv)
    summary_path = tmp / SUMMARY
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    summary[key] = record
    if after is not None:
        summary["heldout"] = after
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    return record


# --- the command lines (scripts/distill_mtp.py, scripts/unlikelihood.py) -----------------------------------------
def add_stage_arguments(p, d, model_help: str) -> None:
    """The options every stage takes, with the defaults of its config `d`; the stage adds its own."""
    from train.data import CORPUS_HELP

    p.add_argument("--model", required=True, help=model_help)
    p.add_argument("--out", required=True, help="output model directory (may be --model itself)")
    p.add_argument("--corpus", default=None, help=CORPUS_HELP)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="training windows per step")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--no-compile", action="store_true", help="run mHC eagerly instead of through torch.compile")
    p.add_argument("--eval-tokens", type=int, default=d.eval_tokens, help="held-out tokens evaluated before/after")
    p.add_argument("--no-progress", action="store_true")


def stage_main(p, config_cls, prepare: Callable, run: Callable, argv: list[str] | None) -> int:
    """Parses the command line into `config_cls` (its fields by option name), refuses bad input before any work
    (exit 2, one line naming the problem), runs the stage and prints its record."""
    import dataclasses
    import sys

    args = p.parse_args(argv)
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls) if hasattr(args, f.name)}
    config = config_cls(**values, compile=not args.no_compile, progress=not args.no_progress)
    try:
        prepared = prepare(config)
    except (ValueError, OSError) as e:  # ConfigError and CorpusError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    recorded = sys.argv[1:] if argv is None else list(argv)
    record = run(config, log=lambda m: print(m, file=sys.stderr, flush=True), argv=recorded, prepared=prepared)
    print(json.dumps({k: v for k, v in record.items() if k != "config"}, indent=2))
    return 0
