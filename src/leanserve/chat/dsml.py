"""Incremental parser of DeepSeek-V4's output: reasoning, content and DSML tool calls.

What the model writes after the prompt (which ends with ``<｜Assistant｜><think>`` in thinking mode or
``<｜Assistant｜></think>`` in chat mode):

- thinking mode: reasoning, ``</think>``, then the rest (no ``</think>`` at all: everything is reasoning);
  chat mode: the rest directly.
- the rest: content, optionally a tool-call block opened by ``\\n\\n<｜DSML｜tool_calls>`` (the two newlines
  belong to the marker; a block without them is accepted too), holding one or more
  ``<｜DSML｜invoke name="NAME">`` elements, each with zero or more
  ``<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>`` and a closing
  ``</｜DSML｜invoke>``, then ``</｜DSML｜tool_calls>``. Whitespace between the tags is ignored.

A block is atomic: it turns into tool calls only once it closes and all of it is valid (known tool names, no
duplicate parameter, JSON where ``string="false"``). A malformed block is given back as content, raw, from its
first newline up to the point where it went wrong, and the text after that point is read as content again; a
block still open at the end is content too. Text after a closed block is content.

``OutputParser.feed`` takes the output in pieces of any size and returns what became certain; text that may
still be the start of a marker is held back until decided, so every way of cutting the same text yields the
same result. Each call costs time proportional to the new text (plus a small constant).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Generator
from dataclasses import dataclass

THINK_END = "</think>"
BLOCK_OPEN = "<｜DSML｜tool_calls>"
BLOCK_OPEN_NL = "\n\n" + BLOCK_OPEN
BLOCK_CLOSE = "</｜DSML｜tool_calls>"
INVOKE_OPEN = '<｜DSML｜invoke name="'
INVOKE_CLOSE = "</｜DSML｜invoke>"
PARAM_OPEN = '<｜DSML｜parameter name="'
PARAM_CLOSE = "</｜DSML｜parameter>"
WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class ToolCallDelta:
    index: int  # 0, 1, ... in output order
    name: str | None  # set on the first delta of a call, None on the following ones
    arguments: str  # a fragment of the JSON arguments text ("" on the first delta)


@dataclass(frozen=True)
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON object text


class _Malformed(Exception):
    pass


def _held_back(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker` (0 if none)."""
    i = text.find(marker[0], max(0, len(text) - len(marker) + 1))
    while i >= 0:
        if marker.startswith(text[i:]):
            return len(text) - i
        i = text.find(marker[0], i + 1)
    return 0


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


class _Block:
    """One tool-call block, parsed as its text arrives.

    The grammar is a generator that yields whenever it needs more text, returns at the block's end and raises
    `_Malformed` where the text stops fitting. `_tail` is the text not parsed yet.
    """

    def __init__(self, opener: str, tools: frozenset[str]) -> None:
        self._raw = [opener]
        self._tail = ""
        self._tools = tools
        self._steps = self._grammar()
        self.calls: list[tuple[str, list[str]]] = []  # (name, argument fragments)
        self.rest = ""  # once decided: the text after the decision point

    def feed(self, text: str) -> bool | None:
        """Add text: None while undecided, True when the block closed well formed, False when malformed."""
        self._raw.append(text)
        self._tail += text
        try:
            next(self._steps)
            return None
        except StopIteration:
            ok = True
        except _Malformed:
            ok = False
        self.rest, self._tail = self._tail, ""
        return ok

    def raw(self) -> str:
        """The block's text from its marker up to the decision point (or all of it while undecided)."""
        raw = "".join(self._raw)
        return raw[: len(raw) - len(self.rest)]

    # -- primitives: each consumes from the tail, yielding while the tail is too short to decide --

    def _skip_whitespace(self) -> Generator[None, None, None]:
        while True:
            self._tail = self._tail.lstrip(WHITESPACE)
            if self._tail:
                return
            yield

    def _one_of(self, *literals: str) -> Generator[None, None, str]:
        while True:
            for lit in literals:
                if self._tail.startswith(lit):
                    self._tail = self._tail[len(lit) :]
                    return lit
            if not any(lit.startswith(self._tail) for lit in literals):
                raise _Malformed
            yield

    def _until(self, delimiter: str) -> Generator[None, None, str]:
        """The text up to `delimiter` (which is consumed too); keeps only a short tail between calls."""
        parts = []
        keep = len(delimiter) - 1
        while True:
            i = self._tail.find(delimiter)
            if i >= 0:
                parts.append(self._tail[:i])
                self._tail = self._tail[i + len(delimiter) :]
                return "".join(parts)
            if len(self._tail) > keep:
                parts.append(self._tail[: len(self._tail) - keep])
                self._tail = self._tail[len(self._tail) - keep :]
            yield

    # -- the grammar --

    def _grammar(self) -> Generator[None, None, None]:
        while True:
            yield from self._skip_whitespace()
            if (yield from self._one_of(INVOKE_OPEN, BLOCK_CLOSE)) == BLOCK_CLOSE:
                if not self.calls:
                    raise _Malformed
                return
            name = yield from self._until('"')
            yield from self._one_of(">")
            if name not in self._tools:
                raise _Malformed
            self.calls.append((name, (yield from self._parameters())))

    def _parameters(self) -> Generator[None, None, list[str]]:
        fragments: list[str] = []
        keys: set[str] = set()
        while True:
            yield from self._skip_whitespace()
            if (yield from self._one_of(PARAM_OPEN, INVOKE_CLOSE)) == INVOKE_CLOSE:
                return [*fragments, "}"] if fragments else ["{}"]
            key = yield from self._until('"')
            if key in keys or any(c in key for c in "<>\n"):
                raise _Malformed
            keys.add(key)
            yield from self._one_of(' string="')
            is_string = (yield from self._one_of('true">', 'false">')) == 'true">'
            raw = yield from self._until(PARAM_CLOSE)
            if is_string:
                value = json.dumps(raw, ensure_ascii=False)
            else:
                try:
                    value = json.dumps(json.loads(raw, parse_constant=_reject_constant), ensure_ascii=False)
                except (ValueError, RecursionError):
                    raise _Malformed from None
            fragments.append(("{" if not fragments else ", ") + json.dumps(key, ensure_ascii=False) + ": " + value)


