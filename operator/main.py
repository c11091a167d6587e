"""`headroom operator`: run the kopf operator for InferenceServers.

    headroom operator --namespace=llm --standalone --liveness=http://0.0.0.0:8080/healthz \\
        --webhook-port=9443 --webhook-cert=/etc/headroom/webhook-tls/tls.crt --webhook-key=.../tls.key
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from headroom.operator.context import MEMO_KEY, OperatorContext, OperatorSettings, WebhookOptions
from headroom.operator.smoke_gate import SmokeRunner, run_engine_smoke

_DEFAULTS = OperatorSettings()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], help="watch this namespace (repeatable)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch the whole cluster")
    peers = parser.add_mutually_exclusive_group()
    peers.add_argument("--standalone", action="store_true", help="no peering: the only operator instance")
    peers.add_argument("--peering", default=None, help="kopf peering object name (several replicas, one active)")
    parser.add_argument("--priority", type=int, default=0, help="peering priority of this instance")
    parser.add_argument("--liveness", default=None, help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--engine-image", default=_DEFAULTS.engine_image, help="image for engine.kind=builtin")
    parser.add_argument(
        "--engine-url-template", default=_DEFAULTS.engine_url_template,
        help="URL of the revision under test; fields {service} {namespace} {name} {port} {cluster_ip}",
    )
    parser.add_argument("--tick-seconds", type=float, default=_DEFAULTS.tick_seconds, help="re-check interval")
    parser.add_argument("--webhook-port", type=int, default=None, help="serve the validating webhook on this port")
    parser.add_argument("--webhook-addr", default="0.0.0.0", help="address the webhook server binds")
    parser.add_argument("--webhook-host", default=None, help="DNS name in a self-signed certificate / managed URL")
    parser.add_argument("--webhook-cert", default=None, help="PEM certificate file (chart Secret or cert-manager)")
    parser.add_argument("--webhook-key", default=None, help="PEM private key file")
    parser.add_argument("--webhook-insecure", action="store_true", help="plain HTTP (local testing only)")
    parser.add_argument("--webhook-manage", default=None, help="let kopf own this ValidatingWebhookConfiguration")


def webhook_options(args: argparse.Namespace) -> WebhookOptions | None:
    if args.webhook_port is None:
        return None
    if bool(args.webhook_cert) != bool(args.webhook_key):
        raise SystemExit("--webhook-cert and --webhook-key go together (got only one)")
    return WebhookOptions(
        port=args.webhook_port, addr=args.webhook_addr, host=args.webhook_host, cert_file=args.webhook_cert,
        key_file=args.webhook_key, insecure=args.webhook_insecure, manage=args.webhook_manage,
    )


def run(args: argparse.Namespace) -> int:
    import kopf
    from headroom.operator.kube import KubeClient
    from headroom.operator.registry import build_registry

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.namespace and not args.all_namespaces:
        raise SystemExit("choose --namespace NAME (repeatable) or --all-namespaces")
    webhook = webhook_options(args)
    settings = OperatorSettings(
        engine_image=args.engine_image, engine_url_template=args.engine_url_template, tick_seconds=args.tick_seconds
    )
    ctx = OperatorContext(
        kube=KubeClient.from_environment(), settings=settings, smoke=SmokeRunner(run_engine_smoke), webhook=webhook
    )
    asyncio.run(kopf.operator(
        registry=build_registry(with_admission=webhook is not None),
        memo=kopf.Memo({MEMO_KEY: ctx}),
        standalone=args.standalone or args.peering is None,
        peering_name=args.peering,
        priority=args.priority,
        liveness_endpoint=args.liveness,
        clusterwide=args.all_namespaces,
        namespaces=args.namespace,
    ))
    return 0
