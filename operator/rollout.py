"""The rollout state machine, pure: what is observed -> the one next step.

Every input is re-read on each pass (spec, status, the live Deployment, the smoke test's state),
and everything that must survive a restart lives in status (currentRevision, lastGoodRevision,
failedRevision, rollout.startedAt). So a restarted operator lands on the same step.

    plan -> deploy(target) -> wait ready -> smoke -> promote (Service moves, lastGood = target)
                                   \\-> timeout or smoke failed -> fail (failedRevision = target)
    desired == failedRevision -> target = lastGood (autoRollback) -> deploy/wait -> Degraded
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class SmokeState(str, Enum):
    NONE = "none"
    RUNNING = "running"
    PASSED = "passed"
    FAILED = "failed"


class Action(str, Enum):
    HOLD = "hold"  # nothing to do: no plan and nothing to fall back to
    DEPLOY = "deploy"  # render the Deployment of `revision`
    WAIT = "wait"  # the Deployment of `revision` is not ready yet
    START_SMOKE = "start_smoke"
    PROMOTE = "promote"  # smoke passed: lastGood = revision, the Service moves to it
    FAIL = "fail"  # revision failed (smoke or readiness): failedRevision = revision
    STEADY = "steady"  # revision is the last good one and ready


@dataclass(frozen=True)
class Observed:
    """Inputs of one pass. Times are seconds since the epoch."""

    desired_revision: str | None
    last_good_revision: str | None
    failed_revision: str | None
    deployment_revision: str | None
    deployment_ready: bool
    rollout_started_at: float | None
    smoke: SmokeState
    smoke_enabled: bool
    auto_rollback: bool
    ready_timeout_s: float
    now: float


@dataclass(frozen=True)
class Step:
    action: Action
    revision: str | None
    phase: str
    reason: str
    message: str = ""


def target_revision(observed: Observed) -> str | None:
    """The revision the Deployment should run: the desired one, unless it already failed."""
    if observed.desired_revision is None:
        return observed.deployment_revision
    if observed.desired_revision != observed.failed_revision:
        return observed.desired_revision
    return observed.last_good_revision if observed.auto_rollback else observed.failed_revision


def next_step(observed: Observed) -> Step:
    target = target_revision(observed)
    # A spec that does not plan (desired None) keeps what runs; only a failed desired revision rolls back.
    rolling_back = (
        observed.desired_revision is not None and target != observed.desired_revision
        and target == observed.last_good_revision
    )
    if target is None:
        reason = "NoGoodRevision" if observed.desired_revision else "NotPlanned"
        return Step(Action.HOLD, None, "Failed" if observed.desired_revision else "Pending", reason)
    if target == observed.failed_revision and target != observed.last_good_revision:
        return Step(Action.HOLD, target, "Failed", "RevisionFailed", f"revision {target} failed; autoRollback is off")
    if observed.deployment_revision != target:
        phase = "RollingBack" if rolling_back else "Deploying"
        return Step(Action.DEPLOY, target, phase, "RollingBack" if rolling_back else "NewRevision")
    if not observed.deployment_ready:
        started = observed.rollout_started_at if observed.rollout_started_at is not None else observed.now
        waited = observed.now - started
        is_known_good = target == observed.last_good_revision
        if waited > observed.ready_timeout_s and not is_known_good:
            return Step(
                Action.FAIL, target, "Failed", "NotReady",
                f"revision {target} not ready after {waited:.0f} s (readyTimeoutSeconds={observed.ready_timeout_s:.0f})",
            )
        return Step(Action.WAIT, target, "RollingBack" if rolling_back else "Deploying", "WaitingForReady")
    if target == observed.last_good_revision:
        if rolling_back:
            return Step(Action.STEADY, target, "Degraded", "RolledBack",
                        f"serving last good revision {target}; revision {observed.desired_revision} failed")
        return Step(Action.STEADY, target, "Ready", "Validated")
    if not observed.smoke_enabled:
        return Step(Action.PROMOTE, target, "Ready", "SmokeTestDisabled")
    if observed.smoke == SmokeState.NONE:
        return Step(Action.START_SMOKE, target, "Validating", "SmokeStarted")
    if observed.smoke == SmokeState.RUNNING:
        return Step(Action.WAIT, target, "Validating", "SmokeRunning")
    if observed.smoke == SmokeState.PASSED:
        return Step(Action.PROMOTE, target, "Ready", "SmokePassed")
    return Step(Action.FAIL, target, "Failed", "SmokeFailed")
