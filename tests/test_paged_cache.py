"""The paged cache: blocks handed out by the scheduler as sequences grow, preemption when they run out, the block
tables the plans carry, the budget that sizes the pools, and the same tokens whatever the budget."""

import random
from pathlib import Path

import pytest

from leanserve import LLM, SamplingParams, StructuredOutput
from leanserve.engine.blocks import BlockPool
from leanserve.engine.runner import StepPlan
from leanserve.engine.scheduler import Scheduler
from leanserve.engine.sequence import SampledToken, SeqOutput, Sequence, SequenceStatus
from leanserve.memory import parse_bytes
from leanserve.model.config import ConfigError
from leanserve.sampling_params import SamplingParams as Params

EOS = 2
MODEL = str(Path(__file__).resolve().parent.parent / "models" / "dsv4-stdlib-8m")


def make_seq(seq_id: int, prompt_len: int, max_tokens: int, **kw) -> Sequence:
    return Sequence(seq_id, [100 + i for i in range(prompt_len)], Params(max_tokens=max_tokens, **kw), (EOS,))


def test_block_pool_hands_out_lowest_first_and_takes_back():
    pool = BlockPool(6, 4)
    assert pool.allocate(2) == [0, 1] and pool.allocate(1) == [2] and pool.num_free == 3
    pool.free([0, 1])
    assert pool.num_used == 1 and sorted(pool.allocate(5)) == [0, 1, 3, 4, 5]
    with pytest.raises(RuntimeError, match="1 blocks asked for, 0 free"):
        pool.allocate(1)
    assert pool.blocks_for(0) == 0 and pool.blocks_for(4) == 1 and pool.blocks_for(5) == 2


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_in_a_small_pool_preempts_and_finishes_everything(seed):
    """Requests larger together than the pool: every one finishes with its tokens fed in order (from position 0
    again after a preemption), no block is held by two sequences, each step's plan tells the stages every block
    its chunks write, and the pool is whole again at the end."""
    rng = random.Random(seed)
    block, max_len = 4, 48
    pool = BlockPool(rng.randint(12, 20), block)
    max_seqs = rng.randint(2, 8)
    sched = Scheduler(max_seqs, rng.randint(8, 40), max_len, pool)
    seqs = []
    for i in range(40):
        plen = rng.randint(1, 30)
        seqs.append(make_seq(i, plen, rng.randint(1, max_len - plen), ignore_eos=rng.random() < 0.5))
    pending = list(seqs)
    fed = {s.seq_id: [] for s in seqs}
    tables: dict[int, dict[int, int]] = {}  # slot -> {block index: block}, as a stage's table learns them
    aborted = set()
    steps = 0
    while pending or sched.has_unfinished:
        for _ in range(rng.randint(0, 3)):
            if pending:
                sched.add(pending.pop(0))
        if rng.random() < 0.02 and sched.has_unfinished:  # an abort, waiting or running
            victim = rng.choice(
                [
                    s
                    for s in seqs
                    if s.seq_id not in aborted and s.status is not SequenceStatus.FINISHED and s.seq_id in sched._live
                ]
            )
            sched.abort(victim.seq_id)
            aborted.add(victim.seq_id)
        batch = sched.schedule()
        if batch is None:
            assert not sched.has_unfinished
            continue
        steps += 1
        plan = StepPlan.from_batch(batch)
        for slot, first, blocks in plan.blocks:
            for j, b in enumerate(blocks):
                tables.setdefault(slot, {})[first + j] = b
        owners = {}
        for q in sched._running:
            for b in q.blocks:
                assert b not in owners, f"block {b} held by {owners[b]} and {q.seq_id}"
                owners[b] = q.seq_id
        assert len(owners) == pool.num_used
        sampled = {}
        for s in batch.seqs:
            seq = s.seq
            end = s.start + s.num_tokens
            # The stage's table names a block of this sequence for every position the chunk writes.
            for j in range(pool.blocks_for(end)):
                assert tables[s.slot][j] == seq.blocks[j]
            if s.start == 0:
                fed[seq.seq_id] = []
            assert len(fed[seq.seq_id]) == s.start
            fed[seq.seq_id].extend(s.fed_token_ids)
            if s.is_sampled:
                sampled[seq.seq_id] = [EOS if rng.random() < 0.05 else rng.randint(10, 99)]
        outs = {k: SeqOutput(tuple(SampledToken(t) for t in v)) for k, v in sampled.items()}
        sched.update(batch, outs)
        assert steps < 20_000
    assert sched.num_preemptions > 0
    assert pool.num_free == pool.num_blocks and sched.slots.num_free == max_seqs
    for seq in seqs:
        assert seq.status is SequenceStatus.FINISHED and seq.blocks == []
        if seq.seq_id not in aborted:
            assert fed[seq.seq_id] == seq.all_token_ids[:-1]


def test_a_request_larger_than_the_pool_is_refused_with_the_sizes():
    sched = Scheduler(4, 64, 64, BlockPool(3, 4))
    with pytest.raises(ValueError, match=r"needs 4 cache blocks of 4 tokens; the cache holds 3"):
        sched.add(make_seq(0, 10, 6))
    assert not sched.has_unfinished


