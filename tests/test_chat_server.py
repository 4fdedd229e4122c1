"""Chatting with a DeepSeek-V4-format model through the server, with the official `openai` client: the prompt
is the one DeepSeek's encoder writes (`/tokenize` of a conversation is case 1's gold bytes and the ids the chat
request prefills), reasoning and DSML tool calls come back as OpenAI fields (streaming and not), malformed DSML
as content, and every field the server cannot honour is a 400 naming it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest

from leanserve import LLM
from leanserve.chat import dsv4
from leanserve.chat_tokens import add_chat_tokens
from leanserve.engine.sequence import SampledToken
from leanserve.server.async_engine import Delta
from test_server import SHIPPED, Server

NAME = "dsv4-chat"
CASES = Path(__file__).parent / "data" / "dsv4_encoding"
CASE1 = json.loads((CASES / "test_input_1.json").read_text())
GOLD1 = (CASES / "test_output_1.txt").read_text()
WEATHER = CASE1["tools"][0]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The shipped model with DeepSeek-V4's chat tokens added to its tokenizer (embedding and head grown)."""
    out = tmp_path_factory.mktemp("dsv4-chat") / "model"
    add_chat_tokens(SHIPPED, out)
    return out


@pytest.fixture(scope="module")
def server(model):
    s = Server("--served-model-name", NAME, "--max-model-len", "2048", model=model)
    yield s
    assert s.stop() == 0


def post(server, path: str, body: dict) -> tuple[int, dict]:
    status, raw = server.raw(path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return status, json.loads(raw)


def test_tokenize_of_a_conversation_is_deepseeks_prompt_and_what_the_chat_prefills(server):
    # Case 1 up to its last user turn, in thinking mode: the prompt is the gold text up to its last <think>.
    messages = CASE1["messages"][:-1]
    want = GOLD1[: GOLD1.rindex(dsv4.ASSISTANT + dsv4.THINK_START) + len(dsv4.ASSISTANT + dsv4.THINK_START)]
    kwargs = {"thinking": True}
    body = {"model": NAME, "messages": messages, "tools": CASE1["tools"], "chat_template_kwargs": kwargs}
    status, out = post(server, "/tokenize", {**body, "return_token_strs": True})
    assert (
        status == 200 and out["count"] == len(out["tokens"]) == len(out["token_strs"]) and out["max_model_len"] == 2048
    )
    status, back = post(server, "/detokenize", {"model": NAME, "tokens": out["tokens"]})
    assert status == 200 and back["prompt"] == want
    chat = server.client().chat.completions.create(
        model=NAME, messages=messages, tools=CASE1["tools"], max_tokens=1, extra_body={"chat_template_kwargs": kwargs}
    )
    assert chat.usage.prompt_tokens == out["count"]
    # Without the generation prompt the ids stop before <｜Assistant｜>; a plain prompt is tokenized as text.
    status, bare = post(server, "/tokenize", {**body, "add_generation_prompt": False})
    assert bare["tokens"] == out["tokens"][: len(bare["tokens"])] and len(bare["tokens"]) == out["count"] - 2
    status, plain = post(server, "/tokenize", {"model": NAME, "prompt": "def f(x):", "add_special_tokens": False})
    status, back = post(server, "/detokenize", {"model": NAME, "tokens": plain["tokens"]})
    assert status == 200 and back["prompt"] == "def f(x):"


def test_thinking_chat_streams_what_it_returns(server):
    client = server.client()
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    extra = {"chat_template_kwargs": {"thinking": True}}
    full = client.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0, extra_body=extra)
    message = full.choices[0].message
    # The model never closes its reasoning in 24 tokens: all of it is reasoning, under both names.
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"]
    reasoning, content = message.model_extra["reasoning_content"], message.content
    assert reasoning + content and full.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=24, temperature=0, extra_body=extra, stream=True
    )
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.delta.model_extra.get("reasoning_content") or "" for c in chunks) == reasoning
    assert "".join(c.delta.content or "" for c in chunks) == content
    assert chunks[-1].finish_reason == "length"
    # Chat mode (the default): no reasoning fields.
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0)
    assert "reasoning_content" not in (plain.choices[0].message.model_extra or {})


