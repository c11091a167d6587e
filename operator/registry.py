"""Build the kopf registry of this operator: which handler reacts to what.

Explicit registries instead of import-time decorators: the admission handler is registered only
when a webhook server is configured (kopf refuses to start otherwise), and tests can run several
operators in one process without sharing global state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import kopf
from headroom.operator import admission, handlers, startup
from headroom.operator.labels import GROUP, PLURAL, VERSION


def build_registry(
    *, with_admission: bool, login: Callable[..., Any] = kopf.login_via_client
) -> kopf.OperatorRegistry:
    """login: kopf's credentials source (in-cluster service account, else kubeconfig, by default)."""
    registry = kopf.OperatorRegistry()
    resource = (GROUP, VERSION, PLURAL)
    kopf.on.login(registry=registry)(login)
    kopf.on.startup(registry=registry)(startup.operator_startup)
    kopf.on.cleanup(registry=registry)(startup.operator_cleanup)
    kopf.on.create(*resource, registry=registry)(handlers.inferenceserver_create)
    kopf.on.update(*resource, field="spec", registry=registry)(handlers.inferenceserver_update)
    kopf.on.resume(*resource, registry=registry)(handlers.inferenceserver_resume)
    kopf.daemon(*resource, cancellation_timeout=10.0, registry=registry)(handlers.inferenceserver_daemon)
    kopf.on.delete(*resource, registry=registry)(handlers.inferenceserver_delete)
    if with_admission:
        kopf.on.validate(
            *resource, id=admission.WEBHOOK_ID, operations=["CREATE", "UPDATE"], registry=registry
        )(admission.inferenceserver_validate)
    return registry
