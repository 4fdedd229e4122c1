"""Held-out figures of a trained model through leanserve's own inference path (strict loader, inference forward
and MTP forward): trunk next-token top-1, the MTP layer's agreement with the trunk's greedy next-next token,
its top-1 against the real token t+2, and both cross-entropies; and the acceptance of one-token MTP drafts
when the engine decodes held-out prompts greedily. `eval_main` is scripts/eval_small.py."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from leanserve.model.build import build_model
from leanserve.model.config import ModelConfig
from train import data as data_mod
from train.forward import inference_logits


@torch.no_grad()
def evaluate(
    model_dir: str | Path,
    corpus: data_mod.Corpus | str | Path | None = None,
    max_tokens: int | None = None,
    seq_len: int | None = None,
    batch_size: int = 4,
    dtype: str = "auto",
) -> dict[str, Any]:
    """On the corpus' held-out files, packed like the training data into windows of seq_len + 1 tokens, with
    the checkpoint loaded by leanserve's strict loader and run by its inference forward:
      trunk_top1       trunk argmax at t == token t+1
      mtp_agreement    MTP argmax at t == trunk argmax at t+1 (trunk fed the real token t+1): the greedy
                       acceptance rate of a one-token speculative draft
      mtp_top1         MTP argmax at t == token t+2
    plus the two cross-entropies (nats/token)."""
    from leanserve.engine.llm_engine import resolve_dtype
    from leanserve.model.loader import has_mtp_weights, load_weights

    model_dir = Path(model_dir)
    cfg = ModelConfig.from_hf(model_dir)
    if not has_mtp_weights(model_dir):
        raise ValueError(f"{model_dir} has no MTP weights (mtp.0.*); nothing to evaluate the MTP layer with.")
    if not isinstance(corpus, data_mod.Corpus):
        corpus = data_mod.load_corpus(corpus)
    if not corpus.heldout:
        raise data_mod.CorpusError(f"Corpus {corpus.root} has no held-out files (about 3% of the files are held out).")
    if seq_len is None:
        summary = model_dir / "train_summary.json"
        seq_len = 512
        if summary.is_file():
            seq_len = int(json.loads(summary.read_text()).get("train_config", {}).get("seq_len", 512))
    tok = data_mod.load_tokenizer(model_dir)
    stream = data_mod.encode_documents(tok, corpus.heldout)
    window = seq_len + 1
    n = (stream.numel() - 1) // seq_len
    if max_tokens:
        n = min(n, max(1, max_tokens // seq_len))
    if n < 1:
        raise data_mod.CorpusError(f"The held-out files encode to {stream.numel()} tokens, fewer than {window}.")
    windows = torch.stack([stream[i * seq_len : i * seq_len + window] for i in range(n)])

    torch_dtype = resolve_dtype(dtype, str(model_dir))
    model = build_model(cfg, max_positions=window, dtype=torch_dtype, with_mtp=True)
    load_weights(model, model_dir, progress=False)
    sums = dict.fromkeys(("trunk_hit", "mtp_agree", "mtp_hit", "trunk_nll", "mtp_nll"), 0.0)
    n_trunk = n_mtp = 0
    start = time.perf_counter()
    for i in range(0, n, batch_size):
        ids = windows[i : i + batch_size]
        b = ids.shape[0]
        logits, mtp_logits = inference_logits(model, ids)
        logits, mtp_logits = logits.float().view(b, seq_len, -1), mtp_logits.float().view(b, seq_len, -1)
        trunk_pred, mtp_pred = logits.argmax(-1), mtp_logits.argmax(-1)
        target = ids[:, 1:]
        sums["trunk_hit"] += (trunk_pred == target).sum().item()
        sums["trunk_nll"] += F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum").item()
        m_pred = mtp_pred[:, :-1]  # positions t = 0..L-2, where t+1 and t+2 are in the window
        sums["mtp_agree"] += (m_pred == trunk_pred[:, 1:]).sum().item()
        sums["mtp_hit"] += (m_pred == ids[:, 2:]).sum().item()
        sums["mtp_nll"] += F.cross_entropy(
            mtp_logits[:, :-1].flatten(0, 1), ids[:, 2:].flatten(), reduction="sum"
        ).item()
        n_trunk += target.numel()
        n_mtp += m_pred.numel()
    seconds = time.perf_counter() - start
    return {
        "model": str(model_dir),
        "dtype": str(torch_dtype).removeprefix("torch."),
        "heldout_files": len(corpus.heldout),
        "tokens": n_trunk,
        "seq_len": seq_len,
        "trunk_top1": sums["trunk_hit"] / n_trunk,
        "mtp_agreement": sums["mtp_agree"] / n_mtp,
        "mtp_top1": sums["mtp_hit"] / n_mtp,
        "trunk_loss": sums["trunk_nll"] / n_trunk,
        "mtp_loss": sums["mtp_nll"] / n_mtp,
        "seconds": round(seconds, 1),
        "corpus": str(corpus.root),
        "heldout_stream_tokens": stream.numel(),
        "batch_size": batch_size,
        "threads": torch.get_num_threads(),
    }


REPEAT_SPAN = 8  # a completion repeats itself when some run of this many tokens occurs three times in it


def most_repeated_span(token_ids: list[int], span: int = REPEAT_SPAN) -> int:
    """How often the most frequent run of `span` consecutive tokens occurs (0 if there are fewer tokens)."""
    counts: dict[tuple[int, ...], int] = {}
    for i in range(len(token_ids) - span + 1):
        key = tuple(token_ids[i : i + span])
        counts[key] = counts.get(key, 0) + 1
    return max(counts.values(), default=0)


def greedy_acceptance(
    model_dir: str | Path, prompts: int = 48, prompt_tokens: int = 48, max_tokens: int = 64, dtype: str = "auto"
) -> dict[str, Any]:
    """The engine decodes `prompts` held-out code prompts (bench spec's) greedily with one-token MTP drafts: the
    share of drafts the trunk accepts, i.e. how often the MTP layer's draft is the trunk's greedy next-next token
    on the text the trunk itself writes (where a draft's first token is the trunk's greedy token, not the
    held-out text's); and the share of those completions that repeat themselves (some 8-token run three times)."""
    from leanserve import LLM, SamplingParams
    from leanserve.bench.prompts import code_prompts

    spec = {"method": "mtp", "num_speculative_tokens": 1}
    with LLM(
        str(model_dir), dtype=dtype, max_model_len=prompt_tokens + max_tokens + 1, max_num_seqs=prompts,
        load_progress=False, speculative_config=spec,
    ) as llm:  # fmt: skip
        if llm.get_tokenizer() is None:
            raise ValueError(f"{model_dir} has no tokenizer.json to encode the held-out prompts with.")
        ids = code_prompts(llm.get_tokenizer(), prompts, prompt_tokens)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], params)
        m = llm.spec_decode_metrics()
    repeating = sum(most_repeated_span(list(o.outputs[0].token_ids)) >= 3 for o in outs)
    return {
        "greedy_prompts": prompts,
        "greedy_prompt_tokens": prompt_tokens,
        "greedy_max_tokens": max_tokens,
        "mtp_greedy_drafts": m["num_draft_tokens"],
        "mtp_greedy_acceptance": m["num_accepted_tokens"] / m["num_draft_tokens"],
        "greedy_repeating": repeating / len(outs),
    }


