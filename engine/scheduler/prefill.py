"""The prefill half of one pass: chunks for running prefills, then admission of waiting requests.

Split out of scheduler.py because it is the policy the seed report was about: an even split of the
chunk budget, admission judged on the next chunk, and a bounded scan past requests that do not fit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from headroom.engine.scheduler.types import Phase, SchedRequest, ScheduledPass

if TYPE_CHECKING:
    from headroom.engine.scheduler.scheduler import Scheduler


class PrefillPlanner:
    """Fills `plan` with prefill chunks within `budget` tokens and `kv_free` KV token slots."""

    def __init__(self, scheduler: Scheduler, plan: ScheduledPass, budget: int, kv_free: int):
        self.scheduler = scheduler
        self.config = scheduler.config
        self.capacity = scheduler.capacity
        self.plan = plan
        self.budget_left = budget
        self.kv_free = kv_free
        self.num_decodes = len(plan.decodes)

    def run(self) -> None:
        prefilling = [r for r in self.scheduler.running if r.phase is Phase.PREFILL]
        free_running = self.config.max_running_requests - len(self.scheduler.running)
        admissible = min(len(self.scheduler.waiting), max(0, free_running), self.capacity.free_ssm_slots())
        contenders = len(prefilling) + admissible
        if contenders == 0:
            return
        if self.config.policy == "short_first":
            self._run_short_first(prefilling)
            return
        limit = self._per_request_limit(contenders)
        for request in prefilling:
            self._continue(request, limit)
        self._admit(limit)
        is_capped = self.config.cap_contended_chunks and (contenders > 1 or self.config.cap_lone_request)
        if not is_capped:
            self._hand_out_leftover()

    def _run_short_first(self, prefilling: list[SchedRequest]) -> None:
        """Short prefills first, whole; then long prompts oldest first, each taking what budget is left."""
        short = self.config.short_limit
        for request in prefilling:
            if request.num_uncomputed <= short:
                self._continue(request, self.budget_left)
        self._admit(self.budget_left, select=lambda r: r.num_uncomputed <= short)
        if self.plan.prefills:
            # A pass carrying a short prefill stays short (long prompts add min_prefill_tokens at most): the
            # question's first token waits for the pass in flight and one short pass, not a full one. It costs
            # one pass's fixed overhead per arrival of shorts, ~47 ms on the H200 (bench/scheduling_h200.py).
            self.budget_left = min(self.budget_left, self.config.min_prefill_tokens)
        for request in sorted(prefilling, key=lambda r: r.arrival_seq):
            if request.num_uncomputed > short and self.budget_left > 0:
                self._continue(request, self.budget_left)
        if self.budget_left > 0:
            self._admit(self.budget_left, select=lambda r: r.num_uncomputed > short)

    def _per_request_limit(self, contenders: int) -> int:
        """Chunk tokens one request may take this pass."""
        budget = self.budget_left
        if contenders == 1 and not self.config.cap_lone_request:
            return budget
        limit = budget // contenders if self.config.even_split else budget
        if self.config.cap_contended_chunks:
            limit = min(limit, self.config.per_request_cap)
        return max(1, limit)

    def _fit(self, request: SchedRequest, num_tokens: int) -> int:
        """The largest chunk <= num_tokens whose KV fits in kv_free (binary search; pages round up)."""
        low, high = 0, num_tokens
        while low < high:
            mid = (low + high + 1) // 2
            if self.capacity.kv_tokens_to_extend(request, mid) <= self.kv_free:
                low = mid
            else:
                high = mid - 1
        return low

    def _take(self, request: SchedRequest, num_tokens: int) -> None:
        self.kv_free -= self.capacity.kv_tokens_to_extend(request, num_tokens)
        self.budget_left -= num_tokens

    def _continue(self, request: SchedRequest, limit: int) -> None:
        """A running prefill takes its share, shrunk to the KV left; with none left it waits a pass."""
        num_tokens = self._fit(request, min(request.num_uncomputed, limit, self.budget_left))
        if num_tokens > 0:
            self._take(request, num_tokens)
            self.plan.add_item(request, num_tokens)

    def _admit(self, limit: int, select: Callable[[SchedRequest], bool] | None = None) -> None:
        """Scan the waiting queue in arrival order; judge each on its next chunk; skip past misfits.
        select: consider only these requests (the others are neither judged nor counted as overtaken)."""
        scheduler = self.scheduler
        skipped: list[SchedRequest] = []
        for request in list(scheduler.waiting):
            if select is not None and not select(request):
                # Passed over by policy: it ages like a misfit, and once overtaken too often it is a barrier.
                if request.times_overtaken >= self.config.max_times_overtaken:
                    break
                skipped.append(request)
                continue
            if request in self.plan.preempted:
                # Preempted to make room in this very pass: taking it back would undo that.
                continue
            if len(scheduler.running) >= self.config.max_running_requests:
                scheduler.reject(request, "MAX_RUNNING", 0, self.kv_free, self.budget_left)
                break
            if self.capacity.free_ssm_slots() - len(self.plan.admitted) < 1:
                scheduler.reject(request, "NO_SSM_SLOT", 1, self.kv_free, self.budget_left)
                break
            if self.budget_left < 1:
                scheduler.reject(request, "NO_BUDGET", 1, self.kv_free, self.budget_left)
                break
            cached = self.capacity.cached_prefix_len(request)
            chunk = min(request.num_tokens - cached, limit, self.budget_left)
            # A preempted request comes back only when all of it fits, or it would be preempted again (thrash).
            whole = self.config.judge_whole_prompt or request.num_preemptions > 0
            judged = request.num_tokens - cached if whole else chunk
            # Room kept for running decodes to grow. With nothing running there is nothing to protect, and a
            # reserve would keep a preempted request as long as the pool out forever.
            reserve = self.config.decode_reserve_tokens * (self.num_decodes + 1) if scheduler.running else 0
            # Judging whole prompts also means honouring what running prefills were promised.
            reserve += self._promised_after_this_pass() if whole else 0
            # Its cached prefix was counted as free (evictable) and admission locks it: pay for it here.
            locked = self.capacity.kv_tokens_locked_by_admission(request) if cached else 0
            need = self.capacity.kv_tokens_to_extend(request, judged) + locked + reserve
            if need > self.kv_free:
                scheduler.reject(request, "NO_KV", need, self.kv_free, self.budget_left)
                skipped.append(request)
                # Aging: a request overtaken too often stops the scan, so freed pages go to it first.
                if request.times_overtaken >= self.config.max_times_overtaken:
                    break
                if sum(1 for r in skipped if select is None or select(r)) > self.config.skip_ahead_limit:
                    break
                continue
            for earlier in skipped:
                earlier.times_overtaken += 1
            scheduler.move_to_running(self.plan, request, cached, chunk)
            self.kv_free -= locked
            self._take(request, chunk)

    def _promised_after_this_pass(self) -> int:
        """Prompt tokens running prefills still need after the chunks already in this pass."""
        planned = {id(item.request): item.num_tokens for item in self.plan.prefills}
        prefilling = [r for r in self.scheduler.running if r.phase is Phase.PREFILL]
        return sum(r.num_uncomputed - planned.get(id(r), 0) for r in prefilling)

    def _hand_out_leftover(self) -> None:
        """Budget a short request left unused goes to the others in order (the seed's 4096 + 30)."""
        for item in list(self.plan.prefills):
            if self.budget_left < 1:
                return
            request = item.request
            wanted = min(request.num_uncomputed - item.num_tokens, self.budget_left)
            if wanted < 1:
                continue
            extra = self._fit_extra(request, item.num_tokens, wanted)
            if extra > 0:
                self.kv_free -= self.capacity.kv_tokens_to_extend(request, item.num_tokens + extra)
                self.kv_free += self.capacity.kv_tokens_to_extend(request, item.num_tokens)
                self.budget_left -= extra
                self.plan.grow_prefill(request, extra)

    def _fit_extra(self, request: SchedRequest, current: int, wanted: int) -> int:
        base = self.capacity.kv_tokens_to_extend(request, current)
        low, high = 0, wanted
        while low < high:
            mid = (low + high + 1) // 2
            if self.capacity.kv_tokens_to_extend(request, current + mid) - base <= self.kv_free:
                low = mid
            else:
                high = mid - 1
        return low
