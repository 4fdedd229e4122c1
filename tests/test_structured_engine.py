"""Grammar-constrained decoding in the engine (SamplingParams.structured): on a tiny random model with the shipped
tokenizer and DeepSeek-V4's chat tokens, every output at temperature 1 (many seeds, one batch) and greedy is valid
JSON that validates against its schema, a forced tool call parses into the calls asked for with arguments that
validate, thinking mode leaves the reasoning free; unconstrained requests beside constrained ones are unchanged;
speculative decoding and a pipeline with overlap give the tokens of plain decoding; a schema that cannot compile
is refused before anything is queued; regex outputs fully match their regex and choice outputs are one of the
choices. The schemas and regexes have bounded content (enums, maxLength, bounded integers, maxItems, bounded
repeats), so that a random model's outputs end."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import jsonschema
import pytest
import torch

from leanserve import LLM, SamplingParams, StructuredOutput
from leanserve.chat.dsml import THINK_END, parse
from leanserve.engine.grammar import GrammarState, compile_structured
from leanserve.engine.runner import SampleSpec, StepPlan
from leanserve.engine.sequence import SampledToken
from leanserve.model.config import ModelConfig
from leanserve.structured import Matcher
from leanserve.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "dsv4-stdlib-12l"
MAX_LEN = 512
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "kind": {"enum": ["a", "b", "多云"]},
        },
        "required": ["name", "age", "kind"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 3},
            "ok": {"type": "boolean"},
            "score": {"type": "integer", "minimum": -5, "maximum": 5},
        },
        "required": ["tags", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 9},
                "label": {"type": ["string", "null"], "maxLength": 4},
            },
            "required": ["id"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 2,
    },
]


REGEXES = [
    r"[a-z]{1,8}@[a-z]{2,6}\.(com|org)",
    r"-?(0|[1-9][0-9]{0,4})(\.[0-9]{1,2})?",
    r"(yes|no|maybe), [A-Z][a-z]{0,6}!",
    r"[多云晴☔]{1,3}( [0-9]{1,2}°)?",
]
CHOICES = ("yes", "no", "no way", "多云", 'say "hi"')


def bounded_tools() -> list[dict]:
    """DeepSeek's test case 1 tools (get_weather, search), their free values bounded."""
    tools = json.loads((ROOT / "tests" / "data" / "dsv4_encoding" / "test_input_1.json").read_text())["tools"]
    weather, search = (t["function"]["parameters"] for t in tools)
    weather["properties"]["location"]["maxLength"] = 12
    search["properties"]["query"]["maxLength"] = 12
    search["properties"]["num_results"].update(minimum=1, maximum=20)
    for params in (weather, search):
        params["additionalProperties"] = False
    return tools


TOOLS = bounded_tools()
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CHAT = "<｜begin▁of▁sentence｜>You help.<｜User｜>What is the weather in Paris?<｜Assistant｜>"


def json_spec(i: int, **kw) -> StructuredOutput:
    return StructuredOutput("json", schema=SCHEMAS[i % len(SCHEMAS)], strict=True, **kw)


@pytest.fixture(scope="module")
def chat_ckpt(make_ckpt) -> Path:
    """The tiny preset with the shipped tokenizer (4096 ids) and DeepSeek-V4's chat tokens after them."""
    return make_ckpt("tiny-chat", tokenizer=MODEL, chat_tokens=True, index_n_heads=16)


def engine(ckpt: Path, **kw) -> LLM:
    kw = dict(max_model_len=MAX_LEN, max_num_seqs=20, max_num_batched_tokens=96, load_progress=False) | kw
    return LLM(str(ckpt), **kw)


@pytest.fixture(scope="module")
def llm(chat_ckpt):
    with engine(chat_ckpt) as llm:
        yield llm


@pytest.fixture(scope="module")
def tok(llm) -> Tokenizer:
    return llm.get_tokenizer()


