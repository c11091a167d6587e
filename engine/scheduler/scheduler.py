"""Fair continuous-batching scheduler: every pass carries the running decodes plus prefill chunks.

Pure Python; capacity is read through `Capacity` so the same code runs in the engine, the tests and
the scheduling benchmark. The loop calling it: schedule() -> release `preempted`, allocate and run
the pass -> complete(pass, finished_ids) -> release finished requests.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections import Counter

from headroom.engine.scheduler.capacity import Capacity
from headroom.engine.scheduler.prefill import PrefillPlanner
from headroom.engine.scheduler.types import Phase, SchedRequest, ScheduledPass, SchedulerConfig

logger = logging.getLogger("headroom.scheduler")


class Scheduler:
    """Owns the waiting queue (arrival order) and the running list (admission order)."""

    def __init__(self, config: SchedulerConfig, capacity: Capacity):
        self.config = config
        self.capacity = capacity
        self.waiting: list[SchedRequest] = []
        self.running: list[SchedRequest] = []
        self.rejections: Counter[str] = Counter()
        self.num_preemptions = 0
        self._arrivals = itertools.count()

    def add(self, request: SchedRequest) -> None:
        request.arrival_seq = next(self._arrivals)
        self.waiting.append(request)

    def abort(self, request_id: str) -> SchedRequest | None:
        """Forget a request wherever it is; the caller releases its KV pages and SSM slot."""
        for queue in (self.waiting, self.running):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    return request
        return None

    @property
    def num_prefilling(self) -> int:
        return sum(1 for r in self.running if r.phase is Phase.PREFILL)

    @property
    def num_decoding(self) -> int:
        return sum(1 for r in self.running if r.phase is Phase.DECODE)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledPass:
        """Plan the next pass. Preempted requests are back in the waiting queue; release their memory."""
        plan = ScheduledPass()
        free_kv = self.capacity.free_kv_tokens()
        free_kv -= self._schedule_decodes(plan, free_kv)
        budget = self._prefill_budget(len(plan.decodes))
        plan.prefill_budget = budget
        PrefillPlanner(self, plan, budget, free_kv).run()
        if plan.is_empty and not plan.preempted and len(self.running) > 1:
            # Everyone holds pages and nobody can grow: free the newest so the others can finish.
            self._preempt(plan, self.running[-1])
        return plan

    def complete(self, plan: ScheduledPass, finished_ids: set[str] | frozenset[str] = frozenset()) -> None:
        """Record that `plan` ran; requests in finished_ids leave (the caller releases their memory)."""
        for item in plan.items:
            request = item.request
            request.num_computed = item.start + item.num_tokens
            if item.samples:
                request.num_generated += 1
                request.phase = Phase.DECODE
        self.running = [r for r in self.running if r.request_id not in finished_ids]

    def _schedule_decodes(self, plan: ScheduledPass, free_kv: int) -> int:
        """Add every decode that fits (oldest first); when one does not, preempt the newest request."""
        used = 0
        starved = False
        for request in [r for r in self.running if r.phase is Phase.DECODE]:
            need = self.capacity.kv_tokens_to_extend(request, 1)
            if used + need > free_kv:
                starved = True
                continue
            used += need
            plan.add_item(request, 1)
        if starved and len(self.running) > 1:
            # One victim a pass: its pages show up as free next pass, so we never over-preempt.
            victim = self.running[-1]
            if victim in plan.scheduled_requests:
                used -= self.capacity.kv_tokens_to_extend(victim, 1)
                plan.remove_item(victim)
            self._preempt(plan, victim)
        return used

    def _prefill_budget(self, num_decodes: int) -> int:
        """The chunk budget, shrunk while decodes run so the pass stays within the ITL target."""
        budget = self.config.chunked_prefill_size
        if self.config.itl_target_s is not None and num_decodes > 0:
            bound = self.config.cost_model.prefill_tokens_within(self.config.itl_target_s, num_decodes)
            budget = min(budget, max(self.config.min_prefill_tokens, bound))
        return budget

    def _preempt(self, plan: ScheduledPass, victim: SchedRequest) -> None:
        """Recompute later: back to the waiting queue in arrival order, nothing computed."""
        self.running.remove(victim)
        victim.phase = Phase.WAITING
        victim.num_computed = 0
        victim.num_cached = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        keys = [r.arrival_seq for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, victim.arrival_seq), victim)
        plan.preempted.append(victim)

    def defer(self, plan: ScheduledPass, request: SchedRequest, reason: str) -> None:
        """Undo this pass's admission of `request` (the caches refused it after all): it waits again."""
        plan.remove_item(request)
        self.running.remove(request)
        request.phase = Phase.WAITING
        request.num_computed = 0
        request.num_cached = 0
        keys = [r.arrival_seq for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, request.arrival_seq), request)
        self.reject(request, reason, request.num_uncomputed, self.capacity.free_kv_tokens(), 0)

    def reject(self, request: SchedRequest, reason: str, need: int, kv_free: int, budget_left: int) -> None:
        """Count an admission rejection and, when asked, log it with the budgets involved."""
        self.rejections[reason] += 1
        if self.config.log_rejections:
            logger.info(
                "admission reject id=%s reason=%s need=%d kv_free=%d budget_left=%d prefilling=%d"
                " running=%d/%d waiting=%d overtaken=%d",
                request.request_id, reason, need, kv_free, budget_left, self.num_prefilling,
                len(self.running), self.config.max_running_requests, len(self.waiting), request.times_overtaken,
            )
