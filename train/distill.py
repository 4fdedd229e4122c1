"""Self-distillation of a trained model's MTP layer (scripts/distill_mtp.py).

A one-token MTP draft is accepted by greedy verification when the MTP layer's argmax at position t equals the
trunk's argmax at t+1. Joint training (train.trainer) fits the MTP layer to the data's token t+2;
here it is fitted to the trunk's own next-token distribution one position on, which is what verification
accepts:

    loss = (1 - w_data) * CE(p_trunk(. | t+1) as a soft target, MTP logits at t) + w_data * CE(MTP at t, token t+2)

The trunk is frozen (no gradient, no router balancing) and only `mtp.*` parameters learn, so the written
checkpoint's trunk tensors are byte-identical to the input's (checked before anything is written) and plain
decoding's tokens do not change. The held-out figures before and after (train.evaluate) go into
train_summary.json under "mtp_distill", with the run's settings; the per-step log is distill_log.jsonl.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from leanserve.model.config import ConfigError, ModelConfig
from train import data as data_mod
from train.architecture import check_trainable
from train.evaluate import evaluate, format_eval
from train.forward import check_parity, make_ctx, mtp_forward, trunk_forward
from train.stage_dir import (
    add_stage_arguments,
    check_model_dir,
    finish_stage,
    learn_only,
    stage_main,
    staged_output,
)
from train.trainer import check_fields, lr_at

LOG = "distill_log.jsonl"


@dataclass
class DistillConfig:
    model: str  # the trained model directory (with mtp.0.* weights)
    out: str  # where the distilled model goes (may be `model` itself: written only at the end)
    corpus: str | None = None  # None: the running interpreter's standard library
    steps: int = 400
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 5e-4
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    w_data: float = 0.0  # weight of the plain next-next-token loss against the soft target
    seed: int = 1
    threads: int = 2
    compile: bool = True  # mHC through torch.compile (forward.compiled_mhc; eager where it cannot compile)
    eval_tokens: int = 32768  # held-out tokens evaluated before and after (0: skip)
    progress: bool = True

    def validate(self) -> None:
        check_fields(
            self,
            positive_ints=("steps", "batch_size", "seq_len", "threads"),
            positive=("lr",),
            non_negative=("warmup_steps", "grad_clip", "eval_tokens"),
            fractions=("w_data", "min_lr_ratio"),
        )


def prepare(dc: DistillConfig) -> tuple[data_mod.Corpus, ModelConfig]:
    """Everything that can refuse the run, before any work: arguments, the model directory, the corpus."""
    from leanserve.model.loader import has_mtp_weights

    dc.validate()
    src = Path(dc.model)
    check_model_dir(src, "the distillation data is encoded with the model's tokenizer.")
    cfg = ModelConfig.from_hf(src)
    if not has_mtp_weights(src):
        raise ConfigError(f"{src} has no MTP weights (mtp.0.*); there is no MTP layer to distil.")
    check_trainable(cfg, dc.seq_len)
    return data_mod.load_corpus(dc.corpus), cfg


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def distill(dc: DistillConfig, log=print, argv: list[str] | None = None, prepared=None) -> dict[str, Any]:
    """Distils, writes the model directory `dc.out` and returns the "mtp_distill" record of its summary.
    `prepared`: what `prepare(dc)` already returned, so the corpus is not read twice."""
    from tqdm import tqdm

    from leanserve.model.build import build_model
    from leanserve.model.loader import checkpoint_dtype, load_weights, save_checkpoint

    corpus, cfg = prepared or prepare(dc)
    torch.set_num_threads(dc.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(dc.threads))
    torch.manual_seed(dc.seed)
    src, out = Path(dc.model), Path(dc.out)
    tok = data_mod.load_tokenizer(src)
    stream = data_mod.encode_documents(tok, corpus.train, seed=dc.seed)
    sampler = data_mod.WindowSampler(stream, dc.seq_len + 2, dc.batch_size, dc.seed)
    model = build_model(
        cfg, max_positions=dc.seq_len + 2, dtype=torch.float32, with_mtp=True, backend="torch"
    )  # (training: the torch statement, under autograd)
    load_weights(model, src, progress=False)
    params = learn_only(model, lambda name: name.startswith("mtp.") and not name.endswith("gate.bias"))
    log(f"model: {src}, {sum(p.numel() for p in params) / 1e6:.2f}M MTP parameters learn, the trunk is frozen")
    parity_ids = sampler.next()[:2, : min(dc.seq_len, 256) + 2]
    log(f"parity: batched training forward vs inference forward, max |dlog p| {check_parity(model, parity_ids):.2e}")

    before = None
    if dc.eval_tokens and corpus.heldout:
        before = evaluate(src, corpus=corpus, max_tokens=dc.eval_tokens, seq_len=dc.seq_len)
        log("before: " + format_eval(before))

    optimizer = torch.optim.AdamW(params, lr=dc.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    ctx = make_ctx(model, dc.batch_size, dc.seq_len, compiled=dc.compile)
    b, length = dc.batch_size, dc.seq_len
    records = []
    start = time.perf_counter()
    with tqdm(total=dc.steps, desc="distilling", unit="step", disable=not dc.progress) as bar:
        for step in range(dc.steps):
            lr = lr_at(dc, step, step / dc.steps)  # (lr, warmup_steps, min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            ids = sampler.next()
            with torch.no_grad():
                streams, logits = trunk_forward(model, ids, ctx)
                teacher = logits.view(b, length, -1)[:, 1:].softmax(dim=-1)  # p_trunk at t+1, for the MTP at t
            mtp_logits = mtp_forward(model, streams, ids, ctx).view(b, length, -1)
            soft = -(teacher * mtp_logits[:, :-1].log_softmax(dim=-1)).sum(-1).mean()
            hard = F.cross_entropy(mtp_logits.flatten(0, 1), ids[:, 2 : length + 2].reshape(-1))
            loss = (1 - dc.w_data) * soft + dc.w_data * hard
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"Loss became {loss.item()} at step {step}; lower --lr.")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if dc.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, dc.grad_clip)
            optimizer.step()
            agree = (mtp_logits[:, :-1].argmax(-1) == teacher.argmax(-1)).float().mean().item()
            records.append(
                {
                    "step": step + 1,
                    "soft_ce": round(soft.item(), 5),
                    "mtp_loss": round(hard.item(), 5),
                    "agreement": round(agree, 5),
                    "lr": lr,
                    "elapsed": round(time.perf_counter() - start, 2),
                }
            )
            bar.set_postfix(soft=f"{soft.item():.3f}", agree=f"{agree:.3f}", refresh=False)
            bar.update(1)
    seconds = time.perf_counter() - start
    log(f"distilled {dc.steps} steps in {seconds / 60:.1f} min")

    def measure(model_dir: Path) -> dict[str, Any]:
        return evaluate(model_dir, corpus=corpus, max_tokens=dc.eval_tokens, seq_len=dc.seq_len)

    # Written into a scratch directory beside `out`, checked that the trunk is untouched, then moved into place.
    with staged_output(src, out) as tmp:
        save_checkpoint(model, tmp, dtype=checkpoint_dtype(src))  # the source's own dtype
        new, old = _tensors(tmp / "model.safetensors"), _tensors(src / "model.safetensors")
        changed = [n for n in old if not n.startswith("mtp.") and not torch.equal(old[n], new[n])]
        if changed or set(new) != set(old):
            raise RuntimeError(f"distillation would change trunk tensors ({changed[:3]}...); nothing written")
        tail = records[-max(1, len(records) // 10) :]
        record: dict[str, Any] = {
            "source": str(src),
            "steps": dc.steps,
            "tokens": dc.steps * b * length,
            "seconds": round(seconds, 1),
            "config": {k: v for k, v in asdict(dc).items() if k != "progress"},
            "final_agreement_mean_last_10pct": sum(r["agreement"] for r in tail) / len(tail),
            "heldout_before": before,
            "torch_version": torch.__version__,
        }
        return finish_stage(
            tmp, out, "mtp_distill", record, LOG, records, measure if before is not None else None, log, argv
        )


# --- command line (scripts/distill_mtp.py) ----------------------------------------------------------------
def distill_main(argv: list[str] | None = None) -> int:
    import argparse

    d = DistillConfig(model="", out="")
    p = argparse.ArgumentParser(
        description="Distil a trained model's MTP layer towards its own trunk (higher speculative acceptance); "
        "the trunk's weights are left byte-identical."
    )
    add_stage_arguments(p, d, "trained model directory (with mtp.0.* weights)")
    p.add_argument("--w-data", type=float, default=d.w_data, help="weight of the real-token MTP loss (0..1)")
    return stage_main(p, DistillConfig, prepare, distill, argv)