def prompts(tok, n: int, suffix: str = "") -> list[dict]:
    """n chat prompts of different lengths (several are prefilled in chunks: a 96-token budget for 20)."""
    return [{"prompt_token_ids": tok.encode(CHAT + "x" * i + suffix, add_special_tokens=False)} for i in range(n)]


def check_json(llm, outputs, specs) -> None:
    eos = set(llm.engine.eos_token_ids)
    for out, spec in zip(outputs, specs, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.token_ids[-1] in eos and c.token_ids.count(c.token_ids[-1]) == 1
        jsonschema.validate(json.loads(c.text), json.loads(spec.schema))


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# --- StructuredOutput -------------------------------------------------------------------------------------------
def test_the_spec_is_small_frozen_and_hashable():
    a = StructuredOutput("json", schema={"type": "object"}, strict=True)
    assert a.schema == '{"type": "object"}' and a == StructuredOutput("json", schema='{"type": "object"}', strict=True)
    assert hash(a) == hash(StructuredOutput("json", schema='{"type": "object"}', strict=True))
    b = StructuredOutput("tool_calls", tools=TOOLS, required_name="search", after_think=True)
    assert json.loads(b.tools) == TOOLS and len({a, b, StructuredOutput()}) == 3
    with pytest.raises(AttributeError):
        a.strict = False  # type: ignore[misc]
    assert SamplingParams(structured=b).structured is b
    c = StructuredOutput("choice", choices=["yes", "no"])
    assert c.choices == ("yes", "no") and hash(c) == hash(StructuredOutput("choice", choices=("yes", "no")))
    assert StructuredOutput("regex", pattern="[0-9]+", after_think=True).pattern == "[0-9]+"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(kind="yaml"), "kind"),
        (dict(schema="{not json"), "schema is not valid JSON"),
        (dict(schema="[1, 2]"), "must be a JSON schema"),
        (dict(schema=3), "schema must be JSON text"),
        (dict(strict="yes"), "strict"),
        (dict(after_think=1), "after_think"),
        (dict(tools=TOOLS), 'for kind "tool_calls"'),
        (dict(kind="tool_calls"), "needs tools"),
        (dict(kind="tool_calls", tools="[]"), "needs tools"),
        (dict(kind="tool_calls", tools=TOOLS, strict=True), "strict"),
        (dict(kind="tool_calls", tools=TOOLS, required_name=""), "required_name"),
        (dict(kind="regex"), 'kind "regex" needs pattern'),
        (dict(kind="regex", pattern=""), 'kind "regex" needs pattern'),
        (dict(kind="regex", pattern=3), 'kind "regex" needs pattern'),
        (dict(kind="regex", pattern="a", schema={}), 'structured.schema is for kind "json", not "regex"'),
        (dict(pattern="a"), 'structured.pattern is for kind "regex", not "json"'),
        (dict(kind="choice"), 'kind "choice" needs choices: a list of strings'),
        (dict(kind="choice", choices="yes"), 'kind "choice" needs choices: a list of strings'),
        (dict(kind="choice", choices=[]), "at least one choice"),
        (dict(kind="choice", choices=["a", 1]), "choices must all be strings, got 1"),
        (dict(kind="choice", choices=["a"], pattern="a"), 'structured.pattern is for kind "regex"'),
        (dict(kind="tool_calls", tools=TOOLS, choices=["a"]), 'structured.choices is for kind "choice"'),
    ],
)
def test_bad_specs_raise_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutput(**kwargs)


def test_sampling_params_take_a_spec_and_refuse_ignore_eos():
    with pytest.raises(ValueError, match="structured must be a StructuredOutput"):
        SamplingParams(structured={"kind": "json"})
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(structured=StructuredOutput(), ignore_eos=True)


