"""The model card of a directory written by scripts/train_small.py: `README.md` and `loss_curve.png`.

Every figure in the card is read from the directory (config.json, model.safetensors, tokenizer.json,
train_summary.json, train_log.jsonl), from an eval_small.py JSON file, or computed by running the model
(the example completion); nothing is typed in by hand. `card_main` is scripts/model_card.py. This module
lives beside the scripts, outside the installed leanserve package: only scripts/model_card.py and the tests
import it.
"""

from __future__ import annotations

import json
import platform
import shlex
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from leanserve.bench.prompts import EXCLUDED_DIRS, HELDOUT_PER_MILLE
from leanserve.model.config import CSA, HASH_MOE, HCA, MOE, SLIDING, ModelConfig
from leanserve.model.deepseek_v4 import DeepseekV4
from train import data as data_mod
from train.evaluate import REPEAT_SPAN, most_repeated_span
from train.trainer import TrainConfig

DEFAULT_PROMPT = "def fibonacci(n):\n"
DEFAULT_MAX_TOKENS = 48
PYTHON = ".venv/bin/python"
ATTENTION_NAMES = {SLIDING: "sliding window", CSA: "compressed sparse (CSA)", HCA: "heavily compressed (HCA)"}
ROUTING_NAMES = {HASH_MOE: "hash-routed", MOE: "top-k-routed"}


class CardError(ValueError):
    """The model directory lacks something the card needs; the message says what."""


