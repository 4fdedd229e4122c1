import random

import pytest

from leanserve.engine.proposers import NgramProposer, ProposeItem, Proposer
from leanserve.engine.scheduler import ScheduledBatch, Scheduler, SeqUpdate
from leanserve.engine.sequence import SampledToken, SeqOutput, Sequence, SequenceStatus
from leanserve.engine.slots import CacheSlots
from leanserve.sampling_params import SamplingParams as Params

EOS = 2


def make_seq(seq_id: int, prompt_len: int, max_tokens: int = 4, **kw) -> Sequence:
    prompt = [100 + seq_id * 1000 + i for i in range(prompt_len)]
    return Sequence(seq_id, prompt, Params(max_tokens=max_tokens, **kw), eos_token_ids=(EOS,))


def outputs(sampled: dict[int, list[int]], drafts: dict[int, tuple[int, ...]] | None = None) -> dict[int, SeqOutput]:
    """Model outputs carrying the given token ids (logprob = -token id, so tokens can be told apart)."""
    drafts = drafts or {}
    return {k: SeqOutput(tuple(SampledToken(t, -float(t)) for t in v), drafts.get(k, ())) for k, v in sampled.items()}


def finished(updates: list[SeqUpdate]) -> list[Sequence]:
    return [u.seq for u in updates if u.finished]


def step(sched: Scheduler, token: int = 7) -> tuple[ScheduledBatch, list[Sequence]]:
    batch = sched.schedule()
    assert batch is not None
    sampled = {s.seq.seq_id: [token] for s in batch.seqs if s.is_sampled}
    return batch, finished(sched.update(batch, outputs(sampled)))


def by_id(batch: ScheduledBatch) -> dict[int, tuple[int, int, bool]]:
    return {s.seq.seq_id: (s.start, s.num_tokens, s.is_sampled) for s in batch.seqs}


def test_decodes_and_prefills_mix_in_one_step():
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    sched.add(make_seq(0, 5))
    sched.add(make_seq(1, 3))
    step(sched)  # both fully prefilled in one step, each sampled its first token
    sched.add(make_seq(2, 10))
    batch, _ = step(sched)
    assert by_id(batch) == {0: (5, 1, True), 1: (3, 1, True), 2: (0, 10, True)}
    assert batch.num_tokens == 12
    # Decodes feed the token sampled last step, at the position right after the prompt.
    assert batch.seqs[0].token_ids == (7,)


def test_request_joins_while_others_decode():
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    a = make_seq(0, 4, max_tokens=10)
    sched.add(a)
    for _ in range(3):
        step(sched)
    assert len(a.output_token_ids) == 3
    b = make_seq(1, 6, max_tokens=2)
    sched.add(b)
    batch, _ = step(sched)
    assert by_id(batch) == {0: (6, 1, True), 1: (0, 6, True)}
    assert a.slot != b.slot
    assert len(a.output_token_ids) == 4 and len(b.output_token_ids) == 1


def test_chunked_prefill_covers_prompt_once_in_order():
    sched = Scheduler(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64)
    long = make_seq(0, 30, max_tokens=3)
    sched.add(long)
    fed: list[int] = []
    positions: list[int] = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        batch, _ = step(sched)
        (s,) = batch.seqs
        assert s.num_tokens <= 8
        assert s.is_sampled == (s.start + s.num_tokens == 30)
        positions.extend(range(s.start, s.start + s.num_tokens))
        fed.extend(s.token_ids)
    assert positions == list(range(30))
    assert fed == long.prompt_token_ids
    assert long.output_token_ids == [7]  # only the final chunk sampled


def test_decodes_continue_during_another_chunked_prefill():
    sched = Scheduler(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64)
    a = make_seq(0, 2, max_tokens=20)
    sched.add(a)
    step(sched)
    sched.add(make_seq(1, 30, max_tokens=2))
    chunks = []
    for _ in range(4):
        batch, _ = step(sched)
        ids = by_id(batch)
        assert ids[0][1] == 1  # a decodes every step
        chunks.append(ids[1])
    assert chunks == [(0, 7, False), (7, 7, False), (14, 7, False), (21, 7, False)]
    batch, _ = step(sched)
    assert by_id(batch)[1] == (28, 2, True)


def test_finished_sequence_frees_slot_and_waiting_is_admitted_next_step():
    sched = Scheduler(max_num_seqs=1, max_num_batched_tokens=16, max_model_len=32)
    a, b = make_seq(0, 3, max_tokens=2), make_seq(1, 3, max_tokens=1)
    sched.add(a)
    sched.add(b)
    batch, _ = step(sched)
    assert [s.seq.seq_id for s in batch.seqs] == [0]  # only one slot
    assert sched.num_waiting == 1
    _, finished = step(sched)
    assert finished == [a] and a.slot is None and sched.slots.num_free == 1
    batch, finished = step(sched)
    assert by_id(batch) == {1: (0, 3, True)}
    assert batch.seqs[0].slot == 0
    assert finished == [b] and not sched.has_unfinished
    assert sched.schedule() is None


