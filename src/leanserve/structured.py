"""Grammar-constrained decoding: JSON output (``response_format``), forced DSML tool calls, a regex or one of
given strings (vLLM's ``structured_outputs`` regex / choice), on llguidance.

`GrammarCompiler` (one per engine) turns a JSON schema, a list of OpenAI tools, a regex or a list of choices into
a `Grammar`; each constrained request gets a `Matcher` that writes the tokens allowed next into a row of a bitmask
(`fill_mask`: bit ``t % 32`` of int32 word ``t // 32`` set = token t allowed) and advances by the token the
sampler drew (`accept`). `fill_masks` / `apply_bitmask` / `apply_masks` do a batch of rows at once.

Why llguidance (compared with xgrammar 0.2.9 on this project's byte-level BPE tokenizer with DeepSeek-V4's
chat tokens added; both fill a mask far faster than a decode step, so correctness decided):

- special tokens: llguidance keeps the tokenizer's special tokens (BOS, EOS, ``<｜User｜>``, ``<think>``,
  ``</think>``...) apart from text, so no text in a grammar can be written with them, and a grammar names one
  explicitly as ``<[id]>``. xgrammar's tokenizer info found no special token in this tokenizer and let
  ``<｜User｜>``, ``<think>`` or BOS into a JSON string as their text.
- one Lark grammar expresses the DSML block exactly: literal text, JSON values from inline JSON schemas
  (``%json``), and raw string values as "any text that does not contain the closing tag" (regex
  intersection and negation, ``&`` and ``~``).
- byte-level tokens that split a UTF-8 character are handled (the grammar works on bytes, a token is allowed
  when its bytes can continue a valid text), and the plain added token ``｜DSML｜`` counts as its text, so
  the model may write a tag with that single token, as it was trained to.
- rollback, ``try_consume_tokens`` (the longest acceptable prefix of draft tokens) and a thread pool that fills
  a batch's masks at once (`fill_masks`), which speculative decoding and batching need.

Grammars. JSON: the schema (None = any JSON object) as llguidance compiles it, with at most 32 whitespace
characters between tokens (a model cannot loop on whitespace forever). Tool calls: exactly the text that
`leanserve.chat.dsv4` writes for an assistant's tool calls and `leanserve.chat.dsml` parses::

    \\n\\n<｜DSML｜tool_calls>\\n<｜DSML｜invoke name="NAME">\\n<｜DSML｜parameter name="KEY" string="true">VALUE
    </｜DSML｜parameter>\\n...</｜DSML｜invoke>\\n</｜DSML｜tool_calls>

Parameters come in the schema's order, the required ones always; a string-typed parameter (plain, enum or
const, with min/maxLength) is written raw (``string="true"``), anything else as JSON (``string="false"``);
a parameter that may be a string or something else (``anyOf`` of typed alternatives, a list of types) may be
either. One parameter beyond the schema's properties may come last when additionalProperties is not false
(one only: the grammar could not stop two from sharing a name, which makes the block invalid). A JSON value
could still hold the closing tag's text inside a JSON string (llguidance cannot intersect a JSON schema with a
regex); a raw value cannot.

Regex: llguidance's own regex grammar, one lexeme (Rust's `regex` syntax; no lookaround or backreference, which a
lexer of regular languages cannot hold); the whole output matches it. Choice: one lexeme whose alternatives are
the strings as literals, so a choice that is a prefix of another may end there or go on.

Thinking mode (``Matcher(grammar, thinking=True)``): the grammar gets a free prefix, any text without
``</think>`` (the output parser splits reasoning at the first one), then ``</think>`` (the special token when
the tokenizer has it, else the text), then the constrained part; EOS is not allowed before the end. The
prompt already ends with ``<think>``.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance
import numpy as np
import torch

from leanserve.chat.dsml import (
    BLOCK_CLOSE,
    BLOCK_OPEN_NL,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAM_CLOSE,
    PARAM_OPEN,
    THINK_END,
)
from leanserve.tokenizer import Tokenizer

JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,32}"  # between JSON tokens
_CACHE_SIZE = 64  # compiled grammars kept per compiler, by their source
_ANNOTATIONS = {"description", "title", "$schema", "$id", "$comment", "default", "examples", "deprecated"}
_RAW_KEYS = {"type", "enum", "const", "minLength", "maxLength"} | _ANNOTATIONS  # what a raw value can enforce
_PARAMS_KEYS = {"type", "properties", "required", "additionalProperties", "$defs", "definitions"} | _ANNOTATIONS
_ANY_TEXT = "/(?s:.*)/"
_NL = "\n"


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _without(text: str) -> str:
    """A Lark regex: any text that does not contain `text` (which must have no regex metacharacter but '/')."""
    return "~/(?s:.*)" + text.replace("/", "\\/") + "(?s:.*)/"


def _json_rule(schema: Any, lenient: bool) -> str:
    """A Lark `%json` item for `schema`, with this module's JSON options."""
    if schema is False:
        raise ValueError("The JSON schema false allows no value at all.")
    schema = {} if schema is True else dict(schema)
    schema["x-guidance"] = {"whitespace_pattern": JSON_WHITESPACE, "lenient": lenient}
    return "%json " + json.dumps(schema)


