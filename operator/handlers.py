"""kopf handlers for InferenceServer: thin and level-based, all funnelled into reconcile().

The create/update/resume handlers give a prompt first pass (status.plan within a second); the
per-object daemon re-runs the same pass every tick, which is what drives a rollout forward.
Handlers are sync on purpose: kopf runs them in threads, and the API calls and the planner block. The
daemon alone is async, running each blocking pass in a worker thread: a sync daemon ends only when kopf
sets its stop flag, so an operator cancelled without that (a test harness, an abrupt shutdown) left its
thread reconciling forever and the event loop's shutdown waiting on it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import kopf
from headroom.operator.context import MEMO_KEY, OperatorContext
from headroom.operator.kube import KubeError, object_path
from headroom.operator.labels import canary_service_name, config_map_name
from headroom.operator.reconcile import reconcile
from headroom.operator.revisions import RevisionMissing
from headroom.operator.rollout import Step


def _context(memo: Any) -> OperatorContext:
    return memo[MEMO_KEY]


def _locked_reconcile(memo: Any, namespace: str, name: str, logger: logging.Logger) -> Step | None:
    # One pass at a time per object: the daemon and the change handlers run in different threads.
    lock = memo.setdefault("reconcile_lock", threading.Lock())
    with lock:
        return reconcile(_context(memo), namespace, name, logger)


def _handle(memo: Any, namespace: str, name: str, logger: logging.Logger) -> None:
    try:
        _locked_reconcile(memo, namespace, name, logger)
    except (KubeError, RevisionMissing) as exc:
        raise kopf.TemporaryError(str(exc), delay=5) from exc


def inferenceserver_create(namespace: str, name: str, memo: Any, logger: logging.Logger, **_: Any) -> None:
    _handle(memo, namespace, name, logger)


def inferenceserver_update(namespace: str, name: str, memo: Any, logger: logging.Logger, **_: Any) -> None:
    _handle(memo, namespace, name, logger)


def inferenceserver_resume(namespace: str, name: str, memo: Any, logger: logging.Logger, **_: Any) -> None:
    _handle(memo, namespace, name, logger)


async def inferenceserver_daemon(
    stopped: kopf.DaemonStopped, namespace: str, name: str, memo: Any, logger: logging.Logger, **_: Any
) -> None:
    """Re-check every tick: Deployment readiness and smoke results arrive without any event. Stopping or
    cancelling the operator ends it at the next await; a pass already in its thread runs to its end."""
    tick = _context(memo).settings.tick_seconds
    while not stopped:
        try:
            await asyncio.to_thread(_locked_reconcile, memo, namespace, name, logger)
        except Exception as exc:  # noqa: BLE001 - the daemon must outlive one failed pass; the next tick retries
            logger.warning(f"reconcile of {namespace}/{name} failed, retrying in {tick} s: {exc}")
        await stopped.wait(tick)


def inferenceserver_delete(
    namespace: str, name: str, status: Any, memo: Any, logger: logging.Logger, **_: Any
) -> None:
    """Delete children explicitly: owner references suffice in a cluster, but not without a GC."""
    ctx = _context(memo)
    ctx.smoke.forget(namespace, name)
    kube = ctx.kube
    revisions = {status.get(k) for k in ("currentRevision", "lastGoodRevision", "failedRevision")} - {None}
    paths = [
        object_path("apps/v1", "deployments", namespace, name),
        object_path("v1", "services", namespace, name),
        object_path("v1", "services", namespace, canary_service_name(name)),
        *(object_path("v1", "configmaps", namespace, config_map_name(name, r)) for r in sorted(revisions)),
    ]
    for path in paths:
        kube.delete(path)
    logger.info(f"{namespace}/{name}: deleted {len(paths)} children")
