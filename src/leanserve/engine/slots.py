import heapq


class CacheSlots:
    """Hands out indices into the per-slot cache tensors that the model allocates once.

    Each running sequence holds exactly one slot. A freed slot's memory is not zeroed: the cache state
    of a sequence is a function of its committed token count, so stale data past it is never read.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}.")
        self.num_slots = num_slots
        # Min-heap of free indices so allocate() always returns the lowest one (deterministic layouts).
        self._free: list[int] = list(range(num_slots))
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} cache slots are in use")
        slot = heapq.heappop(self._free)
        self._allocated.add(slot)
        return slot

    def free(self, slot: int) -> None:
        assert slot in self._allocated, f"cache slot {slot} is not allocated"
        self._allocated.remove(slot)
        heapq.heappush(self._free, slot)
