"""`leanserve add-chat-tokens` (leanserve.chat_tokens): the shipped model with DeepSeek-V4's chat tokens added keeps its
behaviour on plain prompts, encodes the chat tokens to single ids, generates from a chat prompt, and transformers
agrees with leanserve on it; make-random writes such checkpoints too; bad inputs are refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from leanserve import LLM, SamplingParams
from leanserve.chat_tokens import DSV4_CHAT_TOKENS, add_chat_tokens
from leanserve.cli import main
from leanserve.make_random import make_random
from leanserve.tokenizer import Tokenizer

MODEL = Path(__file__).resolve().parent.parent / "models" / "dsv4-stdlib-12l"
VOCAB = 4096  # the shipped model's
NEW_IDS = list(range(VOCAB, VOCAB + len(DSV4_CHAT_TOKENS)))
BOS, EOS, USER, ASSISTANT, THINK, END_THINK = NEW_IDS[:6]
CHAT = (
    "<｜begin▁of▁sentence｜>You write Python.<｜User｜>Write a function that adds two numbers.<｜Assistant｜><think>"
    "The user wants add(a, b).</think>def add(a, b):"
)
PLAIN = [
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n",
    "if __name__ == '__main__':\n    main()\n",  # the original model ends the file here: <eos> (1) at once
]


def engine(model_dir: Path) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", max_model_len=256, load_progress=False)


@pytest.fixture(scope="module")
def grown(tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("chat-tokens") / "dsv4-stdlib-12l-chat"
    assert add_chat_tokens(MODEL, dst, seed=0) == NEW_IDS
    return dst


@pytest.fixture(scope="module")
def grown_llm(grown):
    with engine(grown) as llm:
        yield llm


def test_the_copy_has_the_tokens_and_points_at_them(grown):
    config = json.loads((grown / "config.json").read_text())
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (VOCAB + 14, BOS, EOS)
    generation = json.loads((grown / "generation_config.json").read_text())
    # The new EOS first; the model's own <eos> still stops a plain completion.
    assert generation["bos_token_id"] == BOS and generation["eos_token_id"] == [EOS, 1]
    tok_config = json.loads((grown / "tokenizer_config.json").read_text())
    assert (tok_config["bos_token"], tok_config["eos_token"]) == DSV4_CHAT_TOKENS[:2]
    for name in ("README.md", "train_summary.json"):  # the other files come along
        assert (grown / name).read_bytes() == (MODEL / name).read_bytes()

    tok = Tokenizer.from_dir(grown)
    assert tok.vocab_size == VOCAB + 14
    for token, token_id in zip(DSV4_CHAT_TOKENS, NEW_IDS, strict=True):
        assert tok.encode(token, add_special_tokens=False) == [token_id], token
        assert tok.encode(f"x {token}y", add_special_tokens=False).count(token_id) == 1, token
    ids = tok.encode(CHAT, add_special_tokens=False)
    assert [t for t in ids if t >= VOCAB] == [BOS, USER, ASSISTANT, THINK, END_THINK]
    assert tok.decode(ids, skip_special_tokens=False) == CHAT
    # BOS / EOS are special (skipped on request), <think> and the rest are plain added tokens, as in DeepSeek's.
    assert tok.decode(ids) == CHAT.removeprefix(DSV4_CHAT_TOKENS[0])
    assert tok.decode([EOS, THINK, END_THINK]) == "<think></think>"
    # Text without chat tokens encodes as before (the plain prompt still starts with the model's own <bos>).
    original = Tokenizer.from_dir(MODEL)
    assert all(tok.encode(p) == original.encode(p) for p in PLAIN)


def test_old_rows_and_other_tensors_are_unchanged(grown):
    with safe_open(MODEL / "model.safetensors", "pt") as old, safe_open(grown / "model.safetensors", "pt") as new:
        names = sorted(old.keys())
        assert names == sorted(new.keys())
        grown_names = set()
        for name in names:
            a, b = old.get_tensor(name), new.get_tensor(name)
            assert a.dtype == b.dtype, name
            if b.shape != a.shape:
                grown_names.add(name)
                assert b.shape[0] == VOCAB + 14 and b.shape[1:] == a.shape[1:], name
                b = b[:VOCAB]
            assert torch.equal(a, b), name
    assert grown_names == {"model.embed_tokens.weight", "head.weight", "model.layers.0.ffn.gate.tid2eid"}
    with safe_open(grown / "model.safetensors", "pt") as f:
        tid2eid = f.get_tensor("model.layers.0.ffn.gate.tid2eid")[VOCAB:]
        head = f.get_tensor("head.weight").float()
    assert all(len(set(row.tolist())) == 2 for row in tid2eid) and int(tid2eid.max()) < 8  # 2 distinct of 8 experts
    # New head rows near the old rows' mean: small next to the rows of real tokens.
    assert head[VOCAB:].norm(dim=1).max() < head[:VOCAB].norm(dim=1).median()


def test_plain_prompts_complete_as_before(grown_llm):
    # What a user would notice: greedy completions of plain prompts, their text and where they stop, are the
    # original model's (a new token's logit sits near the old logits' mean, far below the greedy pick).
    params = SamplingParams(temperature=0, max_tokens=24)
    with engine(MODEL) as original:
        before = original.generate(PLAIN, params)
    after = grown_llm.generate(PLAIN, params)
    for b, a in zip(before, after, strict=True):
        assert a.prompt_token_ids == b.prompt_token_ids
        assert (a.outputs[0].token_ids, a.outputs[0].text) == (b.outputs[0].token_ids, b.outputs[0].text)
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
    assert after[-1].outputs[0].token_ids == [1] and after[-1].outputs[0].finish_reason == "stop"


def test_the_engine_generates_from_a_chat_prompt(grown_llm):
    ids = grown_llm.get_tokenizer().encode(CHAT, add_special_tokens=False)
    out = grown_llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=16))[0]
    assert out.prompt_token_ids == ids and len(out.outputs[0].token_ids) > 0
    # A text prompt takes the same path (after the tokenizer's own <bos>).
    text_out = grown_llm.generate(CHAT, SamplingParams(temperature=0, max_tokens=4))[0]
    assert text_out.prompt_token_ids == [0, *ids]


def test_transformers_agrees_on_a_chat_prompt(grown, grown_llm):
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM.from_pretrained(grown, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    ids = grown_llm.get_tokenizer().encode(CHAT, add_special_tokens=False)
    out = grown_llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    prompt = torch.tensor([ids])
    with torch.inference_mode():
        ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    assert out[0].outputs[0].token_ids == ref[0, len(ids) :].tolist()


@pytest.mark.parametrize("fmt", ["hf", "published"])
def test_make_random_with_a_tokenizer_and_chat_tokens(tmp_path, lean_loader, fmt):
    # The shipped tokenizer sets the vocabulary (4096 ids, not the tiny preset's 512); the chat tokens follow it.
    out = make_random(tmp_path / "tiny", "tiny", seed=3, format=fmt, tokenizer=MODEL, chat_tokens=True)
    config = json.loads((out / "config.json").read_text())
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (VOCAB + 14, BOS, EOS)
    assert Tokenizer.from_dir(out).token_to_id("<think>") == THINK
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [EOS, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # (no scratch directory left behind)
    model = lean_loader(out)
    assert model.embed.weight.shape[0] == model.head.weight.shape[0] == VOCAB + 14


def test_cli(tmp_path, capsys):
    src = tmp_path / "random"
    assert main(["make-random", str(src), "--tokenizer", str(MODEL)]) == 0
    assert json.loads((src / "config.json").read_text())["vocab_size"] == VOCAB
    assert main(["add-chat-tokens", str(src), str(tmp_path / "chat"), "--seed", "1"]) == 0
    assert f"{THINK}\t<think>" in capsys.readouterr().out
    assert main(["add-chat-tokens", str(src), str(tmp_path / "chat")]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["add-chat-tokens", str(src), str(tmp_path / "chat"), "--force"]) == 0
    assert main(["make-random", str(tmp_path / "none"), "--chat-tokens"]) == 2
    assert "needs a tokenizer" in capsys.readouterr().err


def test_refusals(tmp_path, grown):
    with pytest.raises(ValueError, match="already exists; pass --force"):
        add_chat_tokens(MODEL, grown)
    with pytest.raises(ValueError, match="is the source directory"):
        add_chat_tokens(grown, grown, force=True)
    with pytest.raises(ValueError, match="already has DeepSeek-V4 chat tokens"):
        add_chat_tokens(grown, tmp_path / "twice")
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    shutil.copy(MODEL / "config.json", no_tokenizer / "config.json")
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        add_chat_tokens(no_tokenizer, tmp_path / "out")
    mismatched = tmp_path / "mismatched"  # a 4096-id tokenizer on a 512-id model: the ids would not follow
    make_random(mismatched, "tiny")
    shutil.copy(MODEL / "tokenizer.json", mismatched / "tokenizer.json")
    with pytest.raises(ValueError, match="must agree"):
        add_chat_tokens(mismatched, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "twice").exists()
    with pytest.raises(ValueError, match="differs from the 4096 ids"):
        make_random(tmp_path / "bad", "tiny", tokenizer=MODEL, vocab_size=512)