class Grammar:
    """A compiled constraint: build Matchers from it, any number, one per request."""

    def __init__(self, compiler: GrammarCompiler, body: str, what: str) -> None:
        self._compiler = compiler
        self._body = body  # Lark rules defining `body`
        self._what = what
        self._pristine: dict[bool, llguidance.LLMatcher] = {}
        self._matcher_template(False)  # compiles (and checks) the grammar now

    def _matcher_template(self, thinking: bool) -> llguidance.LLMatcher:
        if thinking not in self._pristine:
            start = f"start: {self._compiler.think_prefix} body\n" if thinking else "start: body\n"
            lark = start + (self._compiler.think_rules if thinking else "") + self._body
            m = llguidance.LLMatcher(
                self._compiler.ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0
            )
            if m.is_error():
                raise ValueError(f"{self._what} cannot be compiled into a grammar: {_reason(m.get_error())}.")
            self._pristine[thinking] = m
        return self._pristine[thinking]


def _reason(error: str) -> str:
    """The one line of llguidance's compile error that says what is wrong."""
    lines = error.strip().splitlines()
    reason = re.sub(r"^at \d+\(\d+\): ", "", lines[0]).rstrip(".")
    if reason.endswith("regex parse error:"):  # the regex crate's reason comes lines below, after the caret
        detail = next((ln.removeprefix("error: ") for ln in lines if ln.startswith("error: ")), "")
        reason = f"{reason} {detail}".rstrip(" :")
    reason = re.sub(r'^invalid regex ".*" \(in regex\): ', "", reason)  # (the caller names the regex)
    return re.sub(r" in regex /.*/$", "", reason).removeprefix("regex parse error: ")


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, grammar: Grammar, *, thinking: bool = False) -> None:
        self._m = grammar._matcher_template(thinking).deep_copy()
        self._eos = grammar._compiler.eos_ids
        self._eos_after_end = False  # an EOS accepted once the grammar had ended
        self.vocab_size = grammar._compiler.vocab_size
        self.mask_words = (self.vocab_size + 31) // 32

    def fill_mask(self, out_row: torch.Tensor) -> None:
        """Writes the tokens allowed next into `out_row`: a contiguous CPU int32 tensor of `mask_words` words.
        After the grammar's end only EOS is allowed."""
        if out_row.dtype != torch.int32 or out_row.device.type != "cpu" or not out_row.is_contiguous():
            raise ValueError("A mask row must be a contiguous int32 tensor on the CPU.")
        if out_row.numel() != self.mask_words:
            raise ValueError(f"A mask row has {self.mask_words} words, not {out_row.numel()}.")
        self._m.unsafe_compute_mask_ptr(out_row.data_ptr(), self.mask_words * 4)

    def accept(self, token_id: int) -> bool:
        """Advances by one token; False (and no change) when the grammar does not allow it."""
        return self.accept_prefix((token_id,)) == 1

    def accept_prefix(self, token_ids: Sequence[int]) -> int:
        """Advances by the longest allowed prefix of `token_ids` (draft tokens); returns its length."""
        n = self._m.try_consume_tokens(list(token_ids))  # (it stops before EOS)
        if n < len(token_ids) and token_ids[n] in self._eos and not self._eos_after_end:
            if self._m.is_stopped():  # llguidance would not count this EOS: remember it here, for rollback
                self._eos_after_end = True
                n += 1
            elif self._m.is_accepting():
                n += self._m.consume_token(token_ids[n])
        return n

    def rollback(self, n: int) -> None:
        """Undoes the last `n` accepted tokens (EOS included)."""
        if n and self._eos_after_end:
            self._eos_after_end, n = False, n - 1
        if n and not self._m.rollback(n):
            raise ValueError(f"Cannot roll back {n} tokens: {self._m.get_error() or 'fewer were accepted'}.")

    @property
    def is_finished(self) -> bool:
        """True once the grammar's end is reached (nothing but EOS can follow) or EOS was accepted."""
        return self._m.is_stopped()

    @property
    def allows_eos(self) -> bool:
        """True when the text so far is complete (EOS may come now)."""
        return self._m.is_accepting()


