"""The scheduler's side of the paged cache: which blocks each sequence holds (engine/blocks.py), the prefix cache's
entries (engine/prefix_cache.py), and the copies the next plan carries for every stage to make before its step
(window states saved and restored, block rows copied). The scheduler decides who runs and who is preempted; this
keeps the books of what they hold."""

from __future__ import annotations

from leanserve.engine.blocks import BlockPool
from leanserve.engine.prefix_cache import Hit, PrefixCache
from leanserve.engine.sequence import Sequence, SequenceStatus


class KvCacheManager:
    def __init__(self, pool: BlockPool, prefix: PrefixCache | None = None) -> None:
        self.pool, self.prefix = pool, prefix
        self._saves: list[tuple[int, int]] = []  # (slot, saved state)
        self._restores: list[tuple[int, int, int]] = []  # (saved state, slot, position)
        self._block_copies: list[tuple[int, int]] = []  # (block, block)

    def take_copies(self) -> tuple[tuple, tuple, tuple]:
        """The copies made since the last call, for the next plan: (saves, restores, block copies)."""
        copies = tuple(self._saves), tuple(self._restores), tuple(self._block_copies)
        self._saves, self._restores, self._block_copies = [], [], []
        return copies

    # --- blocks -------------------------------------------------------------------------------------------
    def grow(self, seq: Sequence, tokens: int) -> bool:
        """Gives seq the blocks for its first `tokens` positions (evicting prefix-cache entries if need be); False,
        taking none, when too few can be had."""
        need = self.pool.blocks_for(tokens) - len(seq.blocks)
        if need <= 0:
            return True
        if not self.make_free(need):
            return False
        seq.blocks.extend(self.pool.allocate(need))
        return True

    def make_free(self, need: int, keep: Hit | None = None) -> bool:
        """Whether `need` blocks are free, evicting prefix-cache entries (not `keep`'s) until they are."""
        while need > self.pool.num_free and self.prefix is not None and self.prefix.evict(keep and keep.entry):
            pass
        return need <= self.pool.num_free

    def owed(self, seq: Sequence) -> int:
        """Blocks seq will still take to hold every token it knows (0 once prefilled: decoding grows by preempting)."""
        if seq.num_computed_tokens >= seq.num_tokens - 1 and seq.status is SequenceStatus.RUNNING:
            return 0
        return max(0, self.pool.blocks_for(seq.num_tokens) - len(seq.blocks))

    def release(self, seq: Sequence) -> None:
        """seq's blocks given back (those the prefix cache holds too stay in use)."""
        self.pool.free(seq.blocks)
        seq.blocks = []
        seq.num_blocks_sent = 0

    # --- the prefix cache ----------------------------------------------------------------------------------
    def lookup(self, seq: Sequence) -> Hit | None:
        """The prefix-cache entry a waiting sequence can start from (None: none, or it may not: penalties and
        prompt logprobs need every prompt token in their own steps)."""
        p = seq.params
        if self.prefix is None or seq.num_computed_tokens or p.has_penalties or p.prompt_logprobs is not None:
            return None
        return self.prefix.lookup(seq.all_token_ids)

    def blocks_to_admit(self, seq: Sequence, hit: Hit | None) -> int:
        """Blocks a waiting sequence takes for all its tokens (a hit shares the entry's full blocks before it)."""
        return self.owed(seq) - (0 if hit is None else hit.start // self.pool.block_tokens)

    def admitted(self, seq: Sequence, hit: Hit | None) -> None:
        """seq (just given a slot) starts at hit.start when there is a hit: the entry's window state restored into
        its slot, its full blocks before that position shared, the block holding it copied. A fresh request's
        prefill also stops at the last block boundary it shares with a kept prefix, for the cache to keep."""
        if self.prefix is not None and not seq.num_output_tokens:
            self.prefix.record(seq.num_prompt_tokens, hit)
            seq.prefix_cut = self.prefix.shared_boundary(seq.prompt_token_ids, hit.start if hit else 0)
        if hit is None:
            return
        b = hit.start // self.pool.block_tokens
        shared = hit.entry.blocks[:b]
        self.pool.hold(shared)
        seq.blocks = shared + self.pool.allocate(1)
        self._restores.append((hit.entry.state, seq.slot, hit.start))
        self._block_copies.append((hit.entry.blocks[b], seq.blocks[b]))
        seq.num_computed_tokens = hit.start
        if not seq.num_output_tokens:
            seq.num_cached_tokens = hit.start

    def committed(self, seq: Sequence, fed_to: int, finished: bool) -> None:
        """After a step of seq that fed its tokens up to `fed_to`: the prefix cache keeps the cut points it reached
        (its prompt in, its prefix cut, its end), their window states saved from its slot before the next step."""
        if self.prefix is None:
            return
        if seq.prefix_cut and fed_to == seq.prefix_cut:
            self._keep(seq, seq.prefix_cut)
            seq.prefix_cut = 0
        if fed_to == seq.num_prompt_tokens and seq.num_output_tokens:
            self._keep(seq, seq.num_prompt_tokens)
        if finished and seq.num_computed_tokens > seq.num_prompt_tokens:
            self._keep(seq, seq.num_computed_tokens)

    def _keep(self, seq: Sequence, length: int) -> None:
        state = self.prefix.insert(seq.token_ids_between(0, length), seq.blocks)
        if state is not None:
            self._saves.append((seq.slot, state))
