"""The `leanserve` command: make-random and generate, in-process through `main([...])` and once as a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from leanserve import LLM, SamplingParams
from leanserve.cli import main
from leanserve.make_random import make_random

VOCAB = 512


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_random(tmp_path_factory.mktemp("cli_tiny"), "tiny", seed=0)


@pytest.fixture(scope="module")
def ref(ckpt):
    """ref(prompt_ids, **sampling) -> the CompletionOutput LLM.generate gives for it."""
    llm = LLM(model=str(ckpt), max_num_seqs=1, load_progress=False)
    return lambda prompt, **kw: llm.generate({"prompt_token_ids": prompt}, SamplingParams(**kw))[0].outputs[0]


def run_json(capsys, *args: str) -> dict:
    assert main(["generate", *args, "--output", "json"]) == 0
    captured = capsys.readouterr()
    assert "error" not in captured.err
    (line,) = captured.out.strip().splitlines()  # exactly one JSON document on stdout
    return json.loads(line)


def error_line(capsys, argv: list[str]) -> str:
    """Runs main(argv) in-process, expects exit code 2 and returns the single error line from stderr."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err
    assert "Traceback" not in err
    # Only the error line may follow a (self-erasing, carriage-return) weight-loading progress bar.
    lines = [ln for ln in err.split("\n") if ln.strip()]
    assert len(lines) == 1, err
    last = lines[0].rsplit("\r", 1)[-1].strip()
    assert last.startswith("leanserve: error: "), err
    assert err.count("leanserve: error:") == 1
    return last


