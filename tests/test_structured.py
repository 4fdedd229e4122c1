"""Grammar-constrained decoding (leanserve.structured): random walks through the masks must give text that parses
and validates (JSON schemas, forced DSML tool calls, thinking mode), that Python's `re` fully matches (regexes)
or that is one of the choices; masks, EOS, rollback and refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from leanserve.chat.dsml import BLOCK_CLOSE, INVOKE_CLOSE, PARAM_CLOSE, THINK_END, parse
from leanserve.chat_tokens import DSV4_CHAT_TOKENS
from leanserve.structured import GrammarCompiler, Matcher, allocate_bitmask, apply_masks, fill_masks
from leanserve.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "dsv4_encoding"
TOOLS_1 = json.loads((DATA / "test_input_1.json").read_text())["tools"]  # get_weather, search
TOOLS_3 = json.loads((DATA / "test_input_3.json").read_text())[2]["tools"]  # search, open, find (strict schemas)
PLAN = {
    "type": "function",
    "function": {
        "name": "plan",
        "parameters": {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 12},
                "sky": {"enum": ["晴", "多云", "☔ rain"]},
                "when": {"type": ["string", "null"]},
                "count": {"type": "integer", "minimum": 0},
                "opts": {"type": "object", "properties": {"fast": {"type": "boolean"}}, "required": ["fast"]},
            },
            "required": ["title", "count"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [*TOOLS_1, *TOOLS_3[1:], PLAN]  # get_weather, search, open, find, plan
SCHEMA = {
    "type": "object",
    "properties": {
        "weather": TOOLS_1[0]["function"]["parameters"],
        "open": TOOLS_3[1]["function"]["parameters"],
        "find": TOOLS_3[2]["function"]["parameters"],
        "mode": {"enum": ["fast", "slow", 3]},
        "sky": {"enum": ["晴", "多云", "☔"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["weather", "mode", "sky"],
    "additionalProperties": False,
}
BITS = torch.arange(32, dtype=torch.int32)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """The shipped tokenizer with DeepSeek-V4's chat tokens added after its 4096 ids (as add-chat-tokens does)."""
    inner = HFTokenizer.from_file(str(ROOT / "models" / "dsv4-stdlib-12l" / "tokenizer.json"))
    for i, token in enumerate(DSV4_CHAT_TOKENS):
        inner.add_tokens([AddedToken(token, special=i < 2, normalized=False)])
    return Tokenizer(inner)


@pytest.fixture(scope="module")
def ids(tok) -> dict[str, int]:
    return {t: tok.token_to_id(t) for t in DSV4_CHAT_TOKENS}


@pytest.fixture(scope="module")
def eos_ids(ids) -> tuple[int, ...]:
    return ids["<｜end▁of▁sentence｜>"], 1  # the chat EOS, then the base model's


@pytest.fixture(scope="module")
def compiler(tok, eos_ids) -> GrammarCompiler:
    return GrammarCompiler(tok, eos_ids)


def allowed(row: torch.Tensor, vocab: int) -> torch.Tensor:
    return ((row.unsqueeze(-1) >> BITS) & 1).bool().flatten()[:vocab]


def walk(tok, matcher: Matcher, eos_ids, seed: int, budget: int = 100, limit: int = 4000) -> list[int]:
    """Uniformly random allowed tokens (a random model at temperature 1) until the matcher finishes or EOS is
    drawn; from step 0 to `budget` the walk turns, with growing probability, to closing text instead (the end of
    the open string, value or element), so that every walk ends. Returns the tokens, EOS excluded."""
    gen = torch.Generator().manual_seed(seed)
    row = torch.zeros(matcher.mask_words, dtype=torch.int32)
    out: list[int] = []
    while not matcher.is_finished:
        assert len(out) < limit, "the walk did not end"
        matcher.fill_mask(row)
        ok = allowed(row, tok.vocab_size)
        if torch.rand(1, generator=gen).item() < len(out) / budget:
            closing = close(tok, matcher, out, eos_ids)
            out += closing
            if closing or matcher.is_finished:  # (finished: by EOS, or by the closing text)
                continue
        choices = ok.nonzero().flatten()
        token = int(choices[torch.randint(len(choices), (1,), generator=gen)])
        assert matcher.accept(token)
        if token in eos_ids:
            break
        out.append(token)
    return [t for t in out if t not in eos_ids]