class GrammarCompiler:
    """Compiles JSON schemas, tool lists, regexes and choices into Grammars for one tokenizer; build it once per
    engine.

    `vocab_size` is the width of the model's logits (the tokenizer's size when None)."""

    def __init__(self, tokenizer: Tokenizer, eos_ids: Sequence[int], *, vocab_size: int | None = None) -> None:
        if not eos_ids:
            raise ValueError("Grammar-constrained decoding needs at least one EOS token id.")
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self.eos_ids = frozenset(eos_ids)
        self.ll_tokenizer = llguidance.LLTokenizer(
            tokenizer.to_json(), n_vocab=self.vocab_size, eos_token=list(eos_ids)
        )
        think_id = tokenizer.token_to_id(THINK_END)
        reasoning = f"{_ANY_TEXT} & {_without(THINK_END)}"
        if think_id is not None and self.ll_tokenizer.is_special_token(think_id):
            self.think_prefix, self.think_rules = f"REASONING <[{think_id}]>", f"REASONING: {reasoning}\n"
        else:  # the text closes the reasoning within its lexeme, like a raw value's closing tag
            self.think_prefix, self.think_rules = "REASONING", f"REASONING: ({reasoning}) {_lit(THINK_END)}\n"
        self._cache: OrderedDict[str, Grammar] = OrderedDict()

    def json(self, schema: dict | None, strict: bool) -> Grammar:
        """Any JSON object (schema None), or a JSON value valid against `schema`. With `strict`, a schema keyword
        the engine does not enforce is an error; without, it is ignored (the output may then not validate)."""
        if schema is None:
            schema = {"type": "object"}
        elif not isinstance(schema, dict | bool):
            raise ValueError(f"A JSON schema must be an object, not {type(schema).__name__}.")
        return self._compile("body: " + _json_rule(schema, lenient=not strict) + "\n", "The JSON schema")

    def regex(self, pattern: str) -> Grammar:
        """Text that `pattern` matches as a whole, in the syntax of Rust's `regex` crate (llguidance's own regex
        grammar): no lookaround, backreference or ``\\b``; ``^`` and ``$`` change nothing."""
        if not isinstance(pattern, str):
            raise ValueError(f"A regex must be a string, not {type(pattern).__name__}.")
        lark = json.loads(llguidance.LLMatcher.grammar_from_regex(pattern))["grammars"][0]["lark_grammar"]
        grammar = self._compile("body: " + lark.removeprefix("start: ") + "\n", f"The regex {pattern!r}")
        start = Matcher(grammar)  # a regex of no text (``[^\\s\\S]``) compiles, then allows nothing
        start.fill_mask(torch.empty(start.mask_words, dtype=torch.int32))
        if start._m.is_error():
            raise ValueError(f"The regex {pattern!r} matches no text.")
        return grammar

    def choice(self, choices: Sequence[str]) -> Grammar:
        """Exactly one of the strings `choices` (one lexeme: a choice that is a prefix of another may end there)."""
        if isinstance(choices, str) or not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("The choices must be a non-empty list of strings.")
        alternatives = " | ".join(_lit(c) for c in dict.fromkeys(choices))
        return self._compile(f"body: CHOICE\nCHOICE: {alternatives}\n", "The choices")

    def tool_calls(self, tools: list[dict], required_name: str | None) -> Grammar:
        """A DSML tool-call block: one or more calls of the offered tools, or exactly one call of the function
        `required_name`. A function whose "strict" is true gets its schema enforced in full (see `json`)."""
        functions = []
        for tool in tools or []:
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError('Each tool must be an OpenAI tool object: {"type": "function", "function": {...}}.')
            functions.append(function)
        if not functions:
            raise ValueError("A forced tool call needs at least one tool.")
        names = [f["name"] for f in functions]
        if len(set(names)) < len(names):
            raise ValueError(f"Two tools are named {next(n for n in names if names.count(n) > 1)!r}.")
        if required_name is not None and required_name not in names:
            raise ValueError(f"The required function {required_name!r} is not among the tools.")
        rules, first, later = [], [], []
        for i, function in enumerate(functions):
            if required_name is None or function["name"] == required_name:
                rules += _invoke_rules(f"call{i}", function)
                first.append(f"call{i}")
                later.append(f"call{i}_next")
        more = "" if required_name is not None else f" ({' | '.join(later)})*"
        body = f"body: {_lit(BLOCK_OPEN_NL + _NL)} ({' | '.join(first)}){more} {_lit(_NL + BLOCK_CLOSE)}\n"
        return self._compile(body + "".join(rules), "The tools' parameter schemas")

    def _compile(self, body: str, what: str) -> Grammar:
        grammar = self._cache.get(body)
        if grammar is None:
            grammar = Grammar(self, body, what)
            self._cache[body] = grammar
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(body)
        return grammar