def test_seq_limit_caps_a_step_even_with_token_budget_left():
    sched = Scheduler(max_num_seqs=2, max_num_batched_tokens=100, max_model_len=64)
    for i in range(3):
        sched.add(make_seq(i, 2))
    batch = sched.schedule()
    assert [s.seq.seq_id for s in batch.seqs] == [0, 1]
    assert sched.num_running == 2 and sched.num_waiting == 1


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_respects_limits_and_every_request_completes(seed):
    rng = random.Random(seed)
    max_seqs, max_batched, max_len = rng.randint(1, 6), rng.randint(1, 40), 64
    sched = Scheduler(max_seqs, max_batched, max_len)
    pending = []
    for i in range(60):
        plen = rng.randint(1, 40)
        seq = make_seq(i, plen, max_tokens=rng.randint(1, max_len - plen), ignore_eos=rng.random() < 0.3)
        pending.append(seq)
    seqs = list(pending)
    fed: dict[int, list[int]] = {s.seq_id: [] for s in seqs}
    done: set[int] = set()
    steps = 0
    while pending or sched.has_unfinished:
        for _ in range(rng.randint(0, 3)):  # requests arrive over time
            if pending:
                sched.add(pending.pop(0))
        if not sched.has_unfinished:
            continue
        batch = sched.schedule()
        assert batch is not None
        steps += 1
        assert len(batch.seqs) <= max_seqs
        assert batch.num_tokens == sum(s.num_tokens for s in batch.seqs) <= max_batched
        assert all(s.num_tokens >= 1 for s in batch.seqs)
        assert len({s.slot for s in batch.seqs}) == len(batch.seqs)
        assert len({s.seq.seq_id for s in batch.seqs}) == len(batch.seqs)
        assert sched.num_running <= max_seqs
        sampled = {}
        for s in batch.seqs:
            assert s.start == s.seq.num_computed_tokens
            assert list(s.token_ids) == s.seq.all_token_ids[s.start : s.start + s.num_tokens]
            assert s.is_sampled == (s.start + s.num_tokens == s.seq.num_tokens)
            assert len(fed[s.seq.seq_id]) == s.start  # contiguous positions, nothing fed twice
            fed[s.seq.seq_id].extend(s.token_ids)
            if s.is_sampled:
                sampled[s.seq.seq_id] = [EOS if rng.random() < 0.05 else rng.randint(10, 99)]
        for seq in finished(sched.update(batch, outputs(sampled))):
            assert seq.seq_id not in done
            done.add(seq.seq_id)
        assert steps < 10_000
    assert done == {s.seq_id for s in seqs}
    assert sched.slots.num_free == max_seqs
    for seq in seqs:
        out = seq.output_token_ids
        assert seq.status is SequenceStatus.FINISHED and seq.slot is None
        assert 1 <= len(out) <= seq.params.max_tokens
        if not seq.params.ignore_eos and EOS in out:
            assert out.index(EOS) == len(out) - 1 and seq.finish_reason == "stop"
        else:
            assert len(out) == seq.params.max_tokens and seq.finish_reason == "length"
        # Everything but the last sampled token went through the model exactly once, in order.
        assert fed[seq.seq_id] == seq.all_token_ids[:-1]


def test_too_long_request_raises_and_leaves_scheduler_unchanged():
    sched = Scheduler(max_num_seqs=2, max_num_batched_tokens=4, max_model_len=16)
    sched.add(make_seq(0, 4))
    with pytest.raises(ValueError, match=r"prompt \(10 tokens\) \+ max_tokens \(7\) exceeds max_model_len \(16\)"):
        sched.add(make_seq(1, 10, max_tokens=7))
    sched.add(make_seq(2, 10, max_tokens=6))  # exactly max_model_len is fine
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add(Sequence(3, [], Params()))
    with pytest.raises(ValueError, match="already"):
        sched.add(make_seq(0, 2))
    assert sched.num_waiting == 2 and sched.num_running == 0
    batch = sched.schedule()
    assert [s.seq.seq_id for s in batch.seqs] == [0]


def test_constructor_rejects_non_positive_limits():
    for args in ((0, 1, 1), (1, 0, 1), (1, 1, 0)):
        with pytest.raises(ValueError):
            Scheduler(*args)


