"""DeepSeek-V4's chat prompt format: OpenAI-style messages in, one prompt string out.

The format is defined by DeepSeek's reference encoder, ``encoding_dsv4.py``, published next to the DeepSeek-V4
weights; this module is an independent implementation of it, checked byte for byte against DeepSeek's own test
cases (``tests/data/dsv4_encoding/``).

Shape of a prompt: BOS, then every message in order. A system message is its bare text (plus a "## Tools"
section when tools are attached); user text, developer text and tool results open with ``<｜User｜>``; consecutive
tool results and user text share one user turn as ``<tool_result>`` blocks joined by blank lines. An assistant
turn is ``[reasoning</think>]content[DSML tool calls]`` + EOS. Whatever precedes an assistant turn (or ends the
prompt) gets a transition: ``<｜Assistant｜>`` plus ``<think>`` when the model should reason, ``</think>`` when not.

In thinking mode, when no message carries tools, only the turn after the last user message keeps its reasoning:
earlier assistant turns are written without it (and earlier developer messages are left out).
"""

from __future__ import annotations

import json
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
LATEST_REMINDER = "<｜latest_reminder｜>"
# Internal quick-instruction tasks (a message's "task" field), each with its own token.
TASK_TOKENS = {name: f"<｜{name}｜>" for name in ("action", "query", "authority", "domain", "title", "read_url")}

CHAT_TOKENS: tuple[str, ...] = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END)
REASONING_EFFORTS = ("low", "medium", "high", "max")

ROLES = ("system", "developer", "user", "tool", "assistant", "latest_reminder")

# Written right after BOS in thinking mode when reasoning_effort is "max" (the model was trained on this text).
MAX_EFFORT_PREAMBLE = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

# The tool section appended (after a blank line) to a system or developer message that carries tools.
TOOLS_SECTION = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

@SCHEMAS@

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _text(msg: dict, key: str = "content") -> str:
    value = msg.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"A {msg.get('role')} message's {key!r} must be a string or None, not {type(value).__name__}.")
    return value


def _tools_section(tools: list[dict]) -> str:
    schemas = []
    for tool in tools:
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise ValueError('Each tool must be an OpenAI tool object: {"type": "function", "function": {...}}.')
        schemas.append(_json(tool["function"]))
    return "\n\n" + TOOLS_SECTION.replace("@SCHEMAS@", "\n".join(schemas))


def _invoke(call: dict) -> str:
    """One tool call as a DSML invoke block: strings raw (string="true"), everything else as JSON."""
    function = call.get("function") or {}
    name, raw = function.get("name"), function.get("arguments")
    if not name:
        raise ValueError("An assistant tool call has no function name.")
    if isinstance(raw, dict):
        args = raw
    else:
        try:
            args = json.loads(raw)
        except (TypeError, ValueError):  # like the reference: unparsable arguments become one "arguments" parameter
            args = {"arguments": raw}
    if not isinstance(args, dict):
        raise ValueError(f"The arguments of tool call {name!r} must be a JSON object.")
    params = [
        f'<{DSML}parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
        f"{value if isinstance(value, str) else _json(value)}</{DSML}parameter>"
        for key, value in args.items()
    ]
    return f'<{DSML}invoke name="{name}">\n' + "\n".join(params) + f"\n</{DSML}invoke>"


def _merge_turns(messages: list[dict]) -> list[dict]:
    """Copy the messages, folding tool results and user text that follow each other into single user turns.

    A merged user turn keeps ``blocks``: ("text", text, None) or ("tool", content, tool_call_id). User text does
    not join a turn that carries a task; a tool result joins any preceding user turn.
    """
    turns: list[dict] = []
    for msg in messages:
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            role = msg.get("role") if isinstance(msg, dict) else msg
            raise ValueError(f"Unsupported message role {role!r}; expected one of {', '.join(ROLES)}.")
        task = msg.get("task")
        if task is not None and task not in TASK_TOKENS:
            raise ValueError(f"Unknown task {task!r}; expected one of {', '.join(TASK_TOKENS)}.")
        role, prev = msg["role"], turns[-1] if turns else {}
        if role == "tool":
            block = ("tool", _text(msg), msg.get("tool_call_id"))
            if prev.get("role") == "user":
                prev["blocks"].append(block)
            else:
                turns.append({"role": "user", "blocks": [block]})
        elif role == "user":
            block = ("text", _text(msg), None)
            if prev.get("role") == "user" and prev.get("task") is None:
                prev["blocks"].append(block)
            else:
                turns.append({"role": "user", "blocks": [block], "task": task})
        else:
            if role == "developer" and not _text(msg):
                raise ValueError("A developer message must have non-empty content.")
            turns.append(dict(msg))
    return turns