def test_admission_waits_for_the_blocks_of_the_whole_prompt():
    # 4 blocks of 4 tokens: a 12-token prompt holds 3 of them while it prefills in chunks of 4, so a second
    # 8-token prompt waits (its 2 blocks are not free beyond what the first still takes).
    sched = Scheduler(4, 4, 64, BlockPool(4, 4))
    a, b = make_seq(0, 12, 1), make_seq(1, 8, 1)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [s.seq.seq_id for s in batch.seqs] == [0] and a.blocks == [0]
    assert b.status is SequenceStatus.WAITING


def test_parse_bytes_and_bad_budgets():
    assert parse_bytes("20GiB", "x") == 20 * 2**30 and parse_bytes("1.5 GB", "x") == 1_500_000_000
    assert parse_bytes(4096, "x") == 4096 and parse_bytes("512MiB", "x") == 512 * 2**20
    for bad in ("lots", "-1GiB", -5, "12 parsecs", True, 1.5):
        with pytest.raises(ValueError, match="kv_cache_memory"):
            parse_bytes(bad, "kv_cache_memory")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kv_cache_memory": "-3GiB"}, "kv_cache_memory must not be negative"),
        ({"kv_cache_memory": "a lot"}, "kv_cache_memory must be a size in bytes such as 20GiB, got 'a lot'"),
        ({"kv_cache_memory": "100KiB"}, r"kv_cache_memory \(100.00 KiB\) holds 384 tokens, fewer than one request"),
        (
            {"kv_block_size": 100},
            r"kv_block_size must be a positive multiple of the compression rates \[4, 16\], got 100",
        ),
        ({"kv_block_size": 0}, "kv_block_size must be a positive integer"),
    ],
)
def test_bad_cache_options_are_refused_before_anything_is_allocated(options, message):
    with pytest.raises(ConfigError, match=message):
        LLM(MODEL, max_model_len=1024, load_progress=False, **options)


PROMPTS = [{"prompt_token_ids": [(7 * i + j) % 500 + 3 for j in range(30 + 14 * i)]} for i in range(32)]


def _generate(model, **options):
    llm = LLM(model, max_model_len=768, max_num_seqs=64, load_progress=False, **options)
    try:
        params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True, logprobs=0)
        outs = llm.generate(PROMPTS, params)
        sched = llm.engine.scheduler
        llm.reset_prefix_cache()
        assert sched.blocks.num_free == sched.blocks.num_blocks  # every block back
        return [o.outputs[0].token_ids for o in outs], sched.num_preemptions
    finally:
        llm.shutdown()


# 256 tokens cost the shipped 8M model's 4 layers 52 KiB of blocks; 32 requests of up to 564 tokens take 0.5 to 2.2
# such spans each, so 832 KiB holds about 12 of them at once.
SMALL = 16 * 52 * 1024


@pytest.mark.parametrize(
    "options",
    [
        {},
        # (float32: in bfloat16 the torch statement's greedy tokens change with the batch's makeup, paged or not)
        {"backend": "torch", "dtype": "float32"},
        {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}},
        {"pipeline_parallel_size": 2},
        {"pipeline_parallel_size": 2, "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}},
    ],
    ids=["cpu", "torch", "mtp2", "pp2", "pp2-mtp2"],
)
def test_same_tokens_when_preempted_as_with_room_for_everything(options):
    ample, none = _generate(MODEL, **options)
    tight, preempted = _generate(MODEL, kv_cache_memory=SMALL, **options)
    assert none == 0 and preempted > 0
    assert tight == ample


def _mixed_params(i: int) -> SamplingParams:
    """Greedy, seeded sampling, penalties (their counts rebuilt after a preemption), prompt logprobs and a grammar
    (its matcher kept while the request waits to be recomputed)."""
    kinds = [
        dict(temperature=0.0, ignore_eos=True),
        dict(temperature=0.9, seed=1000 + i, ignore_eos=True),
        dict(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.2, ignore_eos=True),
        dict(temperature=0.0, prompt_logprobs=1, ignore_eos=True),
        dict(temperature=0.0, structured=StructuredOutput("regex", pattern="[a-z]+( [a-z]+){0,80}")),
    ]
    return SamplingParams(max_tokens=100, **kinds[i % len(kinds)])


def _generate_mixed(**options):
    llm = LLM(MODEL, max_model_len=768, max_num_seqs=64, load_progress=False, **options)
    try:
        outs = llm.generate(PROMPTS, [_mixed_params(i) for i in range(len(PROMPTS))])
        prompt = [[p and p[next(iter(p))].logprob for p in o.prompt_logprobs or []] for o in outs]
        return [o.outputs[0].token_ids for o in outs], prompt, llm.engine.scheduler.num_preemptions
    finally:
        llm.shutdown()


