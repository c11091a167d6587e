"""SSMSlotAllocator: which SSM state slots are free. Pure Python (the scheduler and radix cache use it)."""

from __future__ import annotations


class SSMSlotAllocator:
    """Slots 0..num_slots-1; a slot is either free or owned by one request or one cache checkpoint."""

    def __init__(self, num_slots: int):
        if num_slots < 0:
            raise ValueError(f"ssm slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._is_free = [True] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._is_free[slot] = False
        return slot

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"ssm slot {slot} outside 0..{self.num_slots - 1}")
        if self._is_free[slot]:
            raise ValueError(f"double free of ssm slot {slot}")
        self._is_free[slot] = True
        self._free.append(slot)