def close(tok, matcher: Matcher, out: list[int], eos_ids) -> list[int]:
    """The tokens of the first closing text the grammar accepts here (accepted), or [] when none (or EOS)."""
    text = tok.decode(out, skip_special_tokens=False)
    if text.rfind('string="true">') > text.rfind(PARAM_CLOSE):  # in a raw value: only its closing tag ends it
        candidates = [PARAM_CLOSE]
    else:
        candidates = ['"', "}", "]", "\n" + INVOKE_CLOSE, "\n" + BLOCK_CLOSE, PARAM_CLOSE, "1"]
    if THINK_END not in text:  # (the end of the reasoning in thinking mode)
        candidates.insert(0, THINK_END)
    for ids in [[e] for e in eos_ids] + [tok.encode(c, add_special_tokens=False) for c in candidates]:
        n = matcher.accept_prefix(ids)
        if n == len(ids):
            return ids if ids[0] not in eos_ids else []
        matcher.rollback(n)
    return []


def check_tokens(tok, tokens: list[int], ids, *, thinking: bool = False) -> str:
    """No special token in the output but ｜DSML｜ (and one </think> in thinking mode); valid UTF-8 throughout."""
    specials = [t for t in tokens if t < 3 or t >= 4096]
    assert set(specials) <= {ids["｜DSML｜"], ids[THINK_END]}, specials
    assert specials.count(ids[THINK_END]) == thinking
    text = tok.decode(tokens, skip_special_tokens=False)
    assert "\ufffd" not in text
    return text


def retokenized(tok, grammar, text: str, *, thinking: bool = False) -> str:
    """The text's own tokenization (the tokenizer's, not the walk's) goes through a fresh matcher too."""
    tokens = tok.encode(text, add_special_tokens=False)
    m = Matcher(grammar, thinking=thinking)
    assert m.accept_prefix(tokens) == len(tokens) and m.allows_eos, text
    return text


def validate_calls(text: str, tools: list[dict], *, thinking: bool = False) -> list:
    by_name = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    parser = parse(text, thinking=thinking, tools=by_name)
    assert parser.tool_calls and not parser.content.strip(), text
    for call in parser.tool_calls:
        jsonschema.validate(json.loads(call.arguments), by_name[call.name])
    return parser.tool_calls


def test_any_json_object(tok, ids, eos_ids, compiler):
    grammar = compiler.json(None, strict=True)
    for seed in range(12):
        text = check_tokens(tok, walk(tok, Matcher(grammar), eos_ids, seed), ids)
        assert isinstance(json.loads(retokenized(tok, grammar, text)), dict)


def test_json_schema(tok, ids, eos_ids, compiler):
    grammar = compiler.json(SCHEMA, strict=True)
    for seed in range(20):
        text = check_tokens(tok, walk(tok, Matcher(grammar), eos_ids, seed), ids)
        jsonschema.validate(json.loads(retokenized(tok, grammar, text)), SCHEMA)


def test_tool_calls_of_any_offered_tool(tok, ids, eos_ids, compiler):
    grammar = compiler.tool_calls(TOOLS, None)
    names, most_calls, most_arguments = set(), 0, 0
    for seed in range(25):
        text = check_tokens(tok, walk(tok, Matcher(grammar), eos_ids, seed), ids)
        calls = validate_calls(retokenized(tok, grammar, text), TOOLS)
        names |= {call.name for call in calls}
        most_calls = max(most_calls, len(calls))
        most_arguments = max(most_arguments, *(len(json.loads(call.arguments)) for call in calls))
    assert len(names) >= 3 and most_calls >= 2 and most_arguments >= 3


