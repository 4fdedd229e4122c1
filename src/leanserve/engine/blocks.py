"""The blocks of a stage's paged caches (model/cache.py), handed out by the scheduler on the first stage.

A block holds the compressed rows of `block_tokens` consecutive tokens of one sequence, in every layer of every
stage (each stage allocates the same number of blocks, sized by the smallest stage's share of the budget). A
running sequence holds the blocks for the positions it has written; the prefix cache (engine/prefix_cache.py)
holds the blocks of the prefixes it keeps. A block is counted once per holder and is free when none holds it; a
freed block is reused without clearing: a sequence only reads rows it wrote, or rows of a prefix it shares.
"""

from __future__ import annotations


class BlockPool:
    def __init__(self, num_blocks: int, block_tokens: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}.")
        self.num_blocks, self.block_tokens = num_blocks, block_tokens
        # A stack with the lowest block on top: allocation order is deterministic, and a step's new blocks are
        # mostly consecutive.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._holders = [0] * num_blocks  # per block: how many sequences and prefix-cache entries hold it

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        """Blocks a sequence of `tokens` positions holds."""
        return -(-tokens // self.block_tokens)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"{n} blocks asked for, {len(self._free)} free")
        taken = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        taken.reverse()
        for b in taken:
            self._holders[b] = 1
        return taken

    def hold(self, blocks: list[int]) -> None:
        """One more holder for each of `blocks` (all in use)."""
        for b in blocks:
            assert self._holders[b] > 0, f"block {b} is free"
            self._holders[b] += 1

    def free(self, blocks: list[int]) -> None:
        """One holder fewer for each of `blocks`; those nobody holds any more are free."""
        for b in reversed(blocks):
            assert self._holders[b] > 0, f"block {b} is already free"
            self._holders[b] -= 1
            if self._holders[b] == 0:
                self._free.append(b)