# --- outputs ---------------------------------------------------------------------------------------------------
def test_sampled_outputs_validate(llm, tok):
    specs = [json_spec(i) for i in range(20)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=400, structured=s) for i, s in enumerate(specs)]
    outputs = llm.generate(prompts(tok, 20), params)
    check_json(llm, outputs, specs)
    assert len({o.outputs[0].text for o in outputs}) == 20  # (really sampled)


def test_greedy_outputs_validate(llm, tok):
    specs = [json_spec(i) for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=400, structured=s) for s in specs]
    outputs = llm.generate(prompts(tok, 6), params)
    check_json(llm, outputs, specs)
    assert token_ids(llm.generate(prompts(tok, 6)[2:3], params[2])) == token_ids(outputs)[2:3]  # alone: the same


@pytest.mark.parametrize("name", ["get_weather", "search", None])
def test_forced_tool_calls_parse_and_validate(llm, tok, name):
    spec = StructuredOutput("tool_calls", tools=json.dumps(TOOLS), required_name=name)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=400, structured=spec) for i in range(12)]
    outputs = llm.generate(prompts(tok, 12), params)
    counts = []
    for out in outputs:
        c = out.outputs[0]
        assert c.finish_reason == "stop"
        parser = parse(c.text, thinking=False, tools=PARAMETERS)
        assert parser.tool_calls and not parser.content.strip(), c.text
        if name is not None:
            assert [call.name for call in parser.tool_calls] == [name]
        for call in parser.tool_calls:
            jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
        counts.append(len(parser.tool_calls))
    if name is None:
        assert max(counts) >= 2  # one or more calls


def test_thinking_mode_leaves_the_reasoning_free(llm, tok):
    # The random model seldom writes </think> by itself: a bias brings it on after a few tokens (the grammar
    # refuses it after that, bias or not).
    end = tok.token_to_id(THINK_END)
    specs = [json_spec(i, after_think=True) for i in range(10)]
    specs += [StructuredOutput("tool_calls", tools=TOOLS, required_name="get_weather", after_think=True)] * 4
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=400, structured=s, logit_bias={end: 6.0})
        for i, s in enumerate(specs)
    ]
    outputs = llm.generate(prompts(tok, len(specs), "<think>"), params)
    reasoning = []
    for out, spec in zip(outputs, specs, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.token_ids.count(end) == 1
        before, after = c.text.split(THINK_END)
        reasoning.append(before)
        if spec.kind == "json":
            jsonschema.validate(json.loads(after), json.loads(spec.schema))
        else:
            parser = parse(c.text, thinking=True, tools=PARAMETERS)
            assert [call.name for call in parser.tool_calls] == ["get_weather"] and parser.reasoning == before
    assert sum(map(len, reasoning)) > 100  # free text before </think>, not JSON
    assert not all(r.strip().startswith(("{", "[")) for r in reasoning if r.strip())


def test_regex_outputs_match_in_full(llm, tok):
    specs = [StructuredOutput("regex", pattern=REGEXES[i % len(REGEXES)]) for i in range(16)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=100, structured=s) for i, s in enumerate(specs)]
    params += [SamplingParams(temperature=0, max_tokens=100, structured=s) for s in specs[:4]]
    outputs = llm.generate(prompts(tok, len(params)), params)
    eos = set(llm.engine.eos_token_ids)
    for out, p in zip(outputs, params, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.token_ids[-1] in eos
        assert re.fullmatch(p.structured.pattern, c.text), (p.structured.pattern, c.text)
    assert len({o.outputs[0].text for o in outputs[:16]}) == 16  # (really sampled)


def test_choice_outputs_are_one_of_the_choices(llm, tok):
    spec = StructuredOutput("choice", choices=CHOICES)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=100, structured=spec) for i in range(16)]
    outputs = llm.generate(prompts(tok, 17), [*params, SamplingParams(temperature=0, max_tokens=100, structured=spec)])
    for out in outputs:
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.token_ids[-1] in llm.engine.eos_token_ids and c.text in CHOICES
    assert len({o.outputs[0].text for o in outputs}) >= 3


