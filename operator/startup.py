"""kopf's own settings for this operator, applied at startup from the context in memo."""

from __future__ import annotations

import logging
from typing import Any

import kopf
from headroom.operator.context import MEMO_KEY, OperatorContext, WebhookOptions

PREFIX = "headroom.dev"


def webhook_server(options: WebhookOptions) -> kopf.WebhookServer:
    return kopf.WebhookServer(
        addr=options.addr,
        port=options.port,
        host=options.host,
        certfile=options.cert_file,
        pkeyfile=options.key_file,
        insecure=options.insecure,
    )


def operator_startup(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    ctx: OperatorContext = memo[MEMO_KEY]
    settings.persistence.finalizer = f"{PREFIX}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=PREFIX)
    # Handler logs stay in the operator's log; Events are posted explicitly, for what users must see.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    if ctx.webhook is not None:
        settings.admission.server = webhook_server(ctx.webhook)
        settings.admission.managed = ctx.webhook.manage


def operator_cleanup(memo: Any, **_: Any) -> None:
    memo[MEMO_KEY].smoke.shutdown()
