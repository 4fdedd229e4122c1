"""DeepSeek-V4 prompt encoding: DeepSeek's published cases byte for byte, plus conversations written out by hand."""

import copy
import json
from pathlib import Path

import pytest

from leanserve.chat import dsv4
from leanserve.chat.dsv4 import encode_chat

DATA = Path(__file__).parent / "data" / "dsv4_encoding"

# The format's tokens, spelled out here so that expectations do not come from the code under test.
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
U = "<｜User｜>"
A = "<｜Assistant｜>"
TS = "<think>"
TE = "</think>"

MAX_PREAMBLE = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)


def tools_section(*schema_lines: str) -> str:
    return (
        "\n\n## Tools\n\n"
        "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
        '"<｜DSML｜tool_calls>" block like the following:\n\n'
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="$TOOL_NAME">\n'
        '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
        "...\n"
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="$TOOL_NAME2">\n'
        "...\n"
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls>\n\n"
        'String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, '
        'arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
        "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
        "<think>...</think> BEFORE any tool calls or final response.\n\n"
        "Otherwise, output directly after </think> with tool calls or final response.\n\n"
        "### Available Tool Schemas\n\n" + "\n".join(schema_lines) + "\n\n"
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
    )


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "查询天气 🌦",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
WEATHER_LINE = (
    '{"name": "get_weather", "description": "查询天气 🌦", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}}, "required": ["city"]}}'
)


def call(id_: str, arguments: str, name: str = "get_weather") -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


# ---------------------------------------------------------------- DeepSeek's own cases


@pytest.mark.parametrize("case, thinking", [(1, True), (2, True), (3, True), (4, False)])
def test_reference_cases_byte_for_byte(case, thinking):
    data = json.loads((DATA / f"test_input_{case}.json").read_text(encoding="utf-8"))
    tools = None
    if isinstance(data, dict):  # case 1: {"tools": [...], "messages": [...]}
        tools, data = data["tools"], data["messages"]
    expected = (DATA / f"test_output_{case}.txt").read_text(encoding="utf-8")
    assert encode_chat(data, tools=tools, thinking=thinking) == expected


def test_tokens():
    assert (dsv4.BOS, dsv4.EOS, dsv4.USER, dsv4.ASSISTANT, dsv4.THINK_START, dsv4.THINK_END) == (BOS, EOS, U, A, TS, TE)
    assert dsv4.DSML == "｜DSML｜"
    assert dsv4.CHAT_TOKENS == (BOS, EOS, U, A, TS, TE)
    assert dsv4.REASONING_EFFORTS == ("low", "medium", "high", "max")


# ---------------------------------------------------------------- hand-written conversations


def test_multi_turn_chat_mode():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "not shown in chat mode"},
        {"role": "user", "content": "Bye"},
    ]
    assert encode_chat(messages) == BOS + "Be brief." + U + "Hi" + A + TE + "Hello!" + EOS + U + "Bye" + A + TE


def test_thinking_drops_earlier_reasoning():
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
        {"role": "user", "content": "Q2"},
    ]
    assert encode_chat(messages, thinking=True) == BOS + U + "Q1" + A + TE + "A1" + EOS + U + "Q2" + A + TS
    # the turn after the last user message keeps its reasoning; vLLM's "reasoning" name works the same
    messages.append({"role": "assistant", "content": "A2", "reasoning": "R2"})
    assert encode_chat(messages, thinking=True) == (
        BOS + U + "Q1" + A + TE + "A1" + EOS + U + "Q2" + A + TS + "R2" + TE + "A2" + EOS
    )


def test_thinking_with_tools_keeps_reasoning_and_inserts_system():
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
        {"role": "user", "content": "Q2"},
    ]
    expected = BOS + tools_section(WEATHER_LINE) + U + "Q1" + A + TS + "R1" + TE + "A1" + EOS + U + "Q2" + A + TS
    assert encode_chat(messages, tools=[WEATHER], thinking=True) == expected


def test_request_tools_follow_existing_system_text():
    messages = [{"role": "system", "content": "Sys."}, {"role": "user", "content": "Hi"}]
    assert encode_chat(messages, tools=[WEATHER]) == BOS + "Sys." + tools_section(WEATHER_LINE) + U + "Hi" + A + TE


