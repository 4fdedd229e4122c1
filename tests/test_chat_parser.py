"""The DeepSeek-V4 output parser (leanserve.chat.dsml): reasoning, content and DSML tool calls, whole and streamed."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from leanserve.chat.dsml import Delta, OutputParser, ToolCall, ToolCallDelta, parse

DATA = Path(__file__).parent / "data" / "dsv4_encoding"
TOOLS = {"get_weather", "search"}
EOS = "<｜end▁of▁sentence｜>"
OPEN_THINKING = "<｜Assistant｜><think>"

BLOCK = "\n\n<｜DSML｜tool_calls>\n"
END = "</｜DSML｜tool_calls>"


def invoke(name: str, *params: tuple[str, str, str]) -> str:
    body = "".join(f'<｜DSML｜parameter name="{k}" string="{s}">{v}</｜DSML｜parameter>\n' for k, s, v in params)
    return f'<｜DSML｜invoke name="{name}">\n{body}</｜DSML｜invoke>\n'


def run(pieces: list[str], *, thinking: bool, tools=TOOLS) -> tuple[OutputParser, list[Delta]]:
    parser = OutputParser(thinking=thinking, tools=tools)
    deltas = [parser.feed(p) for p in pieces]
    deltas.append(parser.finish())
    return parser, deltas


def splits(text: str, n_three: int = 150) -> list[list[str]]:
    """The whole text, one character at a time, two pieces at every cut, three pieces at sampled cuts."""
    out = [[text], list(text)]
    out += [[text[:i], text[i:]] for i in range(len(text) + 1)]
    rng = random.Random(len(text))
    for _ in range(n_three):
        i, j = sorted(rng.randrange(len(text) + 1) for _ in range(2))
        out.append([text[:i], text[i:j], text[j:]])
    return out


def check(text: str, *, thinking: bool, tools=TOOLS, reasoning: str, content: str, calls: list[ToolCall]) -> None:
    """Every split of `text` gives the expected result, in the accumulated fields and in the streamed deltas."""
    for pieces in splits(text):
        parser, deltas = run(pieces, thinking=thinking, tools=tools)
        assert (parser.reasoning, parser.content, parser.tool_calls) == (reasoning, content, calls), pieces
        assert "".join(d.reasoning for d in deltas) == reasoning
        assert "".join(d.content for d in deltas) == content
        streamed = [d for delta in deltas for d in delta.tool_calls]
        names = [(d.index, d.name) for d in streamed if d.name is not None]
        assert names == [(i, c.name) for i, c in enumerate(calls)]
        for i, call in enumerate(calls):
            frags = [d for d in streamed if d.index == i]
            assert frags[0].name == call.name and frags[0].arguments == ""
            assert all(d.name is None for d in frags[1:])
            assert "".join(d.arguments for d in frags) == call.arguments
        assert all(isinstance(d, ToolCallDelta) for d in streamed)


# -- DeepSeek's case 1 --


def case1_turns() -> list[tuple[str, dict]]:
    prompt = (DATA / "test_output_1.txt").read_text(encoding="utf-8")
    messages = json.loads((DATA / "test_input_1.json").read_text(encoding="utf-8"))["messages"]
    texts = [part.split(EOS)[0] for part in prompt.split(OPEN_THINKING)[1:]]
    expected = [m for m in messages if m["role"] == "assistant"]
    assert len(texts) == len(expected) == 2
    return list(zip(texts, expected, strict=True))


@pytest.mark.parametrize("turn", [0, 1])
def test_case1_turns(turn: int) -> None:
    text, msg = case1_turns()[turn]
    calls = [ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])]
    check(
        text,
        thinking=True,
        reasoning=msg["reasoning_content"],
        content=msg.get("content") or "",
        calls=calls,
    )


def test_case1_first_turn_fragments() -> None:
    text, _ = case1_turns()[0]
    parser = parse(text, thinking=True, tools=TOOLS)
    assert parser.reasoning.startswith("The user wants")
    assert parser.content == ""
    assert parser.tool_calls == [ToolCall("get_weather", '{"location": "Beijing", "unit": "celsius"}')]
    _, deltas = run(list(text), thinking=True)
    streamed = [d for delta in deltas for d in delta.tool_calls]
    assert streamed == [
        ToolCallDelta(0, "get_weather", ""),
        ToolCallDelta(0, None, '{"location": "Beijing"'),
        ToolCallDelta(0, None, ', "unit": "celsius"'),
        ToolCallDelta(0, None, "}"),
    ]


# -- well-formed output --


def test_several_invokes_and_json_values() -> None:
    text = (
        "Let me look.\n\n<｜DSML｜tool_calls>\n"
        + invoke("search", ("query", "true", "weather Beijing"), ("num_results", "false", "5"))
        + invoke(
            "search",
            ("query", "true", "x"),
            ("ratio", "false", "3.5"),
            ("tags", "false", '[1, "a", null]'),
            ("opts", "false", '{"a": {"b": false}}'),
            ("exact", "false", "true"),
        )
        + invoke("get_weather")
        + END
    )
    check(
        text,
        thinking=False,
        reasoning="",
        content="Let me look.",
        calls=[
            ToolCall("search", '{"query": "weather Beijing", "num_results": 5}'),
            ToolCall(
                "search",
                '{"query": "x", "ratio": 3.5, "tags": [1, "a", null], "opts": {"a": {"b": false}}, "exact": true}',
            ),
            ToolCall("get_weather", "{}"),
        ],
    )


def test_value_with_newlines_angle_brackets_and_non_ascii() -> None:
    value = "line 1\n<b>a < b</b>\n</｜DSML｜param\n北京 🌧"
    text = "思考</think>好的" + BLOCK + invoke("search", ("query", "true", value), ("城市", "false", '"上海"')) + END
    args = json.dumps({"query": value, "城市": "上海"}, ensure_ascii=False)
    check(text, thinking=True, reasoning="思考", content="好的", calls=[ToolCall("search", args)])
    assert json.loads(args)["query"] == value and "北京" in args


def test_chat_mode_and_thinking_without_end() -> None:
    check("Hello </think> there", thinking=False, reasoning="", content="Hello </think> there", calls=[])
    cut = "Still thinking ... \n\n<｜DSML｜tool_calls>\n</thi"
    check(cut, thinking=True, reasoning=cut, content="", calls=[])
    check("", thinking=True, reasoning="", content="", calls=[])


def test_text_after_block_and_block_without_blank_line() -> None:
    text = "a\n\n\n" + BLOCK.lstrip("\n") + invoke("get_weather", ("location", "true", "Oslo")) + END + "\nDone."
    # "a\n\n\n<block>": the last two newlines belong to the marker.
    check(
        text,
        thinking=False,
        reasoning="",
        content="a\n\nDone.",
        calls=[ToolCall("get_weather", '{"location": "Oslo"}')],
    )
    text = "Sure:<｜DSML｜tool_calls>\n" + invoke("get_weather", ("location", "true", "Oslo")) + END
    check(text, thinking=False, reasoning="", content="Sure:", calls=[ToolCall("get_weather", '{"location": "Oslo"}')])
    text = "x\n<｜DSML｜tool_calls>\n" + invoke("get_weather") + END
    check(text, thinking=False, reasoning="", content="x\n", calls=[ToolCall("get_weather", "{}")])


def test_two_blocks() -> None:
    text = (
        "r</think>"
        + BLOCK
        + invoke("search", ("query", "true", "a"))
        + END
        + "mid"
        + BLOCK
        + invoke("get_weather")
        + END
    )
    calls = [ToolCall("search", '{"query": "a"}'), ToolCall("get_weather", "{}")]
    check(text, thinking=True, reasoning="r", content="mid", calls=calls)


def test_delta_truthiness() -> None:
    assert not Delta()
    assert Delta(content="x") and Delta(reasoning="x")
    assert Delta(tool_calls=(ToolCallDelta(0, "f", ""),))


# -- malformed output: the raw text comes back as content --

GOOD = invoke("get_weather", ("location", "true", "Beijing"))
MALFORMED = {
    "unclosed": BLOCK + GOOD,
    "unclosed_in_value": BLOCK
    + '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="location" string="true">Bei',
    "no_string_attribute": BLOCK
    + '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="location">Beijing</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
    + END,
    "bad_string_attribute": BLOCK + invoke("get_weather", ("location", "yes", "Beijing")) + END,
    "invalid_json": BLOCK + invoke("search", ("query", "true", "q"), ("num_results", "false", "{five")) + END,
    "nan": BLOCK + invoke("search", ("num_results", "false", "NaN")) + END,
    "unknown_tool": BLOCK + invoke("get_time", ("zone", "true", "UTC")) + END,
    "duplicate_parameter": BLOCK + invoke("get_weather", ("location", "true", "A"), ("location", "true", "B")) + END,
    "garbage_between_invokes": BLOCK + GOOD + "and then\n" + GOOD + END,
    "empty_block": BLOCK + END,
    "unclosed_invoke": BLOCK + '<｜DSML｜invoke name="get_weather">\n' + END,
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
@pytest.mark.parametrize("thinking", [False, True])
def test_malformed_is_content(name: str, thinking: bool) -> None:
    rest = "Text before." + MALFORMED[name] + " after"
    text = ("Reasoning.</think>" if thinking else "") + rest
    check(text, thinking=thinking, reasoning="Reasoning." if thinking else "", content=rest, calls=[])


def test_no_tools_offered() -> None:
    text = "ok" + BLOCK + GOOD + END
    check(text, thinking=False, tools=(), reasoning="", content=text, calls=[])


def test_malformed_then_valid_block() -> None:
    bad = BLOCK + invoke("nope") + END
    text = "a" + bad + "b" + BLOCK + GOOD + END
    check(
        text,
        thinking=False,
        reasoning="",
        content="a" + bad + "b",
        calls=[ToolCall("get_weather", '{"location": "Beijing"}')],
    )


def test_a_long_text_in_token_sized_pieces() -> None:
    """Long reasoning, content and a long parameter value, four characters at a time."""
    long = "word < \n" * 50_000
    text = "r" * 100_000 + "</think>" + long + BLOCK + invoke("search", ("query", "true", long)) + END
    parser = OutputParser(thinking=True, tools=TOOLS)
    for i in range(0, len(text), 4):
        parser.feed(text[i : i + 4])
    parser.finish()
    assert parser.content == long and json.loads(parser.tool_calls[0].arguments) == {"query": long}
