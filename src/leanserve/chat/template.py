"""Which chat format a model speaks, chosen once when the server starts, and a chat rendered through it.

In order: a Jinja file given with `--chat-template`; DeepSeek-V4's own encoding (`chat/dsv4.py`) when the
tokenizer has DeepSeek-V4's chat tokens; a `chat_template.jinja` beside the weights; `tokenizer_config.json`'s
`chat_template`; the plain `"<role>: <content>\\n"` format as the last resort. Only DeepSeek-V4's format
has reasoning and tool calls that leanserve parses back out of the output (`chat/dsml.py`); the others
render role and content.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from leanserve.chat import dsv4

logger = logging.getLogger("leanserve")


@dataclass(frozen=True)
class ChatInput:
    """A validated chat: OpenAI-shaped messages and what the request asks of the format."""

    messages: list[dict]
    tools: list[dict] | None = None  # rendered into the prompt (None: no tools, or tool_choice "none")
    thinking: bool = False
    reasoning_effort: str | None = None
    template_kwargs: dict = field(default_factory=dict)  # a Jinja template's extra variables

    @property
    def tool_names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools or ())


class ChatFormat:
    """The interface: `name` (for the log and errors), whether the output is parsed into reasoning and tool
    calls (`structured`), and the prompt text of a chat."""

    name = "plain"
    structured = False  # reasoning, tool calls, thinking mode
    writes_special_tokens = False  # the text carries its own BOS: encode without the tokenizer's

    def render(self, chat: ChatInput, add_generation_prompt: bool = True) -> str:
        text = "".join(f"{m['role']}: {m['content'] or ''}\n" for m in chat.messages)
        return text + "assistant:" if add_generation_prompt else text

    def encode(self, tokenizer, chat: ChatInput, add_generation_prompt: bool = True) -> list[int]:
        text = self.render(chat, add_generation_prompt)
        return tokenizer.encode(text, add_special_tokens=not self.writes_special_tokens)


class DeepSeekV4Format(ChatFormat):
    name = "deepseek_v4"
    structured = True
    writes_special_tokens = True

    def render(self, chat: ChatInput, add_generation_prompt: bool = True) -> str:
        return dsv4.encode_chat(
            chat.messages, tools=chat.tools, thinking=chat.thinking, reasoning_effort=chat.reasoning_effort,
            add_generation_prompt=add_generation_prompt,
        )  # fmt: skip


class JinjaFormat(ChatFormat):
    """A HuggingFace-style chat template: `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, and the
    request's `chat_template_kwargs`. It writes its own special tokens."""

    writes_special_tokens = True
    RESERVED = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})

    def __init__(self, source: str, origin: str, special: dict[str, str | None]) -> None:
        import jinja2.sandbox

        try:
            self.template = jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"The chat template {origin} is not a valid Jinja template: {e}") from None
        self.name = f"jinja ({origin})"
        self.special = special

    def render(self, chat: ChatInput, add_generation_prompt: bool = True) -> str:
        messages = [{"role": m["role"], "content": m["content"] or ""} for m in chat.messages]
        try:
            return self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special, **chat.template_kwargs
            )
        except Exception as e:  # jinja2.TemplateError, or the template's own raise_exception()
            raise ValueError(f"The model's chat template rejected the messages: {e}") from None


def has_dsv4_tokens(tokenizer) -> bool:
    return tokenizer is not None and all(tokenizer.token_to_id(t) is not None for t in dsv4.CHAT_TOKENS)


def load_chat_format(model_dir: str | Path, tokenizer, template_file: str | Path | None = None) -> ChatFormat:
    """The model's chat format, in the order of the module docstring; logs which one and why."""
    model_dir = Path(model_dir)
    config = _tokenizer_config(model_dir)
    special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
    if template_file is not None:
        path = Path(template_file)
        if not path.is_file():
            raise ValueError(f"--chat-template {path}: no such file.")
        chosen, why = JinjaFormat(path.read_text(), str(path), special), "given with --chat-template"
    elif has_dsv4_tokens(tokenizer):
        chosen, why = DeepSeekV4Format(), "the tokenizer has DeepSeek-V4's chat tokens"
    elif (model_dir / "chat_template.jinja").is_file():
        path = model_dir / "chat_template.jinja"
        chosen, why = JinjaFormat(path.read_text(), str(path), special), "beside the weights"
    elif isinstance(config.get("chat_template"), str):
        origin = str(model_dir / "tokenizer_config.json")
        chosen, why = JinjaFormat(config["chat_template"], origin, special), "the tokenizer's chat_template"
    else:
        chosen, why = ChatFormat(), "the model has no chat template"
    logger.info("chat format: %s (%s)", chosen.name, why)
    return chosen


def _tokenizer_config(model_dir: Path) -> dict:
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}).") from None
    return config if isinstance(config, dict) else {}


def _token_text(value) -> str | None:
    """Special tokens may be plain strings or AddedToken objects ({"content": ...})."""
    return value.get("content") if isinstance(value, dict) else value