def _sort_results(blocks: list[tuple], call_order: dict[str, int]) -> list[tuple]:
    """Put tool results back in the order of the assistant's calls; text blocks keep their places."""
    results = iter(sorted((b for b in blocks if b[0] == "tool"), key=lambda b: call_order.get(b[2], 0)))
    return [next(results) if b[0] == "tool" else b for b in blocks]


def encode_chat(
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    thinking: bool = False,
    reasoning_effort: str | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """Encode a conversation as a DeepSeek-V4 prompt string (starting with BOS).

    ``tools`` (OpenAI format) go into the leading system message, which is inserted empty when the conversation
    does not start with one. ``thinking`` selects thinking mode (reasoning in ``<think>``) over chat mode;
    ``reasoning_effort`` "max" adds the maximum-effort preamble in thinking mode, the other efforts change nothing.
    With ``add_generation_prompt`` False, a final user or tool turn gets no ``<｜Assistant｜>`` transition.
    The caller's messages are not modified. Raises ValueError for input the format cannot express.
    """
    if reasoning_effort is not None and reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, not {reasoning_effort!r}.")
    if not messages:
        raise ValueError("A conversation needs at least one message.")
    turns = _merge_turns(messages)
    if tools:
        if turns[0]["role"] != "system":
            turns.insert(0, {"role": "system", "content": ""})
        turns[0]["tools"] = list(turns[0].get("tools") or []) + list(tools)

    # Thinking mode drops old reasoning unless tools are in play (then every turn keeps its reasoning).
    drop_old = thinking and not any(turn.get("tools") for turn in turns)
    last_user = max((i for i, t in enumerate(turns) if t["role"] in ("user", "developer")), default=-1)
    if drop_old:
        turns = [t for i, t in enumerate(turns) if i >= last_user or t["role"] != "developer"]
        last_user = max((i for i, t in enumerate(turns) if t["role"] in ("user", "developer")), default=-1)

    parts = [BOS, MAX_EFFORT_PREAMBLE if thinking and reasoning_effort == "max" else ""]
    call_order: dict[str, int] = {}
    for i, turn in enumerate(turns):
        role = turn["role"]
        if role == "system":
            parts.append(_text(turn) + (_tools_section(turn["tools"]) if turn.get("tools") else ""))
        elif role == "developer":
            parts.append(USER + _text(turn) + (_tools_section(turn["tools"]) if turn.get("tools") else ""))
        elif role == "latest_reminder":
            parts.append(LATEST_REMINDER + _text(turn))
        elif role == "user":
            blocks = _sort_results(turn["blocks"], call_order) if call_order else turn["blocks"]
            texts = [text if kind == "text" else f"<tool_result>{text}</tool_result>" for kind, text, _ in blocks]
            parts.append(USER + "\n\n".join(texts))
        else:  # assistant
            calls = turn.get("tool_calls") or []
            if calls:
                call_order = {call.get("id"): n for n, call in enumerate(calls) if call.get("id")}
            reasoning = _text(turn, "reasoning_content") or _text(turn, "reasoning")
            after_task = i > 0 and turns[i - 1].get("task") is not None
            keep_reasoning = thinking and not after_task and (not drop_old or i > last_user)
            dsml = (
                f"\n\n<{DSML}tool_calls>\n" + "\n".join(map(_invoke, calls)) + f"\n</{DSML}tool_calls>" if calls else ""
            )
            parts.append((reasoning + THINK_END if keep_reasoning else "") + _text(turn) + dsml + EOS)

        # The transition is written only before an assistant turn, a reminder, or the end of the prompt.
        following = turns[i + 1]["role"] if i + 1 < len(turns) else None
        if following not in (None, "assistant", "latest_reminder") or (following is None and not add_generation_prompt):
            continue
        think = THINK_START if thinking and (not drop_old or i >= last_user) else THINK_END
        task = turn.get("task")
        if task == "action":
            parts.append(ASSISTANT + (THINK_START if thinking else THINK_END) + TASK_TOKENS[task])
        elif task is not None:
            parts.append(TASK_TOKENS[task])
        elif role in ("user", "developer"):
            parts.append(ASSISTANT + think)
    return "".join(parts)
