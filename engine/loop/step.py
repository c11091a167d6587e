"""One engine step: ask the scheduler for a pass, bind it to the caches, run the model, sample, finish.

Kept apart from the thread and queue plumbing (engine_loop.py) so it can be driven synchronously
(warm-up, tests). Events go out through `emit(request_id, event)`. While a long pass runs, short requests
that arrive (poll_arrivals) may be run in a pass of their own between two of its layers
(scheduler/interjection.py says why that is safe).

Graphed decode steps overlap on a GPU (engine/loop/in_flight.py says why): a step is launched, then the next
one is launched on its tokens while they are still on the device, and only then are its tokens read, emitted
and checked for stops. A step chains onto the one in flight only when nothing else could be planned instead:
no request waiting, every running request decoding and in the step in flight, and KV room for all of them
(so planning it can neither admit nor preempt). A request that stops on a token read after its next step was
launched is released at once; that step's extra token is dropped, and what it computed (the stop token's KV
and state) is exactly what the request's token_ids and num_computed_tokens then say.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from headroom.engine.cache.manager import CacheManager
from headroom.engine.loop.capacity import CacheCapacity
from headroom.engine.loop.in_flight import PENDING_TOKEN, InFlightDecode
from headroom.engine.runtime.forward_batch import BatchItem
from headroom.engine.runtime.model_runner import ModelRunner
from headroom.engine.runtime.sampling import sample, sample_on_device
from headroom.engine.scheduler.interjection import decode_step_due, decodes_outside, interjects_decodes
from headroom.engine.scheduler.scheduler import Scheduler
from headroom.engine.scheduler.types import PassItem, Phase, SchedRequest, ScheduledPass, SchedulerConfig
from headroom.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger("headroom.engine")


@dataclass(frozen=True)
class TokenEvent:
    """New tokens of one request; the last event has finish_reason ('stop', 'length', 'abort', 'error')."""

    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass
class StepStats:
    """What the last pass did, for metrics and the cost model. Seconds are wall time, less the interjected_s
    spent on passes between its layers (those that ran are in `interjected`, each with its own seconds)."""

    seconds: float = 0.0
    num_prefill_tokens: int = 0
    num_decodes: int = 0
    admitted: list[str] = field(default_factory=list)
    interjected: list[StepStats] = field(default_factory=list)
    interjected_s: float = 0.0


class StepRunner:
    def __init__(self, runner: ModelRunner, scheduler_config: SchedulerConfig,
                 emit: Callable[[str, TokenEvent], None]):
        if scheduler_config.max_running_requests > runner.config.max_running_requests:
            # The runner holds per-request state for that many (SSM slots, KIVI window rows, graph table rows).
            raise ValueError(
                f"scheduler max_running_requests={scheduler_config.max_running_requests} exceeds the engine's "
                f"{runner.config.max_running_requests} (EngineConfig.max_running_requests)")
        self.runner = runner
        self.emit = emit
        self.sequences: dict[str, Sequence] = {}
        self.eos_ids: dict[str, frozenset[int]] = {}
        self.cache = CacheManager(runner.kv_allocator, runner.ssm_pool.allocator if runner.ssm_pool else None,
                                  runner.ssm_pool.copy if runner.ssm_pool else (lambda src, dst: None),
                                  runner.config.enable_prefix_cache, scheduler_config.max_running_requests,
                                  scheduler_config.chunked_prefill_size)
        self.capacity = CacheCapacity(self.cache, self.sequences, scheduler_config.max_running_requests)
        if not runner.supports_interjection:
            # Tensor parallel: nothing can run between layers, so the scheduler must not plan for it (it would
            # defer decodes no step takes); the ITL target then shrinks chunks instead.
            scheduler_config = replace(scheduler_config, interject_short=False)
        self.scheduler = Scheduler(scheduler_config, self.capacity)
        # Called between two layers of an interruptible pass: takes newly arrived requests in (add) and says
        # whether any came; None (the default, as in warm-up and tests) never interjects.
        self.poll_arrivals: Callable[[], bool] | None = None
        # When the last pass carrying decodes ended (perf_counter): interjected decode steps fall due from then.
        # (A request's first token comes from a prefill: the decodes' gap runs from their own last token.)
        self.last_decode_at = time.perf_counter()
        # Graphed decode steps overlap (module docstring); tests turn it on for the CPU's uncaptured graphs.
        self.overlap = runner.overlaps_decode
        self._in_flight: InFlightDecode | None = None

    @property
    def has_work(self) -> bool:
        """Requests to schedule, or a decode step in flight whose tokens are still to be read."""
        return self.scheduler.has_work or self._in_flight is not None

    def add(self, seq: Sequence, eos_token_ids: frozenset[int]) -> None:
        """Queue seq; one that could never fit the KV pool, even alone, is refused at once with the numbers."""
        pool = self.cache.kv_allocator.num_tokens
        if seq.num_prompt_tokens + seq.sampling.max_new_tokens > pool:
            self.emit(seq.request_id, TokenEvent([], "error", (
                f"prompt of {seq.num_prompt_tokens} tokens + max_new_tokens {seq.sampling.max_new_tokens} = "
                f"{seq.num_prompt_tokens + seq.sampling.max_new_tokens} exceeds the KV pool of {pool} tokens: "
                "it could never be scheduled"), seq.num_prompt_tokens))
            return
        self.sequences[seq.request_id] = seq
        self.eos_ids[seq.request_id] = frozenset() if seq.sampling.ignore_eos else eos_token_ids
        self.scheduler.add(SchedRequest(seq.request_id, seq.num_prompt_tokens, seq.sampling.max_new_tokens))

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> None:
        """Free a request's slot and pages now (client gone, or its pass failed)."""
        if self.scheduler.abort(request_id) is None and request_id not in self.sequences:
            return
        seq = self.sequences.pop(request_id, None)
        self.eos_ids.pop(request_id, None)
        if seq is not None:
            # A failed pass may have updated some layers' SSM state in place: never publish it as a checkpoint.
            self._release(seq, publish=error is None)
            self.emit(request_id, TokenEvent([], reason, error, seq.num_prompt_tokens, seq.cached_tokens))

    def _release(self, seq: Sequence, publish: bool = True) -> None:
        if seq.kv_slots or seq.ssm_slot is not None:
            self.cache.finish(seq, publish)
        self.runner.release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING

    def step(self) -> StepStats:
        """Run one pass and return what it did; with overlapped decode, launch the next decode step and return
        the stats of the one whose tokens this call read."""
        if self._in_flight is None:
            started = time.perf_counter()
            plan = self.scheduler.schedule()
            for request in plan.preempted:
                self._release(self.sequences[request.request_id])
            stats = self._execute(plan, started, interruptible=True)
            if self._in_flight is None:
                return stats
        return self._advance()

    def _advance(self) -> StepStats:
        """Launch the next decode step on the in-flight one's device tokens when it may chain, then read those
        tokens (emit, stops, release)."""
        previous, self._in_flight = self._in_flight, None
        assert previous is not None
        if self._may_chain(previous):
            started = time.perf_counter()
            plan = self.scheduler.schedule()
            # _may_chain leaves the scheduler nothing but decodes of requests in `previous` to plan; anything else
            # is left unplanned (planning decodes changes no state) and planned again once the tokens are read.
            if plan.decodes and not plan.prefills and not plan.admitted and not plan.preempted:
                items = [item for item in plan.items if self._reserve(plan, item)]
                if items:
                    seqs = [self.sequences[item.request.request_id] for item in items]
                    self._launch(plan, items, seqs, [BatchItem(seq, [PENDING_TOKEN]) for seq in seqs], started,
                                 previous)
        return self._read(previous)

    def _may_chain(self, previous: InFlightDecode) -> bool:
        """Whether the scheduler's next pass can only be a decode step of requests all in `previous`, with KV
        room for each (so that planning it admits and preempts nothing)."""
        scheduler = self.scheduler
        if scheduler.waiting or not scheduler.running or any(r.phase is not Phase.DECODE for r in scheduler.running):
            return False
        in_previous = {seq.request_id for seq in previous.seqs}
        if any(r.request_id not in in_previous for r in scheduler.running):
            return False
        need = sum(self.capacity.kv_tokens_to_extend(r, 1) for r in scheduler.running)
        return need <= self.capacity.free_kv_tokens()

    def _overlaps(self, items: list[PassItem], seqs: list[Sequence], batch: list[BatchItem]) -> bool:
        """Whether this pass may run as an in-flight decode step: every item one sampled token of a request past
        its prompt, and the decode graphs able to run it."""
        graphs = self.runner.decode_graphs
        return (self.overlap and graphs is not None and all(item.samples for item in items)
                and not any(seq.is_prefilling for seq in seqs) and graphs.can_run(batch))

    def _launch(self, plan: ScheduledPass, items: list[PassItem], seqs: list[Sequence], batch: list[BatchItem],
                started: float, previous: InFlightDecode | None = None) -> None:
        """Launch a decode step whose tokens stay on the device (on previous's device tokens when given), and
        record it as the step in flight. Requests whose token limit it reaches leave the scheduler now (the
        next step must not carry them); their Sequences stay until the token is read."""
        ahead = 0 if previous is None else 1
        try:
            on_device = None if previous is None else (previous.tokens, previous.rows(seqs))
            logits = self.runner.forward(batch, tokens_on_device=on_device)
            tokens = sample_on_device(logits, seqs, ahead)
        except Exception as exc:  # noqa: BLE001 - one failing pass fails its own requests, not the server
            for item in items:
                self.abort(item.request.request_id, "error", f"{type(exc).__name__}: {exc}")
            return
        at_limit = {seq.request_id for seq in seqs if len(seq.output_token_ids) + ahead + 1 >= seq.sampling.max_new_tokens}
        self.scheduler.complete(plan, at_limit)
        self._in_flight = InFlightDecode.start_copy(plan, seqs, tokens, started)

    def _is_live(self, seq: Sequence) -> bool:
        """seq is still this runner's running request (not aborted or finished since its step was launched)."""
        return self.sequences.get(seq.request_id) is seq

    def _read(self, step: InFlightDecode) -> StepStats:
        """Take an in-flight step's tokens: append, emit, release the requests that finished."""
        try:
            tokens = step.read()
        except Exception as exc:  # noqa: BLE001 - the device failed this step: its requests fail, the loop goes on
            for failed in step.seqs:
                if self._is_live(failed):
                    self.abort(failed.request_id, "error", f"{type(exc).__name__}: {exc}")
            tokens = []
        finished: set[str] = set()
        for running, token in zip(step.seqs, tokens, strict=False):
            if not self._is_live(running):
                continue  # aborted, or stopped on the step before this one, since the launch
            running.output_token_ids.append(token)
            reason = self._finish_reason(running, token)
            self.emit(running.request_id,
                      TokenEvent([token], reason, None, running.num_prompt_tokens, running.cached_tokens))
            if reason is not None:
                finished.add(running.request_id)
        # Those at their token limit left the scheduler at the launch; those stopped by a token leave now.
        self.scheduler.complete(ScheduledPass(), finished)
        self.last_decode_at = time.perf_counter()
        self._retire(finished)
        return StepStats(seconds=self.last_decode_at - step.started, num_decodes=len(step.seqs))

    def _execute(self, plan: ScheduledPass, started: float, interruptible: bool) -> StepStats:
        for request in list(plan.admitted):
            self._admit(plan, request)
        items = [item for item in plan.items if self._reserve(plan, item)]
        stats = StepStats(num_prefill_tokens=plan.num_prefill_tokens, num_decodes=len(plan.decodes),
                          admitted=[r.request_id for r in plan.admitted])
        if items:
            # A pass interjected into another must be read before that one goes on: it never overlaps.
            self._run(plan, items, self._interjection_hook(plan, stats) if interruptible else None,
                      may_overlap=interruptible, started=started)
        stats.seconds = time.perf_counter() - started - stats.interjected_s
        return stats

    def _interjection_hook(self, outer: ScheduledPass, stats: StepStats) -> Callable[[], None] | None:
        """What runs between two layers of `outer`: new arrivals in and a pass of short ones if the scheduler plans
        one; a decode step of the decodes outer deferred when the ITL target is due. None where outer cannot be
        interrupted (scheduler policy, a short pass, tensor parallel). Nothing here may fail the outer pass."""
        if not self.runner.supports_interjection or not self.scheduler.is_interruptible(outer):
            return None
        poll, config = self.poll_arrivals, self.scheduler.config
        steps_decodes = interjects_decodes(config)
        if poll is None and not outer.deferred_decodes:
            return None
        # The decode-step decision needs how long one more layer takes: the pass's cost over its layers.
        layer_s = config.cost_model.pass_seconds(outer.num_prefill_tokens, 0) / self.runner.model_config.num_layers
        spent_on_prefill = [0.0]

        def between_layers() -> None:
            try:
                if poll is not None and poll():
                    spent_on_prefill[0] += self._interject(
                        lambda: self.scheduler.schedule_interjection(outer, spent_on_prefill[0]), stats)
                # Decodes to step: those outer deferred, and those an interjected pass brought to a first token.
                pending = len(decodes_outside(self.scheduler, outer)) if steps_decodes and (
                    outer.deferred_decodes or stats.interjected) else 0
                if pending and decode_step_due(config, time.perf_counter() - self.last_decode_at, pending, layer_s):
                    self._interject(lambda: self.scheduler.schedule_decode_step(outer), stats)
            except Exception:  # noqa: BLE001 - the pass it interrupts must go on
                logger.exception("interjection between two layers failed; the pass goes on")

        return between_layers

    def _interject(self, plan_inner: Callable[[], ScheduledPass | None], outer_stats: StepStats) -> float:
        """Plan and run a pass now, in the middle of the outer one; the seconds it took (0 when none ran). A
        failure outside its model call (which _run contains) fails its own requests only."""
        started, inner = time.perf_counter(), None
        try:
            inner = plan_inner()
            if inner is not None:
                outer_stats.interjected.append(self._execute(inner, started, interruptible=False))
        except Exception:  # noqa: BLE001 - a bug here must fail the interjected requests, not the long pass
            logger.exception("an interjected pass failed outside its model call; failing its requests")
            for request in inner.scheduled_requests if inner is not None else []:
                self.fail(request.request_id, "interjected pass failed")
        spent = time.perf_counter() - started if inner is not None else 0.0
        outer_stats.interjected_s += spent
        return spent

    def fail(self, request_id: str, error: str) -> None:
        """End a request with an error even when its abort fails too (then only the bookkeeping is dropped)."""
        try:
            self.abort(request_id, "error", error)
        except Exception:  # noqa: BLE001 - the caller is a pass or the engine thread: both must go on
            logger.exception("aborting request %s after a failure failed too", request_id)
            self.scheduler.abort(request_id)
            self.sequences.pop(request_id, None)
            self.eos_ids.pop(request_id, None)
            self.emit(request_id, TokenEvent([], "error", error))

    def _admit(self, plan: ScheduledPass, request: SchedRequest) -> None:
        seq = self.sequences[request.request_id]
        first_hit = seq.cached_tokens
        if not self.cache.admit(seq):
            # The scheduler counted a slot that a locked checkpoint still holds: wait, never fail.
            self.scheduler.defer(plan, request, "ssm_slot_held")
            return
        seq.status = SequenceStatus.RUNNING
        if seq.output_token_ids:
            # Re-admitted after preemption: usage keeps the hit the client's prompt had, not the resume point.
            seq.cached_tokens = first_hit
        if seq.num_computed_tokens != request.num_computed:
            # The prefix hit at admission differs from the scheduler's estimate: restart the chunk there.
            item = next(i for i in plan.prefills if i.request is request)
            plan.remove_item(request)
            request.num_computed = request.num_cached = seq.num_computed_tokens
            plan.add_item(request, min(item.num_tokens, request.num_uncomputed))

    def _reserve(self, plan: ScheduledPass, item: PassItem) -> bool:
        seq = self.sequences[item.request.request_id]
        if self.cache.reserve(seq, item.start + item.num_tokens):
            return True
        # The estimate was off (page rounding, cache locks): skip this item for one pass.
        plan.remove_item(item.request)
        return False

    def _run(self, plan: ScheduledPass, items: list[PassItem], between_layers: Callable[[], None] | None = None,
             may_overlap: bool = False, started: float | None = None) -> None:
        seqs = [self.sequences[item.request.request_id] for item in items]
        batch, captures = [], []
        for item, seq in zip(items, seqs, strict=True):
            end = item.start + item.num_tokens
            # A hybrid prefill runs through its checkpoint stops; the pass leaves each stop's state in a slot.
            taken = self.cache.take_captures(seq, item.start, end) if seq.is_prefilling else []
            captures.append(taken)
            batch.append(BatchItem(seq, seq.tokens_between(item.start, end),
                                   tuple((stop - item.start, slot) for stop, slot in taken) if taken else ()))
        if may_overlap and between_layers is None and self._overlaps(items, seqs, batch):
            self._launch(plan, items, seqs, batch, time.perf_counter() if started is None else started)
            return
        sampling = [i for i, item in enumerate(items) if item.samples]
        try:
            logits = self.runner.forward(batch) if between_layers is None else \
                self.runner.forward(batch, between_layers=between_layers)
            # A decode step samples every row: no gather of the rows it already has.
            rows = logits if len(sampling) == len(items) else logits[sampling]
            tokens = dict(zip(sampling, sample(rows, [seqs[i] for i in sampling]), strict=True)) if sampling else {}
        except Exception as exc:  # noqa: BLE001 - one failing pass fails its own requests, not the server
            for taken in captures:
                self.cache.drop_captures(taken)
            for item in items:
                self.abort(item.request.request_id, "error", f"{type(exc).__name__}: {exc}")
            return
        # Every capture is published (or freed) before anything below can raise: none can leak.
        for seq, taken in zip(seqs, captures, strict=True):
            if taken:
                self.cache.publish_captures(seq, taken)
        finished: set[str] = set()
        for index, seq in enumerate(seqs):
            if seq.num_computed_tokens <= seq.num_prompt_tokens:
                # Publish the prefix; at a checkpoint stop with a copy of the SSM state (hybrid models can
                # only reuse a prefix up to a node that holds one).
                self.cache.checkpoint(seq)
            token = tokens.get(index)
            if token is None:
                continue
            seq.output_token_ids.append(token)
            reason = self._finish_reason(seq, token)
            self.emit(seq.request_id, TokenEvent([token], reason, None, seq.num_prompt_tokens, seq.cached_tokens))
            if reason is not None:
                finished.add(seq.request_id)
        # Whether any request was decoding before this pass matters only to a pass that carried no decode.
        decoding_before = self.scheduler.num_decoding if not plan.decodes else 0
        self.scheduler.complete(plan, finished)
        # The decodes' last token: this pass's, or the first tokens it gave when no request was decoding before
        # (their gaps count from here, not from a decode long gone).
        if plan.decodes or decoding_before == 0 < self.scheduler.num_decoding:
            self.last_decode_at = time.perf_counter()
        self._retire(finished)

    def _retire(self, finished: set[str]) -> None:
        """Release the requests that ended with a token of the pass just read (the scheduler has dropped them)."""
        for request_id in finished:
            seq = self.sequences.pop(request_id)
            self.eos_ids.pop(request_id, None)
            self._release(seq)
            seq.status = SequenceStatus.FINISHED

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token in self.eos_ids[seq.request_id] or token in seq.sampling.stop_token_ids:
            return "stop"
        if len(seq.output_token_ids) >= seq.sampling.max_new_tokens:
            return "length"
        return None
