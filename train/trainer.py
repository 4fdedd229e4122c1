"""Training a small DeepSeek-V4-architecture model and its MTP layer, jointly, DeepSeek-style (the math is in
`train.forward`): the run's configuration, the learning-rate schedule, the optimizer, the loop that
writes the model directory, and `train_main` (scripts/train_small.py).

Every step: AdamW on  CE(trunk, t+1) + w_mtp * CE(MTP, t+2) + w_indexer * indexer KL,  then the routers'
auxiliary-loss-free bias update. The model directory is saved every few minutes and at the end, and the
held-out figures (`train.evaluate`) are computed through leanserve's inference path.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from leanserve.model.deepseek_v4 import DeepseekV4
from train import data as data_mod
from train.architecture import check_trainable, model_config, new_model
from train.evaluate import evaluate, format_eval
from train.forward import balance_routers_, check_parity, compute_losses, make_ctx


# --- the training run -----------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    out: str
    corpus: str | None = None  # None: the running interpreter's standard library
    seed: int = 0
    steps: int | None = None  # exactly this many steps (deterministic) ...
    minutes: float | None = None  # ... or a wall-clock budget (LR schedule follows elapsed time)
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    w_mtp: float = 0.3
    w_indexer: float = 1.0
    balance_gamma: float = 1e-3
    threads: int = 2
    compile: bool = True  # mHC through torch.compile (forward.compiled_mhc; eager where it cannot compile)
    vocab_size: int = 4096
    save_every_minutes: float = 10.0
    eval_tokens: int = 32768  # after training: held-out figures through leanserve's inference path (0: skip)
    progress: bool = True
    model: dict[str, Any] = field(default_factory=dict)  # ModelConfig overrides of DEFAULT_MODEL

    def validate(self) -> None:
        if (self.steps is None) == (self.minutes is None):
            raise ValueError("Give exactly one of steps or minutes.")
        if self.steps is not None and (
            isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1
        ):
            raise ValueError(f"steps must be a positive integer, got {self.steps!r}.")
        if self.minutes is not None and not (self.minutes > 0 and math.isfinite(self.minutes)):
            raise ValueError(f"minutes must be a positive number, got {self.minutes!r}.")
        check_fields(
            self,
            positive_ints=("batch_size", "seq_len", "threads", "vocab_size"),
            positive=("lr",),
            non_negative=("w_mtp", "w_indexer", "weight_decay", "balance_gamma", "grad_clip", "warmup_steps"),
            fractions=("min_lr_ratio",),
        )


def check_fields(obj, positive_ints=(), positive=(), non_negative=(), fractions=()) -> None:
    """Refuses a run's setting out of its range, naming it (a ValueError)."""
    for name in positive_ints:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    for name in positive:
        value = getattr(obj, name)
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive number, got {value!r}.")
    for name in non_negative:
        value = getattr(obj, name)
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be >= 0, got {value!r}.")
    for name in fractions:
        value = getattr(obj, name)
        if not 0 <= value <= 1:
            raise ValueError(f"{name} must be in [0, 1], got {value!r}.")


def lr_at(tc: TrainConfig, step: int, progress: float) -> float:
    """Linear warm-up over warmup_steps, then cosine from lr down to lr * min_lr_ratio as progress goes 0 -> 1."""
    warm = min(1.0, (step + 1) / tc.warmup_steps) if tc.warmup_steps else 1.0
    cosine = 0.5 * (1 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    return tc.lr * warm * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * cosine)


def _optimizer(model: DeepseekV4, tc: TrainConfig) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        leaf = name.rsplit(".", 1)[-1]
        matrix = p.dim() >= 2 and not leaf.startswith("hc_") and leaf not in ("ape", "tid2eid")
        (decay if matrix else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(0.9, 0.95), eps=1e-8)


def prepare(tc: TrainConfig):
    """Everything that can refuse the run, before any training: arguments, corpus, model config."""
    tc.validate()
    corpus = data_mod.load_corpus(tc.corpus)
    cfg = model_config(**{"vocab_size": tc.vocab_size, **tc.model})
    check_trainable(cfg, tc.seq_len)
    return corpus, cfg