@pytest.mark.parametrize(
    ("params", "tokens", "reason", "n_out"),
    [
        (Params(max_tokens=10), [5, EOS, 5], "stop", 2),
        (Params(max_tokens=3, ignore_eos=True), [EOS, EOS, EOS, EOS], "length", 3),
        (Params(max_tokens=10, ignore_eos=True, stop_token_ids=(9,)), [EOS, 9], "stop", 2),
        (Params(max_tokens=10, stop_token_ids=(9,)), [5, 5, 9], "stop", 3),
        (Params(max_tokens=3), [5, 5, 5, 5], "length", 3),
        (Params(max_tokens=1), [EOS], "stop", 1),  # a stop token wins over length on the same step
    ],
)
def test_finish_reasons(params, tokens, reason, n_out):
    sched = Scheduler(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=32)
    seq = Sequence(0, [1, 1, 1], params, eos_token_ids=(EOS,))
    sched.add(seq)
    done: list[Sequence] = []
    steps = 0
    for tok in tokens:
        steps += 1
        done = finished(sched.update(sched.schedule(), outputs({0: [tok]})))
        if done:
            break
    assert done == [seq]
    assert steps == n_out and len(seq.output_token_ids) == n_out
    assert seq.finish_reason == reason and seq.is_finished
    assert seq.num_computed_tokens == seq.num_tokens - 1  # the last sampled token is never fed
    assert sched.slots.num_free == 1 and not sched.has_unfinished


def test_abort_frees_slot_for_waiting_request():
    sched = Scheduler(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=32)
    a, b = make_seq(0, 3, max_tokens=10), make_seq(1, 3)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.abort(0) is a
    assert a.is_finished and a.finish_reason == "abort" and a.slot is None
    assert sched.slots.num_free == 1
    assert sched.abort(0) is None and sched.abort(99) is None
    batch, _ = step(sched)
    assert by_id(batch) == {1: (0, 3, True)}


def test_abort_waiting_and_between_schedule_and_update():
    sched = Scheduler(max_num_seqs=2, max_num_batched_tokens=8, max_model_len=32)
    a, b, c = make_seq(0, 3), make_seq(1, 3), make_seq(2, 3)
    for s in (a, b, c):
        sched.add(s)
    assert sched.abort(2) is c and sched.num_waiting == 2 and c.finish_reason == "abort"
    batch = sched.schedule()
    sched.abort(0)  # e.g. client disconnects while the model runs
    (update,) = sched.update(batch, outputs({0: [5], 1: [5]}))  # the aborted one gains nothing
    assert update.seq is b and update.new_tokens == (SampledToken(5, -5.0),) and not update.finished
    assert a.output_token_ids == [] and b.output_token_ids == [5]
    assert sched.num_running == 1 and sched.slots.num_free == 1


def test_cache_slots():
    slots = CacheSlots(3)
    assert [slots.allocate() for _ in range(3)] == [0, 1, 2]
    with pytest.raises(RuntimeError):
        slots.allocate()
    slots.free(1)
    slots.free(0)
    assert slots.num_free == 2 and slots.allocate() == 0
    with pytest.raises(AssertionError):
        slots.free(1)


def test_drafts_use_only_the_budget_left_after_every_running_sequence_has_its_token():
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=6, max_model_len=64)
    seqs = [make_seq(i, 1, max_tokens=20) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    step(sched)  # the four one-token prompts, then every sequence is decoding
    for seq in seqs:
        seq.spec_token_ids = (5, 6, 7)
    batch = sched.schedule()
    assert [s.seq.seq_id for s in batch.seqs] == [0, 1, 2, 3]  # nobody starves behind the drafts
    assert [s.num_drafts for s in batch.seqs] == [2, 0, 0, 0] and batch.num_tokens == 6
    assert batch.seqs[0].token_ids == (7, 5, 6)  # the newest token, then its drafts


def test_drafts_never_run_past_max_tokens():
    sched = Scheduler(max_num_seqs=1, max_num_batched_tokens=16, max_model_len=64)
    seq = make_seq(0, 2, max_tokens=3)
    sched.add(seq)
    step(sched)
    seq.spec_token_ids = (5, 6, 7, 8)
    (s,) = sched.schedule().seqs
    assert s.num_drafts == 1  # 1 output so far + 1 draft + the token the step always adds = max_tokens


def test_update_reports_each_sampled_sequences_new_tokens_and_drops_those_after_a_stop():
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=20, max_model_len=64)
    a, b = make_seq(0, 3, max_tokens=20, stop_token_ids=(9,)), make_seq(1, 3, max_tokens=20)
    long = make_seq(2, 40, max_tokens=5)
    for seq in (a, b):
        sched.add(seq)
    step(sched)
    sched.add(long)
    a.spec_token_ids, b.spec_token_ids = (5, 9, 6), (5, 6)
    batch = sched.schedule()
    s_a, s_b, s_long = batch.seqs
    # The fed tokens and the drafts are kept apart; the model sees their concatenation.
    assert (s_a.fed_token_ids, s_a.draft_token_ids, s_a.token_ids) == ((7,), (5, 9, 6), (7, 5, 9, 6))
    assert (s_b.num_tokens, s_b.num_drafts) == (3, 2)
    assert (s_long.num_tokens, s_long.is_sampled) == (13, False)  # the budget left: a chunk, not sampled
    # a's drafts are all accepted but the second is a stop token; b accepts one draft and gets one new token.
    updates = sched.update(batch, outputs({0: [5, 9, 6, 8], 1: [5, 4]}, drafts={1: (3, 3)}))
    assert [u.seq for u in updates] == [a, b]  # the sampled ones, in batch order; the chunk gained nothing
    u_a, u_b = updates
    assert u_a.new_tokens == (SampledToken(5, -5.0), SampledToken(9, -9.0))  # nothing after the stop
    assert (u_a.finished, u_a.finish_reason, a.finish_reason) == (True, "stop", "stop")
    assert a.output_token_ids == [7, 5, 9] and [t.logprob for t in a.output_tokens] == [-7.0, -5.0, -9.0]
    assert [t.token_id for t in u_b.new_tokens] == [5, 4] and not u_b.finished and u_b.finish_reason is None
    assert b.output_token_ids == [7, 5, 4]
    assert b.num_computed_tokens == b.num_tokens - 1  # the accepted draft committed, the new token not yet
    assert b.spec_token_ids == (3, 3)  # the next drafts, stored for the next schedule()
    assert long.num_computed_tokens == 13 and long.spec_token_ids == ()
    batch = sched.schedule()  # the rest of the prefill takes the budget first, so b's drafts wait
    assert [(s.seq.seq_id, s.token_ids) for s in batch.seqs][0] == (1, (4,)) and batch.seqs[1].num_tokens == 19


