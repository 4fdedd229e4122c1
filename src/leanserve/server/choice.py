"""One choice being generated: its token ids, the text released so far, stop strings and logprob entries."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Choice:
    """One choice being generated: its token ids, the text released so far, stop-string handling."""

    index: int
    prompt_tokens: int
    stop: list[str]
    tokenizer: object
    token_ids: list[int] = dataclasses.field(default_factory=list)
    sent: int = 0  # characters of text released
    finish_reason: str | None = None
    ends: list[int] = dataclasses.field(default_factory=list)  # text length after each token (when tracked)
    pending: list[dict] = dataclasses.field(default_factory=list)  # logprob entries not yet released
    released_tokens: int = 0

    def add(self, tokens, finish_reason: str | None) -> tuple[str, list[dict]]:
        """Takes a delta; returns the text now safe to release and the logprob entries of the tokens whose
        text is released. Text that may still turn into a stop string, or an incomplete UTF-8 character, is
        held back. A stop string cuts the text before it, and the tokens after the one completing it."""
        first = len(self.token_ids)
        for t in tokens:
            self.token_ids.append(t.token_id)
            if t.logprob is not None:
                top = [(self._piece(i), lp) for i, lp in t.top]
                self.pending.append({"token": self._piece(t.token_id), "logprob": t.logprob, "top": top})
        text = self._decode(self.token_ids)
        if self.stop or self.pending:  # where each new token's text ends (the last one ends the text)
            self.ends += [len(self._decode(self.token_ids[:i])) for i in range(first + 1, len(self.token_ids))]
            self.ends += [len(text)] if tokens else []
        for s in self.stop:
            at = text.find(s, max(0, self.sent - len(s) + 1))
            if at >= 0:
                keep = next((i + 1 for i, end in enumerate(self.ends) if end >= at + len(s)), len(self.token_ids))
                del self.token_ids[keep:], self.ends[keep:]
                del self.pending[max(0, keep - self.released_tokens) :]
                text, finish_reason = text[:at], "stop"
                self.finish_reason = "stop"
        if finish_reason is not None:
            self.finish_reason = self.finish_reason or finish_reason
            release = len(text)
        else:
            hold = max((len(s) - 1 for s in self.stop), default=0)
            release = len(text) - hold
            while release > self.sent and text[release - 1] == "\ufffd":  # an incomplete UTF-8 character
                release -= 1
        out = text[self.sent : max(release, self.sent)]
        self.sent = max(release, self.sent)
        # Logprob entries go out with their token's text (all of them once the choice is done).
        n = len(self.pending)
        if not self.done and self.ends:
            n = sum(1 for end in self.ends[self.released_tokens : self.released_tokens + n] if end <= self.sent)
        entries, self.pending = self.pending[:n], self.pending[n:]
        self.released_tokens += n
        return out, entries

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def _piece(self, token_id: int) -> str:
        return (
            self.tokenizer.decode([token_id], skip_special_tokens=False)
            if self.tokenizer is not None
            else str(token_id)
        )

    @property
    def done(self) -> bool:
        return self.finish_reason is not None