def _invoke_rules(rule: str, function: dict) -> list[str]:
    """Lark rules for one DSML invoke element of `function` (rule names start with `rule`)."""
    name = function["name"]
    if not name or any(c in name for c in '"<>\n'):
        raise ValueError(f"The function name {name!r} cannot be written in a DSML tool call.")
    params = function.get("parameters")
    params = {} if params is None else params
    lenient = function.get("strict") is not True
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise ValueError(f"The parameters of function {name!r} must be a JSON schema of an object.")
    extra_keys = set(params) - _PARAMS_KEYS
    if extra_keys and not lenient:
        raise ValueError(
            f"The parameters of function {name!r} use {sorted(extra_keys)[0]!r}, which a DSML call cannot enforce."
        )
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    properties = dict(params.get("properties") or {})
    additional = params.get("additionalProperties", True)
    for key in params.get("required") or []:
        if key not in properties:
            if additional is False:
                raise ValueError(f"Function {name!r} requires the parameter {key!r}, which its schema does not define.")
            properties[key] = additional
    required = set(params.get("required") or [])
    keys = [k for k, s in properties.items() if s is not False]
    for key in keys:
        if not key or any(c in key for c in '"<>\n'):
            raise ValueError(f"The parameter name {key!r} of function {name!r} cannot be written in a DSML tool call.")
    if any(properties[k] is False for k in required):
        raise ValueError(f"Function {name!r} requires a parameter its schema forbids.")

    # Lexemes are matched greedily: a literal that could end where another one at the same place goes on would
    # cut that one off. So separators open the element after them, and a key ends with its closing quote.
    opener = INVOKE_OPEN + name + '">' + _NL
    rules = [
        f"{rule}: {_lit(opener)} {rule}_a0 {_lit(_NL + INVOKE_CLOSE)}\n",
        f"{rule}_next: {_lit(_NL + opener)} {rule}_a0 {_lit(_NL + INVOKE_CLOSE)}\n",
    ]
    first, later = _lit(PARAM_OPEN), _lit(_NL + PARAM_OPEN)
    for j, key in enumerate(keys):  # a<j>: params j.. with none written yet; b<j>: params j.. after one
        p, a, b = f"{rule}_p{j}", f"{rule}_a{j + 1}", f"{rule}_b{j + 1}"
        rules += _param_rules(p, _lit(key + '" string="'), properties[key], defs, lenient)
        rules.append(f"{rule}_a{j}: {first} {p} {b}" + ("" if key in required else f" | {a}") + "\n")
        if j:
            rules.append(f"{rule}_b{j}: {later} {p} {b}\n" if key in required else f"{rule}_b{j}: ({later} {p})? {b}\n")
    n, x = len(keys), f"{rule}_x"
    if additional is False:
        rules += [f'{rule}_a{n}: ""\n', f'{rule}_b{n}: ""\n']
    else:  # one extra parameter at most (two could share a name, which the parser refuses): not a declared name
        names = f'/[^"<>\\n]+/ & ~({" | ".join(map(_lit, keys))})' if keys else '/[^"<>\\n]+/'
        rules += [f"{x.upper()}_KEY: {names}\n", f"{rule}_a{n}: ({first} {x})?\n", f"{rule}_b{n}: ({later} {x})?\n"]
        rules += _param_rules(x, f"{x.upper()}_KEY {_lit(chr(34) + ' string=' + chr(34))}", additional, defs, lenient)
    return rules


