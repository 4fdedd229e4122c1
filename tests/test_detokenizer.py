"""Incremental detokenization (server/detokenizer.py) and the server's Choice over it: the streamed text is
exactly the full decode, for the shipped tokenizer, multi-byte characters split across tokens included; stop
strings cut the text and the tokens as before."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from leanserve.server.choice import Choice
from leanserve.server.detokenizer import IncrementalDetokenizer
from leanserve.tokenizer import Tokenizer

SHIPPED = Path(__file__).resolve().parent.parent / "models" / "dsv4-stdlib-12l"
TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "héllo wörld — “quotes” 日本語のテキスト 🎉🎉 emoji ∑∫√ and more",
    "for i in range(10):\n    print(i, 'ü€', i * 2)  # naïve café\n" * 3,
    "\U0001f600\U0001f680\u4e2d\u6587 a\u00e9b \u0416\u0438\u0437\u043d\u044c",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(SHIPPED)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> str:
    return "".join(detok.add(i) for i in ids) + detok.flush()


def test_the_shipped_tokenizer_splits_characters_across_tokens(tok):
    # (what the cases below rely on: some token's bytes are only part of a character)
    pieces = [tok.decode([i]) for t in TEXTS for i in tok.encode(t, add_special_tokens=False)]
    assert any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_decode_is_the_full_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    released = []
    for i in ids:
        piece = detok.add(i)
        assert "\ufffd" not in piece  # an incomplete character is held back, never sent as U+FFFD
        released.append(piece)
    assert "".join(released) + detok.flush() == tok.decode(ids) == text
    # Each token's end offset: the text so far after it; the last one ends the text.
    assert detok.ends[-1] == len(text) and detok.ends == sorted(detok.ends) and len(detok.ends) == len(ids)
    prefixes = [tok.decode(ids[: k + 1]) for k in range(len(ids))]
    for end, prefix in zip(detok.ends, prefixes, strict=True):
        assert text[:end] == prefix.rstrip("\ufffd")


def test_special_tokens_kept_or_skipped_and_dropped_ids(tok):
    eos, bos = tok.token_to_id("<eos>"), tok.token_to_id("<bos>")
    body = tok.encode(TEXTS[1], add_special_tokens=False)
    ids = [bos, *body[:7], eos, *body[7:], eos]
    assert stream(IncrementalDetokenizer(tok), ids) == tok.decode(ids)
    kept = stream(IncrementalDetokenizer(tok, skip_special_tokens=False), ids)
    assert kept == tok.decode(ids, skip_special_tokens=False) and kept.startswith("<bos>") and kept.endswith("<eos>")
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False, drop_ids=frozenset({eos}))
    dropped = stream(detok, ids)
    assert dropped == tok.decode([i for i in ids if i != eos], skip_special_tokens=False)
    assert "<eos>" not in dropped and len(detok.ends) == len(ids) and detok.ends[-1] == len(dropped)


def test_random_ids_decode_as_the_full_decode(tok):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        for keep in (False, True):
            detok = IncrementalDetokenizer(tok, skip_special_tokens=not keep, drop_ids=frozenset({1}))
            assert stream(detok, ids) == tok.decode([i for i in ids if i != 1], skip_special_tokens=not keep)


# --- Choice ---------------------------------------------------------------------------------------------
def tokens(ids: list[int], logprobs: bool = False) -> list:
    return [SimpleNamespace(token_id=i, logprob=-0.5 if logprobs else None, top=()) for i in ids]


def run_choice(choice: Choice, ids: list[int], sizes: list[int], finish: str = "length", logprobs: bool = False):
    """Feeds `ids` in deltas of `sizes` tokens (the last with `finish`) as the server does; returns the released
    text pieces and the released logprob entries' tokens."""
    pieces, entries, i = [], [], 0
    for k in sizes:
        if choice.done:
            break
        delta, i = ids[i : i + k], i + k
        text, new = choice.add(tokens(delta, logprobs), finish if i >= len(ids) else None)
        pieces.append(text)
        entries += [e["token"] for e in new]
    return pieces, entries


