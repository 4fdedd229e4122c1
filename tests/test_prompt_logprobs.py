"""Prompt logprobs (vLLM's `prompt_logprobs`) on the tiny random checkpoint, float32 on CPU: equal to transformers'
full-sequence forward and to the engine's own logprobs of the same tokens generated one by one; the same through
chunked prefill, a two-stage pipeline and speculative decoding; no change to the requests that do not ask; and
`max_tokens=0`, scoring a prompt without generating."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DeepseekV4ForCausalLM

from leanserve import LLM, SamplingParams
from leanserve.engine.runner import StepPlan
from leanserve.engine.scheduler import Scheduler, SeqUpdate
from leanserve.engine.sequence import SampledToken, SeqOutput, Sequence

MAX_LEN = 160
TOP = 5
SCORE = SamplingParams(prompt_logprobs=TOP, max_tokens=0)


def engine(ckpt, **kwargs) -> LLM:
    kwargs.setdefault("max_num_batched_tokens", 256)
    return LLM(str(ckpt), max_model_len=MAX_LEN, max_num_seqs=4, load_progress=False, **kwargs)


def tok(ids: list[int]) -> dict:
    return {"prompt_token_ids": ids}


@pytest.fixture(scope="module")
def whole(tiny_ckpt):
    """Every prompt here prefilled in one chunk."""
    with engine(tiny_ckpt) as llm:
        yield llm


@pytest.fixture(scope="module")
def chunked(tiny_ckpt):
    """A token budget of 16: the prompts here span several chunks, mixed with other requests' chunks."""
    with engine(tiny_ckpt, max_num_batched_tokens=16) as llm:
        yield llm


@pytest.fixture(scope="module")
def prompts(ids_of) -> list[list[int]]:
    # Lengths that cross the tiny preset's sliding window (16) and compression rates (4, 16); one token alone.
    return [ids_of(n, seed=300 + n) for n in (70, 23, 41, 1)]


# A mix: scoring only, generating with prompt logprobs (greedy and seeded sampling), and requests without them.
MIXED = [
    SCORE,
    SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=3, prompt_logprobs=2),
    SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=9, ignore_eos=True, prompt_logprobs=0),
    SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=3),
]


def plain(p: SamplingParams) -> SamplingParams:
    """The same request without prompt logprobs (a scoring-only one generates a token instead)."""
    return dataclasses.replace(p, prompt_logprobs=None, max_tokens=max(p.max_tokens, 1))


def assert_same_entries(want, got, tol: float = 1e-5) -> None:
    assert len(want) == len(got)
    for a, b in zip(want, got, strict=True):
        if a is None:
            assert b is None
            continue
        assert a.keys() == b.keys()
        for t in a:
            assert a[t].rank == b[t].rank
            assert abs(a[t].logprob - b[t].logprob) <= tol, (t, a[t], b[t])


def assert_same_outputs(want, got) -> None:
    for a, b in zip(want, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert (a.outputs[0].logprobs is None) == (b.outputs[0].logprobs is None)
        assert_same_entries(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [])
        assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
        assert_same_entries(a.prompt_logprobs or [], b.prompt_logprobs or [])


@pytest.fixture(scope="module")
def mixed_reference(whole, prompts):
    return whole.generate([tok(p) for p in prompts], MIXED)


# --- the values -----------------------------------------------------------------------------------------
def test_prompt_logprobs_match_a_transformers_full_forward(whole, tiny_ckpt, prompts):
    ids = prompts[0]
    (res,) = whole.generate(tok(ids), SCORE)
    hf = DeepseekV4ForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    got = res.prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        entry, row = got[i], ref[i - 1]
        assert abs(entry[ids[i]].logprob - row[ids[i]].item()) <= 1e-4
        top_lp, top_ids = row.topk(TOP)
        ranked = {t: e for t, e in entry.items() if e.rank is not None}
        assert [ranked[t].rank for t in top_ids.tolist()] == list(range(1, TOP + 1))
        for t, lp in zip(top_ids.tolist(), top_lp.tolist(), strict=True):
            assert abs(ranked[t].logprob - lp) <= 1e-4
        # The prompt token is there too: ranked when among the top, with rank None otherwise (as `logprobs`).
        assert set(entry) == set(ranked) | {ids[i]}
        assert entry[ids[i]].rank == (top_ids.tolist().index(ids[i]) + 1 if ids[i] in ranked else None)


def test_prompt_logprobs_equal_the_logprobs_of_the_same_tokens_generated(whole, prompts):
    prefix = prompts[1]
    (gen,) = whole.generate(tok(prefix), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=TOP))
    generated = gen.outputs[0].token_ids
    (res,) = whole.generate(tok(prefix + generated), SCORE)
    assert_same_entries(gen.outputs[0].logprobs, res.prompt_logprobs[len(prefix) :])


def test_chunked_prefill_gives_the_same_values(chunked, prompts, mixed_reference):
    res = chunked.generate([tok(p) for p in prompts], MIXED)
    assert_same_outputs(mixed_reference, res)


