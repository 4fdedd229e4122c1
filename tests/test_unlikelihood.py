"""The repetition fine-tune (train.unlikelihood): what it penalises, that it makes a model's greedy
text repeat less while only the trunk moves, and that bad input is refused before any work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from card import card_main
from leanserve import LLM, SamplingParams
from leanserve.model.build import build_model
from leanserve.model.config import ModelConfig
from leanserve.model.loader import load_weights
from test_train import tiny_config, write_corpus
from train.forward import make_ctx, trunk_forward
from train.trainer import train
from train.unlikelihood import (
    Pool,
    UnlikelihoodConfig,
    repeated_ngram_mask,
    tune,
    unlikelihood_loss,
    unlikelihood_main,
)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus_dir) -> Path:
    out = tmp_path_factory.mktemp("model")
    train(tiny_config(out, corpus_dir, steps=40), log=lambda m: None)
    return out


def ul_loss_of(model_dir: Path, pool: Pool) -> float:
    cfg = ModelConfig.from_hf(model_dir)
    model = build_model(cfg, max_positions=64, dtype=torch.float32, with_mtp=True, backend="torch")
    load_weights(model, model_dir, progress=False)
    with torch.no_grad():
        _, logits = trunk_forward(model, pool.ids, make_ctx(model, *pool.ids.shape))
    return unlikelihood_loss(logits, pool.ids, pool.where, pool.candidates).item()


def test_a_token_is_a_candidate_where_its_ngram_already_occurred():
    # prefix [1, 2, 3] then a continuation that repeats "1 2 3" and then "2 3 9 9"'s first bigram only
    tokens = [1, 2, 3, 7, 1, 2, 3, 2, 3, 9]
    assert repeated_ngram_mask(tokens, 3, 3) == [False, True, True, True, False, False, False]
    assert repeated_ngram_mask(tokens, 3, 2) == [False, True, True, True, True, True, False]
    assert repeated_ngram_mask(list(range(12)), 0, 2) == [False] * 12  # nothing recurs


def test_the_loss_counts_only_candidates_and_pushes_their_probability_down():
    pool = Pool.build([[5, 6], [5]], [[5, 6, 5, 6], [7, 8]], length=8, n=2)
    assert pool.ids[0].tolist() == [5, 6, 5, 6, 5, 6, 2, 2] and pool.ids[1].tolist() == [5, 7, 8, 2, 2, 2, 2, 2]
    assert pool.where.sum() == 6 and pool.candidates.sum() == 4 and pool.repeating == 0.5
    logits = torch.zeros(2 * 8, 10, requires_grad=True)
    loss = unlikelihood_loss(logits, pool.ids, pool.where, pool.candidates)
    assert loss.item() == pytest.approx(-4 * torch.log(torch.tensor(0.9)).item() / 6, rel=1e-5)
    loss.backward()
    grads = logits.grad.view(2, 8, 10)
    assert grads[0, 1, 5] > 0 and grads[0, 0, 6] == 0  # candidate 5 after 5 6 pushed down; the first 6 is not
    assert torch.all(grads[1] == 0)  # the second continuation repeats nothing


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, trained, corpus_dir) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("tuned")
    uc = UnlikelihoodConfig(
        model=str(trained), out=str(out), corpus=str(corpus_dir), steps=12, batch_size=2, seq_len=64, gen_batch=8,
        gen_tokens=24, prefix_min=2, prefix_max=8, regen_every=4, ngram=2, w_ul=4.0, lr=3e-3, warmup_steps=0,
        threads=1, compile=False, eval_tokens=256, progress=False,
    )  # fmt: skip
    return out, tune(uc, log=lambda m: None)


def test_tuning_makes_the_greedy_text_repeat_less_and_moves_only_the_trunk(trained, tuned):
    out, record = tuned
    logs = [json.loads(line) for line in (out / "unlikelihood_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logs] == list(range(1, 13))
    assert record["pool_repeating_first"] == logs[0]["pool_repeating"]

    # the source's own greedy continuations of a few prompts: the tuned trunk gives their repeated tokens less
    # probability than the source did (what the loss asks for), at little cost to the rest
    llm = LLM(model=str(trained), max_model_len=64, load_progress=False)
    prompts = ["def func_1(items", "class Thing2:", "    for item in", "        result.append("]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    prefixes = [o.prompt_token_ids for o in outs]
    pool = Pool.build(prefixes, [list(o.outputs[0].token_ids) for o in outs], length=32, n=2)
    assert pool.candidates.sum() > 5  # the source repeats itself
    before, after = (ul_loss_of(m, pool) for m in (trained, out))
    assert after < before / 2, (before, after)

    old, new = load_file(str(trained / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(old) == set(new)
    assert all(torch.equal(old[n], new[n]) for n in old if n.startswith("mtp.") or n.endswith("gate.bias"))
    assert any(not torch.equal(old[n], new[n]) for n in old if not n.startswith("mtp."))
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["unlikelihood"]["steps"] == 12 and "train_config" in summary  # the training record is kept
    assert (out / "tokenizer.json").read_bytes() == (trained / "tokenizer.json").read_bytes()


def test_bad_input_is_refused_before_any_work(trained, corpus_dir, tmp_path, capsys):
    base = ["--corpus", str(corpus_dir), "--out", str(tmp_path / "out"), "--threads", "1"]
    cases = [
        (["--model", str(tmp_path / "missing")], "not a model directory"),
        (["--model", str(trained), "--steps", "0"], "steps must be a positive integer"),
        (["--model", str(trained), "--prefix-min", "9", "--prefix-max", "8"], "prefix_min (9) must not exceed"),
        (["--model", str(trained), "--w-ul", "-1"], "w_ul must be >= 0"),
        (["--model", str(trained), "--seq-len", "4"], "seq_len must be at least 8"),
    ]
    for args, message in cases:
        assert unlikelihood_main([*args, *base]) == 2, args
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_model_card_reports_the_fine_tune(tuned, tmp_path):
    pytest.importorskip("matplotlib", reason="the loss curve needs the 'train' extra: pip install -e '.[train]'")
    out, record = tuned
    model = tmp_path / "model"
    shutil.copytree(out, model)
    assert card_main(["--model", str(model), "--threads", "1"]) == 0
    readme = (model / "README.md").read_text()
    before, after = record["heldout_before"], record["heldout_after"]
    assert "### Repetition fine-tune" in readme and "scripts/unlikelihood.py" in readme
    row = f"| greedy completions that repeat themselves | {100 * before['greedy_repeating']:.2f}% | "
    assert row + f"{100 * after['greedy_repeating']:.2f}% |" in readme
    row = f"| trunk next-token top-1 accuracy | {100 * before['trunk_top1']:.2f}% | "
    assert row + f"{100 * after['trunk_top1']:.2f}% |" in readme
