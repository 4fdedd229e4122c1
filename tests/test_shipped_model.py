"""The shipped default model: it loads in transformers too, and both engines agree on greedy tokens; written in
DeepSeek's published format (FP8 linears, FP4 experts) it keeps its quality, and the two engines agree on it too."""

from pathlib import Path

import pytest
import torch

from leanserve import LLM, SamplingParams
from leanserve.model.loader import has_mtp_weights

MODEL = Path(__file__).resolve().parent.parent / "models" / "dsv4-stdlib-12l"
PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_files(path):\n    ",
    "class Stack:\n    def __init__(self):\n",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(model=str(MODEL), dtype="float32", max_model_len=512, load_progress=False)


def test_shipped_model_has_everything_a_user_needs():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md"):
        assert (MODEL / name).is_file(), name
    assert has_mtp_weights(MODEL)
    assert (MODEL / "model.safetensors").stat().st_size <= 20 * 1024 * 1024


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    """The shipped model written by `leanserve quantize`: FP8 linears with 128x128 block scales, FP4 experts."""
    from leanserve.quantize import quantize_checkpoint

    return quantize_checkpoint(MODEL, tmp_path_factory.mktemp("dsv4-stdlib-12l-fp4"))


def assert_greedy_tokens_equal_transformers(llm, model_dir: Path) -> None:
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist(), prompt


def test_greedy_tokens_equal_transformers(llm):
    assert_greedy_tokens_equal_transformers(llm, MODEL)


def test_published_format_greedy_tokens_equal_transformers(published):
    # leanserve keeps the FP8 / FP4 bytes and decodes them per call; transformers (with accelerate) dequantizes at
    # load. On trained weights and real text, where a wrong scale or a flipped FP4 code would show in the tokens.
    with LLM(model=str(published), dtype="float32", max_model_len=512, load_progress=False) as llm:
        assert llm.engine.model_config.quantization is not None
        assert_greedy_tokens_equal_transformers(llm, published)


def test_published_format_keeps_the_quality(published):
    # Rounding the linears to FP8 and the experts to FP4 (power-of-two scales) costs the model almost nothing on
    # held-out code: next-token top-1 within half a point, the loss within 0.02 nats (measured: 49.66% vs
    # 49.69%, 2.437 vs 2.433 on the first 16K held-out tokens; the README has the full figures).
    from leanserve.train import data
    from leanserve.train.evaluate import evaluate

    corpus = data.load_corpus()
    plain, quantized = (evaluate(m, corpus, max_tokens=8192, dtype="float32") for m in (MODEL, published))
    assert quantized["tokens"] == plain["tokens"] > 0
    assert quantized["trunk_top1"] >= plain["trunk_top1"] - 0.005, (plain, quantized)
    assert quantized["trunk_loss"] <= plain["trunk_loss"] + 0.02, (plain, quantized)
    assert quantized["mtp_agreement"] >= plain["mtp_agreement"] - 0.01, (plain, quantized)


def test_completion_is_python_like(llm):
    # A model that learned Python opens an indented function body after a signature; a random one does not.
    # (No trailing newline in the prompt: the tokenizer merges a newline with the indentation after it.)
    for prompt in ("def add(a, b):", "def fibonacci(n):", "class Stack:"):
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24))[0]
        assert out.outputs[0].text.startswith("\n    "), (prompt, out.outputs[0].text)


@pytest.mark.xfail(
    strict=True, reason="the default model's greedy completions still repeat on 3 of the 5 prompts (see its card)"
)
def test_everyday_completions_do_not_repeat_themselves(llm):
    # The model card's five everyday prompts: in 64 greedy tokens no run of 8 tokens occurs three times.
    import card  # scripts/card.py (conftest puts scripts/ on sys.path)

    for prompt in card.EVERYDAY_PROMPTS:
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=card.EVERYDAY_MAX_TOKENS))[0]
        ids = list(out.outputs[0].token_ids)
        assert card.most_repeated_span(ids) < 3, (prompt, out.outputs[0].text)