@pytest.mark.parametrize("name", ["get_weather", "open", "plan"])
def test_tool_call_of_the_named_function(tok, ids, eos_ids, compiler, name):
    grammar = compiler.tool_calls(TOOLS, name)
    for seed in range(8):
        text = check_tokens(tok, walk(tok, Matcher(grammar), eos_ids, seed), ids)
        assert [call.name for call in validate_calls(retokenized(tok, grammar, text), TOOLS)] == [name]


def test_thinking_mode(tok, ids, eos_ids, compiler):
    json_grammar, tool_grammar = compiler.json(SCHEMA, strict=True), compiler.tool_calls(TOOLS, None)
    for seed in range(8):
        text = check_tokens(tok, walk(tok, Matcher(json_grammar, thinking=True), eos_ids, seed), ids, thinking=True)
        reasoning, answer = retokenized(tok, json_grammar, text, thinking=True).split(THINK_END)
        jsonschema.validate(json.loads(answer), SCHEMA)
        text = check_tokens(tok, walk(tok, Matcher(tool_grammar, thinking=True), eos_ids, seed), ids, thinking=True)
        validate_calls(retokenized(tok, tool_grammar, text, thinking=True), TOOLS, thinking=True)
    # the reasoning is free: any text (here, JSON-breaking and with DSML), but not EOS
    m = Matcher(json_grammar, thinking=True)
    free = tok.encode("}{ <｜DSML｜invoke 多云 ", add_special_tokens=False)
    assert m.accept_prefix(free) == len(free)
    assert not any(m.accept(e) for e in eos_ids)
    assert m.accept(ids[THINK_END]) and not m.accept(tok.encode("x")[0])


# Regexes that llguidance (Rust's `regex` syntax) and Python's `re` read the same way: Unicode digits and case
# folding, non-ASCII literals, a slash (escaped in the grammar), a newline, quotes and alternations.
REGEXES = [
    r"[a-z]{1,8}@[a-z]{2,6}\.(com|org|net)",
    r"\d{3}-\d{4}",
    r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?",
    r"(?i)hello( world){0,2}!?",
    r"[多云晴☔]{1,3}(, [a-z]{1,4}){0,2}",
    r"(yes|no|maybe)\n[A-Z][a-z ]{0,10}\.",
    r".{1,6}/x",
    r'"[^"\\]{0,6}"',
]
CHOICES = ("yes", "no", "no way", "多云 ☔", 'say "hi"\n', "a\\b/c", "")


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex(tok, ids, eos_ids, compiler, pattern):
    grammar = compiler.regex(pattern)
    texts = set()
    for seed in range(10):
        text = check_tokens(tok, walk(tok, Matcher(grammar), eos_ids, seed), ids)
        assert re.fullmatch(pattern, retokenized(tok, grammar, text)), text
        texts.add(text)
    assert len(texts) >= 5  # (really walked)
    for text in ("", "x" * 40, texts.pop() + "\u0000"):  # text the regex does not match is refused
        tokens = tok.encode(text, add_special_tokens=False)
        m = Matcher(grammar)
        assert m.accept_prefix(tokens) < len(tokens) or not m.allows_eos


def test_choice(tok, ids, eos_ids, compiler):
    grammar = compiler.choice(CHOICES)
    seen = set()
    for seed in range(40):
        text = check_tokens(tok, walk(tok, Matcher(grammar), eos_ids, seed), ids)
        assert retokenized(tok, grammar, text) in CHOICES
        seen.add(text)
    assert len(seen) >= 5
    m = Matcher(grammar)  # a choice that is a prefix of another ends there, or goes on
    assert m.accept_prefix(tok.encode("no", add_special_tokens=False)) and m.allows_eos and not m.is_finished
    assert m.accept_prefix(tok.encode(" way", add_special_tokens=False)) and m.is_finished
    m = Matcher(grammar)
    assert m.accept_prefix(tok.encode("yess", add_special_tokens=False)) < len(tok.encode("yess"))


