"""Incremental detokenization: a stream of token ids to text, each id costing O(1) decode work (not O(n)).

As vLLM's and HF TextStreamer's: a short window of recent ids is re-decoded (from a "prefix" offset, so a
decoder that treats a window's first token specially, e.g. a leading space, still joins right), and the text
the newest ids add is released, except a trailing incomplete UTF-8 character (U+FFFD until its last byte
arrives), which is held back. The concatenated releases equal `tokenizer.decode(all ids)` for byte-level
tokenizers. The text length after each token (its end offset) is known as a by-product.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"
# A window that has not ended on a complete character for this many ids is garbage bytes, not a character
# being spelled out (at most 4 bytes, each id at least one): it is cut there, so the cost stays bounded.
_MAX_UNREAD = 8


class IncrementalDetokenizer:
    """Feed ids with `add` (returns the text they complete, possibly ""); `flush` at the end returns what was
    held back. `length` is the text released so far; `ends[i]` the text length after the i-th id (ids in
    `drop_ids` are never decoded: they add no text but still get an end offset)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, drop_ids: frozenset[int] = frozenset()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.drop_ids = drop_ids
        self.ids: list[int] = []  # the decoded ids (without drop_ids)
        self.ends: list[int] = []  # text length after each id given to add (drop_ids included)
        self.length = 0
        self._prefix = 0  # ids[_prefix:_read] were released already; decoded again only for context
        self._read = 0
        self._prefix_text = ""  # decode(ids[_prefix:_read])
        self._partial = 0  # characters released past _prefix_text while the window ends mid-character

    def add(self, token_id: int) -> str:
        out = "" if token_id in self.drop_ids else self._step(token_id)
        self.length += len(out)
        self.ends.append(self.length)
        return out

    def flush(self) -> str:
        """The held-back text (an incomplete character: U+FFFD, as a full decode shows it); the last id's end
        offset then covers it."""
        if self._read == len(self.ids):
            return ""
        out = self._release(self._decode(self.ids[self._prefix :]), cut=True)
        self.length += len(out)
        if self.ends:
            self.ends[-1] = self.length
        return out

    def _step(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self._decode(self.ids[self._prefix :])
        cut = not text.endswith(_REPLACEMENT) or len(self.ids) - self._read > _MAX_UNREAD
        return self._release(text, cut)

    def _release(self, text: str, cut: bool) -> str:
        start = len(self._prefix_text) + self._partial
        if cut:  # the window ends on a character boundary: what follows starts a new window
            out = text[start:]
            self._prefix, self._read, self._partial = self._read, len(self.ids), 0
            self._prefix_text = self._decode(self.ids[self._prefix : self._read])
        else:  # all but the incomplete last character
            out = text[start : len(text) - 1]
            self._partial += len(out)
        return out

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