def format_eval(r: dict[str, Any]) -> str:
    rows = [
        ("trunk next-token top-1", f"{r['trunk_top1']:.2%}"),
        ("MTP agreement with trunk greedy t+2", f"{r['mtp_agreement']:.2%}"),
        ("MTP top-1 vs real t+2", f"{r['mtp_top1']:.2%}"),
        ("trunk loss (nats/token)", f"{r['trunk_loss']:.3f}"),
        ("MTP loss (nats/token)", f"{r['mtp_loss']:.3f}"),
    ]
    if "mtp_greedy_acceptance" in r:
        rows.append(("MTP k=1 acceptance, greedy decoding", f"{r['mtp_greedy_acceptance']:.2%}"))
    if "greedy_repeating" in r:
        rows.append(("greedy completions that repeat themselves", f"{r['greedy_repeating']:.2%}"))
    width = max(len(k) for k, _ in rows)
    head = f"held-out: {r['tokens']} tokens from {r['heldout_files']} files, {r['dtype']}, windows of {r['seq_len']}"
    if "mtp_greedy_acceptance" in r:
        head += (
            f"; greedy decoding: {r['greedy_prompts']} prompts of {r['greedy_prompt_tokens']} tokens,"
            f" {r['greedy_max_tokens']} new tokens each"
        )
    return "\n".join([head] + [f"  {k:<{width}}  {v:>8}" for k, v in rows])


# --- command line (scripts/eval_small.py) ---------------------------------------------------------------
def eval_main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(description="Held-out figures of a model trained by scripts/train_small.py.")
    p.add_argument("--model", required=True, help="model directory")
    p.add_argument("--corpus", default=None, help="the corpus it was trained on (default: the standard library)")
    p.add_argument("--max-tokens", type=int, default=None, help="evaluate at most this many held-out tokens")
    p.add_argument("--seq-len", type=int, default=None, help="window length (default: the training seq_len)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--greedy-prompts",
        type=int,
        default=48,
        help="held-out standard-library prompts (bench spec's) the engine decodes greedily with one-token MTP"
        " drafts (0: skip that figure)",
    )
    p.add_argument(
        "--json-out", "--json", dest="json_out", default=None, help="also write the figures (JSON) to this file"
    )
    args = p.parse_args(argv)
    if args.greedy_prompts < 0:
        p.error(f"--greedy-prompts must be 0 or more, got {args.greedy_prompts}")
    torch.set_num_threads(args.threads)
    try:
        result = evaluate(args.model, args.corpus, args.max_tokens, args.seq_len, args.batch_size, args.dtype)
        if args.greedy_prompts > 0:
            result.update(greedy_acceptance(args.model, args.greedy_prompts, dtype=args.dtype))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_eval(result))
    print(json.dumps(result, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0