REFUSED = [
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"tool_choice": {"type": "function", "function": {"name": "search"}}, "tools": [WEATHER]}, "tool_choice"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format"),
    (
        "chat",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "whatever"}, "strict": True},
            }
        },
        "response_format",
    ),
    (
        "chat",
        {"response_format": {"type": "json_object"}, "tool_choice": "required", "tools": [WEATHER]},
        "response_format",
    ),
    ("chat", {"functions": [WEATHER["function"]]}, "functions"),
    ("chat", {"parallel_tool_calls": False, "tools": [WEATHER]}, "parallel_tool_calls"),
    ("chat", {"reasoning_effort": "extreme"}, "reasoning_effort"),
    (
        "chat",
        {"reasoning_effort": "none", "extra_body": {"chat_template_kwargs": {"thinking": True}}},
        "reasoning_effort",
    ),
    ("chat", {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}, "chat_template_kwargs"),
    ("chat", {"extra_body": {"min_p": 0.1}}, "min_p"),
    (
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages",
    ),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages"),
    ("chat", {"messages": [{"role": "developer", "content": "be brief"}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]}, "messages"),
    ("chat", {"messages": [{"role": "system", "content": "You are terse."}]}, "messages"),
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"suffix": "return x"}, "suffix"),
    ("completions", {"logit_bias": {"50": 100.5}}, "logit_bias"),
]


@pytest.mark.parametrize("endpoint, kwargs, param", REFUSED, ids=[f"{p}{i}" for i, (_, _, p) in enumerate(REFUSED)])
def test_a_field_the_server_cannot_honour_is_a_400_naming_it(server, endpoint, kwargs, param):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            kwargs = {"messages": [{"role": "user", "content": "hi"}], **kwargs}
            client.chat.completions.create(model=NAME, max_tokens=2, **kwargs)
        else:
            client.completions.create(model=NAME, prompt="hi", max_tokens=2, **kwargs)
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"
    assert e.value.body["message"].endswith(".")
    # The server goes on serving.
    assert client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1)


def test_logit_bias_and_penalties_are_honoured(server):
    client = server.client()
    forced = client.completions.create(
        model=NAME, prompt="def f(x):", max_tokens=5, temperature=0, logit_bias={"50": 100}
    )
    assert forced.usage.completion_tokens == 5 and forced.choices[0].text == server_text(server, [50] * 5)
    plain = client.completions.create(model=NAME, prompt="x = [", max_tokens=24, temperature=0)
    varied = client.completions.create(
        model=NAME, prompt="x = [", max_tokens=24, temperature=0, frequency_penalty=2.0, presence_penalty=2.0
    )
    assert varied.choices[0].text != plain.choices[0].text


def server_text(server, tokens: list[int]) -> str:
    return post(server, "/detokenize", {"model": NAME, "tokens": tokens})[1]["prompt"]


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"enum": ["python", "c", "rust"]}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}


def test_a_json_schema_response_always_validates(server):
    import jsonschema

    client = server.client()
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    messages = [{"role": "user", "content": "Describe a programmer as JSON."}]
    for seed in range(6):  # sampled at temperature 1: a model that never learned JSON still writes valid JSON
        out = client.chat.completions.create(
            model=NAME, messages=messages, response_format=response_format, seed=seed, max_tokens=120
        )
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    out = client.chat.completions.create(
        model=NAME, messages=messages, response_format={"type": "json_object"}, temperature=0, max_tokens=120
    )
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_vllm_structured_outputs_json(server):
    client = server.client()
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    for extra in ({"guided_json": schema}, {"structured_outputs": {"json": json.dumps(schema)}}):
        out = client.completions.create(model=NAME, prompt="x = ", max_tokens=80, temperature=0, extra_body=extra)
        assert isinstance(json.loads(out.choices[0].text)["a"], int) and out.choices[0].finish_reason == "stop"
    chat = [{"role": "user", "content": "JSON, please."}]
    out = client.chat.completions.create(
        model=NAME, messages=chat, max_tokens=80, seed=1, extra_body={"guided_json": schema}
    )
    assert isinstance(json.loads(out.choices[0].message.content)["a"], int)
    for extra in ({"guided_regex": "[0-9]{3}-[a-c]+"}, {"structured_outputs": {"regex": "[0-9]{3}-[a-c]+"}}):
        out = client.completions.create(
            model=NAME, prompt="x = ", max_tokens=40, temperature=1, seed=3, extra_body=extra
        )
        assert re.fullmatch("[0-9]{3}-[a-c]+", out.choices[0].text) and out.choices[0].finish_reason == "stop"
    choices = ["yes", "no", "maybe later"]
    for seed in range(4):
        for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
            out = client.chat.completions.create(
                model=NAME, messages=chat, max_tokens=20, temperature=1, seed=seed, extra_body=extra
            )
            assert out.choices[0].message.content in choices
    described = [{"role": "user", "content": "Describe a programmer as JSON."}]
    outs = [
        client.chat.completions.create(model=NAME, messages=described, temperature=0, max_tokens=120, **extra)
        for extra in (
            {"response_format": {"type": "json_object"}},
            {"extra_body": {"structured_outputs": {"json_object": True}}},
        )
    ]
    assert isinstance(json.loads(outs[1].choices[0].message.content), dict)
    assert outs[0].choices[0].message.content == outs[1].choices[0].message.content
    for extra, param in [
        ({"guided_json": schema, "guided_regex": "a"}, "guided_regex"),
        ({"guided_regex": "(?=a)b"}, "guided_regex"),
        ({"guided_regex": 5}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 1]}, "guided_choice"),
        ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs"),
        ({"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
        ({"guided_json": {"type": "whatever"}}, "guided_json"),
        ({"guided_json": "{not json"}, "guided_json"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=NAME, prompt="x", max_tokens=2, extra_body=extra)
        assert e.value.body["param"] == param, e.value.body


# Bounded values, so that a model that never learned the format still finishes its call within max_tokens.
BOUNDED_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"location": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["location"], "additionalProperties": False,
    }}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object",
        "properties": {"query": {"type": "string", "maxLength": 16}, "num_results": {"type": "integer", "maximum": 9}},
        "required": ["query"], "additionalProperties": False,
    }}},
]  # fmt: skip