def _param_rules(rule: str, key: str, schema: Any, defs: dict, lenient: bool) -> list[str]:
    """Lark rules for one DSML parameter after its opening text: `key` (the name, up to `string="`), then the
    value, raw (string="true") or as JSON (string="false"), then the closing tag."""
    raw, rest = _split_strings(schema, defs)
    branches, rules = [], []
    if raw:
        term = rule.upper() + "_RAW"
        rules.append(f"{term}: ({' | '.join(_raw_regex(s) for s in raw)}) {_lit(PARAM_CLOSE)}\n")
        branches.append(f"{_lit('true' + chr(34) + '>')} {term}")
    if rest is not None:
        rest = {} if rest is True else dict(rest)
        rest.update(defs)
        rules.append(f"{rule}_json: {_json_rule(rest, lenient)}\n")
        branches.append(f"{_lit('false' + chr(34) + '>')} {rule}_json {_lit(PARAM_CLOSE)}")
    return [f"{rule}: {key} ({' | '.join(branches)})\n", *rules]


def _is_raw_string(s: Any) -> bool:
    """A schema of strings only that a raw value can enforce exactly (pattern and format need JSON)."""
    if not isinstance(s, dict) or not set(s) <= _RAW_KEYS:
        return False
    if "enum" in s:
        return isinstance(s["enum"], list) and bool(s["enum"]) and all(isinstance(v, str) for v in s["enum"])
    if "const" in s:
        return isinstance(s["const"], str)
    return s.get("type") == "string"


def _split_strings(schema: Any, defs: dict) -> tuple[list[dict], Any]:
    """(string schemas written raw, the schema of the values written as JSON, or None when there are none)."""
    s = schema
    if isinstance(s, dict) and isinstance(s.get("$ref"), str) and set(s) - _ANNOTATIONS == {"$ref"}:
        kind, _, name = s["$ref"].removeprefix("#/").partition("/")
        s = defs.get(kind, {}).get(name, s)  # a local definition, looked at to tell strings apart
    if _is_raw_string(s):
        return [s], None
    if s is True or (isinstance(s, dict) and set(s) <= _ANNOTATIONS):  # anything: a string raw, or any JSON
        return [{"type": "string"}], True
    if not isinstance(s, dict):
        return [], s
    types = s.get("type")
    if isinstance(types, list) and "string" in types and set(s) - _ANNOTATIONS <= {"type", "minLength", "maxLength"}:
        others = [t for t in types if t != "string"]
        string = {k: v for k, v in s.items() if k in ("minLength", "maxLength")} | {"type": "string"}
        return [string], ({"type": others} if others else None)
    alternatives = s.get("anyOf")
    if isinstance(alternatives, list) and set(s) - _ANNOTATIONS == {"anyOf"}:
        typed = all(
            isinstance(a, dict) and (isinstance(a.get("type"), str) or "enum" in a or "const" in a)
            for a in alternatives
        )
        strings = [a for a in alternatives if _is_raw_string(a)]
        if typed and strings:
            others = [a for a in alternatives if not _is_raw_string(a)]
            return strings, ({"anyOf": others} if others else None)
    return [], schema