def test_sampling_penalties_and_prompt_logprobs_survive_preemption():
    ample, ample_prompt, _ = _generate_mixed()
    tight, tight_prompt, preempted = _generate_mixed(kv_cache_memory=SMALL)
    assert preempted > 0
    assert tight == ample
    for a, b in zip(ample_prompt, tight_prompt, strict=True):  # every prompt position scored once
        assert len(a) == len(b) and a[1:] == pytest.approx(b[1:], abs=1e-4)


def test_the_plan_at_a_million_tokens_pages_what_sixteen_chats_hold():
    """DeepSeek-V4-Flash, 16 users, max_model_len 1M: 16 requests of 8K tokens need at most 1/40 of what the
    static layout reserved (every slot a whole 1M sequence), and the plan says what a 20 GiB budget holds."""
    from leanserve.plan import plan_deployment

    kw = dict(max_num_seqs=16, max_model_len=1 << 20)
    static, _ = plan_deployment("deepseek-v4-flash", **kw)
    reserved = sum(n for s in static for f, n in s.by_feature().items() if f == "kv_cache")
    stages, cache = plan_deployment("deepseek-v4-flash", kv_cache_memory="20GiB", **kw)
    assert cache["num_blocks"] * sum(cache["block_bytes"]) <= 20 * 2**30
    eight_k, long = cache["requests"]["8192"], cache["requests"]["131072"]
    assert eight_k["bytes_for_16"] <= reserved / 40
    block = cache["block_tokens"]
    assert eight_k["held"] == cache["num_blocks"] // (8192 // block) > 16
    assert long["held"] == cache["num_blocks"] // (131072 // block) >= 16
    assert cache["requests"][str(1 << 20)]["held"] >= 1
    rows = sum(e.bytes for s in stages for e in s.buffers if e.name.endswith("_rows"))
    assert rows == cache["num_blocks"] * sum(cache["block_bytes"])  # the ledger's pools are the planned blocks


def test_memory_command_reports_the_paged_cache(capsys):
    from leanserve.cli import main

    assert main(["memory", "--plan", "--config", "deepseek-v4-flash", "--max-model-len", "1048576",
                 "--max-num-seqs", "16", "--kv-cache-memory", "20GiB"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert (
        "paged cache: 24385 blocks of 128 tokens (3,121,280 tokens), 20.00 GiB per stage of a 20.00 GiB budget" in out
    )
    assert "requests of 131,072 tokens: the pools hold 23 at once" in out
    assert main(["memory", "--plan", "--config", "deepseek-v4-flash", "--max-model-len", "131072",
                 "--max-num-seqs", "16", "--kv-cache-memory", "20GiB"]) == 0  # fmt: skip
    assert "13.44 GiB per stage of a 20.00 GiB budget (all 16 slots' max_model_len fits)" in capsys.readouterr().out


def test_the_default_budget_is_what_every_slot_needs_capped_at_half_the_free_memory():
    from leanserve.engine.config import EngineConfig
    from leanserve.engine.kv_budget import plan_kv
    from leanserve.engine.topology import PipelineTopology
    from leanserve.model.config import ModelConfig

    cfg = ModelConfig.from_hf(MODEL)
    config = EngineConfig(MODEL, max_num_seqs=8, max_model_len=1024)
    topology = PipelineTopology.build(cfg, 1)
    full = plan_kv(cfg, config, topology, 1024, 4)
    assert full.num_blocks == 8 * (1024 // full.block_tokens) and not full.capped
    assert full.budget == full.num_blocks * full.block_bytes[0]
    half = plan_kv(cfg, config, topology, 1024, 4, available=full.budget)  # half of it free
    assert half.capped and half.budget == full.budget // 2 and half.num_blocks == full.num_blocks // 2
    with pytest.raises(ConfigError, match=r"the default cache budget \(.*\) holds 512 tokens, fewer than one request"):
        plan_kv(cfg, config, topology, 1024, 4, available=full.budget // 8 + 1)
    # Two stages: each gets the blocks its dearer stage's budget buys.
    two = PipelineTopology.build(cfg, 2)
    split = plan_kv(cfg, EngineConfig(MODEL, max_num_seqs=8, kv_cache_memory=300_000), two, 1024, 4)
    assert len(split.block_bytes) == 2 and split.num_blocks == 300_000 // max(split.block_bytes) < 64


def test_aborted_and_finished_requests_return_every_block():
    llm = LLM(MODEL, max_model_len=768, max_num_seqs=8, kv_cache_memory=SMALL, load_progress=False)
    try:
        engine, pool = llm.engine, llm.engine.scheduler.blocks
        ids = [engine.add_request(p["prompt_token_ids"], SamplingParams(max_tokens=50)) for p in PROMPTS[:8]]
        for _ in range(6):
            engine.step()
        assert pool.num_used > 0
        for i in ids[::2]:
            engine.abort(i)
        while engine.has_unfinished:
            engine.step()
        llm.reset_prefix_cache()
        stats = llm.cache_stats()
        assert stats["blocks_free"] == stats["num_blocks"] == pool.num_blocks and stats["blocks_used"] == 0
    finally:
        llm.shutdown()
