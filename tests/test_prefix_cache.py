"""Exact prefix caching: a request that starts with a prefix the engine kept starts after it, with the same tokens
as without the cache; prefixes are matched token for token; eviction under a small budget; off means nothing
kept or hashed."""

import random
from pathlib import Path

import numpy as np
import pytest

from leanserve import LLM, SamplingParams
from leanserve.engine.blocks import BlockPool
from leanserve.engine.prefix_cache import PrefixCache, prefix_hashes
from leanserve.model.config import ConfigError

MODEL = str(Path(__file__).resolve().parent.parent / "models" / "dsv4-stdlib-8m")  # sliding, CSA and HCA layers


def test_prefix_hashes_are_every_prefix_of_one_pass():
    tokens = np.array([5, 0, 7, 7, 1000], dtype=np.int64)
    out = prefix_hashes(tokens)
    assert len(out) == 6 and out[0] == 0
    for c in range(1, 6):
        assert out[c] == prefix_hashes(tokens[:c])[c]
    assert len(set(out.tolist())) == 6


def test_lookup_takes_the_longest_prefix_and_eviction_frees_blocks_and_states():
    pool = BlockPool(8, 4)
    cache = PrefixCache(pool, num_states=2)
    blocks = pool.allocate(3)
    assert cache.insert(list(range(10)), blocks) == 0  # (the lowest free state first)
    assert cache.insert(list(range(6)), blocks) == 1
    assert cache.insert(list(range(6)), blocks) is None  # kept already
    pool.free(blocks)  # the sequence is done: the entries still hold its blocks
    assert pool.num_free == 5
    hit = cache.lookup(list(range(12)))
    assert hit.entry.length == 10 and hit.start == 9
    assert cache.lookup(list(range(8))).start == 5
    assert cache.lookup([0, 1, 2, 9, 9, 9]) is None and cache.lookup([0]) is None
    # A third prefix needs a state: the least recently used entry (length 10) goes, and its third block with it.
    other = pool.allocate(1)
    assert cache.insert([50, 51, 52], other) == 0
    assert cache.num_entries == 2 and cache.lookup(list(range(12))).start == 5
    cache.clear()
    pool.free(other)
    assert pool.num_free == 8 and cache.num_entries == 0


def test_colliding_hashes_never_give_another_prefix():
    pool = BlockPool(8, 4)
    cache = PrefixCache(pool, num_states=4)
    cache.hashes = lambda ids: np.zeros(len(ids) + 1, dtype=np.uint64)  # every prefix collides
    cache.insert([1, 2, 3, 4], pool.allocate(1))
    assert cache.lookup([1, 2, 3, 5, 6]) is None  # same length and hash, other tokens
    assert cache.lookup([1, 2, 3, 4, 6]).start == 3
    cache.insert([9, 9, 9, 9], pool.allocate(1))  # replaces the colliding entry, never mixes them
    assert cache.lookup([1, 2, 3, 4, 6]) is None and cache.lookup([9, 9, 9, 9, 1]).start == 3


def _prompts(rng: random.Random, vocab: int = 500) -> list[list[int]]:
    # Lengths spread over the compression windows (4 and 16 tokens), the sliding window (64) and blocks (128).
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 400))] for _ in range(6)]


def _turns(llm: LLM, prompts: list[list[int]], rng: random.Random, params: SamplingParams):
    """Each prompt, then follow-ups: the same prompt again, the prompt and its output and new tokens (the next
    turn of a chat), the prompt cut at a random point with new tokens, the prompt with a few new tokens."""
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    follow = []
    for p, out in zip(prompts, first, strict=True):
        new = [rng.randrange(3, 500) for _ in range(rng.randint(1, 40))]
        cut = rng.randint(1, len(p))
        follow += [p, p + list(out.outputs[0].token_ids) + new, p[:cut] + new, p + new[:3]]
    second = llm.generate([{"prompt_token_ids": p} for p in follow], params)
    return [_tokens_and_logprobs(o) for o in first + second], [o for o in second]


def _tokens_and_logprobs(out) -> list[tuple[int, float]]:
    """Each generated token with its logprob (the float itself: compared bit for bit)."""
    c = out.outputs[0]
    return [(t, lp[t].logprob) for t, lp in zip(c.token_ids, c.logprobs, strict=True)]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 48},  # chunked prefill
        {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}},
        {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}},
        {"pipeline_parallel_size": 2},
        {"pipeline_parallel_size": 2, "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}},
    ],
    ids=["plain", "chunked", "mtp1", "mtp2", "pp2", "pp2-mtp2"],
)
def test_same_tokens_and_logprobs_with_the_prefix_cache_as_without(options):
    # Bit for bit: the kernels give a token the same float32 arithmetic in any step (batch invariance), so a
    # request that starts after a kept prefix gets exactly the logprobs of one that prefills it all.
    rng = random.Random(7)
    prompts = _prompts(rng)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    runs = {}
    for caching in (False, True):
        llm = LLM(MODEL, max_model_len=1024, load_progress=False, enable_prefix_caching=caching, **options)
        try:
            runs[caching] = _turns(llm, prompts, random.Random(11), params)
            stats = llm.cache_stats()
        finally:
            llm.shutdown()
    assert runs[True][0] == runs[False][0]
    cached = [o.num_cached_tokens for o in runs[True][1]]
    # The same prompt again, the next turn and the extended prompt all start after what was kept.
    for i, p in enumerate(prompts):
        again, turn, _, extended = cached[4 * i : 4 * i + 4]
        assert again == len(p) - 1 and extended == len(p) - 1
        assert turn == len(p) + 24 - 2  # the prompt and the output but its last token, then one fed again
    assert stats["prefix_cache_hits"] == sum(cached) > 0
    assert all(o.num_cached_tokens == 0 for o in runs[False][1])


