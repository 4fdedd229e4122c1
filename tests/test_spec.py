"""Speculative decoding (MTP, n-gram, draft model) is lossless: greedy output equals greedy output without it
(with and without pipeline parallelism), rejection sampling keeps the target's distribution, rejected drafts
leave no trace, and the metrics add up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from leanserve import LLM, SamplingParams
from leanserve.cli import main
from leanserve.engine.proposers import NgramProposer, Proposer
from leanserve.engine.runner import SampleSpec, StepPlan
from leanserve.engine.sampler import STREAM_DRAFT, Sampler, _exponentials
from leanserve.model.batch import Chunk, build_forward_batch
from leanserve.model.config import ConfigError

SHIPPED = Path(__file__).resolve().parent.parent / "models" / "dsv4-stdlib-8m"
CODE_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    # long enough to cross the shipped model's window (64) and many CSA (4) / HCA (16) boundaries
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
MTP = {"method": "mtp"}
NGRAM = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def spec(base: dict, k: int, **extra) -> dict:
    return {**base, "num_speculative_tokens": k, **extra}


def shipped(**kwargs) -> LLM:
    return LLM(str(SHIPPED), dtype="float32", max_model_len=256, max_num_seqs=4, load_progress=False, **kwargs)


def assert_same(want, got) -> None:
    for a, b in zip(want, got, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            for t, lp in x.items():
                assert abs(y[t].logprob - lp.logprob) <= 1e-5


@pytest.fixture(scope="module")
def shipped_reference():
    with shipped() as llm:
        return llm.generate(CODE_PROMPTS, GREEDY)


# --- greedy output is unchanged -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "config",
    [spec(MTP, 1), spec(MTP, 2), spec(MTP, 3), spec(NGRAM, 3)],
    ids=["mtp-k1", "mtp-k2", "mtp-k3", "ngram-k3"],
)
def test_greedy_with_speculation_equals_greedy_without(shipped_reference, config):
    with shipped(speculative_config=config) as llm:
        assert_same(shipped_reference, llm.generate(CODE_PROMPTS, GREEDY))
        m = llm.spec_decode_metrics()
    # The shipped MTP layer (and n-gram lookup on code) get some drafts right and some wrong, so both the
    # accept and the rollback paths ran.
    assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]


def test_greedy_mtp_through_a_pipeline(shipped_reference):
    with shipped(speculative_config=spec(MTP, 2), pipeline_parallel_size=2) as llm:
        assert_same(shipped_reference, llm.generate(CODE_PROMPTS, GREEDY))
        assert llm.spec_decode_metrics()["num_accepted_tokens"] > 0
        ledger = llm.memory_ledger()
        assert [m.find("target_hidden_states") is not None for m in ledger] == [False, True]


# A random checkpoint and a draft model made from it with a perturbed head: the draft agrees with the target
# on some tokens and not on others.
@pytest.fixture(scope="module")
def target5(ckpt5) -> Path:
    return ckpt5


@pytest.fixture(scope="module")
def draft5(target5, perturbed_head) -> Path:
    return perturbed_head(target5, 0.6, seed=0)


@pytest.fixture(scope="module")
def random_prompts(ids_of) -> list[dict]:
    return [{"prompt_token_ids": ids_of(n, seed=200 + n)} for n in (4, 23, 61)]


@pytest.fixture(scope="module")
def random_reference(target5, random_prompts):
    with LLM(str(target5), max_model_len=160, max_num_seqs=4, load_progress=False) as llm:
        return llm.generate(random_prompts, GREEDY)


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_draft_model_is_lossless(target5, draft5, random_prompts, random_reference, pp, k):
    config = spec({"method": "draft_model"}, k, model=str(draft5))
    with LLM(
        str(target5), max_model_len=160, max_num_seqs=4, load_progress=False, speculative_config=config,
        pipeline_parallel_size=pp, max_num_batched_tokens=32,  # chunked prefill, drafts squeezed by the budget
    ) as llm:  # fmt: skip
        assert_same(random_reference, llm.generate(random_prompts, GREEDY))
        m = llm.spec_decode_metrics()
    assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]


def test_greedy_ngram_through_a_pipeline(target5, random_prompts, random_reference):
    # Repetitive prompts so lookup finds matches.
    prompts = [{"prompt_token_ids": (p["prompt_token_ids"] * 3)[:70]} for p in random_prompts]
    with LLM(str(target5), max_model_len=160, max_num_seqs=4, load_progress=False) as llm:
        want = llm.generate(prompts, GREEDY)
    with LLM(
        str(target5), max_model_len=160, max_num_seqs=4, load_progress=False, speculative_config=spec(NGRAM, 2),
        pipeline_parallel_size=3,
    ) as llm:  # fmt: skip
        assert_same(want, llm.generate(prompts, GREEDY))
        assert llm.spec_decode_metrics()["num_drafts"] > 0


def test_stop_tokens_inside_accepted_drafts_end_the_output_there(target5, random_prompts, random_reference):
    # A draft model identical to the target accepts everything, so several tokens arrive per step; the
    # output must still stop at the first stop token, and at max_tokens exactly.
    out = random_reference[1].outputs[0].token_ids
    stop = out[6]
    params = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop])
    config = spec({"method": "draft_model"}, 3, model=str(target5))
    with LLM(str(target5), max_model_len=160, load_progress=False, speculative_config=config) as llm:
        got = llm.generate(random_prompts[1], params)[0].outputs[0]
        assert got.token_ids == out[: out.index(stop) + 1] and got.finish_reason == "stop"
        got = llm.generate(random_prompts[1], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
        assert got[0].outputs[0].token_ids == out[:9]
        m = llm.spec_decode_metrics()
    assert m["acceptance_rate"] == 1.0


def test_a_stream_stops_at_a_stop_token_inside_accepted_drafts(target5, random_prompts, random_reference):
    # What a streaming caller reads, step by step, concatenates to exactly the final output, tokens and
    # logprobs, even when the stop token arrives mid-chunk of accepted drafts with more tokens behind it.
    out = random_reference[1].outputs[0].token_ids
    stop = out[6]
    params = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop], logprobs=1)
    config = spec({"method": "draft_model"}, 3, model=str(target5))
    with LLM(str(target5), max_model_len=160, load_progress=False, speculative_config=config) as llm:
        (want,) = llm.generate(random_prompts[1], params)
        engine, beyond = llm.engine, []
        collect = engine.executor.collect

        def record():  # the tokens the last stage sent back past the stop token
            outputs = collect()
            for o in outputs.values():
                ids = [t.token_id for t in o.tokens]
                beyond.extend(ids[ids.index(stop) + 1 :] if stop in ids else [])
            return outputs

        engine.executor.collect = record
        seq_id = engine.add_request(random_prompts[1]["prompt_token_ids"], params)
        streamed, reasons = [], []
        while engine.has_unfinished:
            for u in engine.step():
                assert u.seq.seq_id == seq_id
                streamed.extend(u.new_tokens)
                reasons.append(u.finish_reason)
    comp = want.outputs[0]
    assert comp.token_ids == out[: out.index(stop) + 1] and comp.finish_reason == "stop"
    assert beyond, "the stop token should have come with accepted drafts behind it"
    assert [t.token_id for t in streamed] == comp.token_ids
    assert [t.logprob for t in streamed] == [d[t].logprob for t, d in zip(comp.token_ids, comp.logprobs, strict=True)]
    assert reasons[-1] == "stop" and reasons.count("stop") == 1 and set(reasons[:-1]) <= {None}


def test_ngram_drafts_come_from_the_engines_proposer():
    config = spec(NGRAM, 3)
    with shipped(speculative_config=config) as llm:
        proposer = llm.engine.proposer
        assert isinstance(proposer, NgramProposer) and isinstance(proposer, Proposer)
        assert llm.engine.executor.runner.proposer is None  # no model proposer on the last stage
        calls = []
        original = proposer.propose

        def record(items, seeds):
            calls.append(items)
            return original(items, seeds)

        proposer.propose = record
        llm.generate(CODE_PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
        m = llm.spec_decode_metrics()
    assert calls and all(it.history for items in calls for it in items)
    assert m["num_accepted_tokens"] > 0  # drafts were made, verified and some accepted


def test_execute_can_skip_the_proposer_and_the_hidden_capture():
    with shipped(speculative_config=spec(MTP, 2)) as llm:
        runner = llm.engine.executor.runner
        prompt = tuple(llm.get_tokenizer().encode(CODE_PROMPTS[1]))
        greedy = SamplingParams(temperature=0.0, max_tokens=10)
        plan = StepPlan((Chunk(0, 0, prompt),), (len(prompt) - 1,), (SampleSpec(0, greedy, 0, 0, 0),), (-1,))
        full = runner.execute(plan)[0]
        assert len(full.drafts) == 2
        runner.target_hidden.fill_(float("nan"))
        bare = runner.execute(plan, propose=False, capture_hidden=False)[0]
        assert bare.tokens == full.tokens and bare.drafts == ()
        assert torch.isnan(runner.target_hidden).all()  # nothing was copied into the buffer
        runner.execute(plan, propose=False)
        assert torch.isfinite(runner.target_hidden[: len(prompt)]).all()
        with pytest.raises(ValueError, match="capture_hidden"):
            runner.execute(plan, capture_hidden=False)
        assert runner.execute(plan)[0] == full  # and the runner goes on as before


# --- the MTP layer's own cache stays right -------------------------------------------------------------
def test_mtp_drafts_equal_the_mtp_layer_run_from_scratch():
    """Every draft proposed during generation equals the MTP layer's prediction computed over the finished
    sequence in one pass with fresh caches: its cache held exactly the committed positions at every step."""
    with shipped(speculative_config=spec(MTP, 1)) as llm:
        runner = llm.engine.executor.runner
        proposed = []  # (position the draft is for, draft)
        original = runner.proposer.propose

        def record(items, seeds):
            drafts = original(items, seeds)
            for it in items:
                if it.seq_id in drafts:
                    committed = it.start + len(it.known) - 1
                    proposed.extend((committed + 1 + j, d) for j, d in enumerate(drafts[it.seq_id]))
            return drafts

        runner.proposer.propose = record
        out = llm.generate(CODE_PROMPTS[2], GREEDY)[0]
        tokens = out.prompt_token_ids + out.outputs[0].token_ids
        model, geo = runner.model, runner.geometry
        caches = model.allocate_cache(geo, torch.float32)
        hidden = torch.zeros(len(tokens), model.cfg.hc_dim)
        with torch.inference_mode():
            fb = build_forward_batch([Chunk(0, 0, tokens)], geo, logits_index=[0])
            model(fb, caches, target_hidden=hidden)
            mtp_fb = build_forward_batch([Chunk(0, 0, tokens[1:])], geo)
            logits, _ = model.mtp_forward(
                hidden[:-1].view(-1, model.cfg.hc_mult, model.cfg.hidden_size), mtp_fb, caches
            )
        reference = logits.argmax(dim=-1)  # row t predicts position t + 2
        assert len(proposed) > 20
        for position, draft in proposed:
            if position - 2 < len(reference):
                assert draft == int(reference[position - 2]), position


# --- sampling -----------------------------------------------------------------------------------------
P_TARGET = torch.tensor([0.05, 0.3, 0.1, 0.4, 0.15])
Q_DRAFT = torch.tensor([0.3, 0.1, 0.3, 0.2, 0.1])


def _first_token_frequencies(draft_probs: torch.Tensor | None, n: int = 40000) -> torch.Tensor:
    """n independent verifications of one draft: drafts ~ q (or a fixed token when q is None), returns the
    frequencies of the token emitted at that position."""
    v = P_TARGET.numel()
    logits = P_TARGET.log().expand(n, v).contiguous()
    seeds = torch.arange(n, dtype=torch.long)
    steps = torch.zeros(n, dtype=torch.long)
    if draft_probs is None:
        drafts = torch.full((n,), 3, dtype=torch.long)  # an n-gram proposing token 3 every time
        q = None
    else:
        q = draft_probs.expand(n, v).contiguous()
        drafts = (q / _exponentials(seeds, steps, v, STREAM_DRAFT)).argmax(dim=-1)
    params = [SamplingParams(temperature=1.0)] * n
    accepted, emit = Sampler().verify(logits, params, seeds, steps, drafts, q)
    final = torch.where(accepted, drafts, emit)
    return torch.bincount(final, minlength=v).double() / n


@pytest.mark.parametrize("draft", ["sampled", "point-mass"])
def test_rejection_sampling_reproduces_the_target_distribution(draft):
    n = 40000
    freq = _first_token_frequencies(Q_DRAFT if draft == "sampled" else None, n)
    expected = P_TARGET.double()
    chi2 = (n * (freq - expected) ** 2 / expected).sum().item()
    # 4 degrees of freedom: P(chi2 > 30) ~ 5e-6. Emitting drafts unchecked gives q's frequencies (chi2 in the
    # thousands); a residual that ignores q overweights the draft's likely tokens.
    assert chi2 < 30, (freq, expected)


def test_a_draft_equal_to_the_target_is_always_accepted():
    n, v = 2000, P_TARGET.numel()
    logits = P_TARGET.log().expand(n, v).contiguous()
    seeds, steps = torch.arange(n), torch.zeros(n, dtype=torch.long)
    q = torch.softmax(logits, dim=-1)
    drafts = (q / _exponentials(seeds, steps, v, STREAM_DRAFT)).argmax(dim=-1)
    accepted, _ = Sampler().verify(logits, [SamplingParams(temperature=1.0)] * n, seeds, steps, drafts, q)
    assert bool(accepted.all())


def test_seeded_sampling_with_mtp_is_reproducible_and_batch_independent():
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=123, max_tokens=30, ignore_eos=True)
    others = SamplingParams(temperature=1.0, seed=5, max_tokens=30, ignore_eos=True)
    with shipped(speculative_config=spec(MTP, 2)) as llm:
        alone = llm.generate(CODE_PROMPTS[0], params)[0].outputs[0].token_ids
        assert llm.generate(CODE_PROMPTS[0], params)[0].outputs[0].token_ids == alone
        batch = llm.generate([CODE_PROMPTS[1], CODE_PROMPTS[0], CODE_PROMPTS[2]], [others, params, others])
        assert batch[1].outputs[0].token_ids == alone
        assert llm.spec_decode_metrics()["num_accepted_tokens"] > 0
    with shipped(speculative_config=spec(MTP, 2)) as llm:  # and in a fresh engine
        assert llm.generate(CODE_PROMPTS[0], params)[0].outputs[0].token_ids == alone


# --- n-gram lookup --------------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_earlier_match():
    ngram = NgramProposer(
        type("S", (), {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})()
    )
    assert ngram.lookup([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3], limit=5) == (7, 8, 1)  # latest match wins
    assert ngram.lookup([5, 6, 7, 5, 6], limit=5) == (7, 5, 6)
    assert ngram.lookup([5, 6, 7, 5, 6], limit=1) == (7,)  # the request's remaining budget caps it
    assert ngram.lookup([1, 2, 3, 4], limit=5) == ()  # nothing repeats


# --- metrics and the CLI ------------------------------------------------------------------------------
def test_metrics_add_up(shipped_reference):
    with shipped(speculative_config=spec(MTP, 3)) as llm:
        llm.generate(CODE_PROMPTS, GREEDY)
        m = llm.spec_decode_metrics()
    assert set(m) == {
        "num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position", "acceptance_rate",
        "mean_acceptance_length",
    }  # fmt: skip
    per = m["accepted_per_position"]
    assert len(per) == 3 and per[0] >= per[1] >= per[2] and sum(per) == m["num_accepted_tokens"]
    assert m["num_drafts"] <= m["num_draft_tokens"] <= 3 * m["num_drafts"]
    assert m["acceptance_rate"] == pytest.approx(m["num_accepted_tokens"] / m["num_draft_tokens"])
    assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_tokens"] / m["num_drafts"])
    # Every emitted token is an accepted draft or the one token each step adds.
    emitted = 3 * GREEDY.max_tokens
    assert emitted <= m["num_accepted_tokens"] + m["num_drafts"] + 3 * 2  # + first tokens and final steps


def test_generate_prints_acceptance(capsys):
    args = ["--log-level", "warning", "generate", "--model", str(SHIPPED), "--prompt", CODE_PROMPTS[0]]
    args += ["--max-tokens", "24", "--speculative-config", json.dumps(spec(MTP, 1)), "--dtype", "float32"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "speculative decoding:" in err and "draft tokens accepted" in err and "mean acceptance length" in err
    assert main([*args, "--output", "json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["spec_decode"]["num_draft_tokens"] > 0 and len(result["token_ids"]) == 24


# --- bad input ---------------------------------------------------------------------------------------
def test_a_draft_model_with_another_vocabulary_is_refused(target5, make_ckpt):
    other = make_ckpt("spec-other-vocab", vocab_size=256)
    with pytest.raises(ConfigError, match=r"draft model's vocabulary \(256 tokens.*differs from the target's \(512\)"):
        LLM(str(target5), speculative_config=spec({"method": "draft_model"}, 2, model=str(other)), load_progress=False)


def test_a_draft_model_that_is_not_a_model_is_refused(target5, tmp_path):
    with pytest.raises(ConfigError, match="is not a model directory"):
        LLM(
            str(target5),
            speculative_config=spec({"method": "draft_model"}, 2, model=str(tmp_path)),
            load_progress=False,
        )


def test_cli_reports_bad_speculative_config(target5, capsys):
    args = ["generate", "--model", str(target5), "--prompt-token-ids", "1,2,3", "--speculative-config"]
    assert main([*args, '{"method": "mtp", "num_speculative_tokens": 0}']) == 2
    assert "num_speculative_tokens must be an integer >= 1" in capsys.readouterr().err
    assert (
        main(
            [*args, '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}']
        )
        == 2
    )
    assert "prompt_lookup_min (3) is larger than prompt_lookup_max (2)" in capsys.readouterr().err


def test_bench_spec_runs_every_method_side_by_side(capsys):
    args = ["--log-level", "warning", "bench", "spec", "--model", str(SHIPPED), "--batch-sizes", "1"]
    assert main([*args, "--max-tokens", "12", "--prompt-len", "16", "--repeats", "1", "--output", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in rows] == ["none", "mtp k=1", "mtp k=2", "mtp k=3", "ngram k=3"]
    assert all(r["same_tokens"] == "1/1" and r["tok_s"] > 0 for r in rows)
    assert rows[0]["acceptance_rate"] is None and 0 <= rows[1]["acceptance_rate"] <= 1
    assert rows[0]["step_cost"] is None
    for r in rows[1:]:  # what one speculative step costs in plain steps: the tokens it yields over its speed-up
        if r["mean_acceptance_length"] is not None:
            assert r["step_cost"] == pytest.approx(r["mean_acceptance_length"] / r["speedup"], rel=0.05)


def test_a_token_and_its_drafts_read_more_of_the_routed_experts_and_once_the_rest():
    # What bench spec-cost's bytes ceilings rest on: 3 tokens of the tiny preset (top 2 of 8 experts) read the
    # experts some token picks, 1 - (3/4)^3 of them, not 3 x 2/8; three embedding rows; every other tensor once.
    from leanserve.engine.costs import token_read_bytes
    from leanserve.make_random import preset_config

    cfg = preset_config("tiny", num_nextn_predict_layers=1)
    one, three = token_read_bytes(cfg, with_mtp=True), token_read_bytes(cfg, 3, with_mtp=True)
    assert one.keys() == three.keys() and any(n.startswith("mtp.") and ".experts." in n for n in one)
    for name, nbytes in one.items():
        if ".experts." in name:
            assert three[name] == pytest.approx(nbytes * 4 * (1 - 0.75**3))
        elif name == "embed.weight" or name.endswith("tid2eid"):
            assert three[name] == 3 * nbytes
        else:
            assert three[name] == nbytes


def test_the_mtp_layers_byte_price_counts_the_experts_of_the_position_it_drafts_from():
    # The MTP layer's catch-up runs its MoE at the last position of each sequence only (torch_math.blocks.mtp): so
    # catching up over three positions and drafting once more (four embedding rows a sequence) costs twice a
    # catch-up over two, and the trunk's verification over 2 tokens a sequence costs more than a plain step.
    from leanserve.bench.spec_cost import byte_prices
    from leanserve.engine.costs import token_read_bytes
    from leanserve.make_random import preset_config

    cfg = preset_config("tiny", num_nextn_predict_layers=1)
    for batch in (1, 4):
        prices, one = byte_prices(cfg, batch), token_read_bytes(cfg, batch, with_mtp=True)
        plain = sum(b for n, b in one.items() if not n.startswith("mtp."))
        row = one["embed.weight"] / batch / plain
        assert prices["two"] == pytest.approx(2 * prices["accepted"])
        mtp_pass = sum(b for n, b in one.items() if n.startswith("mtp.") or n in ("head.weight", "embed.weight"))
        assert prices["accepted"] == pytest.approx(mtp_pass / plain + batch * row)
        assert 1 < prices["verify"] < prices["verify2"]


def test_bench_spec_cost_reports_a_step_and_its_ceiling(capsys, make_ckpt):
    args = ["--log-level", "warning", "bench", "spec-cost", "--model", str(SHIPPED), "--batch-sizes", "1,2"]
    assert main([*args, "--repeats", "4", "--output", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["batch_size"] for r in rows] == [1, 2]
    for r in rows:
        assert r["plain_ms"] > 0 and r["verify"] > 0 and r["propose_accepted"] > 0 and r["propose_rejected"] > 0
        assert r["step_all_accepted"] == pytest.approx(r["verify"] + r["propose_accepted"], abs=0.011)
        # The columns are rounded to 0.01: the ceilings are checked within what that rounding moves them.
        step = r["step_all_accepted"]
        assert r["ceiling"] == pytest.approx(2 / step, abs=0.006 + 2 * 0.006 / (step - 0.006) ** 2)
        step2 = r["verify2"] + r["propose2"]
        assert r["ceiling2"] == pytest.approx(3 / step2, abs=0.006 + 3 * 0.011 / (step2 - 0.011) ** 2)
        # The acceptance each needs for 1.5x: k = 1 yields 1 + a tokens a step, k = 2 1 + a + a^2.
        assert 1 + r["need_k1"] == pytest.approx(1.5 * r["step_all_accepted"], abs=0.02)
        a = r["need_k2"]
        assert 1 + a + a * a == pytest.approx(1.5 * step2, abs=0.05)
        # At memory speed the drafts' extra experts and the MTP layer's reads still cost something.
        assert 1 < r["bytes_ceiling"] < 2 and 1 < r["bytes_ceiling2"] < 3
        # The byte prices the ceilings come from: the trunk over more tokens reads more, the MTP layer less.
        assert r["bytes_ceiling"] == pytest.approx(2 / (r["verify_bytes"] + r["accepted_bytes"]), abs=0.02)
        assert 1 <= r["verify_bytes"] <= r["verify2_bytes"] and 0 < r["accepted_bytes"] < r["propose2_bytes"]

    no_mtp = make_ckpt("spec-cost-no-mtp", num_nextn_predict_layers=0)
    assert main(["--log-level", "warning", "bench", "spec-cost", "--model", str(no_mtp)]) == 2
    assert "needs the checkpoint's MTP layer" in capsys.readouterr().err
