"""`fp4_inputs="bfloat16"`: a published checkpoint's FP4 experts multiply their inputs rounded to bfloat16. The torch
backend and the CPU kernels (AVX512-BF16's vdpbf16ps where the CPU has it, float32 products of the rounded inputs
elsewhere) give the same tokens, with speculation too; the option changes the logits (it is honoured), and a value
or a model it does not fit is refused by name."""

from __future__ import annotations

import pytest

from leanserve import LLM, SamplingParams
from leanserve.model.build import build_model
from leanserve.model.config import ConfigError, ModelConfig


@pytest.fixture(scope="module")
def wide_pub(tmp_path_factory):
    # hidden 256: the experts' rows hold whole 128-value chunks (the tiny preset's 64 only a last, partial one)
    from leanserve.make_random import make_random

    return make_random(
        tmp_path_factory.mktemp("fp4-inputs"), "tiny", 3, format="published", expert_dtype="fp4",
        hidden_size=256, moe_intermediate_size=128, q_lora_rank=128, o_lora_rank=128, head_dim=64,
        qk_rope_head_dim=16, index_head_dim=64, index_n_heads=16,
    )  # fmt: skip


def _run(path, ids_of, **kwargs):
    prompts = [{"prompt_token_ids": ids_of(n, seed=n)} for n in (6, 33, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    with LLM(str(path), dtype="float32", max_model_len=128, max_num_seqs=3, load_progress=False, **kwargs) as llm:
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    return [(o.token_ids, [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids, strict=True)]) for o in outs]


def test_bfloat16_inputs_give_the_torch_backends_tokens(wide_pub, ids_of):
    ref = _run(wide_pub, ids_of, backend="torch", fp4_inputs="bfloat16")
    runs = {
        "cpu": _run(wide_pub, ids_of, backend="cpu", fp4_inputs="bfloat16"),
        "cpu+mtp": _run(
            wide_pub,
            ids_of,
            backend="cpu",
            fp4_inputs="bfloat16",
            speculative_config={"method": "mtp", "num_speculative_tokens": 2},
        ),  # fmt: skip
    }
    # Tokens equal. Logprobs within 0.02 (0.006 measured): the backends' float32 sums differ in their last bits (1e-6), and an
    # input that lands near the midpoint of two bfloat16 numbers can round to either, 2^-9 of its size.
    for name, outs in runs.items():
        for (want, want_lp), (got, got_lp) in zip(ref, outs, strict=True):
            assert got == want, name
            assert max(abs(a - b) for a, b in zip(want_lp, got_lp, strict=True)) < 2e-2, name
    exact = _run(wide_pub, ids_of, backend="cpu")
    moved = max(abs(a - b) for (_, lp), (_, lq) in zip(ref, exact, strict=True) for a, b in zip(lp, lq, strict=True))
    assert moved > 5e-2  # (0.09 measured; float32 inputs give other logprobs: the option is not ignored)


def test_fp4_inputs_refused_where_they_do_not_apply(wide_pub, tiny_ckpt):
    with pytest.raises(ConfigError, match="fp4_inputs must be one of .*'float16'"):
        LLM(str(wide_pub), fp4_inputs="float16", load_progress=False)
    with pytest.raises(ConfigError, match="fp4_inputs 'bfloat16' applies to FP4 experts, and this model has none"):
        LLM(str(tiny_ckpt), fp4_inputs="bfloat16", load_progress=False)
    with pytest.raises(ConfigError, match="this model has none"):
        build_model(ModelConfig.from_hf(tiny_ckpt), 16, fp4_inputs="bfloat16")
