"""The smoke test as a rollout gate: run `headroom smoke`'s library function in a worker thread.

Handlers never block on it: start() submits, state() polls. The results live in memory only;
a restarted operator finds no result for the revision under test and simply runs it again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from headroom.operator.rollout import SmokeState

# CRD spec.smokeTest.thresholds (camelCase) -> headroom.client.smoke_types.SmokeThresholds fields.
THRESHOLD_FIELDS = {
    "maxShortTtftSeconds": "max_short_ttft_s",
    "minPrefillTokensPerSecond": "min_prefill_tokens_per_s",
    "minRetentionHitRate": "min_retention_hit_rate",
    "cliffUtilPercent": "cliff_util_percent",
    "cliffPowerRatio": "cliff_power_ratio",
}


@dataclass(frozen=True)
class SmokeRequest:
    """What to test: the engine's URL and the plan's limits (tokens); timeout in seconds. plan: the revision's
    plan, whose retained sessions the retention probe revisits (never more than it promised)."""

    url: str
    context_length: int
    max_new_tokens: int
    thresholds: dict[str, float]
    timeout_s: float
    plan: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SmokeOutcome:
    passed: bool
    summary: str
    checks: dict[str, Any] = field(default_factory=dict)


SmokeFn = Callable[[SmokeRequest], SmokeOutcome]


def run_engine_smoke(request: SmokeRequest) -> SmokeOutcome:
    """The real gate: headroom.client.smoke.smoke against the engine over HTTP, retention sized by the plan."""
    import asyncio

    from headroom.client.retention_target import retention_settings
    from headroom.client.smoke import smoke
    from headroom.client.smoke_types import SmokeSettings, SmokeThresholds

    unknown = sorted(set(request.thresholds) - set(THRESHOLD_FIELDS))
    if unknown:
        return SmokeOutcome(False, f"spec.smokeTest.thresholds has unknown keys {unknown}; known: {sorted(THRESHOLD_FIELDS)}")
    thresholds = SmokeThresholds(**{THRESHOLD_FIELDS[k]: v for k, v in request.thresholds.items()})
    settings = SmokeSettings(context_length=request.context_length, max_new_tokens=request.max_new_tokens)
    settings = retention_settings(settings, request.plan or None)
    report = asyncio.run(smoke(request.url, settings, thresholds, request_timeout_s=request.timeout_s))
    checks = {name: {"status": c.status, "reason": c.reason} for name, c in report.checks.items()}
    if report.passed:
        return SmokeOutcome(True, f"{len(checks)} checks passed", checks)
    failures = "; ".join(f"{name}: {reason}" for name, reason in report.failures.items())
    return SmokeOutcome(False, failures, checks)


class SmokeRunner:
    """Smoke tests in flight, keyed by (namespace, name, revision)."""

    def __init__(self, smoke_fn: SmokeFn, max_workers: int = 2):
        self._smoke_fn = smoke_fn
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="smoke")
        self._futures: dict[tuple[str, str, str], Future[SmokeOutcome]] = {}
        self._lock = threading.Lock()

    def _guarded(self, request: SmokeRequest) -> SmokeOutcome:
        try:
            return self._smoke_fn(request)
        except Exception as exc:  # noqa: BLE001 - a crashed smoke test is a failed gate, with the reason
            return SmokeOutcome(False, f"smoke test crashed: {type(exc).__name__}: {exc}")

    def start(self, key: tuple[str, str, str], request: SmokeRequest) -> None:
        with self._lock:
            if key not in self._futures:
                self._futures[key] = self._pool.submit(self._guarded, request)

    def state(self, key: tuple[str, str, str]) -> tuple[SmokeState, SmokeOutcome | None]:
        with self._lock:
            future = self._futures.get(key)
        if future is None:
            return SmokeState.NONE, None
        if not future.done():
            return SmokeState.RUNNING, None
        outcome = future.result()
        return (SmokeState.PASSED if outcome.passed else SmokeState.FAILED), outcome

    def forget(self, namespace: str, name: str) -> None:
        """Drop results of one InferenceServer (running threads finish and are ignored)."""
        with self._lock:
            for key in [k for k in self._futures if k[:2] == (namespace, name)]:
                del self._futures[key]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
