"""`leanserve bench formats --peer llama.cpp` without llama.cpp: what it says when the peer or its converter is
missing (before any checkpoint is written), its option, and its arithmetic (agreement, ratios, the format's
name). Nothing here needs llama-cpp-python installed, nor runs it where it is."""

from __future__ import annotations

import argparse
import inspect

import pytest

from leanserve.bench import formats, peer
from leanserve.cli import main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    formats.add_arguments(p)
    return p


def test_the_peer_option_takes_llama_cpp_only_and_is_off_by_default():
    assert _parser().parse_args([]).peer is None
    args = _parser().parse_args(["--peer", "llama.cpp", "--peer-converter", "/x/convert_hf_to_gguf.py"])
    assert (args.peer, args.peer_converter) == ("llama.cpp", "/x/convert_hf_to_gguf.py")
    with pytest.raises(SystemExit):
        _parser().parse_args(["--peer", "vllm"])


def test_a_missing_llama_cpp_python_is_one_sentence_before_any_checkpoint_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(peer, "installed_version", lambda: None)
    monkeypatch.setattr(formats, "make_checkpoints", _must_not_run)
    assert main(["bench", "formats", "--peer", "llama.cpp", "--dir", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.count(". ") == 0 and err.endswith(".")
    assert "llama-cpp-python 0.3.36 or later" in err and "pip install -e '.[peer]'" in err
    assert not (tmp_path / "ckpt").exists()


def test_an_old_llama_cpp_python_is_named_with_its_version(monkeypatch):
    monkeypatch.setattr(peer, "installed_version", lambda: (0, 3, 16))
    with pytest.raises(peer.PeerMissing, match=r"which is 0\.3\.16: install the extra"):
        peer.require(None)


def test_a_missing_converter_says_where_it_looked_and_how_to_get_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(peer, "installed_version", lambda: (0, 3, 36))
    monkeypatch.setattr(peer.importlib.util, "find_spec", lambda name: object())  # (gguf "installed")
    monkeypatch.setattr(peer, "CACHE", tmp_path / "cache")
    monkeypatch.delenv(peer.CONVERTER_ENV, raising=False)
    monkeypatch.setattr(formats, "make_checkpoints", _must_not_run)
    assert main(["bench", "formats", "--peer", "llama.cpp", "--dir", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "convert_hf_to_gguf.py" in err
    assert str(tmp_path / "cache" / "llama_cpp_python-0.3.36") in err
    assert "pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36" in err
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(peer.PeerMissing, match="not found at --peer-converter /nowhere"):
        peer.require("/nowhere")


def test_the_converter_is_found_as_a_script_a_llama_cpp_dir_or_an_unpacked_sdist(tmp_path, monkeypatch):
    monkeypatch.setattr(peer, "CACHE", tmp_path)
    script = tmp_path / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / peer.CONVERTER
    script.parent.mkdir(parents=True)
    script.write_text("")
    for place in (script, script.parent, tmp_path / "llama_cpp_python-0.3.36"):
        assert peer.find_converter(str(place), (0, 3, 36), env={}) == script
    assert peer.find_converter(None, (0, 3, 36), env={peer.CONVERTER_ENV: str(script.parent)}) == script
    assert peer.find_converter(None, (0, 3, 36), env={}) == script  # the cache, by the installed version
    assert peer.find_converter(None, (0, 3, 37), env={}) is None
    assert peer.find_converter(str(tmp_path / "elsewhere"), (0, 3, 36), env={}) is None


def test_agreement_counts_the_positions_where_the_tokens_are_the_same():
    assert peer.agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert peer.agreement([1, 2, 3, 4], [1, 9, 3, 9]) == 0.5
    assert peer.agreement([7] * 25, [7] * 24 + [8]) == 0.96
    with pytest.raises(ValueError):
        peer.agreement([1, 2], [1])
    with pytest.raises(ValueError):
        peer.agreement([], [])


def test_the_rows_give_each_engines_tok_s_and_its_ratio_to_llama_cpp():
    ours, theirs = peer.peer_rows(0.010, 0.016, "MXFP4 + Q8_0 (+ BF16, F32)", 0.9583)
    assert (ours.engine, ours.format, ours.step_ms, ours.tok_s) == ("leanserve", "FP8 + FP4 (published)", 10.0, 100.0)
    assert ours.vs_peer == 1.6 and ours.agreement is None
    assert (theirs.engine, theirs.step_ms, theirs.tok_s, theirs.vs_peer) == ("llama.cpp", 16.0, 62.5, 1.0)
    assert theirs.format == "MXFP4 + Q8_0 (+ BF16, F32)" and theirs.agreement == 0.958
    ours, _ = peer.peer_rows(0.010, 0.016, "MXFP4 + Q8_0", 0.9, {"fp4_inputs": "bfloat16", "fp8_inputs": "float32"})
    assert ours.format == "FP8 + FP4 (published), FP4 x bfloat16 inputs"
    both = {"fp4_inputs": "bfloat16", "fp8_inputs": "bfloat16"}
    ours, _ = peer.peer_rows(0.010, 0.016, "MXFP4 + Q8_0", 0.9, both)
    assert ours.format == "FP8 + FP4 (published), FP4 x bfloat16 inputs, FP8 x bfloat16 inputs"
    ours, _ = peer.peer_rows(0.010, 0.016, "MXFP4 + Q8_0", 0.9, {"fp4_inputs": "int8", "fp8_inputs": "float32"})
    assert ours.format == "FP8 + FP4 (published), FP4 x int8 inputs"


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_the_inputs_options_take_float32_or_bfloat16_fp4_int8_and_are_float32_by_default(fmt):
    from leanserve.bench.options import inputs_of

    assert inputs_of(_parser().parse_args([])) == {"fp4_inputs": "float32", "fp8_inputs": "float32"}
    assert getattr(_parser().parse_args([f"--{fmt}-inputs", "bfloat16"]), f"{fmt}_inputs") == "bfloat16"
    with pytest.raises(SystemExit):
        _parser().parse_args([f"--{fmt}-inputs", "float16"])
    if fmt == "fp4":
        assert _parser().parse_args(["--fp4-inputs", "int8"]).fp4_inputs == "int8"
    else:  # (int8 is FP4's only)
        with pytest.raises(SystemExit):
            _parser().parse_args(["--fp8-inputs", "int8"])


def test_the_format_names_the_types_holding_most_bytes():
    assert peer.format_name({"Q8_0": 300, "MXFP4": 600, "BF16": 50, "F32": 2}) == "MXFP4 + Q8_0 (+ BF16, F32)"
    assert peer.format_name({"Q8_0": 10}) == "Q8_0"
    assert peer.format_name({"F32": 1, "BF16": 1}, share=0.6) == "F32 (+ BF16)"


def test_the_peer_uses_the_prompt_formats_decodes():
    assert inspect.signature(formats.formats_bench).parameters["prompt_len"].default == peer.PROMPT_LEN


def test_the_conversion_tokenizer_loads_and_holds_the_bench_configs_special_tokens(tmp_path):
    from tokenizers import Tokenizer

    peer.write_tokenizer(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert [tok.token_to_id(t) for t in ("<s>", "</s>")] == [0, 1]  # bench_config's bos and eos
    assert tok.get_vocab_size() < formats.bench_config(vocab_size=1024).vocab_size
    assert tok.decode(tok.encode("def f(x): return x").ids) == "def f(x): return x"


def test_a_checkpoint_with_rates_llama_cpp_cannot_load_is_refused_before_conversion(tmp_path):
    published = tmp_path / "published"
    published.mkdir()
    (published / "config.json").write_text('{"compress_ratios": [0, 4, 16]}')  # the shipped model's HCA rate
    with pytest.raises(ValueError, match=r"rates \(0, 4, 128\) only; .* has \[0, 4, 16\]"):
        peer.convert(published, tmp_path / "no-converter.py")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["published"]


def _must_not_run(*args, **kwargs):
    raise AssertionError("a checkpoint was made before the peer's check")


def test_llama_cpp_gets_its_extra_weight_buffers_except_on_a_host_with_amx():
    assert peer.extra_buffers({"avx512f": True, "avx512bf16": True})
    assert not peer.extra_buffers({"avx512f": True, "amx-tile": True})


def test_the_model_params_hold_the_fields_only_inside_the_block():
    llama_cpp = pytest.importorskip("llama_cpp")
    assert llama_cpp.llama_model_default_params().use_extra_bufts
    with peer._model_params(use_extra_bufts=False):
        from llama_cpp import llama as llama_module

        assert not llama_module.llama_cpp.llama_model_default_params().use_extra_bufts
    assert llama_cpp.llama_model_default_params().use_extra_bufts