def test_regex_and_choice_after_thinking(tok, ids, eos_ids, compiler):
    pattern = REGEXES[0]
    regex, choice = compiler.regex(pattern), compiler.choice(CHOICES)
    for seed in range(6):
        text = check_tokens(tok, walk(tok, Matcher(regex, thinking=True), eos_ids, seed), ids, thinking=True)
        assert re.fullmatch(pattern, retokenized(tok, regex, text, thinking=True).split(THINK_END)[1])
        text = check_tokens(tok, walk(tok, Matcher(choice, thinking=True), eos_ids, seed), ids, thinking=True)
        assert retokenized(tok, choice, text, thinking=True).split(THINK_END)[1] in CHOICES


def test_a_regex_that_cannot_compile_is_named(compiler):
    for pattern, reason in [
        (r"(a)\1", "backreferences are not supported"),
        (r"(?=a)a", "look-around"),
        ("[a-", "unclosed character class"),
        (r"[^\s\S]", "matches no text"),
    ]:
        with pytest.raises(ValueError) as info:
            compiler.regex(pattern)
        assert str(info.value).startswith(f"The regex {pattern!r} ") and reason in str(info.value)


def test_a_tokenizer_without_chat_tokens():
    """</think> and ｜DSML｜ are then plain text: the reasoning ends at the text </think>, tags are spelled out."""
    base = Tokenizer.from_dir(ROOT / "models" / "dsv4-stdlib-12l")
    compiler = GrammarCompiler(base, (1,))
    json_grammar, tool_grammar = compiler.json(SCHEMA, strict=True), compiler.tool_calls(TOOLS, "plan")
    for seed in range(4):
        text = base.decode(walk(base, Matcher(json_grammar, thinking=True), (1,), seed), skip_special_tokens=False)
        assert text.count(THINK_END) == 1 and "\ufffd" not in text
        jsonschema.validate(
            json.loads(retokenized(base, json_grammar, text, thinking=True).split(THINK_END)[1]), SCHEMA
        )
        text = base.decode(walk(base, Matcher(tool_grammar), (1,), seed), skip_special_tokens=False)
        assert [call.name for call in validate_calls(retokenized(base, tool_grammar, text), TOOLS)] == ["plan"]


def test_the_encoders_dsml_block_is_accepted(tok, ids, eos_ids, compiler):
    """The block DeepSeek's reference encoding writes (test_output_1) goes through token by token, with the single
    ｜DSML｜ token, and then only EOS may follow."""
    golden = (DATA / "test_output_1.txt").read_text()
    start = golden.index(THINK_END + "\n\n<｜DSML｜tool_calls>") + len(THINK_END)  # (the system prompt has one too)
    block = golden[start : golden.index(BLOCK_CLOSE, start) + len(BLOCK_CLOSE)]
    assert block.count("<｜DSML｜parameter") == 2
    tokens = tok.encode(block, add_special_tokens=False)
    assert ids["｜DSML｜"] in tokens
    m = Matcher(compiler.tool_calls(TOOLS_1, "get_weather"))
    assert m.accept_prefix(tokens) == len(tokens) and m.is_finished and m.allows_eos
    row = torch.zeros(m.mask_words, dtype=torch.int32)
    m.fill_mask(row)
    assert allowed(row, tok.vocab_size).nonzero().flatten().tolist() == sorted(eos_ids)


def test_raw_values_and_extra_parameters(tok, compiler):
    open_ = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="location" string="true">'

    def accepts(tools, text: str) -> bool:
        tokens = tok.encode(text, add_special_tokens=False)
        return Matcher(compiler.tool_calls(tools, None)).accept_prefix(tokens) == len(tokens)

    close = f"</｜DSML｜parameter>\n{INVOKE_CLOSE}\n{BLOCK_CLOSE}"
    assert accepts(TOOLS_1, open_ + "北京 </ <｜DSML｜x" + close)
    assert not accepts(TOOLS_1, open_ + "a</｜DSML｜parameter>b" + close)  # a raw value cannot hold its closing tag
    extra = '</｜DSML｜parameter>\n<｜DSML｜parameter name="{}" string="false">{}'
    assert accepts(TOOLS_1, open_ + "x" + extra.format("days", "[1, 2]") + close)  # one undeclared parameter
    assert not accepts(TOOLS_1, open_ + "x" + extra.format("location", '"y"') + close)  # not a declared one
    strict = json.loads(json.dumps(TOOLS_1))
    strict[0]["function"]["parameters"]["additionalProperties"] = False
    assert not accepts(strict, open_ + "x" + extra.format("days", "[1, 2]") + close)
    assert not accepts(TOOLS_1, open_ + "x" + extra.format("unit", '"kelvin"') + close)  # the enum holds as JSON