def test_length_finish_inside_accepted_drafts():
    sched = Scheduler(max_num_seqs=1, max_num_batched_tokens=16, max_model_len=64)
    seq = make_seq(0, 2, max_tokens=3)
    sched.add(seq)
    step(sched)
    seq.spec_token_ids = (5, 6, 7)
    batch = sched.schedule()
    assert batch.seqs[0].num_drafts == 1  # the scheduler caps drafts at what max_tokens leaves
    (u,) = sched.update(batch, outputs({0: [5, 6]}))
    assert [t.token_id for t in u.new_tokens] == [5, 6] and u.finish_reason == "length"
    assert seq.output_token_ids == [7, 5, 6]


class Recording(Proposer):
    def __init__(self, k: int) -> None:
        self.k, self.calls = k, []

    def propose(self, items, seeds):
        self.calls.append((items, seeds))
        return {it.seq_id: (50 + it.seq_id,) * it.num_drafts for it in items}


def test_a_first_stage_proposer_gets_each_continuing_sequences_history_and_its_drafts_are_stored():
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    a, b, c = make_seq(0, 3, max_tokens=20), make_seq(1, 2, max_tokens=3), make_seq(2, 2, max_tokens=1)
    a.seed = 11
    for seq in (a, b, c):
        sched.add(seq)
    proposer = Recording(k=4)
    batch = sched.schedule()
    updates = sched.update(batch, outputs({0: [7], 1: [8], 2: [9]}, drafts={0: (1, 1)}), proposer)
    assert finished(updates) == [c]  # max_tokens 1: finished, so not asked for drafts
    ((items, seeds),) = proposer.calls
    assert [it.seq_id for it in items] == [0, 1] and seeds == {0: 11, 1: 0}
    item_a, item_b = items
    assert item_a == ProposeItem(
        a.slot, 0, (100, 101, 102, 7), 0, 0, a.params, step=1, num_drafts=4, history=(100, 101, 102, 7)
    )
    assert (item_b.row, item_b.history, item_b.num_drafts) == (3, (1100, 1101, 8), 1)  # 3 - 1 output - 1
    # The proposer's drafts win over the step's outputs (there is one proposer, wherever it lives).
    assert (a.spec_token_ids, b.spec_token_ids, c.spec_token_ids) == ((50,) * 4, (51,), ())


def test_ngram_proposer_through_the_proposer_interface():
    ngram = NgramProposer(
        type("S", (), {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})()
    )
    assert isinstance(ngram, Proposer) and ngram.k == 3
    sched = Scheduler(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    seq = Sequence(0, [1, 2, 3, 9, 1, 2], Params(max_tokens=10), eos_token_ids=(EOS,))
    sched.add(seq)
    sched.update(sched.schedule(), outputs({0: [3]}), ngram)
    assert seq.spec_token_ids == (9, 1, 2)  # what followed the earlier 1, 2, 3
    batch = sched.schedule()
    assert batch.seqs[0].token_ids == (3, 9, 1, 2)
