"""The offline API, shaped like vLLM's: `LLM(model=DIR).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from tqdm import tqdm

from leanserve.engine.config import EngineConfig
from leanserve.engine.llm_engine import LLMEngine
from leanserve.engine.sequence import Sequence as EngineSequence
from leanserve.memory import StageMemory
from leanserve.outputs import CompletionOutput, Logprob, RequestOutput
from leanserve.sampling_params import SamplingParams

PromptType = str | dict[str, Any]
ENGINE_OPTIONS = frozenset(f.name for f in fields(EngineConfig)) - {"model"}


class LLM:
    """`LLM(model, **options)`: an engine for the checkpoint directory `model`.

    The options (dtype, max_model_len, max_num_seqs, speculative_config, ...) are the fields of `EngineConfig`,
    with its defaults; `help(leanserve.engine.config.EngineConfig)` documents each. An unknown option is a
    TypeError. `load_progress` is LLM's own: a progress bar while the weights load."""

    def __init__(self, model: str, *, load_progress: bool = True, **options: Any) -> None:
        unknown = sorted(set(options) - ENGINE_OPTIONS)
        if unknown:
            raise TypeError(
                f"LLM() got unexpected option(s) {unknown}; the options are EngineConfig's fields: "
                f"{sorted(ENGINE_OPTIONS)} (and load_progress)."
            )
        self.engine = LLMEngine(EngineConfig(model=str(model), **options), progress=load_progress)

    def memory_ledger(self) -> list[StageMemory]:
        """Per pipeline stage: weights_bytes and every persistent buffer (name, owner, feature, bytes, dtype,
        shape, device). `[s.to_dict() for s in llm.memory_ledger()]` is the JSON form."""
        return self.engine.memory_ledger()

    def spec_decode_metrics(self) -> dict:
        """Speculative decoding so far: num_drafts, num_draft_tokens, num_accepted_tokens, accepted_per_position,
        acceptance_rate and mean_acceptance_length (1 + accepted tokens per draft). Zeros without speculation."""
        return self.engine.spec_decode_metrics()

    def reset_prefix_cache(self) -> None:
        """Drops every prefix the prefix cache keeps (their blocks and saved states become free)."""
        self.engine.reset_prefix_cache()

    def cache_stats(self) -> dict:
        """The paged cache now: block_tokens, num_blocks, blocks_used, blocks_free, num_preemptions so far, and the
        prefix cache's prefix_cache_entries, prefix_cache_queries and prefix_cache_hits (prompt tokens looked up,
        and found cached) when it is on."""
        return self.engine.cache_stats()

    def shutdown(self) -> None:
        """Stops the pipeline stage processes (if any). The LLM cannot generate afterwards."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One result per prompt, in order. Every prompt is checked before any is queued, so a bad one
        raises ValueError and leaves the engine as it was."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"Got {len(params)} sampling_params for {len(prompts)} prompts; give one or one each.")
        token_ids = [self._prompt_token_ids(p) for p in prompts]
        for ids, p in zip(token_ids, params, strict=True):
            self.engine.check_request(ids, p)

        order = {self.engine.add_request(ids, p): i for i, (ids, p) in enumerate(zip(token_ids, params, strict=True))}
        results: list[RequestOutput | None] = [None] * len(prompts)
        try:
            with tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm) as bar:
                while self.engine.has_unfinished:
                    for update in self.engine.step():
                        if update.finished:
                            i = order[update.seq.seq_id]
                            results[i] = self._output(update.seq, prompts[i])
                            bar.update(1)
        finally:
            # An interrupted call (Ctrl-C, an error in a step) must not leave its requests queued.
            for seq_id, i in order.items():
                if results[i] is None:
                    self.engine.abort(seq_id)
        return results  # type: ignore[return-value]

    # --- helpers --------------------------------------------------------------------------------------
    def _prompt_token_ids(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("A dict prompt needs a 'prompt_token_ids' list.")
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list | tuple):
                raise ValueError("'prompt_token_ids' must be a list of integers.")
            return list(ids)
        if not isinstance(prompt, str):
            raise ValueError(
                f"A prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}."
            )
        if self.engine.tokenizer is None:
            raise ValueError(
                f"{self.engine.config.model} has no tokenizer.json, so text prompts cannot be encoded; "
                "pass {'prompt_token_ids': [...]} instead."
            )
        if not prompt:
            raise ValueError("The prompt is empty; give at least one token.")
        return self.engine.tokenizer.encode(prompt)

    def _output(self, seq: EngineSequence, prompt: PromptType) -> RequestOutput:
        tok = self.engine.tokenizer
        token_ids = seq.output_token_ids
        text = tok.decode(token_ids) if tok is not None else ""
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = [logprob_entry(tok, token.token_id, token.logprob, token.top) for token in seq.output_tokens]
        completion = CompletionOutput(0, text, token_ids, seq.finish_reason, logprobs)
        return RequestOutput(
            request_id=seq.seq_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=list(seq.prompt_token_ids),
            outputs=[completion],
            finished=True,
            metrics=seq.metrics,
            prompt_logprobs=prompt_logprob_entries(seq, tok),
            num_cached_tokens=seq.num_cached_tokens,
        )


def logprob_entry(tokenizer, token_id: int, logprob: float, top) -> dict[int, Logprob]:
    """A token's {token id: Logprob}: the top (token id, logprob) pairs, best first, ranked from 1, then the token
    itself when it is not among them (rank None)."""
    entry = {t: Logprob(lp, rank=r, decoded_token=_decode_one(tokenizer, t)) for r, (t, lp) in enumerate(top, 1)}
    if token_id not in entry:
        entry[token_id] = Logprob(logprob, decoded_token=_decode_one(tokenizer, token_id))
    return entry


def prompt_logprob_entries(seq: EngineSequence, tokenizer) -> list[dict[int, Logprob] | None] | None:
    """RequestOutput.prompt_logprobs of a sequence whose prompt is prefilled: None without
    params.prompt_logprobs, else [None, then each prompt token's entry as logprob_entry makes it]."""
    if seq.params.prompt_logprobs is None:
        return None
    prompt = seq.prompt_token_ids
    entries: list[dict[int, Logprob] | None] = [None]
    for part in seq.prompt_logprobs:
        assert part.first == len(entries), "prompt logprobs arrive in position order"
        top_ids, top_lps = part.top_ids.tolist(), part.top_logprobs.tolist()
        for i, lp in enumerate(part.logprobs.tolist()):
            top = zip(top_ids[i], top_lps[i], strict=True)
            entries.append(logprob_entry(tokenizer, prompt[part.first + i], lp, top))
    return entries


def _decode_one(tokenizer, token_id: int) -> str | None:
    return None if tokenizer is None else tokenizer.decode([token_id], skip_special_tokens=False)
