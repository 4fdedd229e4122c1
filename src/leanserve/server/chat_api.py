"""The chat endpoint's own request fields and response pieces.

Requests: `messages` (text content only), `tools` / `tool_choice` / `parallel_tool_calls`, `reasoning_effort`
and `chat_template_kwargs`, checked against what the model's chat format can honour (`chat/template.py`):
anything it cannot is one 400 naming the field. Responses: the assistant message, or a stream's deltas, with
the output parsed by `chat/dsml.py` into `reasoning_content` (also as `reasoning`, vLLM's newer name),
`content` and OpenAI `tool_calls`.
"""

from __future__ import annotations

import json
import re
import uuid

from leanserve.chat.dsml import Delta, OutputParser
from leanserve.chat.dsv4 import REASONING_EFFORTS
from leanserve.chat.template import ChatFormat, ChatInput, JinjaFormat
from leanserve.sampling_params import StructuredOutput
from leanserve.server.protocol import bad

ROLE_FIELDS = {
    "system": {"role", "content"},
    "developer": {"role", "content"},
    "user": {"role", "content"},
    "assistant": {"role", "content", "tool_calls", "reasoning_content", "reasoning", "refusal"},
    "tool": {"role", "content", "tool_call_id"},
}
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
SHAPE = '\'tool_choice\' must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}.'
FORMAT_SHAPE = '\'response_format\' must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}.'


def parse_chat(body: dict, fmt: ChatFormat) -> ChatInput:
    """The chat fields of a request, validated for `fmt`."""
    tools = _tools(body, fmt)
    choice = body.get("tool_choice")
    _tool_choice(choice, tools)
    if body.get("parallel_tool_calls") not in (None, True):
        raise bad(
            "'parallel_tool_calls': false is not supported; the model may call several tools.", "parallel_tool_calls"
        )
    thinking, effort = _reasoning(body, fmt)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad("'chat_template_kwargs' must be an object.", "chat_template_kwargs")
    return ChatInput(
        messages=_messages(body, fmt), tools=None if choice == "none" else tools, thinking=thinking,
        reasoning_effort=effort, template_kwargs=kwargs if isinstance(fmt, JinjaFormat) else {},
    )  # fmt: skip


