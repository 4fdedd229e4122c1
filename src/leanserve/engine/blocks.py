"""The blocks of a stage's paged caches (model/cache.py), handed out by the scheduler on the first stage.

A block holds the compressed rows of `block_tokens` consecutive tokens of one sequence, in every layer of every
stage (each stage allocates the same number of blocks, sized by the smallest stage's share of the budget). A
running sequence holds the blocks for the positions it has written; it returns them when it finishes, is
aborted or is preempted. A freed block is reused without clearing: a sequence only reads rows it wrote.
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
        return taken

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
