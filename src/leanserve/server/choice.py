"""One choice being generated: its token ids, the text released so far, stop strings and logprob entries."""

from __future__ import annotations

import bisect
import dataclasses

from leanserve.server.detokenizer import IncrementalDetokenizer


@dataclasses.dataclass
class Choice:
    """One choice being generated: its token ids, the text released so far, stop-string handling.

    Each token costs O(1) however long the output is: the text is decoded incrementally, and stop strings are
    looked for in the new text only (plus the tail before it that a stop string could start in).
    keep_special: special tokens (e.g. chat markup such as `</think>`) are decoded into the text, not skipped.
    drop_ids: ids never decoded into the text (e.g. the EOS the engine ends a request with); they still count
    as tokens."""

    index: int
    prompt_tokens: int
    stop: list[str]
    tokenizer: object
    keep_special: bool = False
    drop_ids: frozenset[int] = frozenset()
    token_ids: list[int] = dataclasses.field(default_factory=list)
    sent: int = 0  # characters of text released
    finish_reason: str | None = None
    ends: list[int] = dataclasses.field(default_factory=list)  # text length after each token
    pending: list[dict] = dataclasses.field(default_factory=list)  # logprob entries not yet released
    released_tokens: int = 0
    prompt_logprobs: list | None = None  # RequestOutput.prompt_logprobs' entries, when the request asked
    cached_tokens: int = 0  # prompt tokens the prefix cache gave it

    def __post_init__(self) -> None:
        self._detok = (
            IncrementalDetokenizer(self.tokenizer, not self.keep_special, self.drop_ids)
            if self.tokenizer is not None
            else None
        )
        self._length = 0  # characters of text decoded (released or held)
        self._held = ""  # decoded, not yet released: text[sent:]
        self._hold = max((len(s) - 1 for s in self.stop), default=0)  # what may still turn into a stop string
        self._tail = ""  # the last `_hold` released characters, where a stop string may begin

    def add(self, tokens, finish_reason: str | None) -> tuple[str, list[dict]]:
        """Takes a delta; returns the text now safe to release and the logprob entries of the tokens whose
        text is released. Text that may still turn into a stop string, or an incomplete UTF-8 character, is
        held back. A stop string cuts the text before it, and the tokens after the one completing it."""
        if self.done:
            return "", []
        new = []
        for t in tokens:
            self.token_ids.append(t.token_id)
            if t.logprob is not None:
                top = [(self.piece(i), lp) for i, lp in t.top]
                self.pending.append({"token": self.piece(t.token_id), "logprob": t.logprob, "top": top})
            if self._detok is not None:
                new.append(self._detok.add(t.token_id))
                self._length = self._detok.length
            self.ends.append(self._length)
        if finish_reason is not None and self._detok is not None:  # the last token ends the text
            new.append(self._detok.flush())
            self._length = self._detok.length
            if self.ends:
                self.ends[-1] = self._length
        if new:
            self._held += "".join(new)
        text = self._held  # text[sent:]
        if self.stop:
            at, s = self._find_stop()
            if s is not None:
                keep = min(bisect.bisect_left(self.ends, at + len(s)) + 1, len(self.token_ids))
                del self.token_ids[keep:], self.ends[keep:]
                del self.pending[max(0, keep - self.released_tokens) :]
                text, finish_reason = text[: max(0, at - self.sent)], "stop"
                self.finish_reason = "stop"
        if finish_reason is not None:
            self.finish_reason = self.finish_reason or finish_reason
            out = text
        else:
            out = text[: max(0, len(text) - self._hold)]
        self._held = text[len(out) :]
        self.sent += len(out)
        if self._hold and out:
            self._tail = (self._tail + out)[-self._hold :]
        # Logprob entries go out with their token's text (all of them once the choice is done).
        n = len(self.pending)
        if not self.done and self.ends:
            n = sum(1 for end in self.ends[self.released_tokens : self.released_tokens + n] if end <= self.sent)
        entries, self.pending = self.pending[:n], self.pending[n:]
        self.released_tokens += n
        return out, entries

    def _find_stop(self) -> tuple[int, str | None]:
        """The stop string completed first in the unreleased text (with the released tail it may start in):
        (its start in the whole text, it), or (-1, None)."""
        window = self._tail + self._held
        base = self.sent - len(self._tail)  # where the window starts in the whole text
        best, best_s = -1, None
        for s in self.stop:
            at = window.find(s, max(0, len(self._tail) - len(s) + 1))
            if at >= 0 and (best_s is None or at + len(s) < best + len(best_s)):
                best, best_s = at, s
        return (base + best, best_s) if best_s is not None else (-1, None)

    def piece(self, token_id: int) -> str:
        return (
            self.tokenizer.decode([token_id], skip_special_tokens=False)
            if self.tokenizer is not None
            else str(token_id)
        )

    @property
    def done(self) -> bool:
        return self.finish_reason is not None
