"""Fine-tuning a trained model's trunk against greedy repetition (scripts/unlikelihood.py).

A small model decoding greedily falls into loops (`import sys` forty times over) that no amount of
next-token training of the same budget removes. Sequence-level unlikelihood training (Welleck et al., 2019)
penalises the loops where they happen, in the model's own greedy text:

  * every `regen_every` steps the engine (leanserve.LLM, the current weights) continues a pool of training
    prefixes greedily, half of them file starts (`<bos>` + a few tokens, as a user's prompt is), half cut
    from anywhere in the training stream;
  * a token of a continuation is a candidate when it lies in an n-gram (`ngram` tokens) that already occurred
    earlier in the prefix + continuation;
  * loss = CE(trunk, t+1) on a batch of training windows (+ the indexer's KL, as in training)
           + w_ul * mean over continuation tokens of  -log(1 - p(candidate token))

Only the trunk learns (the MTP layer and the routers' biases are frozen): distil the MTP layer afterwards
(scripts/distill_mtp.py), since the trunk it drafts for has moved. The held-out figures before and after,
and the share of held-out greedy completions that repeat themselves, go into train_summary.json under
"unlikelihood"; the per-step log is unlikelihood_log.jsonl.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from leanserve.model.config import ModelConfig
from train import data as data_mod
from train.architecture import check_trainable
from train.evaluate import evaluate, format_eval, greedy_acceptance
from train.forward import indexer_loss, make_ctx, trunk_forward
from train.stage_dir import (
    add_stage_arguments,
    check_model_dir,
    finish_stage,
    learn_only,
    stage_main,
    staged_output,
)
from train.trainer import check_fields, lr_at

LOG = "unlikelihood_log.jsonl"


@dataclass
class UnlikelihoodConfig:
    model: str  # the trained model directory
    out: str  # where the tuned model goes (may be `model` itself: written only at the end)
    corpus: str | None = None  # None: the running interpreter's standard library
    steps: int = 300
    batch_size: int = 4  # training windows per step (the next-token loss)
    seq_len: int = 512
    gen_batch: int = 16  # greedy continuations per step (the unlikelihood loss)
    gen_tokens: int = 64  # tokens the engine writes after each prefix
    prefix_min: int = 4
    prefix_max: int = 48
    regen_every: int = 8  # steps between two pools of continuations (a pool serves gen_batch per step)
    ngram: int = 8
    w_ul: float = 1.0
    w_indexer: float = 1.0
    lr: float = 2e-4
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    seed: int = 2
    threads: int = 2
    compile: bool = True
    eval_tokens: int = 32768  # held-out tokens evaluated before and after (0: skip, with the repetition figure)
    progress: bool = True

    def validate(self) -> None:
        check_fields(
            self,
            positive_ints=(
                "steps", "batch_size", "seq_len", "gen_batch", "gen_tokens", "prefix_min", "prefix_max",
                "regen_every", "ngram", "threads",
            ),
            positive=("lr",),
            non_negative=("w_ul", "w_indexer", "warmup_steps", "grad_clip", "eval_tokens"),
            fractions=("min_lr_ratio",),
        )  # fmt: skip
        if self.prefix_min > self.prefix_max:
            raise ValueError(f"prefix_min ({self.prefix_min}) must not exceed prefix_max ({self.prefix_max}).")


def prepare(uc: UnlikelihoodConfig) -> tuple[data_mod.Corpus, ModelConfig]:
    """Everything that can refuse the run, before any work: arguments, the model directory, the corpus."""
    uc.validate()
    src = Path(uc.model)
    check_model_dir(src, "the training data is encoded with the model's tokenizer.")
    cfg = ModelConfig.from_hf(src)
    check_trainable(cfg, uc.seq_len)
    check_trainable(cfg, uc.prefix_max + uc.gen_tokens)
    return data_mod.load_corpus(uc.corpus), cfg


# --- what is penalised ----------------------------------------------------------------------------------------
def repeated_ngram_mask(tokens: list[int], start: int, n: int) -> list[bool]:
    """For each position of tokens[start:]: whether the token lies in an n-gram of `tokens` that already
    occurred, starting earlier, in `tokens` (the prefix counts as earlier text)."""
    seen: set[tuple[int, ...]] = set()
    marked = [False] * len(tokens)
    for s in range(len(tokens) - n + 1):
        gram = tuple(tokens[s : s + n])
        if gram in seen:
            for t in range(s, s + n):
                marked[t] = True
        seen.add(gram)
    return marked[start:]


class PrefixSampler:
    """Prompts of lo..hi tokens from the training stream: even ones from a document's start (`<bos>` + tokens),
    odd ones from anywhere, cut before a document boundary; a pure function of (seed, prompts drawn)."""

    def __init__(self, stream: torch.Tensor, lo: int, hi: int, seed: int) -> None:
        self.stream, self.lo, self.hi = stream, lo, hi
        self.starts = (stream == data_mod.BOS_ID).nonzero().flatten()  # every document's first position
        self.gen = torch.Generator().manual_seed(seed)

    def next(self, count: int) -> list[list[int]]:
        prefixes = []
        for i in range(count):
            length = int(torch.randint(self.lo, self.hi + 1, (), generator=self.gen))
            if i % 2 == 0:
                at = int(self.starts[torch.randint(0, self.starts.numel(), (), generator=self.gen)])
            else:
                at = int(torch.randint(0, self.stream.numel() - self.hi, (), generator=self.gen))
            ids = self.stream[at : at + length].tolist()
            if i % 2 == 1:  # nothing past the end of a document
                ends = [j for j, t in enumerate(ids) if j > 0 and t in (data_mod.EOS_ID, data_mod.BOS_ID)]
                ids = ids[: ends[0]] if ends else ids
            prefixes.append(ids)
        return prefixes


@dataclass
class Pool:
    """Continuations laid out for the unlikelihood loss: ids [N, L] (padded), where [N, L - 1] bool marks the
    positions t whose logits predict a continuation token (t + 1), candidates [N, L - 1] those of them that
    are candidates."""

    ids: torch.Tensor
    where: torch.Tensor
    candidates: torch.Tensor

    @property
    def repeating(self) -> float:
        """The share of continuations with any candidate."""
        return self.candidates.any(dim=1).float().mean().item()

    @classmethod
    def build(cls, prefixes: list[list[int]], continuations: list[list[int]], length: int, n: int) -> Pool:
        ids = torch.full((len(prefixes), length), data_mod.PAD_ID, dtype=torch.long)
        where = torch.zeros(len(prefixes), length - 1, dtype=torch.bool)
        candidates = torch.zeros_like(where)
        for i, (p, c) in enumerate(zip(prefixes, continuations, strict=True)):
            seq = (p + c)[:length]
            ids[i, : len(seq)] = torch.tensor(seq)
            rows = slice(len(p) - 1, len(seq) - 1)  # the positions whose logits predict a continuation token
            where[i, rows] = True
            candidates[i, rows] = torch.tensor(repeated_ngram_mask(seq, len(p), n), dtype=torch.bool)
        return cls(ids, where, candidates)


def unlikelihood_loss(logits: torch.Tensor, pool_ids: torch.Tensor, where: torch.Tensor, cand: torch.Tensor):
    """logits [N*L, V] of the trunk at positions 0..L-1 of pool_ids [N, L]: mean over the continuation tokens of
    -log(1 - p(token)) where the token is a candidate."""
    n, length = pool_ids.shape
    logp = logits.view(n, length, -1)[:, :-1].float().log_softmax(-1)
    token_logp = logp.gather(-1, pool_ids[:, 1:, None]).squeeze(-1)  # log p(token t+1) at t
    one_minus = (-torch.expm1(token_logp)).clamp_min(1e-5)
    return -(one_minus.log() * cand).sum() / where.sum().clamp_min(1)


# --- the engine's greedy text ---------------------------------------------------------------------------------
def greedy_continuations(model, src: Path, prefixes: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The current weights, written to a scratch directory beside the source's tokenizer, continue every prefix
    greedily through leanserve's engine."""
    from leanserve import LLM, SamplingParams
    from leanserve.model.loader import save_checkpoint

    with tempfile.TemporaryDirectory(prefix="leanserve-ul-") as scratch:
        tmp = Path(scratch)
        for name in ("tokenizer.json", "generation_config.json"):
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        save_checkpoint(model, tmp, dtype=torch.float32)
        longest = max(len(p) for p in prefixes) + max_tokens + 1
        with LLM(
            str(tmp), dtype="float32", max_num_seqs=len(prefixes), max_model_len=longest, load_progress=False
        ) as llm:
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in prefixes], SamplingParams(temperature=0.0, max_tokens=max_tokens)
            )
    return [list(o.outputs[0].token_ids) for o in outs]


