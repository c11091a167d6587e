"""Prometheus metrics of one engine: pools, prefix cache, queues, scheduler decisions, TTFT and ITL.

One registry per server (no module-level state), rendered by /metrics. Pool gauges are refreshed
after every pass by `observe_step`; latency histograms are fed by the server as tokens stream out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from headroom.engine.server.telemetry import GPUCollector
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from headroom.engine.loop.engine_loop import EngineLoop
    from headroom.engine.loop.step import StepStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class EngineMetrics:
    def __init__(self, with_gpu: bool = True):
        self.registry = CollectorRegistry()
        r = self.registry
        self.kv_used = Gauge("headroom_kv_used_tokens", "KV pool token slots in use", registry=r)
        self.kv_total = Gauge("headroom_kv_total_tokens", "KV pool token slots", registry=r)
        self.ssm_used = Gauge("headroom_ssm_used_slots", "SSM state slots in use", registry=r)
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
        if with_gpu:
            r.register(GPUCollector())

    def observe_step(self, stats: StepStats, loop: EngineLoop) -> None:
        """Called on the engine thread after each pass."""
        self.passes.inc()
        self.pass_seconds.observe(stats.seconds)
        self.prefill_tokens.inc(stats.num_prefill_tokens)
        self.refresh(loop)

    def refresh(self, loop: EngineLoop) -> None:
        cache = loop.steps.cache
        self.kv_total.set(cache.kv_allocator.num_tokens)
        self.kv_used.set(cache.kv_allocator.num_used_tokens)
        if cache.ssm_allocator is not None:
            self.ssm_total.set(cache.ssm_allocator.num_slots)
            self.ssm_used.set(cache.ssm_allocator.num_used)
        if cache.radix is not None:
            self.cache_tokens.set(cache.radix.num_cached_tokens)
        scheduler = loop.scheduler
        self.waiting.set(len(scheduler.waiting))
        self.running.set(len(scheduler.running))
        self.prefilling.set(scheduler.num_prefilling)
        self.preemptions.set(scheduler.num_preemptions)
        # /metrics runs this on the event loop while the engine thread may add a reason: iterate a copy.
        for reason, count in dict(scheduler.rejections).items():
            self.rejections.labels(reason=reason).set(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
