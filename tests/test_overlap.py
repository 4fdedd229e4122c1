"""Pipeline overlap: with N stages up to N micro-batches are in flight, each request in at most one of them,
and the results are PP=1's: requests joining and finishing mid-flight, aborts, every speculative method at
PP=2 and 3. A stage that dies with micro-batches in flight ends the engine naming it; the receive buffers are
in the ledger, one per micro-batch in flight."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from leanserve import LLM, SamplingParams
from leanserve.engine.channel import PipeChannel
from leanserve.engine.pipeline import StageFailure
from leanserve.memory import PIPELINE

MAX_LEN = 160
# Six requests for four slots, finishing after different numbers of tokens: two wait, and join while other
# micro-batches are in flight; the long prompts are prefilled in chunks (max_num_batched_tokens 48).
PROMPT_LENGTHS = (3, 40, 17, 75, 9, 30)
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2) if i % 2 == 0
    else SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=n, ignore_eos=True, logprobs=2)
    for i, n in enumerate((6, 14, 9, 12, 16, 5))
]  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)


def engine(ckpt: Path, **kwargs) -> LLM:
    kwargs.setdefault("max_num_seqs", 4)
    return LLM(str(ckpt), max_model_len=MAX_LEN, max_num_batched_tokens=48, load_progress=False, **kwargs)


@pytest.fixture(scope="module")
def ckpt(ckpt5) -> Path:
    return ckpt5


@pytest.fixture(scope="module")
def prompts(ids_of) -> list[list[int]]:
    return [ids_of(n, seed=300 + n) for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(ckpt, prompts) -> list:
    with engine(ckpt) as llm:
        return [r.outputs[0] for r in llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)]


def assert_same(want, got) -> None:
    assert got.token_ids == want.token_ids
    for a, b in zip(want.logprobs, got.logprobs, strict=True):
        assert a.keys() == b.keys()
        for t in a:
            assert abs(a[t].logprob - b[t].logprob) <= 1e-5


def spy_on_schedule(llm: LLM) -> list[tuple[int, int]]:
    """Records (requests in flight, requests scheduled) per micro-batch; asserts a request is never in two."""
    sched = llm.engine.scheduler
    schedule, seen = sched.schedule, []

    def spy(busy=frozenset(), parts=1):
        batch = schedule(busy, parts)
        if batch is not None:
            ids = {s.seq.seq_id for s in batch.seqs}
            assert not ids & set(busy), "a request was scheduled while its previous step was in flight"
            seen.append((len(busy), len(ids)))
        return batch

    sched.schedule = spy
    return seen


def drive(llm: LLM, prompts, params, abort_after: int | None = None) -> dict[int, list]:
    """Adds one request per step (the rest join mid-flight) and steps until all are done; returns the
    tokens and logprobs per prompt index. abort_after=s: after step s, aborts a request that is in flight."""
    eng, ids, out, aborted = llm.engine, {}, {}, None
    pending, steps = list(range(len(prompts))), 0
    while pending or eng.has_unfinished:
        if pending:
            i = pending.pop(0)
            ids[eng.add_request(prompts[i], params[i])] = i
        for u in eng.step():
            out.setdefault(ids[u.seq.seq_id], []).extend(u.new_tokens)
        steps += 1
        if steps == abort_after:
            aborted = next(s.seq.seq_id for b in eng._in_flight for s in b.seqs)
            eng.abort(aborted)
            out[ids[aborted]] = None
    return out


def check(reference, out, skip=()) -> None:
    for i, want in enumerate(reference):
        if i in skip:
            continue
        got = out[i]
        assert [t.token_id for t in got] == want.token_ids
        for a, t in zip(want.logprobs, got, strict=True):
            assert a.keys() == {t.token_id} | {tid for tid, _ in t.top}
            assert abs(a[t.token_id].logprob - t.logprob) <= 1e-5


@pytest.mark.parametrize("pp", [2, 3])
def test_micro_batches_in_flight_give_one_stages_tokens(ckpt, prompts, reference, pp):
    with engine(ckpt, pipeline_parallel_size=pp) as llm:
        assert isinstance(llm.engine.executor.channel, PipeChannel)  # (stages spawned on this machine)
        seen = spy_on_schedule(llm)
        check(reference, drive(llm, prompts, PARAMS))
        # Micro-batches were launched while others were in flight, each with a share of the requests.
        assert any(busy > 0 for busy, _ in seen)
        assert max(n for _, n in seen) <= -(-4 // pp)  # (4 slots)
        # Through generate as well, on the same engine (slots reused), in another order.
        order = [5, 3, 1, 0, 2, 4]
        results = llm.generate([{"prompt_token_ids": prompts[i]} for i in order], [PARAMS[i] for i in order])
        for i, r in zip(order, results, strict=True):
            assert_same(reference[i], r.outputs[0])


def test_without_overlap_one_step_is_in_flight(ckpt, prompts, reference):
    with engine(ckpt, pipeline_parallel_size=2, pipeline_overlap=False) as llm:
        seen = spy_on_schedule(llm)
        check(reference, drive(llm, prompts, PARAMS))
        assert seen and all(busy == 0 for busy, _ in seen)
        assert llm.memory_ledger()[1].find("pp_recv_streams").shape[0] == 1


def test_a_request_aborted_in_flight_leaves_the_others_unchanged(ckpt, prompts, reference):
    with engine(ckpt, pipeline_parallel_size=2) as llm:
        out = drive(llm, prompts, PARAMS, abort_after=3)
        aborted = {i for i, v in out.items() if v is None}
        assert len(aborted) == 1
        check(reference, out, skip=aborted)
        # Its slot is reused; a new request gets its own tokens.
        (i,) = aborted
        assert_same(reference[i], llm.generate([{"prompt_token_ids": prompts[i]}], PARAMS[i])[0].outputs[0])


@pytest.fixture(scope="module")
def draft(ckpt, perturbed_head) -> Path:
    return perturbed_head(ckpt, 0.5, seed=1)


@pytest.mark.parametrize("pp", [2, 3])
@pytest.mark.parametrize("method", ["mtp", "ngram", "draft_model"])
def test_every_speculative_method_with_overlap_gives_plain_tokens(ckpt, draft, prompts, pp, method):
    # Repeated prompts, so that n-gram lookup finds matches too.
    texts = [{"prompt_token_ids": (p * 3)[:60]} for p in prompts[:4]]
    with engine(ckpt) as llm:
        want = llm.generate(texts, GREEDY)
    config = {"method": method, "num_speculative_tokens": 2}
    if method == "draft_model":
        config["model"] = str(draft)
    if method == "ngram":
        config.update(prompt_lookup_max=2, prompt_lookup_min=1)  # (random weights: short matches)
    with engine(ckpt, pipeline_parallel_size=pp, speculative_config=config) as llm:
        seen = spy_on_schedule(llm)
        got = llm.generate(texts, GREEDY)
        assert llm.spec_decode_metrics()["num_drafts"] > 0
    assert any(busy > 0 for busy, _ in seen)
    for a, b in zip(want, got, strict=True):
        assert_same(a.outputs[0], b.outputs[0])


@pytest.mark.parametrize("pp, victim", [(2, 1), (3, 2)])
def test_a_stage_that_dies_with_micro_batches_in_flight_stops_the_engine(ckpt, prompts, pp, victim):
    llm = engine(ckpt, pipeline_parallel_size=pp)
    eng, procs = llm.engine, llm.engine.executor.procs
    for p in prompts[:4]:
        eng.add_request(p, GREEDY)
    eng.step()
    assert len(eng._in_flight) >= 1
    os.kill(procs[victim].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(StageFailure, match=f"pipeline stage {victim} died \\(killed by signal 9\\)"):
        while eng.has_unfinished:
            eng.step()
    assert time.monotonic() - start < 30
    assert all(p.poll() is not None for p in procs.values())  # no stage process is left
    with pytest.raises(StageFailure, match=f"stage {victim}"):
        llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_receive_buffers_are_in_the_ledger_one_per_micro_batch(ckpt, overlap):
    with engine(ckpt, pipeline_parallel_size=3, pipeline_overlap=overlap) as llm:
        ledger = llm.memory_ledger()
    assert ledger[0].find("pp_recv_streams") is None
    for stage in ledger[1:]:
        entry = stage.find("pp_recv_streams")
        assert entry.feature == PIPELINE
        # One per micro-batch, sharing max_num_batched_tokens (48): as many bytes as one step at a time needs.
        assert entry.shape[:2] == ((3, 16) if overlap else (1, 48))
    with engine(ckpt) as llm:  # no pipeline: no pipeline buffer
        assert all(e.feature != PIPELINE for e in llm.memory_ledger()[0].buffers)


def test_bench_pp_reports_each_arm_side_by_side(ckpt, capsys):
    import json

    from leanserve.cli import main

    args = ["--log-level", "warning", "bench", "pp", "--model", str(ckpt), "--concurrency", "1,4"]
    assert main([*args, "--max-tokens", "6", "--prompt-len", "8", "--repeats", "1", "--output", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["concurrency"] for r in rows] == [1, 4]
    for r in rows:
        assert r["same_tokens"] and min(r["pp1_tok_s"], r["serial_tok_s"], r["overlap_tok_s"]) > 0
        assert r["overlap_vs_serial"] == pytest.approx(r["overlap_tok_s"] / r["serial_tok_s"])
        # No stage computes longer than the round it is in: the measured ratio is within its bound.
        assert r["overlap_vs_serial"] <= r["overlap_bound"] * (1 + 1e-6)
        busy = [float(b) for b in r["overlap_busy"].split("/")]
        assert len(busy) == 2 and all(0 < b <= 1 for b in busy)
    assert main([*args, "--stages", "1"]) == 2
    assert "--stages must be at least 2" in capsys.readouterr().err