def test_eviction_under_a_small_budget_keeps_the_tokens():
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(300)] for _ in range(8)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = {}
    for caching in (False, True):
        llm = LLM(MODEL, max_model_len=512, max_num_seqs=4, kv_cache_memory=260_000, load_progress=False,
                  enable_prefix_caching=caching)  # fmt: skip
        try:
            runs = [llm.generate([{"prompt_token_ids": p} for p in prompts], params) for _ in range(2)]
            outs[caching] = [[_tokens_and_logprobs(o) for o in r] for r in runs]
            stats = llm.cache_stats()
            llm.reset_prefix_cache()
            assert llm.cache_stats()["blocks_free"] == stats["num_blocks"]
        finally:
            llm.shutdown()
    assert outs[True] == outs[False]
    assert stats["prefix_cache_entries"] <= 4  # one saved state per slot


def test_off_keeps_and_hashes_nothing(monkeypatch):
    def no_hashing(tokens):
        raise AssertionError("hashed with the prefix cache off")

    monkeypatch.setattr(PrefixCache, "hashes", staticmethod(no_hashing))
    llm = LLM(MODEL, max_model_len=256, load_progress=False, enable_prefix_caching=False)
    try:
        p = {"prompt_token_ids": list(range(3, 90))}
        llm.generate([p, p], SamplingParams(max_tokens=4))
        (stage,) = llm.memory_ledger()
        assert "prefix_cache" not in stage.by_feature() and llm.engine.scheduler.prefix is None
        assert "prefix_cache_hits" not in llm.cache_stats()
    finally:
        llm.shutdown()
    on = LLM(MODEL, max_model_len=256, load_progress=False)  # on by default, its saved states in the ledger
    try:
        assert on.memory_ledger()[0].by_feature()["prefix_cache"] > 0
    finally:
        on.shutdown()


def test_a_draft_model_and_the_prefix_cache_are_refused_together():
    spec = {"method": "draft_model", "model": MODEL, "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="enable_prefix_caching does not work with a draft model"):
        LLM(MODEL, max_model_len=256, load_progress=False, enable_prefix_caching=True, speculative_config=spec)


def test_requests_sharing_a_long_system_prompt_hit_from_the_third_on():
    """The second request ends a prefill chunk at the last block boundary it shares with the first, and the prefix
    cache keeps that; the ones after it start there."""
    rng = random.Random(5)
    system = [rng.randrange(3, 500) for _ in range(300)]
    requests = [system + [rng.randrange(3, 500) for _ in range(rng.randint(5, 30))] for _ in range(5)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for caching in (False, True):
        llm = LLM(MODEL, max_model_len=512, load_progress=False, enable_prefix_caching=caching)
        try:
            block = llm.engine.kv.block_tokens
            outs[caching] = [llm.generate([{"prompt_token_ids": r}], params)[0] for r in requests]  # one at a time
        finally:
            llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs[True]] == [o.outputs[0].token_ids for o in outs[False]]
    shared = len(system) // block * block
    assert [o.num_cached_tokens for o in outs[True]] == [0, 0] + [shared - 1] * 3


def test_a_request_gets_the_same_logprobs_alone_and_among_others():
    # Batch invariance, which the identity above rests on: the same prompt alone, then in one step with others
    # (its rows in other places of larger matmuls and attention blocks), then in chunks of another size.
    rng = random.Random(5)
    prompt = [rng.randrange(3, 500) for _ in range(150)]
    others = [[rng.randrange(3, 500) for _ in range(rng.randint(5, 200))] for _ in range(5)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    got = []
    for options, batch in (({}, [prompt]), ({}, others[:2] + [prompt] + others[2:]),
                           ({"max_num_batched_tokens": 40}, [prompt] + others)):  # fmt: skip
        llm = LLM(MODEL, max_model_len=512, load_progress=False, enable_prefix_caching=False, **options)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
        finally:
            llm.shutdown()
        got.append(_tokens_and_logprobs(outs[batch.index(prompt)]))
    assert got[0] == got[1] == got[2]
