"""The engine loop: its own thread runs passes; the server talks to it through a thread-safe inbox.

Each submitted request gets a RequestStream; events cross back to the asyncio side with
call_soon_threadsafe. A failing pass fails only its own requests (StepRunner); the loop keeps going.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from headroom.engine.config import EngineConfig
from headroom.engine.loop.step import StepRunner, StepStats, TokenEvent
from headroom.engine.runtime.decode_graphs import CaptureReport
from headroom.engine.runtime.leader import build_runner
from headroom.engine.runtime.model_runner import ModelRunner
from headroom.engine.scheduler.types import SchedulerConfig
from headroom.engine.sequence import Sequence
from headroom.kernels.compile_ahead import CompileAheadReport
from headroom.kernels.compile_watch import CompileWatch

logger = logging.getLogger("headroom.engine")


class QueueFull(Exception):
    """More requests waiting than the engine accepts; the server answers 429."""

    def __init__(self, num_waiting: int, max_waiting: int):
        super().__init__(f"{num_waiting} requests already waiting (max_waiting_requests={max_waiting})")


def check_interjection_lag(layers: object, name: str = "interjection lag") -> int:
    """layers, when it is a whole number of at least 1 (what the host may run ahead of the GPU in a pass that takes
    interjections); else a ValueError that says so under `name`."""
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"{name} {layers!r} must be at least 1 (a whole number of layers the host may run ahead "
                         "of the GPU)")
    return layers


class _Outbox:
    """Events bound for one asyncio loop, handed over in batches: the first push after a delivery schedules the
    next delivery (one call_soon_threadsafe: a self-pipe write and a wake-up of the loop), and the pushes that
    follow before it runs only append. A decode step of 16 requests so wakes the event loop once, not 16 times,
    each wake-up taking the GIL from the engine thread. Order is kept: one list, delivered whole."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue[TokenEvent], TokenEvent]] = []

    def push(self, events: asyncio.Queue[TokenEvent], event: TokenEvent) -> None:
        with self._lock:
            self._pending.append((events, event))
            first = len(self._pending) == 1
        if first:
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        for events, event in batch:
            events.put_nowait(event)


_outboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Outbox] = weakref.WeakKeyDictionary()
_outboxes_lock = threading.Lock()


def _outbox(loop: asyncio.AbstractEventLoop) -> _Outbox:
    with _outboxes_lock:
        box = _outboxes.get(loop)
        if box is None:
            box = _outboxes[loop] = _Outbox(loop)
        return box


