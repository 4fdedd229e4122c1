"""Exact prefix caching over the paged cache: a request whose first tokens are a prefix the engine has already
computed starts after them.

What a sequence's cache holds after its first c tokens is a function of those tokens alone: the compressed
rows of the windows closed by then (in its blocks: engine/blocks.py), and the window state (the sliding-window
ring, the compressors' and the indexer's rings of raw projections, the MTP layer's ring: a slot's per-slot
tensors, model/cache.py). An entry keeps both for one prefix: the blocks covering [0, c) (held, so that they
outlive the sequence), and a copy of the window state at c in one of `num_states` saved states. Entries are
made at the cut points that matter: when a request's prompt is in (c = its prompt length) and when it finishes
(c = its committed tokens: prompt and output but the last token). A conversation's next turn shares the last
turn's prompt and output; a request sent again shares its prompt.

A request that starts with an entry's c tokens (verified token for token; the hash only finds candidates)
starts at c - 1: its slot gets the saved state, it shares the entry's full blocks before the one holding
position c - 1, gets a copy of that block (it will write rows there), and prefills from position c - 1. The
last matched token is fed again so that the step computes its logits (the first output token is sampled from
them) and its MTP entry from the request's own next token; every entry it rewrites is addressed by position, so
the restored state at c is the state at c - 1 plus what that step writes again. Nothing a borrower writes is
shared: full blocks before position c - 1 hold only rows of windows closed before it.

A prefix that several requests share but none ended at (a long system prompt before different questions) is
found at block granularity: a request whose tokens share the first m blocks with a kept prefix, beyond its own
hit, ends a prefill chunk at that block boundary (`shared_boundary`), and an entry is made there, so that the
requests after it hit.

Entries are evicted least recently used when a saved state or blocks are needed. Requests with penalties or
prompt logprobs never hit (they need every prompt position's tokens or logits in their own step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from leanserve.engine.blocks import BlockPool

# The prefix hash's multiplier (odd: its powers never vanish modulo 2^64).
_K = np.uint64(0x9E3779B97F4A7C15)


def prefix_hashes(tokens: np.ndarray) -> np.ndarray:
    """[n + 1] uint64: the hash of every prefix tokens[:c], c = 0..n (sum of (t_i + 1) * K^i modulo 2^64, so one
    pass gives them all)."""
    n = len(tokens)
    powers = np.full(n, _K, dtype=np.uint64)
    if n:
        powers[0] = 1
        powers = np.cumprod(powers, dtype=np.uint64)
    out = np.zeros(n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        np.cumsum((tokens.astype(np.uint64) + np.uint64(1)) * powers, dtype=np.uint64, out=out[1:])
    return out


@dataclass(eq=False)  # (compared by identity)
class Entry:
    tokens: np.ndarray  # the prefix, int64 [c]
    state: int  # its saved window state
    blocks: list[int]  # the blocks holding its rows, blocks_for(c) of them
    last_used: int = 0

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class Hit:
    entry: Entry
    start: int  # the position the request starts at (c - 1): its cached tokens


@dataclass
class PrefixCache:
    pool: BlockPool
    num_states: int
    entries: dict[tuple[int, int], Entry] = field(default_factory=dict)  # (c, hash of the prefix) -> entry
    queries: int = 0  # prompt tokens of the requests looked up
    hits: int = 0  # tokens they found cached
    hashes = staticmethod(prefix_hashes)  # (a test makes them collide)

    def __post_init__(self) -> None:
        self._free_states = list(range(self.num_states - 1, -1, -1))
        self._lengths: dict[int, int] = {}  # c -> how many entries have it
        self._clock = 0
        # (block boundary b, hash of the first b tokens) of every entry's boundaries -> the entries with it
        self._boundaries: dict[tuple[int, int], list[Entry]] = {}

    def _boundary_keys(self, entry: Entry, hashes: np.ndarray) -> list[tuple[int, int]]:
        step = self.pool.block_tokens
        return [(b, int(hashes[b])) for b in range(step, entry.length, step)]

    def shared_boundary(self, tokens: list[int], beyond: int) -> int:
        """The furthest block boundary b > beyond, b < len(tokens) - 1, such that tokens[:b] starts a kept prefix;
        0 when there is none."""
        step = self.pool.block_tokens
        ids = np.asarray(tokens, dtype=np.int64)
        hashes = self.hashes(ids)
        for b in range((len(ids) - 2) // step * step, beyond, -step):
            for entry in self._boundaries.get((b, int(hashes[b])), ()):
                if np.array_equal(entry.tokens[:b], ids[:b]):
                    return b
        return 0

    @property
    def num_entries(self) -> int:
        return len(self.entries)

    def record(self, prompt_tokens: int, hit: Hit | None) -> None:
        """Counts a request admitted after a lookup (the hit it took, if any)."""
        self.queries += prompt_tokens
        self.hits += 0 if hit is None else hit.start

    def lookup(self, tokens: list[int]) -> Hit | None:
        """The longest entry whose prefix starts `tokens` (at least 2 tokens, so that one is left to skip)."""
        ids = np.asarray(tokens, dtype=np.int64)
        hashes = self.hashes(ids)
        for c in sorted((c for c in self._lengths if 2 <= c <= len(ids)), reverse=True):
            entry = self.entries.get((c, int(hashes[c])))
            if entry is not None and np.array_equal(entry.tokens, ids[:c]):
                self._touch(entry)
                return Hit(entry, c - 1)
        return None

    def insert(self, tokens: list[int], blocks: list[int]) -> int | None:
        """Keeps the prefix `tokens` whose rows are in `blocks`: the saved state to copy its window state into,
        or None when it is kept already or no state can be freed."""
        ids = np.asarray(tokens, dtype=np.int64)
        c = len(ids)
        if c < 2:
            return None
        key = (c, int(self.hashes(ids)[c]))
        old = self.entries.get(key)
        if old is not None:
            if np.array_equal(old.tokens, ids):
                self._touch(old)
                return None
            self._drop(key)  # (a different prefix with the same hash: the newer one stays)
        if not self._free_states and not self.evict():
            return None
        held = blocks[: self.pool.blocks_for(c)]
        self.pool.hold(held)
        entry = Entry(ids, self._free_states.pop(), held)
        self.entries[key] = entry
        for k in self._boundary_keys(entry, self.hashes(ids)):
            self._boundaries.setdefault(k, []).append(entry)
        self._lengths[c] = self._lengths.get(c, 0) + 1
        self._touch(entry)
        return entry.state

    def evict(self, keep: Entry | None = None) -> bool:
        """Drops the least recently used entry (not `keep`); False when there is none."""
        candidates = [(e.last_used, k) for k, e in self.entries.items() if e is not keep]
        if not candidates:
            return False
        self._drop(min(candidates)[1])
        return True

    def clear(self) -> None:
        for key in list(self.entries):
            self._drop(key)

    def _drop(self, key: tuple[int, int]) -> None:
        entry = self.entries.pop(key)
        for k in self._boundary_keys(entry, self.hashes(entry.tokens)):
            held = self._boundaries[k]
            held.remove(entry)
            if not held:
                del self._boundaries[k]
        self.pool.free(entry.blocks)
        self._free_states.append(entry.state)
        c = key[0]
        self._lengths[c] -= 1
        if not self._lengths[c]:
            del self._lengths[c]

    def _touch(self, entry: Entry) -> None:
        self._clock += 1
        entry.last_used = self._clock
