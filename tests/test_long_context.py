"""Long context: a 16K-token prompt computed three ways agrees (one chunk, many chunks, the torch statement);
transformers agrees on a shorter prompt of the same model; RoPE tables keep their angles to a million positions."""

from __future__ import annotations

import math

import pytest
import torch

from leanserve import LLM, SamplingParams
from leanserve.model.backends.cpu import kernels as cpu_kernels
from leanserve.model.config import RopeConfig
from leanserve.model.layers import Rotary

LONG = 16384
NEW = 4


@pytest.fixture(scope="module")
def long_model(make_ckpt):
    # The tiny preset (window 16, CSA rate 4 with an indexer choosing 16 rows, HCA rate 16), able to hold 16K
    # tokens: a 16K prompt has 4096 CSA rows per query to choose from and 1024 HCA rows.
    return make_ckpt("long-context", seed=3, max_position_embeddings=LONG + 64, index_topk=16)


def _prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=gen).tolist()


def _run(path, prompt: list[int], chunk: int):
    llm = LLM(str(path), dtype="float32", max_model_len=len(prompt) + 2 * NEW, max_num_batched_tokens=chunk,
              load_progress=False)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=5, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
    return out.outputs[0]


def _assert_same(a, b, tol: float) -> None:
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        common = x.keys() & y.keys()
        assert len(common) >= 4  # (a near-tie may swap the fifth)
        for tok in common:
            assert abs(x[tok].logprob - y[tok].logprob) <= tol, (tok, x[tok].logprob, y[tok].logprob)


def test_a_16k_prompt_in_one_chunk_in_many_and_on_the_torch_statement(long_model):
    prompt = _prompt(LONG, 0)
    whole = _run(long_model, prompt, LONG)
    # Chunks of 1000 tokens: boundaries inside compression windows and query blocks. The CPU kernels are batch
    # invariant, so each token's arithmetic is the same in any chunk.
    chunked = _run(long_model, prompt, 1000)
    _assert_same(whole, chunked, 1e-6)
    # The torch statement (another arithmetic order throughout): the same tokens, and logprobs that agree up to
    # what a near-tie in the indexer's choice moves. Its scores round differently from the kernels' (and from one
    # host's matmuls to another's), so among 16K queries' top-16 of up to 4096 rows a few may swap a row at the
    # cut, and each swap moves the logprobs after it by up to a few 0.01 on this tiny random model (measured: 0.04
    # on a 4K prompt; with every row kept instead, the two agree to 2e-7).
    with cpu_kernels.disabled():
        reference = _run(long_model, prompt, 2048)
    _assert_same(whole, reference, 0.1)


def test_transformers_agrees_on_a_shorter_prompt_of_the_same_model(long_model):
    from transformers import DeepseekV4ForCausalLM

    prompt = _prompt(1024, 1)
    hf = DeepseekV4ForCausalLM.from_pretrained(long_model, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    ours = _run(long_model, prompt, 1024)
    first = ours.logprobs[0]
    assert ours.token_ids[0] == int(ref.argmax())
    for tok, entry in first.items():  # (to what a swapped row at the indexer's cut moves: see the test above)
        assert abs(entry.logprob - float(ref[tok])) <= 0.1


def test_rope_tables_keep_their_angles_to_a_million_positions():
    # The YaRN table of DeepSeek-V4-Flash's compressed rows, at the last of 2^20 positions: each angle is
    # position x frequency, made in float64 (in float32 the product loses up to 0.03 rad there).
    rope = RopeConfig(theta=160000.0, rope_type="yarn", factor=16.0, original_max_position_embeddings=65536)
    positions = 1 << 20
    table = Rotary(rope, 64, positions).freqs
    from leanserve.model.layers import rope_inv_freq

    inv = rope_inv_freq(rope, 64).tolist()
    for p in (1, 65535, 999_999, positions - 1):
        got = torch.angle(table[p]).double()
        for i, f in enumerate(inv):
            want = math.remainder(p * f, 2 * math.pi)
            err = abs(math.remainder(float(got[i]) - want, 2 * math.pi))
            assert err < 1e-5, (p, i, err)
