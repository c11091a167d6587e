"""What every handler needs, built once at startup and carried in kopf's memo (no module globals)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from headroom.operator.kube import KubeClient
from headroom.operator.smoke_gate import SmokeRunner

MEMO_KEY = "headroom"


@dataclass(frozen=True)
class OperatorSettings:
    """engine_url_template fields: {service} (the canary Service), {namespace}, {name}, {port}, and
    {cluster_ip}: the canary Service's spec.clusterIP, read when the template names it.

    In a cluster the default resolves through DNS; `http://{cluster_ip}:{port}` needs no DNS (an operator
    outside the cluster's resolver, or one machine with a local node agent, as `make demo` runs it).
    """

    engine_image: str = "ghcr.io/headroom/headroom-engine:latest"
    engine_url_template: str = "http://{service}.{namespace}.svc:{port}"
    tick_seconds: float = 5.0


@dataclass(frozen=True)
class WebhookOptions:
    """Where the admission webhook listens and which certificate it serves.

    cert_file/key_file: a mounted Secret (the Helm chart's, or cert-manager's). Neither: kopf makes a
    self-signed certificate for `host` (needs kopf's optional certbuilder). insecure: plain HTTP,
    for local tests only. manage: name of a ValidatingWebhookConfiguration kopf should own (off when
    the chart installs one).
    """

    port: int
    addr: str = "0.0.0.0"
    host: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure: bool = False
    manage: str | None = None


@dataclass(frozen=True)
class OperatorContext:
    kube: KubeClient
    settings: OperatorSettings
    smoke: SmokeRunner
    webhook: WebhookOptions | None = None
    clock: Callable[[], float] = field(default=time.time)