def test_regex_and_choice_after_thinking(llm, tok):
    end = tok.token_to_id(THINK_END)
    specs = [StructuredOutput("regex", pattern=REGEXES[i % 2], after_think=True) for i in range(4)]
    specs += [StructuredOutput("choice", choices=CHOICES, after_think=True)] * 4
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=300, structured=s, logit_bias={end: 6.0})
        for i, s in enumerate(specs)
    ]
    outputs = llm.generate(prompts(tok, len(specs), "<think>"), params)
    for out, spec in zip(outputs, specs, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.token_ids.count(end) == 1
        after = c.text.split(THINK_END)[1]
        assert re.fullmatch(spec.pattern, after) if spec.kind == "regex" else after in CHOICES, c.text


def test_a_regex_that_cannot_compile_is_refused_before_anything_is_queued(llm, tok):
    bad = SamplingParams(structured=StructuredOutput("regex", pattern=r"(a)\1"))
    with pytest.raises(ValueError, match=r"The regex .* backreferences are not supported"):
        llm.generate(prompts(tok, 2), [SamplingParams(max_tokens=4), bad])
    assert not llm.engine.has_unfinished


def test_a_cut_output_ends_with_length(llm, tok):
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=5, structured=json_spec(0))
    (out,) = llm.generate(prompts(tok, 1), params)
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 5


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(llm, tok):
    free = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=40, seed=6, max_tokens=24, ignore_eos=True),
    ]
    ps = prompts(tok, 8)
    alone = llm.generate(ps[:3], free)
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=400, structured=json_spec(i)) for i in range(5)]
    mixed = llm.generate(ps, [*free, *constrained])
    assert token_ids(mixed[:3]) == token_ids(alone)
    for a, b in zip(alone[0].outputs[0].logprobs, mixed[0].outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) <= 1e-5 for t in a)
    check_json(llm, mixed[3:], [p.structured for p in constrained])


def test_logprobs_are_the_raw_logits(llm, tok):
    # The first token of both comes from the same raw logits: the same top logprobs, though the grammar only
    # lets the constrained request write "{" or whitespace.
    ps = prompts(tok, 1)
    (free,) = llm.generate(ps, SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    (bound,) = llm.generate(ps, SamplingParams(temperature=0, max_tokens=40, logprobs=5, structured=json_spec(0)))
    first_free, first_bound = free.outputs[0].logprobs[0], bound.outputs[0].logprobs[0]
    top = {t: lp.logprob for t, lp in first_free.items() if lp.rank is not None}
    assert {t: lp.logprob for t, lp in first_bound.items() if lp.rank is not None} == top
    assert bound.outputs[0].token_ids[0] != free.outputs[0].token_ids[0]  # (the grammar did change the token)
    assert tok.decode(bound.outputs[0].token_ids[:1]).strip() in ("", "{")


def test_a_bad_schema_is_refused_before_anything_is_queued(llm, tok):
    good = SamplingParams(max_tokens=4, structured=json_spec(0))
    bad = SamplingParams(max_tokens=4, structured=StructuredOutput("json", schema={"type": "whatever"}))
    with pytest.raises(ValueError, match="JSON schema cannot be compiled"):
        llm.generate(prompts(tok, 2), [good, bad])
    assert not llm.engine.has_unfinished
    bad_tool = StructuredOutput("tool_calls", tools=TOOLS, required_name="no_such_tool")
    with pytest.raises(ValueError, match="no_such_tool"):
        llm.engine.add_request(prompts(tok, 1)[0]["prompt_token_ids"], SamplingParams(structured=bad_tool))
    assert not llm.engine.has_unfinished
    (out,) = llm.generate(prompts(tok, 1), SamplingParams(temperature=0, max_tokens=400, structured=json_spec(1)))
    check_json(llm, [out], [json_spec(1)])


# --- the engine's pieces -----------------------------------------------------------------------------------------
def test_plans_name_constrained_requests_only_while_they_run(llm, tok):
    plans = []
    launch = llm.engine.executor.launch

    def spy(plan: StepPlan) -> None:
        plans.append(plan)
        launch(plan)

    llm.engine.executor.launch = spy
    try:
        ps = prompts(tok, 2)
        llm.generate(
            ps, [SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=400, structured=json_spec(2))]
        )
        ids = {p.structured for p in plans}  # the constrained request's id in every plan while it runs
        assert len(ids) == 1 and len(ids.pop()) == 1
        plans.clear()
        llm.generate(ps[:1], SamplingParams(max_tokens=3, ignore_eos=True))
        assert all(p.structured == () for p in plans)  # nothing for requests that set none
        assert llm.engine.executor.runner.grammars.matchers == {}
    finally:
        del llm.engine.executor.launch