def test_requests_without_prompt_logprobs_are_unchanged_by_those_with(chunked, prompts, mixed_reference):
    # Each request alone and without prompt logprobs: its tokens and logprobs are those it got in the mixed batch.
    for p, params, mixed in zip(prompts, MIXED, mixed_reference, strict=True):
        (alone,) = chunked.generate(tok(p), plain(params))
        if params.max_tokens:
            assert alone.outputs[0].token_ids == mixed.outputs[0].token_ids
            assert_same_entries(alone.outputs[0].logprobs or [], mixed.outputs[0].logprobs or [])
        assert alone.prompt_logprobs is None


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(whole, prompts):
    before = [m.to_dict() for m in whole.memory_ledger()]
    res = whole.generate([tok(p) for p in prompts], SamplingParams(prompt_logprobs=0, max_tokens=0, logprobs=2))
    for p, r in zip(prompts, res, strict=True):
        out = r.outputs[0]
        assert (out.token_ids, out.text, out.finish_reason, out.logprobs) == ([], "", "length", [])
        assert len(r.prompt_logprobs) == len(p) and r.prompt_logprobs[0] is None
        assert all(list(e) == [t] for e, t in zip(r.prompt_logprobs[1:], p[1:], strict=True))
        assert r.metrics.finished_time is not None
    assert res[3].prompt_logprobs == [None]  # a one-token prompt: nothing is scored
    # No buffer is kept for them: the head's rows live for the step that computes them.
    assert [m.to_dict() for m in whole.memory_ledger()] == before
    # A prompt as long as the model's context can be scored (nothing is generated after it).
    (full,) = whole.generate(tok((prompts[0] * 3)[:MAX_LEN]), SCORE)
    assert len(full.prompt_logprobs) == MAX_LEN


# --- pipeline parallelism and speculative decoding ------------------------------------------------------
def test_a_two_stage_pipeline_gives_the_values_of_one(tiny_ckpt, prompts, mixed_reference):
    # The last stage computes them, chunk by chunk (budget 16), and they travel back with the sampled tokens.
    with engine(tiny_ckpt, pipeline_parallel_size=2, max_num_batched_tokens=16) as llm:
        assert_same_outputs(mixed_reference, llm.generate([tok(p) for p in prompts], MIXED))


def test_with_speculative_decoding_the_tokens_and_values_are_unchanged(tiny_ckpt, prompts, mixed_reference):
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with engine(tiny_ckpt, speculative_config=spec, max_num_batched_tokens=16) as llm:
        res = llm.generate([tok(p) for p in prompts], MIXED)
        assert llm.spec_decode_metrics()["num_drafts"] > 0
    # Greedy requests' tokens are exactly those without speculation (a sampled one's only in distribution).
    greedy = [i for i, p in enumerate(MIXED) if p.temperature == 0]
    assert_same_outputs([mixed_reference[i] for i in greedy], [res[i] for i in greedy])
    for want, got in zip(mixed_reference, res, strict=True):
        assert_same_entries(want.prompt_logprobs or [], got.prompt_logprobs or [])


# --- what is computed where -----------------------------------------------------------------------------
def test_the_plan_takes_prompt_rows_only_for_requests_that_ask(prompts):
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=48, max_model_len=MAX_LEN)
    asks = Sequence(0, prompts[0], SamplingParams(prompt_logprobs=3, max_tokens=0))
    other = Sequence(1, prompts[1], SamplingParams(max_tokens=1))
    sched.add(other)
    sched.add(asks)
    first = StepPlan.from_batch(batch := sched.schedule())
    assert sched.update(batch, {1: SeqOutput((SampledToken(7),))}) == [SeqUpdate(other, (SampledToken(7),), "length")]
    second = StepPlan.from_batch(batch := sched.schedule())
    assert sched.update(batch, {}) == [SeqUpdate(asks, (), "length")]
    assert sched.schedule() is None and not sched.has_unfinished
    # Step 1: `other` (23 tokens, sampled at its last row) and the first 25 tokens of `asks` (rows 23..47).
    assert first.logits_rows == (22,)
    (spec,) = first.prompt_logprobs
    assert (spec.seq_id, spec.row, spec.first, spec.k) == (0, 23, 1, 3)
    assert spec.targets == tuple(prompts[0][1:26])  # its last row scores the next chunk's first token
    # Step 2: the rest of `asks`, which samples nothing; its last position scores nothing.
    assert second.logits_rows == () and second.samples == ()
    (spec,) = second.prompt_logprobs
    assert (spec.row, spec.first, spec.targets) == (0, 26, tuple(prompts[0][26:]))
    assert second.next_tokens == (-2,)


def test_bad_values_are_refused():
    for bad in (-1, 1.0, "2", True):
        with pytest.raises(ValueError, match="prompt_logprobs must be None or an int >= 0"):
            SamplingParams(prompt_logprobs=bad)
    with pytest.raises(ValueError, match=r"0, scoring the prompt alone, needs prompt_logprobs"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        SamplingParams(max_tokens=-1, prompt_logprobs=1)
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0