def test_eos_only_at_the_end_and_rollback(tok, eos_ids, compiler):
    m = Matcher(compiler.json({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, True))
    row, masks = torch.zeros(m.mask_words, dtype=torch.int32), []
    for token in tok.encode('{"a": 12}', add_special_tokens=False):
        assert not m.allows_eos and not any(m.accept(e) for e in eos_ids)  # refused, and nothing changed
        m.fill_mask(row)
        masks.append(row.clone())
        assert m.accept(token)
    assert m.allows_eos and m.accept(eos_ids[0]) and m.is_finished
    m.rollback(len(masks) + 1)
    assert not m.is_finished
    m.fill_mask(row)
    assert torch.equal(row, masks[0])
    with pytest.raises(ValueError):
        m.rollback(1)


def test_masks_in_a_batch(tok, compiler):
    vocab = tok.vocab_size
    grammars = [compiler.json(SCHEMA, True), compiler.tool_calls(TOOLS, None), compiler.json(None, False)]
    matchers = [Matcher(g) for g in grammars]
    matchers[0].accept_prefix(tok.encode('{"weather": {"location": "', add_special_tokens=False))
    batch = [matchers[0], None, matchers[1], matchers[2]]
    bitmask = allocate_bitmask(len(batch), vocab)
    fill_masks(batch, bitmask)
    row = torch.zeros(matchers[0].mask_words, dtype=torch.int32)
    for i, m in enumerate(batch):
        if m is None:
            assert (bitmask[i] == -1).all()
        else:
            m.fill_mask(row)
            assert torch.equal(row, bitmask[i])
    logits = torch.randn(len(batch), vocab + 5)  # a model's head may be wider than the tokenizer
    masked = logits.clone()
    apply_masks(masked, batch)
    for i, m in enumerate(batch):
        if m is None:
            assert torch.equal(masked[i], logits[i])
        else:
            keep = torch.cat([allowed(bitmask[i], vocab), torch.zeros(5, dtype=torch.bool)])
            assert torch.equal(masked[i], logits[i].masked_fill(~keep, float("-inf")))


@pytest.mark.parametrize(
    "make",
    [
        lambda c: c.json({"type": "whatever"}, strict=True),
        lambda c: c.json({"type": "string", "format": "not-a-format"}, strict=True),
        lambda c: c.json({"$ref": "#/$defs/missing"}, strict=False),
        lambda c: c.json([1, 2], strict=True),
        lambda c: c.json(False, strict=True),
        lambda c: c.tool_calls(TOOLS, "no_such_tool"),
        lambda c: c.tool_calls([], None),
        lambda c: c.tool_calls([TOOLS_1[0], TOOLS_1[0]], None),
        lambda c: c.tool_calls([{"type": "function", "function": {"name": 'say"hi'}}], None),
        lambda c: c.tool_calls(
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None
        ),
        lambda c: c.tool_calls(
            [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "nope"}}}}}],
            None,
        ),
        lambda c: c.tool_calls(
            [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {"minProperties": 2}}}],
            None,
        ),
        lambda c: c.json({"type": "string", "pattern": "(a)\\1"}, strict=True),
        lambda c: c.regex(r"(a)\1"),
        lambda c: c.regex(r"\bword"),
        lambda c: c.regex(3),
        lambda c: c.choice([]),
        lambda c: c.choice("yes"),
        lambda c: c.choice(["yes", 1]),
    ],
)
def test_schemas_that_cannot_compile(compiler, make):
    with pytest.raises(ValueError) as info:
        make(compiler)
    message = str(info.value)
    assert message.endswith(".") and "\n" not in message