def test_masks_filled_while_the_model_runs_give_the_same_tokens(llm, tok):
    """Filled on the worker thread during the model's step (where a core is free) or after it on the step's
    thread: the same masks, so the same tokens, sampled and greedy, and the worker really ran."""
    grammars = llm.engine.executor.runner.grammars
    fills = []
    fill = grammars._fill

    def spy(*args):
        fills.append(threading.current_thread() is threading.main_thread())
        return fill(*args)

    ps = prompts(tok, 4)
    params = [
        SamplingParams(temperature=t, seed=i, max_tokens=60, structured=json_spec(i)) for i, t in enumerate((0, 1))
    ]
    params += [SamplingParams(temperature=1, seed=7, max_tokens=20, ignore_eos=True)] * 2
    outs = {}
    grammars._fill = spy
    try:
        for overlap in (True, False):
            grammars.overlap = overlap
            fills.clear()
            outs[overlap] = token_ids(llm.generate(ps, params))
            assert fills and all(on_main != overlap for on_main in fills)
    finally:
        grammars.overlap = None
        del grammars._fill
    assert outs[True] == outs[False]


def test_a_verified_row_is_masked_as_plain_decoding_would_mask_it(chat_ckpt):
    """Row j of a request with drafts: its matcher advanced by drafts[:j]; rows after a draft the grammar refuses
    are left as they are (that draft is rejected in its row); the matcher is back where it was afterwards."""
    state = GrammarState(str(chat_ckpt), ModelConfig.from_hf(chat_ckpt))
    tok = Tokenizer.from_dir(chat_ckpt)
    spec = json_spec(0)
    constrained = SamplingParams(temperature=0, structured=spec)
    state.begin((3,), [SampleSpec(3, constrained, 0, 0)])
    history = tok.encode('{"name": "ab', add_special_tokens=False)
    state.record([SampleSpec(3, constrained, 0, 0)], {3: tuple(map(SampledToken, history))})
    valid = tuple(tok.encode('c", "age": 7', add_special_tokens=False))
    drafts = valid + tuple(tok.encode("x}", add_special_tokens=False))  # "x" refused: the last drafts unused
    refused = len(valid)
    samples = [
        SampleSpec(1, SamplingParams(temperature=0), 0, 0, drafts=(5,)),
        SampleSpec(3, constrained, 0, 9, drafts=drafts),
    ]
    logits = torch.randn(2 + len(drafts) + 1, tok.vocab_size, generator=torch.Generator().manual_seed(0))
    raw = logits.clone()
    got = state.mask(logits, samples)
    assert torch.equal(logits, raw) and torch.equal(got[:2], raw[:2])  # not written; the free rows untouched
    grammar = compile_structured(state.compiler, spec)
    row = torch.zeros(state.matchers[3].mask_words, dtype=torch.int32)
    bits = torch.arange(32, dtype=torch.int32)
    for j in range(len(drafts) + 1):
        if j <= refused:
            m = Matcher(grammar)
            assert m.accept_prefix(history + list(drafts[:j])) == len(history) + j
            m.fill_mask(row)
            keep = ((row.unsqueeze(-1) >> bits) & 1).bool().flatten()[: tok.vocab_size]
            assert torch.equal(got[2 + j], raw[2 + j].masked_fill(~keep, float("-inf"))), j
            assert keep.sum() < tok.vocab_size
        else:
            assert torch.equal(got[2 + j], raw[2 + j])
    again = state.mask(logits, samples)  # (the matcher was rolled back)
    assert torch.equal(again, got)
    state.begin((), [])
    assert state.matchers == {}


