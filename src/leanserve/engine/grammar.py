"""Grammar-constrained decoding in the engine: a request's `SamplingParams.structured` (leanserve.structured's
grammars) compiled when it is added and enforced on the last stage, where tokens are sampled.

A request without one costs nothing: no compiler is built until a request first asks, and a step whose plan
names no constrained request (`StepPlan.structured` empty) makes no matcher, mask or bitmask.

  - Admission (stage 0): `LLMEngine.check_request` compiles the spec (`compile_structured`, by its kind: json,
    tool_calls, regex, choice), so a schema, tool list or regex that cannot be compiled is a ValueError naming it
    before anything is queued.
  - The last stage (`GrammarState`) keeps one `Matcher` per running constrained request: made at its first
    sampled chunk (compiled again there: the compiler keeps compiled grammars by source, and a compile takes
    milliseconds), advanced by every token the stage emits for it (at the next fill), dropped by the first plan
    that no longer names it (finished or aborted).
  - Masking: on the rows of constrained requests only, after logit bias and penalties and before temperature,
    top-k and top-p, so sampled and greedy decoding both obey it. The logprobs stay the raw logits'. A mask
    depends only on tokens already emitted and the step's drafts, so where a core is free of the model's
    threads (`overlap_fills`) `begin` starts the step's fill on a worker thread before the model runs and
    `mask` takes it when the logits are ready; otherwise `mask` fills them. A fill first advances the matchers
    by the tokens `record` kept, then fills the rows (in parallel through llguidance when there is enough work,
    PARALLEL_MASKS) and unpacks them into the rows' refused tokens.
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
import os
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import torch

from leanserve.model.config import ModelConfig
from leanserve.sampling_params import StructuredOutput
from leanserve.structured import Grammar, GrammarCompiler, Matcher, fill_masks, refused_tokens
from leanserve.tokenizer import Tokenizer, generation_eos_ids

# Masks are filled in parallel (llguidance's thread pool, `structured.fill_masks`) from this many rows times
# vocabulary entries; below it, one after another on this thread: a few rows of a small vocabulary take less
# than waking the pool beside the model's own threads. A 129k-entry vocabulary goes parallel from 2 rows.
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


def overlap_fills(device: torch.device) -> bool:
    """Whether a step's masks are filled on a worker thread while the model runs: when the model runs on an
    accelerator, or on fewer CPU threads than this process may use. Otherwise the model's threads hold every
    core and a worker would only slow them (a parallel kernel waits for its preempted thread), so the masks are
    filled on the step's thread once the logits are ready."""
    return device.type != "cpu" or torch.get_num_threads() < len(os.sched_getaffinity(0))


