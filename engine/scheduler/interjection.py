"""Interjection: short requests prefilled between two layers of a long pass that is already running.

A pass cannot be interrupted, so under short_first a question that arrives just after an 8K-token chunk was
launched waits for that whole chunk (163 ms on the H200) and then for its own pass (48 ms): 2.7x its idle TTFT
(bench/scheduling_h200.py). Shrinking the chunk shortens the wait but pays the eager pass's fixed cost more
often, which is what kept issue 15's TTFT and throughput goals apart. A pass is, however, a sequence of
layers, and the requests of one pass touch only their own KV pages and SSM slots: between layer i and i+1 the
engine can run a whole pass for newly arrived short requests and then carry on with layer i+1 (loop/step.py).
The question then waits about one layer of the long pass, and the long pass loses only the short pass's own
time, which short_first spends anyway.

The same boundary serves decode gaps: with an ITL target, a long pass that can be interrupted carries no
decodes; a decode step of every running decode is interjected whenever waiting one more layer would overshoot
the target (decode_step_due), on a GPU a CUDA-graph replay of a few ms. Prefill keeps its full chunks instead of
shrinking them to the target, where each extra pass costs the eager pass's fixed ~48 ms.

What an interjected pass may do, since the outer pass's requests are mid-pass: admit waiting short requests
whole (one pass reaches their first token), within short_limit tokens together; never preempt, never touch a
running request; keep the decode reserve admission keeps. Its memory sits on top of the outer pass's live
tensors at a layer boundary (the residual stream and the last MLP output, two [tokens, hidden] tensors), so the
two together stay below the outer pass's own peak inside a layer, which the plan's activation line prices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from headroom.engine.scheduler.types import Phase, SchedRequest, ScheduledPass, SchedulerConfig

if TYPE_CHECKING:
    from headroom.engine.scheduler.scheduler import Scheduler


def is_interruptible(config: SchedulerConfig, outer: ScheduledPass) -> bool:
    """Whether short requests arriving during `outer` may be interjected between its layers: short_first with
    interjection on, and a pass long enough (more than short_limit prefill tokens) that waiting for it hurts."""
    return config.policy == "short_first" and config.interject_short and outer.num_prefill_tokens > config.short_limit


def interjects_decodes(config: SchedulerConfig) -> bool:
    """Whether the ITL target is kept by decode steps interjected into long passes (rather than short passes)."""
    return config.policy == "short_first" and config.interject_short and config.itl_target_s is not None


def decode_step_due(config: SchedulerConfig, since_last_s: float, num_decodes: int, layer_s: float) -> bool:
    """At a layer boundary, since_last_s after the decodes' last token: step now, since waiting one more layer
    (layer_s) and then stepping would overshoot the ITL target under the cost model."""
    target = config.itl_target_s
    if target is None or num_decodes == 0:
        return False
    return since_last_s + layer_s + config.cost_model.pass_seconds(0, num_decodes) > target


def decodes_outside(scheduler: Scheduler, outer: ScheduledPass) -> list[SchedRequest]:
    """The running decodes `outer` does not carry, oldest first: those it deferred, and requests an interjected
    pass has brought to their first token since it began (a long pass that carried no decode defers none)."""
    busy = {id(r) for r in outer.scheduled_requests}
    return [r for r in scheduler.running if r.phase is Phase.DECODE and id(r) not in busy]


def plan_decode_step(scheduler: Scheduler, outer: ScheduledPass) -> ScheduledPass | None:
    """One token for every running decode that `outer` does not carry (decodes_outside), as far as their KV
    fits without preempting; None when there is none."""
    capacity, plan = scheduler.capacity, ScheduledPass()
    kv_free = capacity.free_kv_tokens()
    for request in decodes_outside(scheduler, outer):
        need = capacity.kv_tokens_to_extend(request, 1)
        if need <= kv_free:
            kv_free -= need
            plan.add_item(request, 1)
    return plan if plan.decodes else None


def interjection_budget_s(config: SchedulerConfig, outer: ScheduledPass) -> float:
    """Seconds of short passes one pass takes in between its layers: its own expected length, so a stream of
    short requests can at most double a long pass, never stall it."""
    return config.cost_model.pass_seconds(outer.num_prefill_tokens, len(outer.decodes))


def plan_interjection(scheduler: Scheduler, outer: ScheduledPass, spent_s: float = 0.0) -> ScheduledPass | None:
    """The waiting short requests (arrival order) that one pass can prefill whole now, between two of `outer`'s
    layers; None when outer is not interruptible, its interjections have spent_s of their budget, or none fits.
    The capacity seen already holds outer's reservations (the engine reserves a pass's KV before it runs). The
    requests are chosen first and moved to running together, so a failure while choosing changes nothing."""
    config, capacity = scheduler.config, scheduler.capacity
    if not is_interruptible(config, outer) or spent_s >= interjection_budget_s(config, outer):
        return None
    budget, kv_free = config.short_limit, capacity.free_kv_tokens()
    reserve = config.decode_reserve_tokens * (scheduler.num_decoding + 1)
    slots = min(capacity.free_ssm_slots(), config.max_running_requests - len(scheduler.running))
    passed_over: list[SchedRequest] = []
    # (request, its cached prefix, the tokens to compute, the long requests it overtakes)
    chosen: list[tuple[SchedRequest, int, int, list[SchedRequest]]] = []
    for request in scheduler.waiting:
        if request in outer.preempted:
            # Preempted to make room for the pass in flight: taking it back would undo that.
            continue
        cached = capacity.cached_prefix_len(request)
        whole = request.num_tokens - cached
        if whole > config.short_limit:
            # A long request waits for a normal pass; once overtaken too often it bars the way (aging).
            if request.times_overtaken >= config.max_times_overtaken:
                break
            passed_over.append(request)
            continue
        locked = capacity.kv_tokens_locked_by_admission(request) if cached else 0
        need = capacity.kv_tokens_to_extend(request, whole) + locked
        if whole > budget or len(chosen) >= slots or need + reserve > kv_free:
            break
        chosen.append((request, cached, whole, list(passed_over)))
        budget -= whole
        kv_free -= need
    if not chosen:
        return None
    plan = ScheduledPass()
    for request, cached, whole, overtook in chosen:
        for earlier in overtook:
            earlier.times_overtaken += 1
        scheduler.move_to_running(plan, request, cached, whole)
    return plan