def test_the_scheduler_names_running_constrained_requests():
    from leanserve.engine.scheduler import Scheduler
    from leanserve.engine.sequence import Sequence

    sched = Scheduler(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    plain = Sequence(0, [1, 2, 3], SamplingParams(max_tokens=4))
    bound = [Sequence(1 + i, [4, 5], SamplingParams(max_tokens=4, structured=StructuredOutput())) for i in range(2)]
    for seq in (plain, *bound):
        sched.add(seq)
    assert sched.schedule().structured == (1,)  # the third waits for a slot
    sched.abort(1)
    assert sched.schedule().structured == (2,)
    batch = sched.schedule(busy={2})  # (a micro-batch without it still names it)
    assert 2 not in [s.seq.seq_id for s in batch.seqs] and batch.structured == (2,)
    sched.abort(2)
    assert sched.schedule().structured == ()


# --- speculation and pipelines ----------------------------------------------------------------------------------
def mixed_requests(tok):
    end = tok.token_to_id(THINK_END)
    greedy = [SamplingParams(temperature=0, max_tokens=300, structured=json_spec(i)) for i in range(3)]
    greedy.append(SamplingParams(temperature=0, max_tokens=300, structured=StructuredOutput("tool_calls", tools=TOOLS)))
    greedy.append(
        SamplingParams(temperature=0, max_tokens=300, structured=json_spec(1, after_think=True), logit_bias={end: 4.0})
    )
    greedy.append(SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    sampled = [SamplingParams(temperature=1.0, seed=10 + i, max_tokens=300, structured=json_spec(i)) for i in range(3)]
    ps = prompts(tok, 9)
    ps[4] = prompts(tok, 5, "<think>")[4]
    return ps, greedy + sampled


@pytest.fixture(scope="module")
def plain_tokens(llm, tok):
    ps, params = mixed_requests(tok)
    return llm.generate(ps, params)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(pipeline_parallel_size=2),  # (overlap on: two micro-batches in flight)
        dict(speculative_config={"method": "mtp", "num_speculative_tokens": 2}),
        dict(speculative_config={"method": "mtp", "num_speculative_tokens": 2}, fill_overlap=True),
        dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}),
    ],
    ids=["pp2-overlap", "mtp-k2", "mtp-k2-masks-on-a-worker", "ngram-k3"],
)
def test_speculation_and_pipelines_give_the_tokens_of_plain_decoding(chat_ckpt, tok, plain_tokens, kwargs):
    ps, params = mixed_requests(tok)
    kwargs = dict(kwargs)
    fill_overlap = kwargs.pop("fill_overlap", None)
    with engine(chat_ckpt, **kwargs) as other:
        if fill_overlap:  # (the draft rows' masks filled on the worker thread)
            other.engine.executor.runner.grammars.overlap = True
        got = other.generate(ps, params)
        metrics = other.spec_decode_metrics()
    n = len(params) if "pipeline_parallel_size" in kwargs else 6  # sampled tokens differ with speculation
    assert token_ids(got)[:n] == token_ids(plain_tokens)[:n]
    check_json(other, [got[i] for i in (0, 1, 2, 6, 7, 8)], [params[i].structured for i in (0, 1, 2, 6, 7, 8)])
    if "speculative_config" in kwargs:
        assert metrics["num_accepted_tokens"] > 0