def heldout_figures(model_dir: Path, corpus, uc: UnlikelihoodConfig) -> dict[str, Any]:
    """Held-out next-token figures and the greedy-decoding ones (acceptance, repeating completions)."""
    figures = evaluate(model_dir, corpus=corpus, max_tokens=uc.eval_tokens, seq_len=uc.seq_len)
    figures.update(greedy_acceptance(model_dir))
    return figures


# --- the run ------------------------------------------------------------------------------------------------------
def tune(uc: UnlikelihoodConfig, log=print, argv: list[str] | None = None, prepared=None) -> dict[str, Any]:
    """Fine-tunes, writes the model directory `uc.out` and returns the "unlikelihood" record of its summary."""
    from tqdm import tqdm

    from leanserve.model.build import build_model
    from leanserve.model.loader import checkpoint_dtype, has_mtp_weights, load_weights, save_checkpoint

    corpus, cfg = prepared or prepare(uc)
    torch.set_num_threads(uc.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(uc.threads))
    torch.manual_seed(uc.seed)
    src, out = Path(uc.model), Path(uc.out)
    tok = data_mod.load_tokenizer(src)
    stream = data_mod.encode_documents(tok, corpus.train, seed=uc.seed)
    sampler = data_mod.WindowSampler(stream, uc.seq_len + 2, uc.batch_size, uc.seed)
    prefix_sampler = PrefixSampler(stream, uc.prefix_min, uc.prefix_max, uc.seed)
    with_mtp = has_mtp_weights(src)
    gen_len = uc.prefix_max + uc.gen_tokens
    model = build_model(cfg, max_positions=max(uc.seq_len, gen_len) + 2, dtype=torch.float32, with_mtp=with_mtp,
                        backend="torch")  # fmt: skip
    load_weights(model, src, progress=False)
    params = learn_only(model, lambda name: not name.startswith("mtp.") and not name.endswith("gate.bias"))
    log(f"model: {src}, {sum(p.numel() for p in params) / 1e6:.2f}M trunk parameters learn")

    before = None
    if uc.eval_tokens and corpus.heldout and with_mtp:  # (the figures include the MTP layer's)
        before = heldout_figures(src, corpus, uc)
        log("before: " + format_eval(before))

    optimizer = torch.optim.AdamW(params, lr=uc.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    ctx = make_ctx(model, uc.batch_size, uc.seq_len, compiled=uc.compile)
    ul_ctx = make_ctx(model, uc.gen_batch, gen_len, compiled=uc.compile)
    records, pool = [], None
    start = time.perf_counter()
    with tqdm(total=uc.steps, desc="unlikelihood", unit="step", disable=not uc.progress) as bar:
        for step in range(uc.steps):
            if step % uc.regen_every == 0:
                prefixes = prefix_sampler.next(uc.gen_batch * uc.regen_every)
                pool = Pool.build(prefixes, greedy_continuations(model, src, prefixes, uc.gen_tokens), gen_len,
                                  uc.ngram)  # fmt: skip
            rows = slice((step % uc.regen_every) * uc.gen_batch, (step % uc.regen_every + 1) * uc.gen_batch)
            lr = lr_at(uc, step, step / uc.steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            ids = sampler.next()
            _, logits = trunk_forward(model, ids, ctx)
            lm = F.cross_entropy(logits, ids[:, 1 : uc.seq_len + 1].reshape(-1))
            indexer = indexer_loss(ctx)
            _, ul_logits = trunk_forward(model, pool.ids[rows], ul_ctx)
            ul = unlikelihood_loss(ul_logits, pool.ids[rows], pool.where[rows], pool.candidates[rows])
            loss = lm + uc.w_indexer * indexer + uc.w_ul * ul
            if not math.isfinite(loss.item()):
                raise FloatingPointError(f"Loss became {loss.item()} at step {step}; lower --lr.")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if uc.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, uc.grad_clip)
            optimizer.step()
            records.append(
                {
                    "step": step + 1,
                    "loss": round(lm.item(), 5),
                    "ul_loss": round(ul.item(), 5),
                    "pool_repeating": round(pool.repeating, 4),
                    "candidates": int(pool.candidates[rows].sum()),
                    "lr": lr,
                    "elapsed": round(time.perf_counter() - start, 2),
                }
            )
            bar.set_postfix(loss=f"{lm.item():.3f}", ul=f"{ul.item():.3f}", rep=f"{pool.repeating:.2f}", refresh=False)
            bar.update(1)
            if not uc.progress and (step + 1) % 25 == 0:  # a line now and then for logs without the bar
                log(json.dumps(records[-1]))
    seconds = time.perf_counter() - start
    log(f"tuned {uc.steps} steps in {seconds / 60:.1f} min")

    with staged_output(src, out) as tmp:
        save_checkpoint(model, tmp, dtype=checkpoint_dtype(src))
        record: dict[str, Any] = {
            "source": str(src),
            "steps": uc.steps,
            "tokens": uc.steps * (uc.batch_size * uc.seq_len + uc.gen_batch * gen_len),
            "seconds": round(seconds, 1),
            "config": {k: v for k, v in asdict(uc).items() if k != "progress"},
            "pool_repeating_first": records[0]["pool_repeating"],
            "pool_repeating_last": records[-1]["pool_repeating"],
            "heldout_before": before,
            "torch_version": torch.__version__,
        }
        measure = (lambda d: heldout_figures(d, corpus, uc)) if before is not None else None
        return finish_stage(tmp, out, "unlikelihood", record, LOG, records, measure, log, argv)


# --- command line (scripts/unlikelihood.py) ----------------------------------------------------------------------
def unlikelihood_main(argv: list[str] | None = None) -> int:
    import argparse

    d = UnlikelihoodConfig(model="", out="")
    p = argparse.ArgumentParser(
        description="Fine-tune a trained model's trunk against greedy repetition (sequence-level unlikelihood on "
        "its own greedy continuations of training prefixes, beside the next-token loss)."
    )
    add_stage_arguments(p, d, "trained model directory")
    p.add_argument("--gen-batch", type=int, default=d.gen_batch, help="greedy continuations per step")
    p.add_argument("--gen-tokens", type=int, default=d.gen_tokens, help="tokens of each greedy continuation")
    p.add_argument("--prefix-min", type=int, default=d.prefix_min, help="shortest prefix, in tokens")
    p.add_argument("--prefix-max", type=int, default=d.prefix_max, help="longest prefix, in tokens")
    p.add_argument("--regen-every", type=int, default=d.regen_every, help="steps served by one pool of continuations")
    p.add_argument("--ngram", type=int, default=d.ngram, help="a token repeats when it lies in a repeated n-gram")
    p.add_argument("--w-ul", type=float, default=d.w_ul, help="weight of the unlikelihood loss")
    p.add_argument("--w-indexer", type=float, default=d.w_indexer, help="weight of the indexer's KL loss")
    return stage_main(p, UnlikelihoodConfig, prepare, tune, argv)