def train(tc: TrainConfig, log=print, argv: list[str] | None = None, prepared=None) -> dict[str, Any]:
    """Trains, writes the model directory (config.json, model.safetensors with mtp.0.*, tokenizer.json,
    generation_config.json, train_log.jsonl, train_summary.json) and returns the summary. `argv`: the command
    line's arguments, recorded in the summary (train_main passes them). `prepared`: what `prepare(tc)` already
    returned, so the corpus is not read twice."""
    from tqdm import tqdm

    from leanserve.model.loader import save_checkpoint

    corpus, cfg = prepared or prepare(tc)
    torch.set_num_threads(tc.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(tc.threads))  # the tokenizers library's thread pool
    torch.manual_seed(tc.seed)
    out = Path(tc.out)
    out.mkdir(parents=True, exist_ok=True)
    log(f"corpus: {corpus.summary()}")

    t0 = time.perf_counter()
    tok = train_tokenizer_for(corpus, tc.vocab_size)
    stream = data_mod.encode_documents(tok, corpus.train, seed=tc.seed)
    data_mod.save_tokenizer_files(tok, out)
    heldout_tokens = data_mod.encode_documents(tok, corpus.heldout).numel()
    log(
        f"tokenizer: {tok.get_vocab_size()} tokens, train stream {stream.numel() / 1e6:.2f}M tokens "
        f"({sum(len(d.text) for d in corpus.train) / max(stream.numel(), 1):.2f} chars/token), "
        f"{time.perf_counter() - t0:.0f}s"
    )
    sampler = data_mod.WindowSampler(stream, tc.seq_len + 2, tc.batch_size, tc.seed)

    model = new_model(cfg, tc.seq_len, tc.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"model: {n_params / 1e6:.2f}M parameters ({sum(p.numel() for p in model.mtp.parameters()) / 1e6:.2f}M in the "
        f"MTP layer), layers {list(cfg.layer_types)}, mlp {list(cfg.mlp_layer_types)}"
    )
    parity_len = min(tc.seq_len, 256)
    parity_ids = (
        stream[: 2 * (parity_len + 2)].view(2, parity_len + 2) if stream.numel() >= 2 * (parity_len + 2) else None
    )
    if parity_ids is not None:
        diff = check_parity(model, parity_ids)
        log(f"parity: batched training forward vs leanserve's inference forward, max |dlog p| {diff:.2e}")

    optimizer = _optimizer(model, tc)
    ctx = make_ctx(model, tc.batch_size, tc.seq_len, compiled=tc.compile)
    budget = tc.minutes * 60 if tc.minutes is not None else None
    tokens_per_step = tc.batch_size * tc.seq_len
    log_path = out / "train_log.jsonl"
    summary: dict[str, Any] = {}
    step, tokens, last_save = 0, 0, time.perf_counter()
    smooth = None
    start = time.perf_counter()
    total = tc.steps if tc.steps is not None else int(budget)
    bar_format = None if tc.steps is not None else "{l_bar}{bar}| {n:.0f}/{total:.0f}s [{elapsed}<{remaining}{postfix}]"
    with (
        open(log_path, "w") as log_file,
        tqdm(total=total, desc="training", unit="step", bar_format=bar_format, disable=not tc.progress) as bar,
    ):
        try:
            while True:
                elapsed = time.perf_counter() - start
                if tc.steps is not None:
                    if step >= tc.steps:
                        break
                    progress = step / tc.steps
                else:
                    if elapsed >= budget:
                        break
                    progress = elapsed / budget
                lr = lr_at(tc, step, progress)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                ids = sampler.next()
                losses = compute_losses(model, ids, ctx, tc.w_mtp, tc.w_indexer)
                if not math.isfinite(losses.total.item()):
                    raise FloatingPointError(f"Loss became {losses.total.item()} at step {step}; lower --lr.")
                optimizer.zero_grad(set_to_none=True)
                losses.total.backward()
                if tc.grad_clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
                optimizer.step()
                balance_routers_(model, ctx, tc.balance_gamma)
                step += 1
                tokens += tokens_per_step
                elapsed = time.perf_counter() - start
                smooth = losses.lm if smooth is None else 0.95 * smooth + 0.05 * losses.lm
                record = {
                    "step": step,
                    "tokens": tokens,
                    "loss": round(losses.lm, 5),
                    "mtp_loss": round(losses.mtp, 5),
                    "indexer_kl": round(losses.indexer, 5),
                    "lr": lr,
                    "elapsed": round(elapsed, 2),
                }
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()
                bar.set_postfix(
                    step=step,
                    loss=f"{smooth:.3f}",
                    mtp=f"{losses.mtp:.3f}",
                    lr=f"{lr:.2e}",
                    tok_s=f"{tokens / elapsed:.0f}",
                    refresh=False,
                )
                if tc.steps is not None:
                    bar.update(1)
                else:
                    bar.n = min(elapsed, budget)
                    bar.refresh()
                if time.perf_counter() - last_save > tc.save_every_minutes * 60:
                    save_checkpoint(model, out, dtype=torch.bfloat16)
                    last_save = time.perf_counter()
        except KeyboardInterrupt:
            summary["interrupted"] = True
            log(f"interrupted at step {step}; saving what has been trained")
    elapsed = time.perf_counter() - start
    save_checkpoint(model, out, dtype=torch.bfloat16)
    if argv is not None:
        summary["argv"] = list(argv)
    summary.update(
        steps=step,
        tokens=tokens,
        seconds=round(elapsed, 1),
        tokens_per_second=round(tokens / max(elapsed, 1e-9), 1),
        final_loss_smoothed=smooth,
        parameters=n_params,
        train_config={k: v for k, v in asdict(tc).items() if k != "progress"},
        corpus_files={"train": len(corpus.train), "heldout": len(corpus.heldout)},
        train_stream_tokens=stream.numel(),
        heldout_stream_tokens=heldout_tokens,
        corpus_root=str(corpus.root),
        python_version=platform.python_version(),
        torch_version=torch.__version__,
    )
    log(
        f"trained {step} steps, {tokens / 1e6:.2f}M tokens in {elapsed / 60:.1f} min ({summary['tokens_per_second']:.0f} tok/s)"
    )
    if tc.eval_tokens and corpus.heldout and step:
        summary["heldout"] = evaluate(out, corpus=corpus, max_tokens=tc.eval_tokens, seq_len=tc.seq_len)
        log(format_eval(summary["heldout"]))
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def train_tokenizer_for(corpus: data_mod.Corpus, vocab_size: int):
    return data_mod.train_tokenizer([d.text for d in corpus.train], vocab_size)


