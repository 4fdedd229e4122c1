"""Grammar-constrained decoding in the engine: a request's `SamplingParams.structured` (leanserve.structured's
grammars) compiled when it is added and enforced on the last stage, where tokens are sampled.

A request without one costs nothing: no compiler is built until a request first asks, and a step whose plan
names no constrained request (`StepPlan.structured` empty) makes no matcher, mask or bitmask.

  - Admission (stage 0): `LLMEngine.check_request` compiles the spec (`compile_structured`, by its kind: json,
    tool_calls, regex, choice), so a schema, tool list or regex that cannot be compiled is a ValueError naming it
    before anything is queued.
  - The last stage (`GrammarState`) keeps one `Matcher` per running constrained request: made at its first
    sampled chunk (compiled again there: the compiler keeps compiled grammars by source, and a compile takes
    milliseconds), advanced by every token the stage emits for it, dropped by the first plan that no longer
    names it (finished or aborted).
  - Masking: on the rows of constrained requests only, after logit bias and penalties and before temperature,
    top-k and top-p, so sampled and greedy decoding both obey it. The logprobs stay the raw logits'. The
    rows' masks are filled in parallel (`structured.fill_masks`) when there is enough work (PARALLEL_MASKS).
    Once the grammar is complete only EOS is allowed, so the request's next token is EOS (finish "stop");
    max_tokens may cut it first ("length").
  - Speculative decoding: drafts are verified against exact masks. Row j of a request with drafts is masked
    with its matcher advanced by drafts[:j] (accepted one at a time, then rolled back), which is the mask plain
    decoding uses there once those drafts are accepted; a draft the grammar refuses has probability 0 in its
    row and is rejected there, so the rows after it are never used (left unmasked). Greedy tokens are therefore
    those without speculation, and sampled ones are distributed as the masked target (rejection sampling).
    The drafters do not see the grammar (drafts are guesses), so fewer drafts are accepted, none are wrong.
  - Pipeline overlap: a request is in one micro-batch at a time (the scheduler leaves requests in flight out),
    and the last stage runs micro-batches in launch order, so each step's mask sees every token before it.
"""

from __future__ import annotations

import json
from functools import lru_cache

import torch

from leanserve.config import ModelConfig
from leanserve.sampling_params import StructuredOutput
from leanserve.structured import Grammar, GrammarCompiler, Matcher, apply_bitmask, fill_masks
from leanserve.tokenizer import Tokenizer, generation_eos_ids

# Masks are filled in parallel (llguidance's thread pool, `structured.fill_masks`) from this many rows times
# vocabulary entries; below it, one after another on this thread: a row of a 4k-entry vocabulary takes a few
# microseconds, less than waking the pool (measured on the shipped model: 0.04 ms for 8 rows serially, 0.1 to
# 5 ms through the pool beside the model's own threads). A 129k-entry vocabulary goes parallel from 2 rows.
PARALLEL_MASKS = 1 << 18


@lru_cache(maxsize=4)
def grammar_compiler(model_dir: str, vocab_size: int, eos_ids: tuple[int, ...]) -> GrammarCompiler:
    """The compiler for a model's tokenizer, built once per process (one engine's stage 0 and its last stage
    share it when they are one process)."""
    tokenizer = Tokenizer.from_dir(model_dir)
    if tokenizer is None:
        raise ValueError(f"Structured output needs the model's tokenizer, and {model_dir} has no tokenizer.json.")
    return GrammarCompiler(tokenizer, eos_ids, vocab_size=vocab_size)


def model_compiler(model_dir: str, cfg: ModelConfig) -> GrammarCompiler:
    """`grammar_compiler` for the model in `model_dir`, with the EOS ids the engine stops at."""
    eos = generation_eos_ids(model_dir) or cfg.eos_token_ids
    return grammar_compiler(str(model_dir), cfg.vocab_size, tuple(eos))