# --- reading the run's files -------------------------------------------------------------------------------
def read_log(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise CardError(f"No training log {path} (scripts/train_small.py writes train_log.jsonl).")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise CardError(f"The training log {path} is empty.")
    return records


def read_summary(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CardError(
            f"No {path}: scripts/train_small.py writes it when training ends (it is missing while a run is going "
            "or when one was killed)."
        )
    return json.loads(path.read_text())


def read_eval_json(path: Path) -> dict[str, Any]:
    """The figures eval_small.py writes with --json-out, or its whole stdout (a table, then the JSON)."""
    text = path.read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        start = text.find("\n{")
        if start < 0:
            raise CardError(f"{path} holds no JSON object of eval_small.py's figures.") from None
        return json.loads(text[start + 1 :])


def parameter_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(all parameters including the MTP layer, those of the MTP layer)."""
    with torch.device("meta"):
        model = DeepseekV4(cfg, max_positions=1, with_mtp=cfg.has_mtp)
    total = sum(p.numel() for p in model.parameters())
    mtp = sum(p.numel() for p in model.mtp.parameters()) if model.mtp is not None else 0
    return total, mtp


def heldout_tokens(model_dir: Path, summary: dict[str, Any], figures: dict[str, Any] | None) -> tuple[int, str]:
    """Tokens of the held-out files (BOS/EOS included) and where the number comes from."""
    if "heldout_stream_tokens" in summary:
        return summary["heldout_stream_tokens"], "train_summary.json"
    if figures and "heldout_stream_tokens" in figures:
        return figures["heldout_stream_tokens"], "the evaluation's JSON"
    corpus = data_mod.load_corpus(summary.get("train_config", {}).get("corpus"))
    tok = data_mod.load_tokenizer(model_dir)
    n = data_mod.encode_documents(tok, corpus.heldout).numel()
    source = f"encoded by the card from {corpus.root}"
    files = summary.get("corpus_files")
    if files and (files.get("train"), files.get("heldout")) != (len(corpus.train), len(corpus.heldout)):
        source += (
            f"; it now holds {len(corpus.train)} + {len(corpus.heldout)} files, the run had "
            f"{files.get('train')} + {files.get('heldout')}"
        )
    return n, source


def train_argv(summary: dict[str, Any]) -> tuple[list[str], bool]:
    """The training command's arguments: as recorded, or rebuilt from train_config (non-default values only).
    Returns (arguments, recorded)."""
    if "argv" in summary:
        return list(summary["argv"]), True
    tc = summary["train_config"]
    defaults = asdict(TrainConfig(out=""))
    args = ["--out", str(tc["out"])]
    if tc.get("corpus"):
        args += ["--corpus", str(tc["corpus"])]
    args += ["--steps", str(tc["steps"])] if tc.get("steps") is not None else ["--minutes", str(tc["minutes"])]
    flagged = ("seed", "batch_size", "seq_len", "lr", "warmup_steps", "min_lr_ratio", "weight_decay", "w_mtp")
    flagged += ("w_indexer", "threads", "vocab_size", "save_every_minutes", "eval_tokens")
    for name in flagged:
        if name in tc and tc[name] != defaults[name]:
            args += [f"--{name.replace('_', '-')}", str(tc[name])]
    if tc.get("model"):
        args += ["--model-json", json.dumps(tc["model"], separators=(",", ":"))]
    return args, False


def shell_quote(text: str) -> str:
    """shlex.quote, or bash's $'...' for text with newlines or tabs."""
    if not any(c in text for c in "\n\t\r"):
        return shlex.quote(text)
    escaped = text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n").replace("\t", "\\t")
    return "$'" + escaped.replace("\r", "\\r") + "'"


def fence(text: str, lang: str = "") -> str:
    """A fenced code block that `text` cannot close early."""
    longest, run = 0, 0
    for c in text:
        run = run + 1 if c == "`" else 0
        longest = max(longest, run)
    ticks = "`" * max(3, longest + 1)
    return f"{ticks}{lang}\n{text}{'' if text.endswith(chr(10)) else chr(10)}{ticks}"


# --- the loss curve --------------------------------------------------------------------------------------------
def rolling_mean(values: list[float], window: int) -> list[float]:
    """Centred (no lag), the window shrinking at both ends."""
    half = window // 2
    out = []
    for i in range(len(values)):
        part = values[max(0, i - half) : i + half + 1]
        out.append(sum(part) / len(part))
    return out


def plot_loss_curve(
    records: list[dict[str, Any]], path: Path, title: str, log_x: bool = False, heldout: dict[str, Any] | None = None
) -> None:
    try:
        import matplotlib
    except ImportError:
        raise CardError("The loss curve needs matplotlib: pip install -e '.[train]'.") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [r["tokens"] for r in records]
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120)
    window = 0 if len(records) < 30 else max(3, round(len(records) / 30)) | 1  # odd
    for key, label, color in (("loss", "trunk (token t+1)", "tab:blue"), ("mtp_loss", "MTP (token t+2)", "tab:orange")):
        values = [r[key] for r in records]
        if window:
            ax.plot(tokens, values, color=color, alpha=0.25, linewidth=0.8)
            smooth = rolling_mean(values, window)
            ax.plot(tokens, smooth, color=color, linewidth=1.8, label=f"{label}, mean of {window} steps")
        else:
            ax.plot(tokens, values, color=color, linewidth=1.8, marker="o", label=label)
    if heldout:
        ax.axhline(heldout["trunk_loss"], color="tab:blue", linestyle="--", linewidth=1, label="held-out trunk (end)")
        ax.axhline(heldout["mtp_loss"], color="tab:orange", linestyle="--", linewidth=1, label="held-out MTP (end)")
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel("training tokens" + (" (log scale)" if log_x else ""))
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --- the completions --------------------------------------------------------------------------------------------
# Five everyday prompts: a function signature, a class, an import block, a docstring, a loop.
EVERYDAY_PROMPTS = (
    "def binary_search(items, target):",
    "class Stack:",
    "import os\nimport sys\n",
    '"""Read a configuration file and return its settings as a dict."""\n',
    "for i in range(10):",
)
EVERYDAY_MAX_TOKENS = 64


def complete(model_dir: str, requests: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """Greedy completions of (prompt, max_tokens) through one leanserve.LLM, with the settings `leanserve
    generate` uses."""
    from leanserve import LLM, SamplingParams

    with LLM(model=model_dir, max_num_seqs=1, load_progress=False) as llm:
        outs = [llm.generate(p, SamplingParams(temperature=0.0, max_tokens=n))[0] for p, n in requests]
    return [
        {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "text": out.outputs[0].text,
            "token_ids": list(out.outputs[0].token_ids),
            "prompt_tokens": len(out.prompt_token_ids),
            "generated_tokens": len(out.outputs[0].token_ids),
            "finish_reason": out.outputs[0].finish_reason,
        }
        for (prompt, max_tokens), out in zip(requests, outs, strict=True)
    ]


# --- the card --------------------------------------------------------------------------------------------------
def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _architecture(cfg: ModelConfig, model_dir: Path, summary: dict[str, Any]) -> str:
    total, mtp = parameter_counts(cfg)
    size = (model_dir / "model.safetensors").stat().st_size
    routing = {HASH_MOE: "hash-routed (experts fixed by token id)", MOE: f"top-{cfg.num_experts_per_tok} routed"}
    layers = ["| layer | attention | KV compression | MoE routing |", "| --- | --- | --- | --- |"]
    for i, (kind, mlp) in enumerate(zip(cfg.layer_types, cfg.mlp_layer_types, strict=True)):
        rate = cfg.compress_rate(kind)
        comp = "none (window only)" if not rate else f"1 entry per {rate} tokens"
        if kind == CSA:
            comp += f"; indexer keeps top-{cfg.index_topk}"
        layers.append(f"| {i} | {ATTENTION_NAMES[kind]} | {comp} | {routing[mlp]} |")
    if cfg.has_mtp:
        with torch.device("meta"):
            block = DeepseekV4(cfg, max_positions=1, with_mtp=True).mtp["0"]
        mlp = HASH_MOE if block.ffn.gate.is_hash else MOE
        layers.append(f"| MTP 0 | {ATTENTION_NAMES[block.layer_type]} | none (window only) | {routing[mlp]} |")
    params = f"{total:,} ({total / 1e6:.2f}M), of which {mtp:,} ({mtp / 1e6:.2f}M) in the MTP layer"
    if summary.get("parameters") not in (None, total):
        params += f" (train_summary.json records {summary['parameters']:,})"
    rows = [
        ("hidden size", str(cfg.hidden_size)),
        ("transformer blocks", f"{cfg.num_hidden_layers} + {cfg.num_nextn_predict_layers} MTP"),
        (
            "attention heads",
            f"{cfg.num_attention_heads} query heads x {cfg.head_dim} (of which {cfg.qk_rope_head_dim} rotary), "
            f"{cfg.num_key_value_heads} shared KV head; q LoRA rank {cfg.q_lora_rank}; output in {cfg.o_groups} "
            f"groups, LoRA rank {cfg.o_lora_rank}",
        ),
        ("sliding window", f"{cfg.sliding_window} tokens (every layer)"),
        ("compression rates", f"CSA {cfg.compress_rate_csa}, HCA {cfg.compress_rate_hca}"),
        (
            "Lightning Indexer (CSA)",
            f"{cfg.index_n_heads} heads x {cfg.index_head_dim}, top-{cfg.index_topk} compressed entries",
        ),
        (
            "experts",
            f"{cfg.n_routed_experts} routed ({cfg.num_experts_per_tok} per token, {cfg.scoring_func} scores) + "
            f"{cfg.n_shared_experts} shared, intermediate size {cfg.moe_intermediate_size}",
        ),
        ("hyper-connections (hc_mult)", f"{cfg.hc_mult} residual streams, {cfg.hc_sinkhorn_iters} Sinkhorn iterations"),
        ("vocabulary", f"{cfg.vocab_size} (byte-level BPE trained on the training files)"),
        ("max positions", str(cfg.max_position_embeddings)),
        ("parameters", params),
        ("model.safetensors", f"{size / 1e6:.2f} MB ({cfg.torch_dtype}, MTP weights as mtp.0.*)"),
    ]
    return "\n".join(layers) + "\n\n" + _table(("hyper-parameter", "value"), rows)


def _data(model_dir: Path, summary: dict[str, Any], figures: dict[str, Any] | None) -> str:
    tc = summary.get("train_config", {})
    if "python_version" in summary:
        version = f"Python {summary['python_version']} (recorded in train_summary.json)"
    else:
        version = f"Python {platform.python_version()} (not recorded by the run; the Python that wrote this card)"
    root = summary.get("corpus_root") or tc.get("corpus") or str(data_mod.default_corpus_dir())
    what = "The `.py` files" if tc.get("corpus") else f"The `.py` sources of the standard library of {version}"
    files = summary.get("corpus_files", {})
    n_held, source = heldout_tokens(model_dir, summary, figures)
    excluded = ", ".join(f"`{d}/`" for d in sorted(EXCLUDED_DIRS))
    rows = [
        ("training files", f"{files.get('train', '?'):,}" if "train" in files else "not recorded"),
        (
            "training tokens (one pass)",
            f"{summary['train_stream_tokens']:,}" if "train_stream_tokens" in summary else "?",
        ),
        ("held-out files", f"{files.get('heldout', '?'):,}" if "heldout" in files else "not recorded"),
        ("held-out tokens", f"{n_held:,} ({source})"),
    ]
    return (
        f"{what} under `{root}`, skipping {excluded}. Every file is "
        f"`<bos>` + text + `<eos>`; files are concatenated into one token stream and training samples random "
        f"windows of it.\n\nThe split is **by file**: a file is held out when the first 4 bytes of sha256(its path "
        f"relative to the corpus root) mod 1000 are below {HELDOUT_PER_MILLE} (about "
        f"{HELDOUT_PER_MILLE / 10:g}% of the files). The tokenizer and the model never saw a held-out "
        f"file.\n\n" + _table(("split", "size"), rows)
    )


def _training(summary: dict[str, Any], records: list[dict[str, Any]]) -> str:
    tc = summary.get("train_config", {})
    args, recorded = train_argv(summary)
    cmd = shlex.join([PYTHON, "scripts/train_small.py", *args])
    how = "as recorded in train_summary.json" if recorded else "rebuilt from train_config in train_summary.json"
    last = records[-1]
    tail = records[-max(1, len(records) // 10) :]
    steps, tokens = summary.get("steps", last["step"]), summary.get("tokens", last["tokens"])
    seconds = summary.get("seconds", last["elapsed"])
    passes = (
        f" ({tokens / summary['train_stream_tokens']:.2f} passes over the training tokens)"
        if summary.get("train_stream_tokens")
        else ""
    )
    rows = [
        ("steps", f"{steps:,}" + (" (interrupted)" if summary.get("interrupted") else "")),
        ("batch", f"{tc.get('batch_size')} sequences x {tc.get('seq_len')} tokens"),
        ("tokens", f"{tokens:,}{passes}"),
        (
            "wall time",
            f"{_duration(seconds)} ({summary.get('tokens_per_second', tokens / max(seconds, 1e-9)):,.0f} tokens/s)",
        ),
        ("CPU threads", str(tc.get("threads"))),
        (
            "optimizer",
            f"AdamW, peak lr {tc.get('lr')}, {tc.get('warmup_steps')} warm-up steps, cosine to "
            f"{tc.get('min_lr_ratio')} x peak, weight decay {tc.get('weight_decay')}, grad clip {tc.get('grad_clip')}",
        ),
        (
            "loss",
            f"CE(trunk, t+1) + {tc.get('w_mtp')} x CE(MTP, t+2) + {tc.get('w_indexer')} x indexer KL; router bias "
            f"balancing gamma {tc.get('balance_gamma')}",
        ),
        ("seed", str(tc.get("seed"))),
    ]
    if "torch_version" in summary:
        rows.append(("torch", summary["torch_version"]))
    mean = {k: sum(r[k] for r in tail) / len(tail) for k in ("loss", "mtp_loss", "indexer_kl") if k in last}
    losses = [
        ("trunk loss", f"{last['loss']:.4f}", f"{mean['loss']:.4f}"),
        ("MTP loss", f"{last['mtp_loss']:.4f}", f"{mean['mtp_loss']:.4f}"),
    ]
    if "indexer_kl" in mean:
        losses.append(("indexer KL", f"{last['indexer_kl']:.4f}", f"{mean['indexer_kl']:.4f}"))
    loss_table = _table(
        ("training loss (nats/token)", f"step {last['step']}", f"mean of the last {_plural(len(tail), 'step')}"), losses
    )
    smoothed = summary.get("final_loss_smoothed")
    note = (
        f"\n\nSmoothed trunk loss at the end (the exponential moving average the progress bar shows): {smoothed:.4f}."
        if smoothed
        else ""
    )
    return f"Command ({how}):\n\n{fence(cmd, 'sh')}\n\n{_table(('setting', 'value'), rows)}\n\n{loss_table}{note}"


def _distill_loss(w_data: float) -> str:
    soft = "CE(the trunk's distribution at t+1 as a soft target, MTP logits at t)"
    if not w_data:
        return soft
    return f"{1 - w_data:g} x {soft} + {w_data:g} x CE(MTP logits at t, token t+2)"


def _stage_command(record: dict[str, Any], script: str) -> str:
    """The command line a stage after training ran with, as recorded (or the essentials, for older records)."""
    args = record.get("argv")
    if args is None:
        out = record.get("config", {}).get("out")
        args = ["--model", str(record.get("source")), "--out", str(out), "--steps", str(record["steps"])]
    return shlex.join([PYTHON, script, *args])


def _distillation(record: dict[str, Any]) -> str:
    """The MTP self-distillation run (scripts/distill_mtp.py), from train_summary.json's "mtp_distill"."""
    dc = record.get("config", {})
    cmd = _stage_command(record, "scripts/distill_mtp.py")
    rows = [
        ("steps", f"{record['steps']:,}"),
        ("batch", f"{dc.get('batch_size')} sequences x {dc.get('seq_len')} tokens ({record['tokens']:,} tokens)"),
        ("wall time", f"{_duration(record['seconds'])} on {_plural(dc.get('threads', 1), 'CPU thread')}"),
        (
            "optimizer",
            f"AdamW on the MTP layer only, peak lr {dc.get('lr')}, {dc.get('warmup_steps')} warm-up steps, "
            f"cosine to {dc.get('min_lr_ratio')} x peak",
        ),
        ("loss", _distill_loss(dc.get("w_data", 0.0))),
        ("seed", str(dc.get("seed"))),
    ]
    text = (
        "After training, the MTP layer was fitted to the trunk's own next-token distribution one position on, "
        "which is what greedy verification accepts; the trunk was frozen and its tensors are byte-identical to "
        f"those before this step (plain decoding is unchanged). Command:\n\n{fence(cmd, 'sh')}\n\n"
        + _table(("setting", "value"), rows)
    )
    figures = [
        ("MTP agreement with the trunk's greedy next-next token", "mtp_agreement", _pct),
        ("MTP top-1 accuracy vs the real token t+2", "mtp_top1", _pct),
        ("MTP loss (nats/token)", "mtp_loss", lambda x: f"{x:.4f}"),
        ("trunk next-token top-1 accuracy", "trunk_top1", _pct),
    ]
    return text + _before_after(record, figures)


def _before_after(record: dict[str, Any], figures: list[tuple[str, str, Any]]) -> str:
    """A run's held-out figures before and after it (name, key, format), as measured by the run; those it did not
    measure are left out."""
    before, after = record.get("heldout_before"), record.get("heldout_after")
    if not (before and after):
        return ""
    rows = [(name, f(before[k]), f(after[k])) for name, k, f in figures if k in before and k in after]
    greedy = ""
    if "greedy_prompts" in after:
        greedy = (
            f"; greedy decoding: {after['greedy_prompts']} held-out prompts of {after['greedy_prompt_tokens']} "
            f"tokens, {after['greedy_max_tokens']} new tokens each"
        )
    return (
        f"\n\nOn {after['tokens']:,} held-out tokens ({after['dtype']}, windows of {after['seq_len']}){greedy}, "
        f"measured by the run:\n\n{_table(('held-out metric', 'before', 'after'), rows)}"
    )


def _unlikelihood(record: dict[str, Any]) -> str:
    """The repetition fine-tune (scripts/unlikelihood.py), from train_summary.json's "unlikelihood"."""
    uc = record.get("config", {})
    cmd = _stage_command(record, "scripts/unlikelihood.py")
    pool = uc.get("gen_batch", 0) * uc.get("regen_every", 0)
    rows = [
        ("steps", f"{record['steps']:,}"),
        ("next-token batch", f"{uc.get('batch_size')} training windows x {uc.get('seq_len')} tokens"),
        (
            "unlikelihood batch",
            f"{uc.get('gen_batch')} greedy continuations of {uc.get('gen_tokens')} tokens after prefixes of "
            f"{uc.get('prefix_min')}-{uc.get('prefix_max')} training tokens; {pool} written by the engine every "
            f"{uc.get('regen_every')} steps",
        ),
        ("wall time", f"{_duration(record['seconds'])} on {_plural(uc.get('threads', 1), 'CPU thread')}"),
        (
            "optimizer",
            f"AdamW on the trunk (not the routers' biases, not the MTP layer), peak lr {uc.get('lr')}, "
            f"{uc.get('warmup_steps')} warm-up steps, cosine to {uc.get('min_lr_ratio')} x peak",
        ),
        (
            "loss",
            f"CE(trunk, t+1) + {uc.get('w_indexer'):g} x indexer KL + {uc.get('w_ul'):g} x mean over continuation "
            f"tokens of -log(1 - p(token)), counted where the token lies in a run of {uc.get('ngram')} tokens that "
            "occurred earlier in the prefix or the continuation",
        ),
        ("seed", str(uc.get("seed"))),
        (
            "continuations with a repeated n-gram",
            f"{_pct(record['pool_repeating_first'])} at the first step, {_pct(record['pool_repeating_last'])} at the "
            "last",
        ),
    ]
    text = (
        "After training, the trunk was fine-tuned against greedy loops by sequence-level unlikelihood: the engine "
        "continues training prefixes greedily with the current weights, and the tokens of those continuations "
        "that repeat an earlier n-gram are made less likely, beside the usual next-token loss on training text. "
        f"Command:\n\n{fence(cmd, 'sh')}\n\n" + _table(("setting", "value"), rows)
    )
    figures = [
        ("trunk next-token top-1 accuracy", "trunk_top1", _pct),
        ("trunk loss (nats/token)", "trunk_loss", lambda x: f"{x:.4f}"),
        ("greedy completions that repeat themselves", "greedy_repeating", _pct),
        ("MTP agreement with the trunk's greedy next-next token (MTP layer not yet refitted)", "mtp_agreement", _pct),
    ]
    return text + _before_after(record, figures)


def _evaluation(figures: dict[str, Any] | None, source: str, model_arg: str, summary: dict[str, Any]) -> str:
    if figures is None:
        cmd = [PYTHON, "scripts/eval_small.py", "--model", model_arg, "--json-out", f"{model_arg}/eval.json"]
        return (
            "No held-out figures: train_summary.json has none (the run had --eval-tokens 0) and no --eval-json was "
            f"given. Compute them with\n\n{fence(shlex.join(cmd), 'sh')}\n\nand pass `--eval-json` to model_card.py."
        )
    tc = summary.get("train_config", {})
    cmd = [PYTHON, "scripts/eval_small.py", "--model", model_arg]
    corpus = figures.get("corpus", tc.get("corpus"))
    if corpus and Path(corpus) != data_mod.default_corpus_dir():
        cmd += ["--corpus", str(corpus)]
    cmd += ["--max-tokens", str(figures["tokens"]), "--seq-len", str(figures["seq_len"]), "--dtype", figures["dtype"]]
    cmd += ["--batch-size", str(figures.get("batch_size", 4))]
    cmd += ["--threads", str(figures.get("threads", tc.get("threads", 2)))]
    cmd += ["--greedy-prompts", str(figures.get("greedy_prompts", 0))]
    mismatch = ""
    if source != "train_summary.json" and Path(figures.get("model", model_arg)).resolve() != Path(model_arg).resolve():
        mismatch = f"\n\n**Note:** {source} says these figures are of `{figures['model']}`, not of `{model_arg}`."
    rows = [
        ("trunk next-token top-1 accuracy", _pct(figures["trunk_top1"])),
        ("MTP top-1 agreement with the trunk's greedy next-next token", _pct(figures["mtp_agreement"])),
        ("MTP top-1 accuracy vs the real token t+2", _pct(figures["mtp_top1"])),
        ("trunk loss (nats/token)", f"{figures['trunk_loss']:.4f}"),
        ("MTP loss (nats/token)", f"{figures['mtp_loss']:.4f}"),
    ]
    greedy = ""
    if "mtp_greedy_acceptance" in figures:
        rows.append(
            ("MTP k=1 draft acceptance when the engine decodes greedily", _pct(figures["mtp_greedy_acceptance"]))
        )
        greedy = (
            f" The acceptance in greedy decoding is the same comparison on the text the trunk writes itself: the "
            f"engine continues {figures['greedy_prompts']} held-out prompts of {figures['greedy_prompt_tokens']} "
            f"tokens by {figures['greedy_max_tokens']} greedy tokens each with one-token MTP drafts "
            f"({figures['mtp_greedy_drafts']:,} drafts), so a draft follows the trunk's own greedy token."
        )
    if "greedy_repeating" in figures:
        rows.append(
            (f"greedy completions that repeat themselves (some {REPEAT_SPAN}-token run three times)",
             _pct(figures["greedy_repeating"]))
        )  # fmt: skip
    return (
        f"On {figures['tokens']:,} tokens of the {_plural(figures['heldout_files'], 'held-out file')} (windows of "
        f"{figures['seq_len']} tokens, {figures['dtype']}), run through leanserve's own loader, inference forward "
        f"and MTP forward (source: {source}):\n\n{_table(('metric', 'value'), rows)}\n\n"
        "The MTP agreement is the greedy acceptance rate of the MTP layer as a one-token speculative draft: its "
        "argmax at t against the trunk's argmax at t+1 (the trunk fed the real token t+1)."
        + greedy
        + "\n\nReproduce:\n\n"
        + fence(shlex.join(cmd), "sh")
        + mismatch
    )


def _example(example: dict[str, Any], model_arg: str) -> str:
    cmd = (
        f"{shlex.join(['.venv/bin/leanserve', 'generate', '--model', model_arg])} --prompt "
        f"{shell_quote(example['prompt'])} --max-tokens {example['max_tokens']}"
    )
    return (
        f"Greedy completion of a {example['prompt_tokens']}-token prompt ({example['generated_tokens']} tokens "
        f"generated, finish reason `{example['finish_reason']}`), by `leanserve.LLM(model={model_arg!r})`:\n\n"
        f"{fence(example['prompt'] + example['text'], 'python')}\n\nThe generated text exactly (Python repr):\n\n"
        f"{fence(repr(example['text']))}\n\nReproduce:\n\n{fence(cmd, 'sh')}"
    )


def _everyday(completions: list[dict[str, Any]], model_arg: str) -> str:
    rows, blocks = [], []
    for c in completions:
        most = most_repeated_span(c["token_ids"])
        rows.append((f"`{c['prompt']!r}`", str(c["generated_tokens"]), str(most), "yes" if most >= 3 else "no"))
        blocks.append(fence(c["prompt"] + c["text"], "python"))
    cmd = f"{shlex.join(['.venv/bin/leanserve', 'generate', '--model', model_arg])} --prompt PROMPT --max-tokens 64"
    return (
        f"Greedy completions of {EVERYDAY_MAX_TOKENS} tokens (fewer if the model ends the text). A completion "
        f"repeats itself when some run of {REPEAT_SPAN} consecutive tokens occurs three times in it:\n\n"
        + _table(("prompt", "tokens", f"most frequent {REPEAT_SPAN}-token run, times", "repeats itself"), rows)
        + "\n\n"
        + "\n\n".join(blocks)
        + f"\n\nReproduce each with\n\n{fence(cmd, 'sh')}"
    )


def write_card(
    model_dir: str | Path,
    log_path: str | Path | None = None,
    summary_path: str | Path | None = None,
    eval_json: str | Path | None = None,
    prompt: str = DEFAULT_PROMPT,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    log_x: bool = False,
) -> Path:
    """Writes MODEL_DIR/loss_curve.png and MODEL_DIR/README.md; returns the README's path."""
    model_arg = str(model_dir)
    model_dir = Path(model_dir)
    if not (model_dir / "model.safetensors").is_file():
        raise CardError(f"{model_dir} has no model.safetensors.")
    cfg = ModelConfig.from_hf(model_dir)
    records = read_log(Path(log_path) if log_path else model_dir / "train_log.jsonl")
    summary = read_summary(Path(summary_path) if summary_path else model_dir / "train_summary.json")
    if eval_json:
        figures, source = read_eval_json(Path(eval_json)), f"`{eval_json}`"
    else:
        figures, source = summary.get("heldout"), "train_summary.json"
    name = model_dir.resolve().name
    plot_loss_curve(records, model_dir / "loss_curve.png", f"{name}: training loss", log_x, figures)
    example, *everyday = complete(
        model_arg, [(prompt, max_tokens)] + [(p, EVERYDAY_MAX_TOKENS) for p in EVERYDAY_PROMPTS]
    )

    kinds = ", ".join(ATTENTION_NAMES[k] for k in ATTENTION_NAMES if k in cfg.layer_types)
    moe = " and ".join(name for k, name in ROUTING_NAMES.items() if k in cfg.mlp_layer_types)
    total, _ = parameter_counts(cfg)
    card_cmd = [PYTHON, "scripts/model_card.py", "--model", model_arg]
    if log_path:
        card_cmd += ["--log", str(log_path)]
    if summary_path:
        card_cmd += ["--summary", str(summary_path)]
    if eval_json:
        card_cmd += ["--eval-json", str(eval_json)]
    if prompt != DEFAULT_PROMPT:
        card_cmd += ["--prompt", prompt]
    if max_tokens != DEFAULT_MAX_TOKENS:
        card_cmd += ["--max-tokens", str(max_tokens)]
    if log_x:
        card_cmd.append("--log-x")
    sections = [
        f"# {name}",
        f"A {total / 1e6:.2f}M-parameter language model of Python source with the DeepSeek-V4 architecture "
        f"({cfg.num_hidden_layers} blocks mixing {kinds} attention, {moe} mixture-of-experts, "
        f"{cfg.hc_mult} hyper-connection streams, and {cfg.num_nextn_predict_layers} multi-token-prediction (MTP) "
        "layer), trained from scratch by leanserve's training tooling (scripts/train_small.py) and served by "
        "leanserve.",
        "## Architecture\n\n" + _architecture(cfg, model_dir, summary),
        "## Data\n\n" + _data(model_dir, summary, figures),
        "## Training\n\n" + _training(summary, records),
        "### Loss curve\n\n![trunk and MTP training loss against training tokens](loss_curve.png)",
        *(
            ["### Repetition fine-tune\n\n" + _unlikelihood(summary["unlikelihood"])]
            if "unlikelihood" in summary
            else []
        ),
        *(
            ["### MTP self-distillation\n\n" + _distillation(summary["mtp_distill"])]
            if "mtp_distill" in summary
            else []
        ),
        "## Held-out evaluation\n\n" + _evaluation(figures, source, model_arg, summary),
        "## Example completion\n\n" + _example(example, model_arg),
        "## Everyday completions\n\n" + _everyday(everyday, model_arg),
        "---\n\nThis card and `loss_curve.png` were written by\n\n"
        + fence(" ".join(shell_quote(a) for a in card_cmd), "sh"),
    ]
    readme = model_dir / "README.md"
    readme.write_text("\n\n".join(sections) + "\n")
    return readme


def card_main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(description="Write README.md (model card) and loss_curve.png into a model directory.")
    p.add_argument("--model", required=True, help="model directory written by scripts/train_small.py")
    p.add_argument("--log", default=None, help="training log (default: MODEL/train_log.jsonl)")
    p.add_argument("--summary", default=None, help="training summary (default: MODEL/train_summary.json)")
    p.add_argument("--eval-json", default=None, help="figures from scripts/eval_small.py --json-out FILE")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt of the example completion")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="tokens of the example completion")
    p.add_argument("--log-x", action="store_true", help="log-scale the loss curve's token axis")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        readme = write_card(
            args.model, args.log, args.summary, args.eval_json, args.prompt, args.max_tokens, args.log_x
        )
    except (ValueError, OSError) as e:  # CardError, ConfigError and CorpusError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {readme} and {readme.parent / 'loss_curve.png'}")
    return 0