# --- command line (scripts/train_small.py) ----------------------------------------------------------------
def _tune_malloc() -> None:
    """glibc returns freed large blocks to the OS and faults them back in on the next step; keeping them
    makes the many same-sized temporaries of a training step noticeably cheaper. Best effort."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 32 * 1024 * 1024)  # M_MMAP_THRESHOLD: the largest value glibc accepts
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
        libc.mallopt(-2, 64 * 1024 * 1024)  # M_TOP_PAD
    except (OSError, AttributeError):
        pass


_MODEL_FLAGS = {  # flag -> ModelConfig field
    "hidden": "hidden_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "head_dim": "head_dim",
    "experts": "n_routed_experts",
    "moe_inter": "moe_intermediate_size",
    "hc_mult": "hc_mult",
    "o_groups": "o_groups",
    "index_topk": "index_topk",
}


def train_main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    d = TrainConfig(out="")
    p = argparse.ArgumentParser(
        description="Train leanserve's small DeepSeek-V4-architecture model and its MTP layer on Python source."
    )
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--corpus", default=None, help=data_mod.CORPUS_HELP)
    p.add_argument("--seed", type=int, default=d.seed)
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, default=None, help="train exactly this many steps (deterministic)")
    budget.add_argument("--minutes", type=float, default=None, help="train for this wall-clock time (default 60)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per training sequence")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="final lr / peak lr (cosine)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--w-mtp", type=float, default=d.w_mtp, help="weight of the MTP loss")
    p.add_argument("--w-indexer", type=float, default=d.w_indexer, help="weight of the indexer's KL loss")
    p.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads")
    p.add_argument(
        "--no-compile", action="store_true", help="run mHC eagerly instead of through torch.compile (slower)"
    )
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help="BPE vocabulary (and model vocab) size")
    p.add_argument("--save-every-minutes", type=float, default=d.save_every_minutes)
    p.add_argument("--eval-tokens", type=int, default=d.eval_tokens, help="held-out tokens to evaluate at the end")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    for flag, name in _MODEL_FLAGS.items():
        p.add_argument(f"--{flag.replace('_', '-')}", type=int, default=None, help=f"model {name}")
    p.add_argument("--model-json", default=None, help="JSON object of further ModelConfig overrides")
    args = p.parse_args(argv)

    overrides: dict[str, Any] = {}
    if args.model_json:
        try:
            overrides = json.loads(args.model_json)
        except json.JSONDecodeError as e:
            p.error(f"--model-json is not valid JSON: {e}")
        if not isinstance(overrides, dict):
            p.error("--model-json must be a JSON object")
        for key in ("layer_types", "mlp_layer_types"):
            if isinstance(overrides.get(key), list):
                overrides[key] = tuple(overrides[key])
    for flag, name in _MODEL_FLAGS.items():
        if getattr(args, flag) is not None:
            overrides[name] = getattr(args, flag)
    tc = TrainConfig(
        out=args.out,
        corpus=args.corpus,
        seed=args.seed,
        steps=args.steps,
        minutes=args.minutes if args.minutes is not None or args.steps is not None else 60.0,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        min_lr_ratio=args.min_lr_ratio,
        weight_decay=args.weight_decay,
        w_mtp=args.w_mtp,
        w_indexer=args.w_indexer,
        threads=args.threads,
        compile=not args.no_compile,
        vocab_size=args.vocab_size,
        save_every_minutes=args.save_every_minutes,
        eval_tokens=args.eval_tokens,
        progress=not args.no_progress,
        model=overrides,
    )
    try:
        prepared = prepare(tc)  # refuse bad arguments, corpus or config before anything slow
    except (ValueError, OSError) as e:  # CorpusError and ConfigError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    _tune_malloc()
    recorded = sys.argv[1:] if argv is None else list(argv)
    summary = train(tc, log=lambda m: print(m, file=sys.stderr, flush=True), argv=recorded, prepared=prepared)
    print(json.dumps({k: v for k, v in summary.items() if k != "train_config"}, indent=2))
    return 0