def _joined(parts: list[str]) -> str:
    if len(parts) > 1:
        parts[:] = ["".join(parts)]
    return parts[0] if parts else ""


class OutputParser:
    """Splits a completion into reasoning, content and tool calls, fed piece by piece (see the module doc)."""

    def __init__(self, *, thinking: bool, tools: Collection[str]) -> None:
        self._tools = frozenset(tools)
        self._in_reasoning = thinking
        self._pending = ""  # held back: may be the start of a marker
        self._block: _Block | None = None
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self.tool_calls: list[ToolCall] = []
        self._delta: tuple[list[str], list[str], list[ToolCallDelta]] = ([], [], [])

    @property
    def reasoning(self) -> str:
        return _joined(self._reasoning)

    @property
    def content(self) -> str:
        return _joined(self._content)

    def feed(self, text: str) -> Delta:
        while text:
            if self._in_reasoning:
                text = self._feed_reasoning(text)
            elif self._block is None:
                text = self._feed_content(text)
            else:
                text = self._feed_block(text)
        return self._take_delta()

    def finish(self) -> Delta:
        """End of output: whatever is held back is reasoning or content as it stands."""
        if self._block is not None:
            self._emit_content(self._block.raw())
            self._block = None
        elif self._in_reasoning:
            self._emit_reasoning(self._pending)
        else:
            self._emit_content(self._pending)
        self._pending = ""
        return self._take_delta()

    # -- one state each: consume a prefix of `text`, return what the next state should read --

    def _feed_reasoning(self, text: str) -> str:
        buf = self._pending + text
        i = buf.find(THINK_END)
        if i >= 0:
            self._emit_reasoning(buf[:i])
            self._pending, self._in_reasoning = "", False
            return buf[i + len(THINK_END) :]
        cut = len(buf) - _held_back(buf, THINK_END)
        self._emit_reasoning(buf[:cut])
        self._pending = buf[cut:]
        return ""

    def _feed_content(self, text: str) -> str:
        buf = self._pending + text
        i = buf.find(BLOCK_OPEN)
        if i >= 0:
            start = i - 2 if i >= 2 and buf.startswith("\n\n", i - 2) else i
            self._emit_content(buf[:start])
            self._pending = ""
            self._block = _Block(buf[start : i + len(BLOCK_OPEN)], self._tools)
            return buf[i + len(BLOCK_OPEN) :]
        cut = len(buf) - max(_held_back(buf, BLOCK_OPEN_NL), _held_back(buf, BLOCK_OPEN))
        self._emit_content(buf[:cut])
        self._pending = buf[cut:]
        return ""

    def _feed_block(self, text: str) -> str:
        block = self._block
        assert block is not None
        ok = block.feed(text)
        if ok is None:
            return ""
        self._block = None
        if ok:
            for name, fragments in block.calls:
                self._emit_call(name, fragments)
        else:
            self._emit_content(block.raw())
        return block.rest

    # -- output --

    def _emit_reasoning(self, text: str) -> None:
        if text:
            self._reasoning.append(text)
            self._delta[0].append(text)

    def _emit_content(self, text: str) -> None:
        if text:
            self._content.append(text)
            self._delta[1].append(text)

    def _emit_call(self, name: str, fragments: list[str]) -> None:
        index = len(self.tool_calls)
        self.tool_calls.append(ToolCall(name, "".join(fragments)))
        self._delta[2].append(ToolCallDelta(index, name, ""))
        self._delta[2].extend(ToolCallDelta(index, None, f) for f in fragments)

    def _take_delta(self) -> Delta:
        reasoning, content, calls = self._delta
        self._delta = ([], [], [])
        return Delta("".join(reasoning), "".join(content), tuple(calls))


def parse(text: str, *, thinking: bool, tools: Collection[str]) -> OutputParser:
    """Parse a whole completion at once; read the result from the returned parser."""
    parser = OutputParser(thinking=thinking, tools=tools)
    parser.feed(text)
    parser.finish()
    return parser
