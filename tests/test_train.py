"""The training tooling (train): bad input is refused before any training, a tiny run writes a model
directory leanserve loads and generates from, and a run is a pure function of its seed."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import card  # scripts/card.py: conftest puts scripts/ on sys.path
from card import card_main
from leanserve import LLM, SamplingParams
from leanserve.model.config import ConfigError
from leanserve.model.torch_math import mhc
from train import data
from train import forward as fwd
from train.architecture import model_config, new_model
from train.evaluate import eval_main, evaluate
from train.forward import check_parity
from train.trainer import TrainConfig, train, train_main

# Every path (sliding / CSA / HCA, hash and top-k MoE, an indexer that selects 4 of up to 16 rows), tiny.
TINY_MODEL = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=2,
    head_dim=32,
    qk_rope_head_dim=16,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    hc_mult=2,
    sliding_window=16,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=4,
)
TINY_CLI = [
    "--threads", "1", "--batch-size", "2", "--seq-len", "64", "--vocab-size", "320",
    "--hidden", "64", "--layers", "3", "--heads", "2", "--head-dim", "32", "--experts", "4", "--moe-inter", "32",
    "--hc-mult", "2", "--model-json",
    '{"qk_rope_head_dim": 16, "q_lora_rank": 32, "o_lora_rank": 32, "sliding_window": 16, '
    '"index_n_heads": 2, "index_head_dim": 16, "index_topk": 4}',
]  # fmt: skip

SOURCE = '''
def {name}(items, key=None):
    """Return the items sorted by key, dropping None values."""
    result = []
    for item in items:
        if item is None:
            continue
        result.append(item if key is None else key(item))
    return sorted(result)


class {cls}:
    def __init__(self, value):
        self.value = value

    def __repr__(self):
        return f"{cls}({{self.value!r}})"
'''


def write_corpus(root: Path, n_files: int = 6) -> Path:
    """A few small modules, at least one of them in the held-out split, plus files that must be ignored."""
    root.mkdir(parents=True, exist_ok=True)
    names = [f"mod_{i}.py" for i in range(n_files)]
    heldout = next(f"extra_{i}.py" for i in range(10_000) if data.is_heldout(f"extra_{i}.py"))
    for i, name in enumerate([*names, heldout]):
        (root / name).write_text(SOURCE.format(name=f"func_{i}", cls=f"Thing{i}") * 3)
    for ignored in ("test", "tests", "site-packages"):
        (root / ignored).mkdir()
        (root / ignored / "ignored.py").write_text("IGNORED = True\n")
    return root


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def tiny_config(out: Path, corpus: Path, **kw) -> TrainConfig:
    args = dict(
        out=str(out),
        corpus=str(corpus),
        steps=3,
        batch_size=2,
        seq_len=64,
        lr=1e-2,
        warmup_steps=0,
        threads=1,
        vocab_size=320,
        eval_tokens=0,
        progress=False,
        model=dict(TINY_MODEL),
    )
    return TrainConfig(**{**args, **kw})


def losses_of(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus_dir) -> Path:
    out = tmp_path_factory.mktemp("model")
    train(tiny_config(out, corpus_dir), log=lambda m: None)
    return out


# --- refused before training --------------------------------------------------------------------------------
def run_cli(args: list[str], capsys) -> tuple[int, str]:
    rc = train_main(args)
    return rc, capsys.readouterr().err


def test_missing_corpus_is_refused(tmp_path, capsys):
    rc, err = run_cli(["--out", str(tmp_path / "out"), "--corpus", str(tmp_path / "nowhere"), "--steps", "3"], capsys)
    assert rc == 2
    assert "does not exist" in err and "nowhere" in err
    assert not (tmp_path / "out").exists()


def test_empty_corpus_is_refused(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, err = run_cli(["--out", str(tmp_path / "out"), "--corpus", str(empty), "--steps", "3"], capsys)
    assert rc == 2 and "no .py files" in err
    # only test / site-packages files, or only empty files: nothing to train on either
    (empty / "tests").mkdir()
    (empty / "tests" / "test_x.py").write_text("x = 1\n")
    rc, err = run_cli(["--out", str(tmp_path / "out"), "--corpus", str(empty), "--steps", "3"], capsys)
    assert rc == 2 and "no .py files" in err
    (empty / "blank.py").write_text("\n\n")
    rc, err = run_cli(["--out", str(tmp_path / "out"), "--corpus", str(empty), "--steps", "3"], capsys)
    assert rc == 2 and "no usable training files" in err
    assert not (tmp_path / "out").exists()


def test_bad_model_config_is_refused(tmp_path, corpus_dir, capsys):
    out = tmp_path / "out"
    args = ["--out", str(out), "--corpus", str(corpus_dir), "--steps", "3", *TINY_CLI]
    rc, err = run_cli([*args, "--heads", "3"], capsys)
    assert rc == 2 and "num_attention_heads (3) must be divisible by o_groups (2)" in err
    rc, err = run_cli([*args, "--layers", "2"], capsys)
    assert rc == 2 and "every attention kind" in err
    rc, err = run_cli([*args, "--model-json", '{"no_such_field": 1}'], capsys)
    assert rc == 2 and "no_such_field" in err
    rc, err = run_cli([*args, "--batch-size", "0"], capsys)
    assert rc == 2 and "batch_size" in err
    assert not out.exists()
    with pytest.raises(ConfigError, match="o_groups"):
        model_config(num_attention_heads=4, o_groups=3)


def test_corpus_too_small_for_one_sequence_is_refused(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    (small / "a.py").write_text("x = 1\n")
    with pytest.raises(data.CorpusError, match="fewer than one training sequence"):
        train(tiny_config(tmp_path / "out", small), log=lambda m: None)


# --- data ----------------------------------------------------------------------------------------------------
def test_corpus_split_and_tokenizer(corpus_dir):
    corpus = data.load_corpus(corpus_dir)
    assert all("ignored" not in d.relpath for d in corpus.train + corpus.heldout)
    assert [d.relpath for d in corpus.heldout] == [d.relpath for d in corpus.heldout if data.is_heldout(d.relpath)]
    assert len(corpus.heldout) >= 1 and len(corpus.train) >= 6
    assert data.is_heldout("email/parser.py") == data.is_heldout("email/parser.py")
    tok = data.train_tokenizer([d.text for d in corpus.train], 320)
    assert [tok.token_to_id(t) for t in ("<bos>", "<eos>", "<pad>")] == [0, 1, 2]
    stream = data.encode_documents(tok, corpus.train[:2])
    assert stream[0] == data.BOS_ID and stream[-1] == data.EOS_ID
    assert int((stream == data.BOS_ID).sum()) == 2
    text = corpus.train[0].text
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text  # byte-level: lossless
    assert tok.encode("x").ids[0] == data.BOS_ID  # prompts get <bos>, like the training documents


def test_a_corpus_of_several_directories(corpus_dir, tmp_path, capsys):
    # The first directory's files keep their paths (so its held-out split is the one it has alone), a further
    # directory's are prefixed with its name; a missing one or two of one name are refused before training.
    extra = write_corpus(tmp_path / "pkg", n_files=3)
    spec = os.pathsep.join([str(corpus_dir), str(extra)])
    alone, both = data.load_corpus(corpus_dir), data.load_corpus(spec)
    paths = {d.relpath for d in both.train + both.heldout}
    assert {d.relpath for d in alone.train + alone.heldout} <= paths
    own = data.load_corpus(extra)
    assert {p for p in paths if p.startswith("pkg/")} == {f"pkg/{d.relpath}" for d in own.train + own.heldout}
    assert {d.relpath for d in both.heldout} == {p for p in paths if data.is_heldout(p)}
    assert str(extra) in both.summary()
    missing = os.pathsep.join([str(corpus_dir), str(tmp_path / "nowhere")])
    rc, err = run_cli(["--out", str(tmp_path / "out"), "--corpus", missing, "--steps", "3"], capsys)
    assert rc == 2 and "nowhere" in err and "does not exist" in err
    twice = os.pathsep.join([str(corpus_dir), str(extra), str(extra)])
    rc, err = run_cli(["--out", str(tmp_path / "out"), "--corpus", twice, "--steps", "3"], capsys)
    assert rc == 2 and "distinct names" in err
    assert not (tmp_path / "out").exists()


def test_training_forward_matches_inference_forward():
    cfg = model_config(vocab_size=320, **TINY_MODEL)
    model = new_model(cfg, seq_len=96, seed=0)
    ids = torch.randint(0, 320, (2, 98), generator=torch.Generator().manual_seed(0))
    assert check_parity(model, ids) < 1e-4


def test_compiled_mhc_trains_the_same_model_as_eager_mhc():
    # torch.compile changes how fast mHC's ops run, not what is learned: same losses and gradients.
    model = trained_like_model("torch")
    ids = torch.randint(0, 320, (2, 98), generator=torch.Generator().manual_seed(0))
    if fwd.compiled_mhc() is None:
        pytest.skip("torch.compile cannot compile on this machine (no C++ compiler)")
    eager, compiled = (fwd.make_ctx(model, 2, 96, compiled=c) for c in (False, True))
    assert compiled.hc_pre is not mhc.hc_pre and eager.hc_pre is mhc.hc_pre
    grads = []
    for ctx in (eager, compiled):
        model.zero_grad(set_to_none=True)
        losses = fwd.compute_losses(model, ids, ctx, 0.3, 1.0)
        losses.total.backward()
        grads.append((losses.lm, losses.mtp, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (lm_e, mtp_e, g_e), (lm_c, mtp_c, g_c) = grads
    assert abs(lm_e - lm_c) < 1e-5 and abs(mtp_e - mtp_c) < 1e-5
    assert all(torch.allclose(a, b, rtol=1e-3, atol=1e-5) for a, b in zip(g_e, g_c, strict=True))


def test_training_runs_eagerly_where_torch_compile_cannot(monkeypatch, tmp_path, corpus_dir, caplog):
    def no_compiler(fn, **kw):
        def fails(*a, **k):
            raise RuntimeError("no C++ compiler")

        return fails

    fwd.compiled_mhc.cache_clear()
    monkeypatch.setattr(torch, "compile", no_compiler)
    try:
        with caplog.at_level("WARNING", logger="leanserve"):
            summary = train(tiny_config(tmp_path / "out", corpus_dir), log=lambda m: None)
        assert "torch.compile is unavailable (RuntimeError); mHC runs eagerly" in caplog.text
        assert summary["steps"] == 3 and (tmp_path / "out" / "model.safetensors").is_file()
    finally:
        fwd.compiled_mhc.cache_clear()


def trained_like_model(backend: str):
    """TINY_MODEL (sliding, CSA, HCA; hash and top-k MoE) with the parameters the init leaves at 0 or 1 (mHC
    base and scale, sinks, ape, norms, router biases) made random, so that none of them can drift unseen."""
    from leanserve.model.backends import select_backend
    from leanserve.model.layers import set_backend

    model = new_model(model_config(vocab_size=320, **TINY_MODEL), seq_len=96, seed=0)
    set_backend(model, select_backend("cpu", torch.float32, backend))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("ape"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_training_forward_matches_inference_forward_on_every_path(backend):
    # 96 tokens: 24 CSA rows of which the indexer keeps 4, 6 HCA rows, six sliding windows.
    model = trained_like_model(backend)
    ids = torch.randint(0, 320, (2, 98), generator=torch.Generator().manual_seed(0))
    assert check_parity(model, ids) < 1e-4


@pytest.mark.parametrize("drift", ["the indexer picks the lowest", "entries visible a token early"])
def test_parity_check_catches_a_training_layout_that_drifts(monkeypatch, drift):
    model = trained_like_model("torch")
    ids = torch.randint(0, 320, (2, 98), generator=torch.Generator().manual_seed(0))
    if drift == "the indexer picks the lowest":
        scores = fwd.index_scores_all
        monkeypatch.setattr(fwd, "index_scores_all", lambda *a: -scores(*a))
    else:
        make_ctx = fwd.make_ctx

        def early(model, batch, length):
            ctx = make_ctx(model, batch, length)
            for kind, visible in ctx.visible.items():
                ctx.visible[kind] = torch.cat([visible[1:], visible[-1:]])
            return ctx

        monkeypatch.setattr(fwd, "make_ctx", early)
    with pytest.raises(RuntimeError, match="disagrees"):
        check_parity(model, ids)


# --- a tiny run --------------------------------------------------------------------------------------------------
def test_tiny_run_writes_a_model_leanserve_loads(trained, corpus_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "train_log.jsonl"):
        assert (trained / name).is_file(), name
    assert json.loads((trained / "generation_config.json").read_text()) == {
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    }
    config = json.loads((trained / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["dtype"] == "bfloat16"
    with safe_open(str(trained / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert any(n.startswith("mtp.0.") for n in names)
    records = [json.loads(line) for line in (trained / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert set(records[0]) >= {"step", "tokens", "loss", "mtp_loss", "lr", "elapsed"}
    assert records[-1]["loss"] < records[0]["loss"]

    llm = LLM(model=str(trained), max_model_len=128, load_progress=False)
    out = llm.generate("def func_1(items", SamplingParams(temperature=0, max_tokens=8))[0]
    assert out.prompt_token_ids[0] == data.BOS_ID
    assert 1 <= len(out.outputs[0].token_ids) <= 8 and isinstance(out.outputs[0].text, str)

    figures = evaluate(trained, corpus_dir, seq_len=32, dtype="float32")
    for key in ("trunk_top1", "mtp_agreement", "mtp_top1"):
        assert 0.0 <= figures[key] <= 1.0
    assert figures["tokens"] > 0 and figures["heldout_files"] == 1


def test_same_seed_same_losses(trained, tmp_path, corpus_dir):
    again = tmp_path / "again"
    train(tiny_config(again, corpus_dir), log=lambda m: None)
    assert losses_of(again) == losses_of(trained)
    assert (again / "model.safetensors").read_bytes() == (trained / "model.safetensors").read_bytes()
    other = tmp_path / "other"
    train(tiny_config(other, corpus_dir, seed=1), log=lambda m: None)
    assert losses_of(other) != losses_of(trained)


# --- the model card ------------------------------------------------------------------------------------------------
def test_model_card_reports_the_run_and_the_eval_figures(trained, corpus_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the loss curve needs the 'train' extra: pip install -e '.[train]'")
    model = tmp_path / "model"
    shutil.copytree(trained, model)
    figures_path = tmp_path / "eval.json"
    args = ["--model", str(model), "--corpus", str(corpus_dir), "--seq-len", "32", "--threads", "1"]
    with pytest.raises(SystemExit):
        eval_main([*args, "--greedy-prompts", "-1"])
    assert "--greedy-prompts must be 0 or more, got -1" in capsys.readouterr().err
    assert eval_main([*args, "--greedy-prompts", "2", "--json-out", str(figures_path)]) == 0
    printed = capsys.readouterr().out
    figures = json.loads(figures_path.read_text())
    stdout_copy = tmp_path / "eval_stdout.txt"
    stdout_copy.write_text(printed)
    assert card.read_eval_json(stdout_copy) == figures  # eval_small.py's whole stdout is accepted too

    assert card_main(["--model", str(model), "--eval-json", str(figures_path), "--threads", "1"]) == 0
    png = (model / "loss_curve.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
    readme = (model / "README.md").read_text()
    summary = json.loads((model / "train_summary.json").read_text())
    for key in ("trunk_top1", "mtp_agreement", "mtp_top1", "mtp_greedy_acceptance"):
        assert f"{100 * figures[key]:.2f}%" in readme
    assert figures["greedy_prompts"] == 2 and figures["mtp_greedy_drafts"] > 0
    assert "scripts/eval_small.py --model" in readme and f"--max-tokens {figures['tokens']}" in readme
    assert "--greedy-prompts 2" in readme
    assert f"{summary['parameters']:,}" in readme and f"{summary['train_stream_tokens']:,}" in readme
    assert "![" in readme and "(loss_curve.png)" in readme
    assert "def fibonacci(n):" in readme and "leanserve generate --model" in readme
    assert "## Everyday completions" in readme and all(repr(p) in readme for p in card.EVERYDAY_PROMPTS)
    cfg_layers = json.loads((model / "config.json").read_text())["layer_types"]
    assert len(cfg_layers) == 3 and "heavily compressed (HCA)" in readme and "hash-routed" in readme

    # without --eval-json the card takes the figures from train_summary.json; this run recorded none
    assert card_main(["--model", str(model), "--threads", "1"]) == 0
    assert "No held-out figures" in (model / "README.md").read_text()


def test_a_repeated_span_is_counted_where_it_recurs():
    assert card.most_repeated_span([1, 2, 3] * 4, span=3) == 4
    assert card.most_repeated_span(list(range(20)), span=8) == 1
    assert card.most_repeated_span([5] * 7, span=8) == 0


# --- MTP self-distillation -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def distilled(tmp_path_factory, trained, corpus_dir) -> tuple[Path, dict]:
    from train.distill import DistillConfig, distill

    out = tmp_path_factory.mktemp("distilled")
    dc = DistillConfig(
        model=str(trained), out=str(out), corpus=str(corpus_dir), steps=12, batch_size=2, seq_len=64, lr=1e-2,
        warmup_steps=0, threads=1, eval_tokens=256, progress=False,
    )  # fmt: skip
    return out, distill(dc, log=lambda m: None)


def test_distillation_fits_the_mtp_layer_to_the_trunk_and_leaves_the_trunk_alone(trained, distilled):
    from safetensors.torch import load_file

    out, record = distilled
    old, new = load_file(str(trained / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(old) == set(new)
    trunk = [n for n in old if not n.startswith("mtp.")]
    assert trunk and all(torch.equal(old[n], new[n]) for n in trunk)
    assert any(not torch.equal(old[n], new[n]) for n in old if n.startswith("mtp."))

    records = [json.loads(line) for line in (out / "distill_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    first, last = records[:3], records[-3:]
    assert sum(r["soft_ce"] for r in last) < sum(r["soft_ce"] for r in first)  # it learns the trunk's distribution
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["mtp_distill"]["steps"] == 12 and summary["heldout"] == record["heldout_after"]
    before, after = record["heldout_before"], record["heldout_after"]
    assert after["trunk_top1"] == before["trunk_top1"] and after["trunk_loss"] == pytest.approx(before["trunk_loss"])
    assert (out / "tokenizer.json").read_bytes() == (trained / "tokenizer.json").read_bytes()

    # Speculation with the distilled MTP layer is still lossless against plain greedy decoding of the source.
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(model=str(trained), max_model_len=128, load_progress=False).generate("class Thing1:", p)[0]
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    llm = LLM(model=str(out), max_model_len=128, load_progress=False, speculative_config=spec)
    assert llm.generate("class Thing1:", p)[0].outputs[0].token_ids == plain.outputs[0].token_ids


def test_distillation_refuses_bad_input_before_any_work(trained, corpus_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    from train.distill import distill_main

    base = ["--corpus", str(corpus_dir), "--out", str(tmp_path / "out"), "--threads", "1"]
    no_mtp = tmp_path / "no_mtp"
    shutil.copytree(trained, no_mtp)
    tensors = load_file(str(no_mtp / "model.safetensors"))
    save_file({n: t for n, t in tensors.items() if not n.startswith("mtp.")}, str(no_mtp / "model.safetensors"))
    cases = [
        (["--model", str(no_mtp)], "no MTP weights"),
        (["--model", str(tmp_path / "missing")], "not a model directory"),
        (["--model", str(trained), "--steps", "0"], "steps must be a positive integer"),
        (["--model", str(trained), "--w-data", "2"], "w_data must be in [0, 1]"),
        (["--model", str(trained), "--seq-len", "4"], "seq_len must be at least 8"),
    ]
    for args, message in cases:
        assert distill_main([*args, *base]) == 2, args
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_model_card_reports_the_distillation(distilled, tmp_path):
    pytest.importorskip("matplotlib", reason="the loss curve needs the 'train' extra: pip install -e '.[train]'")
    out, record = distilled
    model = tmp_path / "model"
    shutil.copytree(out, model)
    assert card_main(["--model", str(model), "--threads", "1"]) == 0
    readme = (model / "README.md").read_text()
    before, after = record["heldout_before"], record["heldout_after"]
    assert "### MTP self-distillation" in readme and "scripts/distill_mtp.py" in readme
    row = f"| MTP agreement with the trunk's greedy next-next token | {100 * before['mtp_agreement']:.2f}% | "
    assert row + f"{100 * after['mtp_agreement']:.2f}% |" in readme
    # the held-out section shows the model as it is now: the figures after distillation
    assert (
        f"| MTP top-1 agreement with the trunk's greedy next-next token | {100 * after['mtp_agreement']:.2f}% |"
        in readme
    )