class GrammarState:
    """The last stage's matchers, one per running constrained request (by seq id)."""

    def __init__(
        self, model_dir: str, cfg: ModelConfig, device: torch.device | str = "cpu", overlap: bool | None = None
    ) -> None:
        """`overlap`: fill masks on a worker thread while the model runs; None decides by `overlap_fills` at
        each step (the threads the model runs on may change)."""
        self.model_dir, self.cfg, self.device, self.overlap = model_dir, cfg, torch.device(device), overlap
        self.matchers: dict[int, Matcher] = {}
        self._compiler: GrammarCompiler | None = None
        self._worker: ThreadPoolExecutor | None = None  # (made when a constrained request first comes)
        self._pending = None  # between begin and mask: (the step's samples, rows, future of its refused tokens)
        self._emitted: dict[int, list[int]] = {}  # tokens recorded since the last fill, per request

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:  # (when a constrained request first comes)
            self._compiler = model_compiler(self.model_dir, self.cfg)
        return self._compiler

    def begin(self, structured: tuple[int, ...], samples) -> None:
        """Before the step's model runs: matchers of requests the plan no longer names dropped, a matcher made
        for each constrained request sampled for the first time, and the step's masks started on the worker
        thread (`mask` takes them when the logits are ready)."""
        self._join()  # (a step that failed after its begin left its fill behind)
        if not structured:
            self.matchers.clear()
            self._emitted.clear()
            return
        named = set(structured)
        for seq_id in [i for i in self.matchers if i not in named]:
            del self.matchers[seq_id]
        for s in samples:
            spec = s.params.structured
            if spec is not None and s.seq_id not in self.matchers:
                grammar = compile_structured(self.compiler, spec)
                self.matchers[s.seq_id] = Matcher(grammar, thinking=spec.after_think)
        rows, matchers, later = self._rows(samples)
        if rows and (self.overlap if self.overlap is not None else overlap_fills(self.device)):
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="leanserve-grammar")
            work = (self._take_emitted(), rows, matchers, later)
            self._pending = (samples, rows, self._worker.submit(self._fill, *work))

    def _rows(self, samples) -> tuple[list[int], list[Matcher], list]:
        """The step's constrained rows (each request's first row, then its draft rows), their requests'
        matchers, and per request with drafts (matcher, drafts, its draft rows)."""
        firsts, matchers, later = [], [], []
        row = 0
        for s in samples:
            m = self.matchers.get(s.seq_id) if s.params.structured is not None else None
            if m is not None:
                firsts.append(row)
                matchers.append(m)
                if s.drafts:
                    later.append((m, s.drafts, range(row + 1, row + 1 + len(s.drafts))))
            row += len(s.drafts) + 1
        return firsts + [r for _, _, drafted in later for r in drafted], matchers, later

    def _take_emitted(self) -> list[tuple[int, Matcher, list[int]]]:
        """The tokens `record` kept since the last fill, for the matchers still running."""
        emitted = [(i, self.matchers[i], t) for i, t in self._emitted.items() if i in self.matchers]
        self._emitted.clear()
        return emitted

    def _fill(self, emitted, rows: list[int], matchers: list[Matcher], later: list) -> torch.Tensor:
        """(On the worker thread, while the model runs.) The matchers advanced by the tokens emitted since the
        last fill; the first rows' masks at their matchers' states, in parallel when there is enough work; the
        rows after drafts one at a time (the matcher advanced by the drafts before the row, then rolled back).
        Returns [rows, vocab] bool, True where a token is refused."""
        for seq_id, m, tokens in emitted:
            for t in tokens:
                if not m.accept(t):
                    raise RuntimeError(f"request {seq_id}: token {t} was emitted against its grammar")
        bitmask = torch.full((len(rows), matchers[0].mask_words), -1, dtype=torch.int32)
        if len(matchers) * self.cfg.vocab_size >= PARALLEL_MASKS:
            fill_masks(matchers, bitmask[: len(matchers)])
        else:
            for i, m in enumerate(matchers):
                m.fill_mask(bitmask[i])
        at, eos = len(matchers), self.compiler.eos_ids
        for m, drafts, drafted in later:
            accepted = 0
            for d in drafts:
                if d in eos or not m.accept(d):  # (the rows after a refused draft are never used: left as they are)
                    break
                m.fill_mask(bitmask[at + accepted])
                accepted += 1
            m.rollback(accepted)
            at += len(drafted)
        return refused_tokens(bitmask, self.cfg.vocab_size)

    def _join(self, samples=None):
        """Waits for the pending fill (its error raised here); its (rows, refused) when it was started for these
        `samples`, else None."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        started_for, rows, done = pending
        refused = done.result()
        return (rows, refused) if started_for is samples else None

    def mask(self, logits: torch.Tensor, samples) -> torch.Tensor:
        """[R, V] logits of a step's verified rows (len(drafts) + 1 per sample, in order) -> a new tensor
        whose constrained rows have the tokens their grammar refuses at -inf; `logits` itself when no sample is
        constrained. `logits` is never written. The masks `begin` started for these samples, or filled now."""
        filled = self._join(samples)
        if filled is None:
            rows, matchers, later = self._rows(samples)
            if not rows:
                return logits
            filled = rows, self._fill(self._take_emitted(), rows, matchers, later)
        rows, refused = filled
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        sub = logits.index_select(0, index).float().masked_fill_(refused.to(logits.device), float("-inf"))
        return logits.float().index_copy(0, index, sub)

    def record(self, samples, emitted: dict) -> None:
        """After verification: the tokens the stage emitted for each constrained request (its accepted drafts
        and its sampled token, up to an EOS, which ends it), kept for the next fill to advance its matcher by."""
        if not self.matchers:
            return
        eos = self.compiler.eos_ids
        for s in samples:
            if s.params.structured is None or s.seq_id not in self.matchers:
                continue
            tokens = self._emitted.setdefault(s.seq_id, [])
            for t in emitted[s.seq_id]:
                tokens.append(t.token_id)
                if t.token_id in eos:
                    break