# Choice as it was before the incremental detokenizer (it decoded every id so far on every delta), for the
# same output on the cases below.
class OldChoice(Choice):
    def add(self, tokens, finish_reason):
        first = len(self.token_ids)
        for t in tokens:
            self.token_ids.append(t.token_id)
            if t.logprob is not None:
                self.pending.append({"token": self.piece(t.token_id), "logprob": t.logprob, "top": []})
        text = self.tokenizer.decode(self.token_ids)
        self.ends[first:] = [
            len(self.tokenizer.decode(self.token_ids[:i])) for i in range(first + 1, len(self.token_ids))
        ]
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
            release = len(text) - max((len(s) - 1 for s in self.stop), default=0)
            while release > self.sent and text[release - 1] == "\ufffd":
                release -= 1
        out = text[self.sent : max(release, self.sent)]
        self.sent = max(release, self.sent)
        n = len(self.pending)
        if not self.done and self.ends:
            n = sum(1 for end in self.ends[self.released_tokens : self.released_tokens + n] if end <= self.sent)
        entries, self.pending = self.pending[:n], self.pending[n:]
        self.released_tokens += n
        return out, entries


CODE = TEXTS[0]


@pytest.mark.parametrize(
    "stop, sizes",
    [
        (["fibonacci(n - 1)"], [1] * 200),  # a stop string spread over several tokens, one token per delta
        (["fibonacci(n - 1)"], [3] * 70),  # ... several tokens per delta
        (["return n\n", "if"], [2] * 100),  # the earlier of two
        (["def"], [1] * 200),  # in the first token
        (["def fib"], [5] * 40),  # completed within the first delta
        (["never there"], [1] * 200),  # no stop: all of it, finish "length"
        ([], [4] * 50),
    ],
)
def test_choice_stop_strings_as_before(tok, stop, sizes):
    ids = tok.encode(CODE, add_special_tokens=False)
    new, old = Choice(0, 3, list(stop), tok), OldChoice(0, 3, list(stop), tok)
    new_pieces, new_entries = run_choice(new, ids, sizes, logprobs=True)
    old_pieces, old_entries = run_choice(old, ids, sizes, logprobs=True)
    assert "".join(new_pieces) == "".join(old_pieces)
    assert new.finish_reason == old.finish_reason and new.token_ids == old.token_ids
    assert new_entries == old_entries and len(new_entries) == len(new.token_ids)
    cut = min((CODE.index(s) for s in stop if s in CODE), default=len(CODE))
    assert "".join(new_pieces) == CODE[:cut]
    assert new.finish_reason == ("stop" if cut < len(CODE) else "length")


def test_choice_holds_back_a_split_character_and_finds_a_stop_string_next_to_one(tok):
    text = TEXTS[1]
    ids = tok.encode(text, add_special_tokens=False)
    pieces, _ = run_choice(Choice(0, 3, [], tok), ids, [1] * len(ids))
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    stop = "s” 日"  # right after multi-byte characters, ending in one
    pieces, _ = run_choice(c := Choice(0, 3, [stop], tok), ids, [1] * len(ids))
    assert "".join(pieces) == text[: text.index(stop)] and c.finish_reason == "stop"
    assert tok.decode(c.token_ids).endswith(stop)  # up to the token completing it, no further
    assert not tok.decode(c.token_ids[:-1]).endswith(stop)


def test_choice_keep_special_and_drop_ids(tok):
    eos = tok.token_to_id("<eos>")
    ids = [*tok.encode("x = 1\n", add_special_tokens=False), eos]
    pieces, _ = run_choice(c := Choice(0, 3, [], tok, keep_special=True), ids, [1] * len(ids), finish="stop")
    assert "".join(pieces) == "x = 1\n<eos>" and c.finish_reason == "stop"
    pieces, _ = run_choice(
        c := Choice(0, 3, [], tok, keep_special=True, drop_ids=frozenset({eos})), ids, [1] * len(ids), finish="stop"
    )
    assert "".join(pieces) == "x = 1\n" and c.token_ids == ids  # dropped from the text, still a token
    pieces, _ = run_choice(Choice(0, 3, [], tok), ids, [1] * len(ids), finish="stop")
    assert "".join(pieces) == "x = 1\n"  # special tokens skipped by default


def test_choice_cost_per_token_does_not_grow_with_the_output(tok, monkeypatch):
    # O(1) decode work per token: every decode call sees a short window, however long the output.
    seen = []
    decode = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: seen.append(len(ids)) or decode(ids, **kw))
    ids = tok.encode(CODE * 40, add_special_tokens=False)
    assert len(ids) > 1000
    pieces, _ = run_choice(Choice(0, 3, ["never there"], tok), ids, [1] * len(ids))
    assert "".join(pieces) == CODE * 40 and max(seen) <= 8