@dataclass
class RequestStream:
    """Events of one request, delivered into an asyncio queue owned by `loop` (batched per loop: _Outbox)."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[TokenEvent]
    # Found once, when the request is made, not under the registry's lock for every token the engine pushes.
    outbox: _Outbox = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.outbox = _outbox(self.loop)

    def push(self, event: TokenEvent) -> None:
        self.outbox.push(self.events, event)


class EngineLoop:
    def __init__(self, runner: ModelRunner, scheduler_config: SchedulerConfig, max_waiting_requests: int = 256,
                 on_step: Callable[[StepStats, EngineLoop], None] | None = None):
        self.runner = runner
        self.max_waiting_requests = max_waiting_requests
        self.on_step = on_step
        self._streams: dict[str, RequestStream] = {}
        self.steps = StepRunner(runner, scheduler_config, self._emit)
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        # Aborts taken from the inbox mid-pass: applied once the pass ends, since it may be writing their pages.
        self._deferred_aborts: list[str] = []
        self.steps.poll_arrivals = self._poll_arrivals
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, scheduler_config: SchedulerConfig, max_waiting_requests: int = 256,
                    on_step: Callable[[StepStats, EngineLoop], None] | None = None) -> EngineLoop:
        """Build the model runner (weights and pools) for `config` and a loop around it. The server builds
        its engine through here: it reaches the runtime only through the loop. With tensor_parallel_size > 1
        the runner leads the other ranks' processes (engine/runtime/leader.py); this loop never knows."""
        return cls(build_runner(config), scheduler_config, max_waiting_requests, on_step)

    @property
    def scheduler(self):
        return self.steps.scheduler

    @property
    def compiles_kernels(self) -> bool:
        """True on a GPU, where a kernel's first call at a new shape class compiles (Triton's JIT)."""
        return self.runner.device.type == "cuda"

    def watch_compiles(self) -> CompileWatch | None:
        """Count (and report through the returned watch) every Triton compile from now on; None off the GPU."""
        if not self.compiles_kernels:
            return None
        watch = CompileWatch()
        return watch if watch.install() else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.runner.model_config.eos_token_ids)

    def set_interjection_lag(self, layers: int) -> None:
        """How many layers the host may run ahead of the GPU in a pass that takes interjections: more keeps the
        GPU busy while an interjected pass is launched, fewer starts it sooner (model_runner.INTERJECTION_LAG)."""
        self.runner.interjection_lag = check_interjection_lag(layers)

    def capture_decode_graphs(self) -> CaptureReport:
        """Capture the decode CUDA graphs before the loop starts (nothing on a CPU)."""
        return self.runner.capture_decode_graphs()

    def start_compile_ahead(self) -> int:
        """Until stop_compile_ahead, each pass runs dry first and its kernels compile on every core (the warm-up's
        cold start, kernels/compile_ahead.py; the passes may then compute garbage). The compile threads, 0 where
        it stays off."""
        return self.runner.start_compile_ahead()

    def stop_compile_ahead(self) -> CompileAheadReport | None:
        return self.runner.stop_compile_ahead()

    def clear_prefix_cache(self) -> int:
        """Drop every prefix-cache entry no running request holds (with its SSM checkpoint); tokens freed."""
        radix = self.steps.cache.radix
        return radix.evict(radix.num_cached_tokens) if radix is not None else 0

    def synchronize(self) -> None:
        """Wait until the runner (every tensor-parallel rank) has finished all work sent so far."""
        self.runner.synchronize()

    def _emit(self, request_id: str, event: TokenEvent) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.push(event)
            if event.finish_reason is not None:
                self._streams.pop(request_id, None)

    def submit(self, seq: Sequence, eos_token_ids: frozenset[int], stream: RequestStream) -> None:
        """Queue a request; raises QueueFull when max_waiting_requests are already waiting."""
        with self._lock:
            waiting = len(self.scheduler.waiting) + self._inbox.qsize()
            if waiting >= self.max_waiting_requests:
                raise QueueFull(waiting, self.max_waiting_requests)
            self._streams[seq.request_id] = stream
            self._inbox.put(("add", (seq, eos_token_ids)))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """Free the request's slot and pages at the start of the next pass (client disconnected)."""
        self._streams.pop(request_id, None)
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="headroom-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.runner.close()

    def drain_inbox(self) -> None:
        """Between passes: every arrival and abort, in order (aborts held back mid-pass first)."""
        deferred, self._deferred_aborts = self._deferred_aborts, []
        for request_id in deferred:
            self.steps.abort(request_id)
        self._take_inbox(defer_aborts=False)

    def _poll_arrivals(self) -> bool:
        """Between two layers of a pass (StepRunner's interjection): arrivals in now, aborts after the pass.
        True when a request arrived. Costs a queue check when nothing did (it runs once a layer)."""
        return not self._inbox.empty() and self._take_inbox(defer_aborts=True)

    def _take_inbox(self, defer_aborts: bool) -> bool:
        added = False
        # One thread reads the inbox (the engine's; warm-up's before it starts): what empty() saw is there to get,
        # and no queue.Empty is raised and caught every pass.
        while not self._inbox.empty():
            kind, payload = self._inbox.get_nowait()
            if kind == "add":
                assert isinstance(payload, tuple)
                self.steps.add(payload[0], payload[1])
                added = True
            elif defer_aborts:
                self._deferred_aborts.append(str(payload))
            else:
                self.steps.abort(str(payload))
        return added

    def run_until_idle(self) -> None:
        """Synchronous driving (warm-up): run passes until nothing is left."""
        self.drain_inbox()
        while self.steps.has_work:
            self._step()
            self.drain_inbox()

    def _step(self) -> StepStats:
        stats = self.steps.step()
        if self.on_step is not None:
            for inner in stats.interjected:
                self.on_step(inner, self)
            self.on_step(stats, self)
        return stats

    def _run(self) -> None:
        self.runner.prepare_thread()
        while not self._stop.is_set():
            self.drain_inbox()
            if not self.steps.has_work:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                stats = self._step()
                if stats.num_prefill_tokens == 0 and stats.num_decodes == 0:
                    # Work waits on memory that only an arrival or an abort can free: do not spin.
                    self._wake.wait(0.01)
                    self._wake.clear()
            except Exception:  # noqa: BLE001 - the loop must outlive any single bug
                logger.exception("engine step failed; failing the running requests")
                self._fail_running()

    def _fail_running(self) -> None:
        """Abort every running request after a failed step; one abort failing must not end the thread."""
        for request in list(self.scheduler.running):
            self.steps.fail(request.request_id, "engine step failed")
