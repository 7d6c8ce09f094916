"""SlotManager: hands out the state pool's slots, one per running sequence.

The model's ``MambaStatePool`` has ``num_slots + 1`` lines per layer; line 0 is the null
line padded rows point at (``NULL_BLOCK_ID``), so the slots handed out are the lines
``1 .. num_slots``. A freed slot
needs no clearing: the next sequence in it starts with ``has_initial_state`` False, which
makes the kernels ignore the line's old contents.
"""

from __future__ import annotations


class SlotManager:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        # Lowest slots first (popped from the end), so a quiet engine touches few cache lines.
        self._free = list(range(num_slots, 0, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free state slot (the scheduler must check num_free first)")
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"slot {slot} is not in use (double free?)")
        self._used.remove(slot)
        self._free.append(slot)