def test_several_tool_calls_results_sorted_into_call_order():
    messages = [
        {"role": "user", "content": "Weather in Paris and 北京?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call("c1", '{"city": "Paris"}'), call("c2", '{"city": "北京", "days": 3}')],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "tool", "tool_call_id": "c1", "content": "sun"},
        {"role": "user", "content": "Thanks, which is warmer?"},
    ]
    expected = (
        BOS + U + "Weather in Paris and 北京?" + A + TE + "\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">北京</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls>" + EOS + U + "<tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result>\n\n"
        "Thanks, which is warmer?" + A + TE
    )
    assert encode_chat(messages) == expected


def test_non_string_parameters_and_unparsable_arguments():
    arguments = '{"cities": ["Oslo", "東京"], "n": 2.5, "exact": true, "opts": {"k": "v"}, "none": null}'
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [call("x", arguments, "f"), call("y", "not json", "g")]},
    ]
    expected = (
        BOS + U + "go" + A + TE + "\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="f">\n'
        '<｜DSML｜parameter name="cities" string="false">["Oslo", "東京"]</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="n" string="false">2.5</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="exact" string="false">true</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="opts" string="false">{"k": "v"}</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="none" string="false">null</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="g">\n'
        '<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls>" + EOS
    )
    assert encode_chat(messages) == expected


def test_reasoning_effort():
    messages = [{"role": "user", "content": "Hi"}]
    assert encode_chat(messages, thinking=True, reasoning_effort="max") == BOS + MAX_PREAMBLE + U + "Hi" + A + TS
    for effort in ("high", "medium", "low", None):
        assert encode_chat(messages, thinking=True, reasoning_effort=effort) == BOS + U + "Hi" + A + TS
    # the preamble is a thinking-mode instruction only
    assert encode_chat(messages, reasoning_effort="max") == BOS + U + "Hi" + A + TE


def test_non_ascii_kept_as_is():
    messages = [{"role": "system", "content": "你是助手。"}, {"role": "user", "content": "你好 👋 café"}]
    out = encode_chat(messages, tools=[WEATHER])
    assert out == BOS + "你是助手。" + tools_section(WEATHER_LINE) + U + "你好 👋 café" + A + TE
    assert "\\u" not in out


def test_add_generation_prompt_false():
    messages = [{"role": "user", "content": "Hi"}]
    assert encode_chat(messages, thinking=True, add_generation_prompt=False) == BOS + U + "Hi"
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [call("c1", '{"city": "Oslo"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "snow"},
    ]
    assert encode_chat(messages, add_generation_prompt=False).endswith(EOS + U + "<tool_result>snow</tool_result>")
    assert encode_chat(messages).endswith(EOS + U + "<tool_result>snow</tool_result>" + A + TE)
    # a conversation ending in an assistant turn gets no transition either way
    done = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    assert encode_chat(done, add_generation_prompt=False) == encode_chat(done) == BOS + U + "Hi" + A + TE + "Yo" + EOS


def test_caller_messages_not_mutated():
    messages = [
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "r",
            "tool_calls": [call("a", "{}"), call("b", "{}")],
        },
        {"role": "tool", "tool_call_id": "b", "content": "2"},
        {"role": "tool", "tool_call_id": "a", "content": "1"},
    ]
    tools = [copy.deepcopy(WEATHER)]
    before = copy.deepcopy((messages, tools))
    encode_chat(messages, tools=tools, thinking=True)
    assert (messages, tools) == before


@pytest.mark.parametrize(
    "messages, kwargs",
    [
        ([], {}),
        ([{"role": "developer", "content": ""}], {}),
        ([{"role": "narrator", "content": "x"}], {}),
        ([{"role": "user", "content": "x"}], {"reasoning_effort": "extreme"}),
        ([{"role": "user", "content": "x", "task": "dance"}], {}),
        ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call("a", "[1, 2]")]}], {}),
        ([{"role": "user", "content": ["not", "a", "string"]}], {}),
    ],
)
def test_inexpressible_input_raises_value_error(messages, kwargs):
    with pytest.raises(ValueError):
        encode_chat(messages, **kwargs)