def test_a_forced_tool_call_names_the_function_and_its_arguments_validate(server):
    import jsonschema

    client = server.client()
    messages = [{"role": "user", "content": "What's the weather in Beijing?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed, choice in [(0, named), (1, named), (2, "required"), (3, "required")]:
        out = client.chat.completions.create(
            model=NAME, messages=messages, tools=BOUNDED_TOOLS, tool_choice=choice, seed=seed, max_tokens=200
        )
        first = out.choices[0]
        assert first.finish_reason == "tool_calls" and first.message.tool_calls, first.message
        for call in first.message.tool_calls:
            tool = next(t for t in BOUNDED_TOOLS if t["function"]["name"] == call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        if choice is named:
            assert [c.function.name for c in first.message.tool_calls] == ["get_weather"]
    stream = client.chat.completions.create(
        model=NAME, messages=messages, tools=BOUNDED_TOOLS, tool_choice=named, seed=0, max_tokens=200, stream=True
    )
    calls = [d for c in stream if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert calls[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments for d in calls)
    jsonschema.validate(json.loads(arguments), BOUNDED_TOOLS[0]["function"]["parameters"])


# --- scripted output: the model's tokens are given, the rest is the real server ----------------------------
class Scripted:
    """Stands in for AsyncEngine: every request gets `script`'s tokens one at a time, then finishes."""

    script: list[int] = []
    finish = "stop"

    def __init__(self, engine, on_step=None, on_dead=None) -> None:
        self.engine, self.dead, self.prompts = engine, None, []

    async def generate(self, prompt_token_ids, params):
        self.prompts.append(list(prompt_token_ids))
        for k, t in enumerate(self.script):
            token = SampledToken(t)
            yield Delta([token], self.finish if k == len(self.script) - 1 else None)

    def stop(self) -> None:
        pass


@pytest.fixture(scope="module")
def scripted(model):
    from fastapi.testclient import TestClient

    import leanserve.server.app as app_module

    real = app_module.AsyncEngine
    app_module.AsyncEngine = Scripted
    try:
        llm = LLM(str(model), dtype="float32", max_model_len=2048, max_num_seqs=2, load_progress=False)
        app = app_module.build_app(llm, NAME)
        with TestClient(app) as http:
            client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
            yield SimpleNamespace(client=client, http=http, app=app, tokenizer=llm.get_tokenizer())
    finally:
        app_module.AsyncEngine = real


def say(scripted, text: str, finish: str = "stop") -> None:
    """The model's next outputs: `text`'s tokens, then EOS when it finished by itself."""
    eos = scripted.tokenizer.token_to_id(dsv4.EOS)
    Scripted.script = scripted.tokenizer.encode(text, add_special_tokens=False) + ([eos] if finish == "stop" else [])
    Scripted.finish = finish


def case1_turn(k: int) -> str:
    """The text of case 1's k-th assistant turn as the model writes it (after <think>, without the EOS)."""
    start = dsv4.ASSISTANT + dsv4.THINK_START
    return GOLD1.split(start)[k + 1].split(dsv4.EOS)[0]


def ask(scripted, stream: bool, **kwargs):
    messages = CASE1["messages"][:2]
    extra = {"chat_template_kwargs": {"thinking": True}}
    return scripted.client.chat.completions.create(
        model=NAME, messages=messages, tools=CASE1["tools"], extra_body=extra, stream=stream, **kwargs
    )


def test_a_dsml_tool_call_comes_back_as_openai_tool_calls(scripted):
    want = CASE1["messages"][2]
    say(scripted, case1_turn(0))
    full = ask(scripted, stream=False)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == want["reasoning_content"]
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == json.loads(want["tool_calls"][0]["function"]["arguments"])
    # Streaming: reasoning deltas, then the call's name and its argument fragments; never markup as text.
    chunks = [c.choices[0] for c in ask(scripted, stream=True) if c.choices]
    reasoning = "".join(c.delta.model_extra.get("reasoning_content") or "" for c in chunks)
    content = "".join(c.delta.content or "" for c in chunks)
    assert reasoning == want["reasoning_content"] and content == ""
    calls = [d for c in chunks for d in c.delta.tool_calls or ()]
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_") and len(calls) > 2
    assert all(d.index == 0 for d in calls) and "".join(d.function.arguments for d in calls) == call.function.arguments
    assert chunks[-1].finish_reason == "tool_calls"


def test_a_final_answer_is_reasoning_and_content(scripted):
    want = CASE1["messages"][4]
    say(scripted, case1_turn(1))
    message = ask(scripted, stream=False).choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (want["reasoning_content"], want["content"])
    assert not message.tool_calls


@pytest.mark.parametrize(
    "text",
    [
        'ok</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n',  # unclosed
        'ok</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="launch">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>',
        'ok</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name=x>'
        "1</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
    ],
    ids=["unclosed", "unknown-tool", "bad-parameter"],
)
def test_malformed_dsml_comes_back_as_content(scripted, text):
    say(scripted, text)
    choice = ask(scripted, stream=False).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert (
        choice.message.model_extra["reasoning_content"] == "ok" and choice.message.content == text.split("</think>")[1]
    )
    chunks = [c.choices[0] for c in ask(scripted, stream=True) if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == choice.message.content


def test_the_chat_prefills_exactly_what_tokenize_returns(scripted):
    say(scripted, "fine")
    engine = scripted.app.state.leanserve["async"]
    messages = [*CASE1["messages"][:4], {"role": "user", "content": "And in Shanghai? 你好 🌧"}]
    body = {"model": NAME, "messages": messages, "tools": CASE1["tools"], "reasoning_effort": "max"}
    chat = scripted.client.chat.completions.create(
        model=NAME, messages=messages, tools=CASE1["tools"], reasoning_effort="max"
    )
    tokens = scripted.http.post("/tokenize", json=body).json()["tokens"]
    assert engine.prompts[-1] == tokens and chat.usage.prompt_tokens == len(tokens)
    text = scripted.http.post("/detokenize", json={"model": NAME, "tokens": tokens}).json()["prompt"]
    assert text.startswith(dsv4.BOS + "Reasoning Effort:") and text.endswith("你好 🌧<｜Assistant｜><think>")


def test_tokenize_refuses_what_it_cannot_do(scripted):
    bad = [
        ({"model": NAME}, "prompt"),
        ({"model": NAME, "prompt": "x", "frobnicate": 1}, "frobnicate"),
        (
            {"model": NAME, "messages": [{"role": "user", "content": "x"}], "add_special_tokens": True},
            "add_special_tokens",
        ),
    ]
    for body, param in bad:
        r = scripted.http.post("/tokenize", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = scripted.http.post("/detokenize", json={"model": NAME, "tokens": [1, 10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert scripted.http.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404


def test_the_plain_format_refuses_tools_and_reasoning():
    """The shipped model's tokenizer has no DeepSeek-V4 tokens: tools and reasoning cannot be honoured."""
    from fastapi.testclient import TestClient

    from leanserve.server.app import build_app

    llm = LLM(str(SHIPPED), dtype="float32", max_model_len=128, max_num_seqs=1, load_progress=False)
    with TestClient(build_app(llm, NAME)) as http:
        base = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        for extra, param in [({"tools": [WEATHER]}, "tools"), ({"reasoning_effort": "high"}, "reasoning_effort")]:
            r = http.post("/v1/chat/completions", json={**base, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param
        assert http.post("/v1/chat/completions", json=base).status_code == 200


def test_a_missing_chat_template_file_is_named_before_loading(capsys):
    from leanserve.cli import main

    assert main(["serve", "--model", str(SHIPPED), "--chat-template", "/nonexistent/t.jinja"]) != 0
    assert "--chat-template /nonexistent/t.jinja: no such file." in capsys.readouterr().err