def _tool_choice(choice, tools: list[dict] | None) -> str | None:
    """The function a tool_choice names (None for "auto", "none", "required")."""
    if choice in (None, "auto", "none"):
        return None
    if choice != "required" and not isinstance(choice, dict):
        raise bad(SHAPE, "tool_choice")
    if not tools:
        raise bad("'tool_choice' asks for a tool call but the request offers no 'tools'.", "tool_choice")
    if choice == "required":
        return None
    fn = choice.get("function")
    name = fn.get("name") if choice.get("type") == "function" and isinstance(fn, dict) else None
    if not isinstance(name, str) or set(choice) != {"type", "function"} or set(fn) != {"name"}:
        raise bad(SHAPE, "tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise bad(f"'tool_choice' names {name!r}, which is not among the request's tools.", "tool_choice")
    return name


def structured_output(body: dict, chat: ChatInput) -> StructuredOutput | None:
    """What the output must obey: response_format json_object / json_schema, or a forced tool call
    (tool_choice "required" or a named function); in thinking mode from after </think>."""
    fmt, choice = body.get("response_format"), body.get("tool_choice")
    forced = choice == "required" or isinstance(choice, dict)
    if fmt is None or fmt == {"type": "text"}:
        if not forced:
            return None
        name = _tool_choice(choice, chat.tools)
        return StructuredOutput(kind="tool_calls", tools=chat.tools, required_name=name, after_think=chat.thinking)
    if forced:
        raise bad("'response_format' and a forced 'tool_choice' cannot both constrain the output.", "response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object" and set(fmt) == {"type"}:
        return StructuredOutput(kind="json", after_think=chat.thinking)
    spec = fmt.get("json_schema") if kind == "json_schema" else None
    if not isinstance(spec, dict) or set(fmt) != {"type", "json_schema"}:
        raise bad(FORMAT_SHAPE, "response_format")
    if extra := sorted(set(spec) - {"name", "schema", "strict", "description"}):
        raise bad(f"response_format.json_schema.{extra[0]} is not supported.", "response_format")
    if not isinstance(spec.get("name"), str) or not TOOL_NAME.match(spec["name"]):
        raise bad("response_format.json_schema.name must be 1-64 letters, digits, '_', '.' or '-'.", "response_format")
    schema, strict = spec.get("schema", {}), spec.get("strict") or False
    if not isinstance(schema, dict) or not isinstance(strict, bool):
        raise bad("response_format.json_schema.schema must be an object, and strict true or false.", "response_format")
    return StructuredOutput(kind="json", schema=schema, strict=strict, after_think=chat.thinking)


def _reasoning(body: dict, fmt: ChatFormat) -> tuple[bool, str | None]:
    kwargs, effort = body.get("chat_template_kwargs") or {}, body.get("reasoning_effort")
    if not fmt.structured:
        if effort is not None:
            raise bad(
                f"'reasoning_effort' needs a model with a reasoning format; this one's is {fmt.name}.",
                "reasoning_effort",
            )
        if kwargs and not isinstance(fmt, JinjaFormat):
            raise bad(
                f"'chat_template_kwargs' needs a chat template; this model's format is {fmt.name}.",
                "chat_template_kwargs",
            )
        if isinstance(kwargs, dict) and (reserved := sorted(set(kwargs) & JinjaFormat.RESERVED)):
            raise bad(f"chat_template_kwargs.{reserved[0]} is set by the server itself.", "chat_template_kwargs")
        return False, None
    if not isinstance(kwargs, dict):
        raise bad("'chat_template_kwargs' must be an object.", "chat_template_kwargs")
    for key in kwargs:
        if key != "thinking":
            raise bad(
                f"chat_template_kwargs.{key} is not an option of DeepSeek-V4's chat format; it takes 'thinking'.",
                "chat_template_kwargs",
            )
    thinking = kwargs.get("thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise bad("chat_template_kwargs.thinking must be true or false.", "chat_template_kwargs")
    if effort is None:
        return bool(thinking), None
    if effort != "none" and effort not in REASONING_EFFORTS:
        raise bad(
            f"'reasoning_effort' must be one of none, {', '.join(REASONING_EFFORTS)}; got {json.dumps(effort)[:40]}.",
            "reasoning_effort",
        )
    if (effort == "none") == bool(thinking) and thinking is not None:
        raise bad(
            f"'reasoning_effort' {effort!r} contradicts chat_template_kwargs.thinking {json.dumps(thinking)}.",
            "reasoning_effort",
        )
    return (False, None) if effort == "none" else (True, effort)


def _tools(body: dict, fmt: ChatFormat) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not fmt.structured:
        raise bad(
            f"'tools' needs a chat format whose tool calls leanserve parses; this model's is {fmt.name}.", "tools"
        )
    if not isinstance(tools, list):
        raise bad("'tools' must be a list of function tools.", "tools")
    names = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}.', "tools")
        if extra := sorted(set(tool) - {"type", "function"}):
            raise bad(f"tools[{i}].{extra[0]} is not supported.", "tools")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise bad(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'.", "tools")
        if name in names:
            raise bad(f"tools[{i}]: the function name {name!r} is given twice.", "tools")
        names.add(name)
        if extra := sorted(set(fn) - {"name", "description", "parameters", "strict"}):
            raise bad(f"tools[{i}].function.{extra[0]} is not supported.", "tools")
        if not isinstance(fn.get("description", ""), str):
            raise bad(f"tools[{i}].function.description must be a string.", "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON schema object.", "tools")
        if not isinstance(fn.get("strict", False), bool):
            raise bad(f"tools[{i}].function.strict must be true or false.", "tools")
    return tools


def _messages(body: dict, fmt: ChatFormat) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' is required and must be a non-empty list.", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object.", "messages")
        role = m.get("role")
        if role not in ROLE_FIELDS:
            raise bad(f"messages[{i}].role must be system, user, assistant, developer or tool.", "messages")
        if extra := sorted(set(m) - ROLE_FIELDS[role]):
            raise bad(f"messages[{i}].{extra[0]} is not supported for a {role} message.", "messages")
        structured_only = [k for k in ("tool_calls", "reasoning_content", "reasoning", "tool_call_id") if m.get(k)]
        if (role == "tool" or structured_only) and not fmt.structured:
            what = "a tool message" if role == "tool" else f"messages[{i}].{structured_only[0]}"
            raise bad(f"{what} needs DeepSeek-V4's chat format; this model's is {fmt.name}.", "messages")
        if role == "developer" and fmt.structured:
            raise bad(f"messages[{i}]: DeepSeek-V4's chat format has no developer role; use system.", "messages")
        if m.get("refusal") is not None:
            raise bad(f"messages[{i}].refusal is not supported.", "messages")
        msg = {"role": role, "content": _content(m.get("content"), i, role)}
        if role == "assistant":
            if m.get("tool_calls"):
                msg["tool_calls"] = _history_calls(m["tool_calls"], i)
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise bad(f"messages[{i}].reasoning_content must be a string.", "messages")
                msg["reasoning_content"] = reasoning
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise bad(f"messages[{i}].tool_call_id is required and must be a string.", "messages")
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def _content(content, i: int, role: str) -> str | None:
    if content is None and role == "assistant":
        return None
    if isinstance(content, list):  # content parts: text only
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                shown = f"an {kind!r} part" if isinstance(kind, str) else "not a text part"
                raise bad(f"messages[{i}].content[{j}] is {shown}; this model reads text only.", "messages")
            if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise bad(f'messages[{i}].content[{j}] must be {{"type": "text", "text": "..."}}.', "messages")
        return "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad(f"messages[{i}].content must be a string or a list of text parts.", "messages")
    return content


def _history_calls(calls, i: int) -> list[dict]:
    if not isinstance(calls, list):
        raise bad(f"messages[{i}].tool_calls must be a list.", "messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        where = f"messages[{i}].tool_calls[{j}]"
        if (
            not isinstance(fn, dict)
            or call.get("type", "function") != "function"
            or not isinstance(fn.get("name"), str)
        ):
            raise bad(f'{where} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}.', "messages")
        try:
            arguments = json.loads(fn.get("arguments"))
        except (TypeError, ValueError):
            arguments = None
        if not isinstance(arguments, dict):
            raise bad(f"{where}.function.arguments must be a JSON object as a string.", "messages")
        out.append(
            {
                "id": str(call.get("id") or ""),
                "type": "function",
                "function": {"name": fn["name"], "arguments": fn["arguments"]},
            }
        )
    return out


# --- responses ------------------------------------------------------------------------------------------
def new_parser(chat: ChatInput, fmt: ChatFormat) -> OutputParser | None:
    return OutputParser(thinking=chat.thinking, tools=chat.tool_names) if fmt.structured else None


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def message(parser: OutputParser, thinking: bool) -> dict:
    """The non-streamed assistant message of a parsed output."""
    calls = [
        {"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in parser.tool_calls
    ]
    out = {"role": "assistant", "content": parser.content if parser.content or not calls else None}
    if thinking:
        out["reasoning_content"] = out["reasoning"] = parser.reasoning
    if calls:
        out["tool_calls"] = calls
    return out


def delta_fields(delta: Delta, ids: list[str]) -> dict:
    """A stream chunk's delta for a parser delta; `ids` holds the call ids given so far (one per call)."""
    out = {}
    if delta.reasoning:
        out["reasoning_content"] = out["reasoning"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        calls = []
        for d in delta.tool_calls:
            if d.name is not None:
                ids.append(call_id())
                calls.append(
                    {
                        "index": d.index,
                        "id": ids[d.index],
                        "type": "function",
                        "function": {"name": d.name, "arguments": d.arguments},
                    }
                )
            else:
                calls.append({"index": d.index, "function": {"arguments": d.arguments}})
        out["tool_calls"] = calls
    return out
