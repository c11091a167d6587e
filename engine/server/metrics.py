"""Prometheus metrics of one engine: pools, prefix cache, queues, scheduler decisions, TTFT and ITL.

One registry per server (no module-level state), rendered by /metrics. The engine thread counts each pass
(`observe_step`); the gauges and prefix counters, which read the engine's state, are brought up to date when
/metrics is scraped (`refresh`); latency histograms are fed by the server as tokens stream out.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from headroom.engine.server.telemetry import GPUCollector
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from headroom.engine.loop.engine_loop import EngineLoop
    from headroom.engine.loop.step import StepStats

logger = logging.getLogger("headroom.prefix_cache")
# Matched-but-no-state misses are logged at most this often (seconds).
MISS_LOG_INTERVAL_S = 60.0
# Cumulative PrefixStats fields (and the radix cache's evictions) -> counter name and help.
_PREFIX_COUNTERS = {
    "looked_up_tokens": ("headroom_prefix_lookup_tokens", "prompt tokens looked up in the prefix cache"),
    "matched_tokens": ("headroom_prefix_matched_tokens", "looked-up tokens whose KV the prefix cache held"),
    "matched_no_state_tokens": ("headroom_prefix_matched_no_state_tokens",
                                "matched tokens not reused: no SSM checkpoint covered them (silent miss)"),
    "checkpoints_taken": ("headroom_ssm_checkpoints_taken", "SSM checkpoints stored in the prefix cache"),
    "checkpoints_evicted": ("headroom_ssm_checkpoints_evicted", "SSM checkpoints dropped from the prefix cache"),
}
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class EngineMetrics:
    def __init__(self, with_gpu: bool = True):
        self.registry = CollectorRegistry()
        r = self.registry
        self.kv_used = Gauge("headroom_kv_used_tokens", "KV pool token slots in use", registry=r)
        self.kv_total = Gauge("headroom_kv_total_tokens", "KV pool token slots", registry=r)
        self.ssm_used = Gauge("headroom_ssm_used_slots", "SSM state slots held by running requests (working)",
                              registry=r)
        self.ssm_checkpoints = Gauge("headroom_ssm_checkpoint_slots",
                                     "SSM state slots held by prefix-cache checkpoints (evictable when unlocked)",
                                     registry=r)
        self.ssm_total = Gauge("headroom_ssm_total_slots", "SSM state slots", registry=r)
        self.cache_tokens = Gauge("headroom_prefix_cache_tokens", "tokens held by the prefix cache", registry=r)
        self.waiting = Gauge("headroom_requests_waiting", "requests in the waiting queue", registry=r)
        self.running = Gauge("headroom_requests_running", "requests admitted (prefill or decode)", registry=r)
        self.prefilling = Gauge("headroom_requests_prefilling", "running requests still prefilling", registry=r)
        self.prompt_tokens = Counter("headroom_prompt_tokens", "prompt tokens received", registry=r)
        self.cached_tokens = Counter("headroom_cached_prompt_tokens", "prompt tokens served from the prefix cache",
                                     registry=r)
        self.generated_tokens = Counter("headroom_generation_tokens", "tokens generated", registry=r)
        self.prefill_tokens = Counter("headroom_prefill_tokens_computed", "prefill tokens computed", registry=r)
        self.passes = Counter("headroom_forward_passes", "forward passes run", registry=r)
        self.interjected = Counter("headroom_interjected_passes",
                                   "passes run between two layers of a longer one (short prefills, decode steps)",
                                   registry=r)
        self.rejections = Gauge("headroom_admission_rejections", "admission rejections by reason",
                                ["reason"], registry=r)
        self.preemptions = Gauge("headroom_preemptions", "requests preempted (recomputed later)", registry=r)
        self.requests = Counter("headroom_requests", "finished requests by reason", ["finish_reason"], registry=r)
        self.ttft = Histogram("headroom_time_to_first_token_seconds", "arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("headroom_inter_token_latency_seconds", "gap between streamed tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.pass_seconds = Histogram("headroom_pass_seconds", "forward pass wall time",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.kernel_compiles = Counter(
            "headroom_kernel_compiles_after_ready",
            "Triton kernel specialisations compiled after /ready (each inside a request; the warm-up missed them)",
            registry=r)
        self.prefix = {key: Counter(name, text, registry=r) for key, (name, text) in _PREFIX_COUNTERS.items()}
        self._prefix_seen = dict.fromkeys(_PREFIX_COUNTERS, 0)
        # The miss log is written from the engine thread (after a pass) and from the event loop (/metrics).
        self._prefix_lock = threading.Lock()
        # The first miss is logged at once, later ones at most every MISS_LOG_INTERVAL_S.
        self._miss_logged_at = time.monotonic() - MISS_LOG_INTERVAL_S
        self._miss_logged_tokens = 0
        if with_gpu:
            r.register(GPUCollector())

    def observe_step(self, stats: StepStats, loop: EngineLoop) -> None:
        """Called on the engine thread after each pass: the per-pass counters, and the silent-miss log (due once a
        minute whether or not anyone scrapes). The gauges wait for the scrape (refresh): set after every pass, a
        dozen locked values nobody read cost the engine thread 20-35 us a decode step on the CPU
        (bench/engine_thread_overhead.py)."""
        self.passes.inc()
        # Interjected passes come through here too, before the pass they ran in, which lists them.
        if stats.interjected:
            self.interjected.inc(len(stats.interjected))
        self.pass_seconds.observe(stats.seconds)
        if stats.num_prefill_tokens:
            self.prefill_tokens.inc(stats.num_prefill_tokens)
        prefix = loop.steps.cache.stats
        if prefix.matched_no_state_tokens > self._miss_logged_tokens:
            with self._prefix_lock:
                self._log_misses(prefix.matched_no_state_tokens, prefix.looked_up_tokens)

    def refresh(self, loop: EngineLoop) -> None:
        cache = loop.steps.cache
        self.kv_total.set(cache.kv_allocator.num_tokens)
        self.kv_used.set(cache.kv_allocator.num_used_tokens)
        checkpoints = cache.radix.num_checkpoints if cache.radix is not None else 0
        if cache.ssm_allocator is not None:
            self.ssm_total.set(cache.ssm_allocator.num_slots)
            self.ssm_used.set(cache.ssm_allocator.num_used - checkpoints)
            self.ssm_checkpoints.set(checkpoints)
        if cache.radix is not None:
            self.cache_tokens.set(cache.radix.num_cached_tokens)
        totals = dict(vars(cache.stats))
        totals["checkpoints_evicted"] = cache.radix.num_checkpoints_evicted if cache.radix is not None else 0
        with self._prefix_lock:
            self._refresh_prefix(totals)
        scheduler = loop.scheduler
        self.waiting.set(len(scheduler.waiting))
        self.running.set(len(scheduler.running))
        self.prefilling.set(scheduler.num_prefilling)
        self.preemptions.set(scheduler.num_preemptions)
        # /metrics runs this on the event loop while the engine thread may add a reason: iterate a copy.
        for reason, count in dict(scheduler.rejections).items():
            self.rejections.labels(reason=reason).set(count)

    def _refresh_prefix(self, totals: dict[str, int]) -> None:
        """Advance the prefix counters to the cache's cumulative figures; log silent misses once a minute."""
        for key, counter in self.prefix.items():
            if totals[key] > self._prefix_seen[key]:
                counter.inc(totals[key] - self._prefix_seen[key])
                self._prefix_seen[key] = totals[key]
        self._log_misses(totals["matched_no_state_tokens"], totals["looked_up_tokens"])

    def _log_misses(self, missed: int, looked_up: int) -> None:
        """Log the silent misses since the last report, at most every MISS_LOG_INTERVAL_S (under _prefix_lock)."""
        now = time.monotonic()
        if missed > self._miss_logged_tokens and now - self._miss_logged_at >= MISS_LOG_INTERVAL_S:
            logger.warning(
                "prefix cache: %d prompt tokens matched cached KV but had no SSM checkpoint and were recomputed "
                "since the last report (%d of %d looked up since start); headroom_prefix_matched_no_state_tokens "
                "counts them", missed - self._miss_logged_tokens, missed, looked_up,
            )
            self._miss_logged_at, self._miss_logged_tokens = now, missed

    def render(self) -> bytes:
        return generate_latest(self.registry)
