"""How the scheduler sees the caches: a small Protocol, and a pure token-counting implementation of it.

The real engine adapts the KV pool, SSM slot pool and radix cache to `Capacity` (engine_capacity.py);
tests and the scheduling benchmark use `CountingCapacity`, which only counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from headroom.engine.scheduler.types import SchedRequest, ScheduledPass

if TYPE_CHECKING:
    from headroom.engine.scheduler.scheduler import Scheduler


class Capacity(Protocol):
    """Read-only view of the pools at the start of a pass. All counts are tokens or slots."""

    def free_kv_tokens(self) -> int:
        """KV token slots a request could take now (evictable prefix-cache pages included)."""
        ...

    def free_ssm_slots(self) -> int:
        """SSM state slots free for a newly admitted request."""
        ...

    def kv_tokens_to_extend(self, request: SchedRequest, num_new: int) -> int:
        """KV token slots that growing `request` by `num_new` positions takes (page rounding included)."""
        ...

    def cached_prefix_len(self, request: SchedRequest) -> int:
        """Leading tokens already in the prefix cache (0 when none or no cache)."""
        ...

    def kv_tokens_locked_by_admission(self, request: SchedRequest) -> int:
        """Evictable KV tokens of the request's cached prefix: free_kv_tokens counts them, and admitting the
        request locks them, so admission must pay for them (else it admits what then cannot reserve)."""
        ...

    def kv_tokens_freed_by_preemption(self, request: SchedRequest) -> int:
        """KV tokens free_kv_tokens gains once `request` is released (its own pages, and the part of its
        cached prefix nobody else holds), so a preemption pays for this very pass."""
        ...


def pages_to_extend(held_tokens: int, num_new: int, page_tokens: int) -> int:
    """Token slots, in whole pages of `page_tokens`, to grow a sequence from held_tokens by num_new."""
    pages_now = -(-held_tokens // page_tokens)
    pages_after = -(-(held_tokens + num_new) // page_tokens)
    return (pages_after - pages_now) * page_tokens


class CountingCapacity:
    """Pools as plain counters: `allocate` and `release` are called by whoever runs the passes.

    A cached prefix (set_cached_prefix) lives in the pool as evictable pages, as in the radix cache: counted
    as free until a request that uses it is admitted (then locked), and back to evictable on release.
    """

    def __init__(self, total_kv_tokens: int, total_ssm_slots: int, page_tokens: int = 1):
        if total_kv_tokens < 1 or total_ssm_slots < 1 or page_tokens < 1:
            raise ValueError(
                f"capacity needs total_kv_tokens={total_kv_tokens}, total_ssm_slots={total_ssm_slots}"
                f" and page_tokens={page_tokens} all >= 1"
            )
        self.total_kv_tokens = total_kv_tokens
        self.total_ssm_slots = total_ssm_slots
        self.page_tokens = page_tokens
        self._held_tokens: dict[str, int] = {}
        self._slot_holders: set[str] = set()
        self._cached_prefixes: dict[str, int] = {}
        self._locked_prefixes: dict[str, int] = {}

    def free_kv_tokens(self) -> int:
        used = sum(-(-held // self.page_tokens) * self.page_tokens for held in self._held_tokens.values())
        return self.total_kv_tokens - used - sum(self._locked_prefixes.values())

    def free_ssm_slots(self) -> int:
        return self.total_ssm_slots - len(self._slot_holders)

    def kv_tokens_to_extend(self, request: SchedRequest, num_new: int) -> int:
        return pages_to_extend(self._held_tokens.get(request.request_id, 0), num_new, self.page_tokens)

    def cached_prefix_len(self, request: SchedRequest) -> int:
        return min(self._cached_prefixes.get(request.request_id, 0), request.prompt_len - 1)

    def kv_tokens_locked_by_admission(self, request: SchedRequest) -> int:
        return self.cached_prefix_len(request)

    def kv_tokens_freed_by_preemption(self, request: SchedRequest) -> int:
        held = self._held_tokens.get(request.request_id, 0)
        return -(-held // self.page_tokens) * self.page_tokens + self._locked_prefixes.get(request.request_id, 0)

    def set_cached_prefix(self, request_id: str, num_tokens: int) -> None:
        """Pretend num_tokens of the request's prompt sit in the pool as evictable cache pages."""
        self._cached_prefixes[request_id] = num_tokens

    def allocate(self, request: SchedRequest, num_new: int) -> None:
        """Take KV for `num_new` more positions of `request` (and its SSM slot on first use)."""
        needed = self.kv_tokens_to_extend(request, num_new)
        if request.request_id not in self._slot_holders:
            needed += request.num_cached
        if needed > self.free_kv_tokens():
            raise RuntimeError(
                f"KV pool over-committed: request {request.request_id} needs {needed} tokens,"
                f" {self.free_kv_tokens()} free of {self.total_kv_tokens}"
            )
        if request.request_id not in self._slot_holders:
            # First allocation after admission: the cached prefix it starts from is locked now.
            self._locked_prefixes[request.request_id] = request.num_cached
            if self.free_ssm_slots() < 1:
                raise RuntimeError(f"SSM slots over-committed: all {self.total_ssm_slots} are held")
            self._slot_holders.add(request.request_id)
        # Cached prefix pages belong to the prefix cache, so a request holds only what it computed.
        self._held_tokens[request.request_id] = self._held_tokens.get(request.request_id, 0) + num_new

    def release(self, request: SchedRequest) -> None:
        self._held_tokens.pop(request.request_id, None)
        self._locked_prefixes.pop(request.request_id, None)
        self._slot_holders.discard(request.request_id)


def run_counted_pass(scheduler: Scheduler, capacity: CountingCapacity) -> ScheduledPass:
    """One pass without a model, for tests and simulations: schedule, account memory, finish at max_new_tokens."""
    plan = start_counted_pass(scheduler, capacity, scheduler.schedule())
    finish_counted_pass(scheduler, capacity, plan)
    return plan


def start_counted_pass(scheduler: Scheduler, capacity: CountingCapacity, plan: ScheduledPass) -> ScheduledPass:
    """Before `plan` runs (schedule()'s, or an interjection's): release what it preempted and take its memory,
    as the engine reserves a pass's KV before running it."""
    for request in plan.preempted:
        capacity.release(request)
    for item in plan.items:
        capacity.allocate(item.request, item.num_tokens)
    return plan


def finish_counted_pass(scheduler: Scheduler, capacity: CountingCapacity, plan: ScheduledPass) -> set[str]:
    """After `plan` ran: complete it, finishing requests at max_new_tokens; returns their ids (released)."""
    finished = {item.request.request_id for item in plan.items
                if item.samples and item.request.num_generated + 1 >= item.request.max_new_tokens}
    scheduler.complete(plan, finished)
    for item in plan.items:
        if item.request.request_id in finished:
            capacity.release(item.request)
    return finished
