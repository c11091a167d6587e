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
from headroom.engine.scheduler.interjection import (
    interjects_decodes,
    is_interruptible,
    plan_decode_step,
    plan_interjection,
)
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
        """Plan the next pass. Preempted requests are back in the waiting queue; release their memory.

        Progress every pass: a preemption's pages are counted free in the same pass (no pass spent only
        preempting), and while a pass would compute nothing with several requests holding memory, the newest
        is preempted until the others can grow.
        """
        plan = ScheduledPass()
        free_kv = self._schedule_decodes(plan, self.capacity.free_kv_tokens())
        # Decode steps interjected into a long pass keep the ITL target: the chunk need not shrink for it.
        interjecting = bool(plan.decodes) and interjects_decodes(self.config)
        budget = self._prefill_budget(0 if interjecting else len(plan.decodes))
        plan.prefill_budget = budget
        planner = PrefillPlanner(self, plan, budget, free_kv)
        planner.run()
        while plan.is_empty and len(self.running) > 1:
            # Everyone holds pages and nobody can grow: free the newest so the others can finish.
            freed = self._preempt(plan, self.running[-1])
            planner = PrefillPlanner(self, plan, budget, planner.kv_free + freed)
            planner.run()
        if interjecting and not plan.preempted and is_interruptible(self.config, plan) and \
                self.config.cost_model.pass_seconds(plan.num_prefill_tokens, len(plan.decodes)) > self.config.itl_target_s:
            # A pass within the target carries its decodes; a longer one leaves them to steps between its layers.
            plan.deferred_decodes = [item.request for item in plan.decodes]
            plan.decodes = []
        return plan

    def is_interruptible(self, plan: ScheduledPass) -> bool:
        """Whether short arrivals may be interjected between the layers of `plan` (scheduler/interjection.py)."""
        return is_interruptible(self.config, plan)

    def schedule_interjection(self, outer: ScheduledPass, spent_s: float = 0.0) -> ScheduledPass | None:
        """A pass of waiting short requests to run between two layers of `outer`, which is in flight and whose
        earlier interjections took spent_s; complete() it like any pass. None when there is nothing to
        interject (scheduler/interjection.py)."""
        return plan_interjection(self, outer, spent_s)

    def schedule_decode_step(self, outer: ScheduledPass) -> ScheduledPass | None:
        """A decode step of the running decodes `outer` does not carry, to run between two of its layers when
        decode_step_due says so; None when there are none or their KV does not fit (scheduler/interjection.py)."""
        return plan_decode_step(self, outer)

    def move_to_running(self, plan: ScheduledPass, request: SchedRequest, cached: int, chunk: int) -> None:
        """Admit `request` into `plan`: it starts from its `cached` prefix and computes `chunk` positions."""
        self.waiting.remove(request)
        self.running.append(request)
        request.phase = Phase.PREFILL
        request.num_cached = cached
        request.num_computed = cached
        plan.admitted.append(request)
        plan.add_item(request, chunk)

    def complete(self, plan: ScheduledPass, finished_ids: set[str] | frozenset[str] = frozenset()) -> None:
        """Record that `plan` ran; requests in finished_ids leave (the caller releases their memory)."""
        for item in plan.items:
            request = item.request
            request.num_computed = item.start + item.num_tokens
            if item.samples:
                request.num_generated += 1
                request.phase = Phase.DECODE
        if finished_ids:
            self.running = [r for r in self.running if r.request_id not in finished_ids]

    def _schedule_decodes(self, plan: ScheduledPass, free_kv: int) -> int:
        """Add every decode (oldest first); one that does not fit preempts the newest request, whose pages
        pay for it in this pass. Returns the free KV left."""
        for request in [r for r in self.running if r.phase is Phase.DECODE]:
            need = self.capacity.kv_tokens_to_extend(request, 1)
            # Still running unless preempted above as a victim (_preempt sets WAITING): a flag, not a scan of running.
            while need > free_kv and request.phase is Phase.DECODE and len(self.running) > 1:
                victim = self.running[-1]
                if victim in plan.scheduled_requests:
                    free_kv += self.capacity.kv_tokens_to_extend(victim, 1)
                    plan.remove_item(victim)
                free_kv += self._preempt(plan, victim)
            if request.phase is Phase.DECODE and need <= free_kv:
                free_kv -= need
                plan.add_item(request, 1)
        return free_kv

    def _prefill_budget(self, num_decodes: int) -> int:
        """The chunk budget, shrunk so the pass stays within max_pass_s and, while decodes run, the ITL target."""
        budget = self.config.chunked_prefill_size
        targets = [self.config.max_pass_s] + ([self.config.itl_target_s] if num_decodes > 0 else [])
        for seconds in (s for s in targets if s is not None):
            bound = self.config.cost_model.prefill_tokens_within(seconds, num_decodes)
            budget = min(budget, max(self.config.min_prefill_tokens, bound))
        return budget

    def _preempt(self, plan: ScheduledPass, victim: SchedRequest) -> int:
        """Recompute later: back to the waiting queue in arrival order, nothing computed. Returns the KV
        tokens its release frees (the caller releases it before this pass runs)."""
        freed = self.capacity.kv_tokens_freed_by_preemption(victim)
        self.running.remove(victim)
        victim.phase = Phase.WAITING
        victim.num_computed = 0
        victim.num_cached = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        keys = [r.arrival_seq for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, victim.arrival_seq), victim)
        plan.preempted.append(victim)
        return freed

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