def _raw_regex(s: dict) -> str:
    """A Lark terminal expression for a raw string value valid against `s` (see `_is_raw_string`)."""
    values = s["enum"] if "enum" in s else [s["const"]] if "const" in s else None
    if values is not None:
        if any(PARAM_CLOSE in v for v in values):
            raise ValueError(f"A string value cannot contain {PARAM_CLOSE!r} in a DSML tool call.")
        return "(" + " | ".join(_lit(v) for v in values) + ")"
    low, high = s.get("minLength", 0), s.get("maxLength")
    if not isinstance(low, int) or not (high is None or isinstance(high, int)) or (high is not None and high < low):
        raise ValueError(f"The string length bounds {low!r}..{high!r} are not valid.")
    text = _ANY_TEXT if (low, high) == (0, None) else f"/(?s:.{{{low},{'' if high is None else high}}})/"
    return f"({text} & {_without(PARAM_CLOSE)})"


_executor: llguidance.LLExecutor | None = None


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A [rows, words] int32 bitmask on the CPU, pinned when CUDA is there: `apply_bitmask` copies it to the GPU
    without waiting, which is safe as long as the sampled tokens are read back (a sync) before it is refilled,
    as they must be anyway to advance the matchers."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())


def fill_masks(matchers: Sequence[Matcher | None], bitmask: torch.Tensor) -> None:
    """Fills row i of `bitmask` for matchers[i] (all tokens allowed for None), the rows in parallel."""
    global _executor
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
        raise ValueError("A bitmask must be a contiguous int32 tensor on the CPU.")
    rows, words = bitmask.shape
    if rows < len(matchers):
        raise ValueError(f"The bitmask has {rows} rows for {len(matchers)} matchers.")
    pairs = []
    for i, m in enumerate(matchers):
        if m is None:
            bitmask[i] = -1
        elif m.mask_words != words:
            raise ValueError(f"A mask row has {m.mask_words} words, not {words}.")
        else:
            pairs.append((m._m, i))
    if pairs:
        _executor = _executor or llguidance.LLExecutor()
        _executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, rows)


def refused_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, words] CPU bitmask -> [R, vocab] bool, True for the tokens each row's mask leaves out (tokens beyond
    the mask's width are left out too). Unpacked by numpy: one thread, no wake-up of torch's pool for a small
    tensor."""
    bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1, bitorder="little")
    refused = np.ones((bits.shape[0], vocab), dtype=np.bool_)
    width = min(vocab, bits.shape[1])
    np.equal(bits[:, :width], 0, out=refused[:, :width])
    return torch.from_numpy(refused)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets to -inf, in place, the logits of the tokens each row's mask leaves out ([R, V] logits, [R, words]
    bitmask on any device; tokens beyond the mask's width are left out too)."""
    rows, vocab = logits.shape
    refused = refused_tokens(bitmask[:rows].cpu(), vocab)
    logits.masked_fill_(refused.to(logits.device, non_blocking=True), float("-inf"))


def apply_masks(logits: torch.Tensor, matchers: Sequence[Matcher | None], bitmask: torch.Tensor | None = None) -> None:
    """Masks, in place, row i of `logits` with the tokens matchers[i] allows (None: the row is left as it is).
    `bitmask` is a reusable buffer from `allocate_bitmask` (one is made when None)."""
    if len(matchers) != logits.shape[0]:
        raise ValueError(f"{len(matchers)} matchers for {logits.shape[0]} rows of logits.")
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    if bitmask is None:
        bitmask = allocate_bitmask(len(rows), matchers[rows[0]].vocab_size)
    fill_masks([matchers[i] for i in rows], bitmask)
    if len(rows) == logits.shape[0]:
        apply_bitmask(logits, bitmask)
    else:
        index = torch.tensor(rows, device=logits.device)
        sub = logits.index_select(0, index)
        apply_bitmask(sub, bitmask)
        logits.index_copy_(0, index, sub)