def compile_structured(compiler: GrammarCompiler, spec: StructuredOutput) -> Grammar:
    """The grammar of `spec` (ValueError naming what cannot be compiled). Its thinking-mode variant too, when
    the spec asks for it (it is compiled apart)."""
    if spec.kind == "json":
        grammar = compiler.json(None if spec.schema is None else json.loads(spec.schema), spec.strict)
    elif spec.kind == "tool_calls":
        grammar = compiler.tool_calls(json.loads(spec.tools), spec.required_name)
    elif spec.kind == "regex":
        grammar = compiler.regex(spec.pattern)
    else:
        grammar = compiler.choice(spec.choices)
    if spec.after_think:
        Matcher(grammar, thinking=True)
    return grammar


class GrammarState:
    """The last stage's matchers, one per running constrained request (by seq id)."""

    def __init__(self, model_dir: str, cfg: ModelConfig) -> None:
        self.model_dir, self.cfg = model_dir, cfg
        self.matchers: dict[int, Matcher] = {}
        self._compiler: GrammarCompiler | None = None

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:  # (when a constrained request first comes)
            self._compiler = model_compiler(self.model_dir, self.cfg)
        return self._compiler

    def begin(self, structured: tuple[int, ...], samples) -> None:
        """Before a step's verification: matchers of requests the plan no longer names dropped, a matcher made
        for each constrained request sampled for the first time."""
        if not structured:
            self.matchers.clear()
            return
        named = set(structured)
        for seq_id in [i for i in self.matchers if i not in named]:
            del self.matchers[seq_id]
        for s in samples:
            spec = s.params.structured
            if spec is not None and s.seq_id not in self.matchers:
                grammar = compile_structured(self.compiler, spec)
                self.matchers[s.seq_id] = Matcher(grammar, thinking=spec.after_think)

    def mask(self, logits: torch.Tensor, samples) -> torch.Tensor:
        """[R, V] logits of a step's verified rows (len(drafts) + 1 per sample, in order) -> a new tensor
        whose constrained rows have the tokens their grammar refuses at -inf; `logits` itself when no sample is
        constrained. `logits` is never written."""
        firsts, matchers, later = [], [], []  # each constrained request's first row and matcher; draft rows
        row = 0
        for s in samples:
            m = self.matchers.get(s.seq_id) if s.params.structured is not None else None
            if m is not None:
                firsts.append(row)
                matchers.append(m)
                if s.drafts:
                    later.append((m, s.drafts, range(row + 1, row + 1 + len(s.drafts))))
            row += len(s.drafts) + 1
        if not firsts:
            return logits
        rows = firsts + [r for _, _, drafted in later for r in drafted]
        bitmask = torch.full((len(rows), matchers[0].mask_words), -1, dtype=torch.int32)
        # The first rows at their matchers' states, in parallel; then the rows after drafts, one at a time: the
        # matcher advanced by the drafts before the row, then rolled back.
        if len(matchers) * self.cfg.vocab_size >= PARALLEL_MASKS:
            fill_masks(matchers, bitmask[: len(firsts)])
        else:
            for i, m in enumerate(matchers):
                m.fill_mask(bitmask[i])
        at, eos = len(firsts), self.compiler.eos_ids
        for m, drafts, drafted in later:
            accepted = 0
            for d in drafts:
                if d in eos or not m.accept(d):  # (the rows after a refused draft are never used: left as they are)
                    break
                m.fill_mask(bitmask[at + accepted])
                accepted += 1
            m.rollback(accepted)
            at += len(drafted)
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        sub = logits.index_select(0, index).float()
        apply_bitmask(sub, bitmask)
        return logits.float().index_copy(0, index, sub)

    def record(self, samples, emitted: dict) -> None:
        """After verification: each constrained request's matcher advanced by the tokens the stage emitted for
        it (its accepted drafts and its sampled token), up to an EOS, which ends it."""
        if not self.matchers:
            return
        for s in samples:
            m = self.matchers.get(s.seq_id) if s.params.structured is not None else None
            if m is None:
                continue
            for t in emitted[s.seq_id]:
                if not m.accept(t.token_id):
                    raise RuntimeError(f"request {s.seq_id}: token {t.token_id} was emitted against its grammar")
                if t.token_id in self.compiler.eos_ids:
                    break
