"""KVAllocator: which token slots of the KV pool are free. Pure Python (the scheduler uses it without torch).

Slots are handed out in pages of `page_tokens` (1 for bf16/fp8/auto, the KIVI key group for int8/4/2):
a page is the unit a quantized key group is written in, so a page belongs to one sequence.
"""

from __future__ import annotations


class KVAllocator:
    """Free-page list over num_tokens slots; slot s lies in page s // page_tokens."""

    def __init__(self, num_tokens: int, page_tokens: int = 1):
        if page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
        if num_tokens < page_tokens:
            raise ValueError(f"KV pool of {num_tokens} tokens is smaller than one page of {page_tokens}")
        self.page_tokens = page_tokens
        self.num_pages = num_tokens // page_tokens
        self.num_tokens = self.num_pages * page_tokens
        # Pages pop from the end; start with low pages first for readable tests.
        self._free_pages = list(range(self.num_pages - 1, -1, -1))
        self._is_free = [True] * self.num_pages

    @property
    def num_free_tokens(self) -> int:
        return len(self._free_pages) * self.page_tokens

    @property
    def num_used_tokens(self) -> int:
        return self.num_tokens - self.num_free_tokens

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_tokens)

    def slots_needed(self, num_held_slots: int, new_len: int) -> int:
        """Slots a sequence holding num_held_slots must add to reach new_len tokens (whole pages)."""
        missing = new_len - num_held_slots
        return 0 if missing <= 0 else self.pages_for(missing) * self.page_tokens

    def can_alloc(self, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) <= len(self._free_pages)

    def alloc(self, num_tokens: int) -> list[int] | None:
        """Slots of ceil(num_tokens / page_tokens) whole pages, or None (nothing taken) if they do not fit."""
        if num_tokens < 0:
            raise ValueError(f"cannot allocate {num_tokens} tokens")
        num_pages = self.pages_for(num_tokens)
        if num_pages > len(self._free_pages):
            return None
        # The free list's tail, in pop order, as one slice: an 8K-token chunk's pages one pop and one extend each
        # cost ~5 ms of host time a prefill pass (H200 host, session 11's profile), on a long prompt's critical path.
        pages = self._free_pages[len(self._free_pages) - num_pages:]
        del self._free_pages[len(self._free_pages) - num_pages:]
        pages.reverse()
        is_free = self._is_free
        for page in pages:
            is_free[page] = False
        if self.page_tokens == 1:
            return pages
        size = self.page_tokens
        return [slot for page in pages for slot in range(page * size, page * size + size)]

    def free(self, slots: list[int]) -> None:
        """Return whole pages; slots must list each page's slots in order, page-aligned."""
        if len(slots) % self.page_tokens:
            raise ValueError(f"freeing {len(slots)} slots, not a multiple of the page size {self.page_tokens}")
        for start in range(0, len(slots), self.page_tokens):
            first = slots[start]
            page = first // self.page_tokens
            if first % self.page_tokens or not 0 <= page < self.num_pages:
                raise ValueError(f"slot {first} does not start a page of {self.page_tokens} in a pool of {self.num_pages}")
            if self._is_free[page]:
                raise ValueError(f"double free of KV page {page} (slot {first})")
            self._is_free[page] = True
            self._free_pages.append(page)
