"""The pure rollout state machine: each observed situation -> the one next step."""

from __future__ import annotations

import dataclasses

import pytest
from headroom.operator.rollout import Action, Observed, SmokeState, next_step

BASE = Observed(
    desired_revision="new", last_good_revision="good", failed_revision=None, deployment_revision="good",
    deployment_ready=True, rollout_started_at=100.0, smoke=SmokeState.NONE, smoke_enabled=True,
    auto_rollback=True, ready_timeout_s=600.0, now=200.0,
)


def step_for(**changes):
    return next_step(dataclasses.replace(BASE, **changes))


@pytest.mark.parametrize("changes, action, revision, phase", [
    ({}, Action.DEPLOY, "new", "Deploying"),
    ({"deployment_revision": "new", "deployment_ready": False}, Action.WAIT, "new", "Deploying"),
    ({"deployment_revision": "new"}, Action.START_SMOKE, "new", "Validating"),
    ({"deployment_revision": "new", "smoke": SmokeState.RUNNING}, Action.WAIT, "new", "Validating"),
    ({"deployment_revision": "new", "smoke": SmokeState.PASSED}, Action.PROMOTE, "new", "Ready"),
    ({"deployment_revision": "new", "smoke": SmokeState.FAILED}, Action.FAIL, "new", "Failed"),
    ({"deployment_revision": "new", "smoke_enabled": False}, Action.PROMOTE, "new", "Ready"),
    # Not ready for longer than readyTimeoutSeconds: the revision fails without a smoke test.
    ({"deployment_revision": "new", "deployment_ready": False, "now": 800.0}, Action.FAIL, "new", "Failed"),
    # After a failure: back to the last good revision, then steady but degraded.
    ({"deployment_revision": "new", "failed_revision": "new"}, Action.DEPLOY, "good", "RollingBack"),
    ({"failed_revision": "new", "deployment_ready": False, "now": 9999.0}, Action.WAIT, "good", "RollingBack"),
    ({"failed_revision": "new"}, Action.STEADY, "good", "Degraded"),
    ({"desired_revision": "good"}, Action.STEADY, "good", "Ready"),
    # First rollout failed with nothing to fall back on; or autoRollback is off.
    ({"last_good_revision": None, "failed_revision": "new", "deployment_revision": "new"}, Action.HOLD, None, "Failed"),
    ({"failed_revision": "new", "auto_rollback": False, "deployment_revision": "new"}, Action.HOLD, "new", "Failed"),
    # The spec does not plan (refused): keep serving what runs.
    ({"desired_revision": None}, Action.STEADY, "good", "Ready"),
    ({"desired_revision": None, "deployment_revision": None, "last_good_revision": None}, Action.HOLD, None, "Pending"),
])
def test_next_step(changes, action, revision, phase) -> None:
    step = step_for(**changes)
    assert (step.action, step.revision, step.phase) == (action, revision, phase), step


def test_smoke_result_of_a_revision_is_never_reused_for_another() -> None:
    # The smoke state is looked up per (namespace, name, revision); a new revision starts from NONE.
    assert step_for(deployment_revision="new", smoke=SmokeState.NONE).action == Action.START_SMOKE