# --- make-random ------------------------------------------------------------------------------------------
def test_make_random_writes_a_checkpoint_and_refuses_to_overwrite(tmp_path, capsys):
    d = tmp_path / "rand"
    assert main(["make-random", str(d), "--preset", "tiny"]) == 0
    assert "tiny" in capsys.readouterr().out
    config = json.loads((d / "config.json").read_text())
    assert config["model_type"] == "deepseek_v4" and config["vocab_size"] == VOCAB
    weights = d / "model.safetensors"
    assert weights.stat().st_size > 0
    before = weights.read_bytes()

    msg = error_line(capsys, ["make-random", str(d), "--preset", "tiny", "--seed", "1"])
    assert "already exists" in msg and "--force" in msg
    assert weights.read_bytes() == before  # untouched

    assert main(["make-random", str(d), "--preset", "tiny", "--seed", "1", "--force"]) == 0
    capsys.readouterr()
    assert weights.read_bytes() != before  # rewritten with the other seed
    # The result loads and generates.
    (out,) = LLM(model=str(d), max_model_len=32, max_num_seqs=1, load_progress=False).generate(
        {"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=2)
    )
    assert len(out.outputs[0].token_ids) >= 1


# --- generate ---------------------------------------------------------------------------------------------
def test_generate_json_matches_llm_greedy(ckpt, ref, capsys):
    result = run_json(capsys, "--model", str(ckpt), "--prompt-token-ids", "1,2,3", "--max-tokens", "5")
    expected = ref([1, 2, 3], temperature=0, max_tokens=5)
    assert result["prompt_token_ids"] == [1, 2, 3]
    assert result["token_ids"] == expected.token_ids
    assert result["finish_reason"] == expected.finish_reason
    if result["finish_reason"] == "length":
        assert len(result["token_ids"]) == 5
    else:  # eos (1) before max_tokens
        assert result["finish_reason"] == "stop" and result["token_ids"][-1] == 1
    assert result["text"] == ""  # no tokenizer.json
    timing = result["timing"]
    assert isinstance(timing["prefill_ms"], int | float) and timing["prefill_ms"] >= 0
    if len(result["token_ids"]) > 1:
        assert isinstance(timing["decode_tokens_per_s"], int | float) and timing["decode_tokens_per_s"] > 0
    assert timing["total_s"] >= 0
    assert "logprobs" not in result


def test_generate_passes_sampling_options(ckpt, ref, capsys):
    result = run_json(
        capsys,
        *("--model", str(ckpt), "--prompt-token-ids", "7, 300,42,9", "--max-tokens", "6"),
        *("--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--seed", "3", "--logprobs", "2", "--ignore-eos"),
    )
    expected = ref(
        [7, 300, 42, 9], temperature=0.8, top_p=0.9, top_k=20, seed=3, max_tokens=6, logprobs=2, ignore_eos=True
    )
    assert result["token_ids"] == expected.token_ids and len(result["token_ids"]) == 6
    assert result["finish_reason"] == "length"
    assert len(result["logprobs"]) == 6
    for token, step, exp in zip(result["token_ids"], result["logprobs"], expected.logprobs, strict=True):
        assert str(token) in step
        assert step == pytest.approx({str(t): lp.logprob for t, lp in exp.items()}, abs=1e-5)
    greedy = ref([7, 300, 42, 9], temperature=0, max_tokens=6, ignore_eos=True)
    assert result["token_ids"] != greedy.token_ids  # the sampling options were applied


def test_generate_text_output(ckpt, ref, capsys):
    argv = ["generate", "--model", str(ckpt), "--prompt-token-ids", "5,6", "--max-tokens", "3", "--ignore-eos"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    expected = ref([5, 6], temperature=0, max_tokens=3, ignore_eos=True).token_ids
    assert captured.out.strip() == str(expected)  # without a tokenizer the ids are printed
    summary = captured.err.rsplit("\r", 1)[-1]
    assert "2 prompt tokens" in summary and "3 generated" in summary and "finish: length" in summary


# --- errors -----------------------------------------------------------------------------------------------
def test_error_missing_model_dir(tmp_path, capsys):
    msg = error_line(capsys, ["generate", "--model", str(tmp_path / "nowhere"), "--prompt-token-ids", "1"])
    assert "config.json" in msg


def test_error_unknown_model_type(tmp_path, ckpt, capsys):
    d = tmp_path / "llama"
    d.mkdir()
    config = json.loads((ckpt / "config.json").read_text())
    config["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(config))
    (d / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes())
    msg = error_line(capsys, ["generate", "--model", str(d), "--prompt-token-ids", "1"])
    assert "model_type" in msg and "llama" in msg


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--prompt-token-ids", f"1,{VOCAB}"], "out of range"),
        (["--prompt-token-ids", "1,-4"], "out of range"),
        (["--prompt-token-ids", "1,2", "--temperature", "-1"], "temperature"),
        (["--prompt-token-ids", "1,2", "--top-p", "0"], "top_p"),
        (["--prompt-token-ids", "1,2", "--max-tokens", "0"], "max_tokens"),
        (["--prompt-token-ids", "1,2", "--max-tokens", "40", "--max-model-len", "32"], "max_model_len"),
        (["--prompt", "hello"], "tokenizer"),
        (["--prompt-token-ids", "1,2", "--fp4-inputs", "bfloat16"], "fp4_inputs 'bfloat16' applies to FP4 experts"),
        (["--prompt-token-ids", "1,2", "--fp8-inputs", "bfloat16"], "fp8_inputs 'bfloat16' applies to FP8 weights"),
    ],
    ids=[
        "id-too-large",
        "id-negative",
        "temperature",
        "top-p",
        "max-tokens",
        "too-long",
        "text-no-tokenizer",
        "fp4-inputs-plain-model",
        "fp8-inputs-plain-model",
    ],  # fmt: skip
)
def test_generate_user_errors_exit_2_with_one_line(ckpt, capsys, args, needle):
    msg = error_line(capsys, ["generate", "--model", str(ckpt), *args])
    assert needle in msg


def test_malformed_arguments_exit_2(ckpt, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", str(ckpt), "--prompt-token-ids", "1,x"])
    assert exc.value.code == 2
    assert "leanserve generate: error:" in capsys.readouterr().err


# --- as a real process ------------------------------------------------------------------------------------
def test_console_script_end_to_end(ckpt, ref):
    script = Path(sys.executable).parent / "leanserve"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "leanserve.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ok = subprocess.run(
        [
            *cmd,
            "generate",
            "--model",
            str(ckpt),
            "--prompt-token-ids",
            "1,2,3",
            "--max-tokens",
            "4",
            "--output",
            "json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    result = json.loads(ok.stdout)  # stdout holds only the JSON document; progress goes to stderr
    assert result["token_ids"] == ref([1, 2, 3], temperature=0, max_tokens=4).token_ids
    assert result["finish_reason"] in ("length", "stop")


def test_bench_throughput_compares_both_engines(tmp_path, capsys):
    model = make_random(tmp_path / "m", "tiny", seed=3)
    args = ["bench", "throughput", "--model", str(model), "--batch-sizes", "1,2", "--max-tokens", "4"]
    assert main([*args, "--prompt-len", "20", "--repeats", "1", "--output", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    # both dtypes by default, side by side
    assert [(r["dtype"], r["batch_size"]) for r in rows] == [
        ("float32", 1),
        ("float32", 2),
        ("bfloat16", 1),
        ("bfloat16", 2),
    ]
    for r in rows:
        assert r["leanserve_tok_s"] > 0 and r["transformers_tok_s"] > 0
        assert r["speedup"] == pytest.approx(r["leanserve_tok_s"] / r["transformers_tok_s"], rel=0.02)
        # the same greedy work: in float32 both engines produce the same tokens (in bfloat16 transformers
        # rounds its activations, leanserve computes in float32: counted, not asserted)
        if r["dtype"] == "float32":
            assert r["identical_sequences"] == r["batch_size"]
        assert 0 <= r["identical_sequences"] <= r["batch_size"]


def test_bench_serve_vs_engine_puts_the_server_beside_the_engine(capsys):
    shipped = Path(__file__).resolve().parent.parent / "models" / "dsv4-stdlib-12l"  # (a tokenizer: code prompts)
    args = ["--log-level", "warning", "bench", "serve", "--vs-engine", "--model", str(shipped), "--max-tokens", "12"]
    assert main([*args, "--prompt-len", "8", "--repeats", "1", "--output", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["arm"] for r in rows] == [
        "engine: LLM.generate",
        "server: /v1/completions stream",
        "server: /v1/chat/completions stream",
    ]
    engine = rows[0]
    for r in rows:
        assert set(r) == {
            "arm", "tokens", "repeats", "ms_per_token", "ratio", "first_quarter_ms", "last_quarter_ms", "same_text",
        }  # fmt: skip
        assert r["tokens"] == 12 and r["repeats"] == 1 and r["ms_per_token"] > 0
        assert r["ratio"] == pytest.approx(r["ms_per_token"] / engine["ms_per_token"], rel=0.01)
    assert engine["ratio"] == 1.0
    assert rows[1]["same_text"] is True  # greedy, the same prompt: the server streams the engine's text
    # The table: a column per figure, a line per arm.
    assert main([*args, "--prompt-len", "8", "--repeats", "1"]) == 0
    header, *lines = capsys.readouterr().out.strip().splitlines()
    assert header.split() == [
        "arm", "tokens", "repeats", "ms/token", "vs", "engine", "1st", "quarter", "ms/tok", "last", "quarter", "ms/tok",
        "same", "text",
    ]  # fmt: skip
    assert len(lines) == 3


def test_bench_structured_puts_plain_requests_beside_constrained_ones(capsys):
    shipped = Path(__file__).resolve().parent.parent / "models" / "dsv4-stdlib-12l"  # (a tokenizer: the grammar)
    args = ["--log-level", "warning", "bench", "structured", "--model", str(shipped), "--batch-sizes", "2"]
    args += ["--constrained", "2", "--max-tokens", "6", "--prompt-len", "8", "--repeats", "1"]
    assert main([*args, "--output", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["arm"] for r in rows] == ["plain", "plain + constrained", "plain + unconstrained"]
    plain, bound, control = rows
    for r in rows:
        assert set(r) == {
            "arm", "plain", "beside", "plain_tok_s", "plain_step_ms", "vs_plain", "vs_same_batch",
            "constrained_tok_s", "grammar_ms", "plain_tokens_identical",
        }  # fmt: skip
        assert r["plain"] == 2 and r["plain_tok_s"] > 0 and r["plain_step_ms"] > 0 and r["grammar_ms"] >= 0
        assert r["vs_plain"] == pytest.approx(r["plain_tok_s"] / plain["plain_tok_s"], rel=0.01)
        assert r["plain_tokens_identical"] is True  # greedy: the plain requests' tokens beside others are the same
    assert [r["beside"] for r in rows] == [0, 2, 2] and plain["vs_plain"] == 1.0
    assert bound["vs_same_batch"] == pytest.approx(bound["plain_tok_s"] / control["plain_tok_s"], rel=0.01)
    assert bound["constrained_tok_s"] > 0
    assert (
        plain["vs_same_batch"] is None and plain["constrained_tok_s"] is None and control["constrained_tok_s"] is None
    )
    # The table: a column per figure, a line per arm.
    assert main([*args, "--max-tokens", "3"]) == 0
    header, *lines = capsys.readouterr().out.strip().splitlines()
    assert header.split() == [
        "arm", "plain", "beside", "plain", "tok/s", "plain", "step", "ms", "vs", "plain", "vs", "same", "batch",
        "constrained", "tok/s", "grammar", "ms/step", "plain", "tokens", "identical",
    ]  # fmt: skip
    assert len(lines) == 3
    assert main([*args, "--max-tokens", "1"]) == 2 and "--max-tokens at least 2" in capsys.readouterr().err


def test_prebuild_compiles_every_format_in_parallel_and_names_a_failure(capsys, monkeypatch):
    # (the kernels are in the cache already when make test runs this: each process loads them)
    assert main(["prebuild", "--jobs", "2"]) == 0
    assert "the CPU kernels for float32, fp8, bfloat16, fp4 weights are compiled" in capsys.readouterr().out
    assert main(["prebuild", "--jobs", "0"]) == 2
    assert "--jobs must be at least 1" in capsys.readouterr().err
    import leanserve.prebuild

    monkeypatch.setattr(leanserve.prebuild, "GROUPS", (("float64",),))
    assert main(["prebuild"]) == 1
    err = capsys.readouterr().err
    assert "compiling the kernels for float64 weights failed" in err and "expert" in err


def test_prebuild_clears_builds_made_from_other_kernel_sources(tmp_path):
    # numba would keep a kernel's build whose compiled-in callee (another file) changed: prebuild clears them all.
    from leanserve.prebuild import clear_stale_builds

    (tmp_path / "linear.py").write_text("A = 1\n")
    (tmp_path / "__pycache__").mkdir()
    built = [tmp_path / "__pycache__" / name for name in ("mix._hc_pre-1.py311.nbi", "mix._hc_pre-1.py311.1.nbc")]
    for path in built:
        path.write_text("old")
    assert clear_stale_builds(tmp_path) and not any(p.exists() for p in built)  # (no record: built from unknown)
    for path in built:
        path.write_text("new")
    assert not clear_stale_builds(tmp_path) and all(p.exists() for p in built)  # the same sources: kept
    (tmp_path / "linear.py").write_text("A = 2\n")
    assert clear_stale_builds(tmp_path) and not any(p.exists() for p in built)
