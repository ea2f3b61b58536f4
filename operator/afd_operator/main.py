"""kopf startup settings and handler registration: nothing else lives here."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf

from . import naming
from .api import GROUP, KIND, PLURAL, VERSION
from .handlers import children, deployments  # noqa: F401  (their decorators register the handlers)
from .handlers.admission import guard_pod_membership, validate_afddeployment, validate_afddeployment_scale
from .membership import GUARDED_LABELS
from .metrics import OperatorMetrics
from .reconciler import Reconciler
from .settings import OperatorConfig
from .wakeups import Wakeups
from .writer import Writer

class AFDDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """kopf's diff base, built for AFDDeployments only. kopf builds every watched object's
    "essence" (a deep copy of it) on every event, whether or not a handler compares essences;
    none of ours does for the children (pods and the rest are indexes and wake-ups only), and
    the copies of a 256-pod instance's pod events cost more CPU than creating the pods."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> Any:
        if body.get("kind") != KIND:
            return {}
        return super().build(body=body, extra_fields=extra_fields)


def register(config: OperatorConfig) -> None:
    """Handlers that depend on the configuration (the webhook needs a server to exist)."""
    if config.webhook is not None:
        # Not DELETE: an object must stay deletable whatever today's rules say of it.
        kopf.on.validate(GROUP, VERSION, PLURAL, id="afddeployment-validation",
                         operations=["CREATE", "UPDATE"])(validate_afddeployment)
        kopf.on.validate(GROUP, VERSION, PLURAL, subresource="scale", id="afddeployment-scale-validation",
                         operations=["UPDATE"])(validate_afddeployment_scale)
        for label in GUARDED_LABELS:
            # kopf matches a handler's labels against the new object (and makes them the
            # webhook's objectSelector): an update that removes every guarded label is not seen.
            kopf.on.validate("", "v1", "pods", id=f"pod-membership-{label.rpartition('/')[2]}",
                             operations=["CREATE", "UPDATE"], labels={label: kopf.PRESENT})(guard_pod_membership)


@kopf.on.login()
def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    return memo.config.connection_info()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config: OperatorConfig = memo.config
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = AFDDiffBaseStorage(prefix=GROUP, key="last-handled-configuration")
    # Watches end server-side before the client gives up, so a stuck connection never
    # silences the operator.
    settings.watching.server_timeout = config.watch_timeout_seconds
    settings.watching.client_timeout = config.watch_timeout_seconds + 30
    settings.watching.connect_timeout = 10
    # The operator posts its own events (state changes only); kopf's per-handler chatter
    # would be a write for every loop.
    settings.posting.level = logging.WARNING
    if config.webhook is not None:
        settings.admission.server = kopf.WebhookServer(
            addr=config.webhook.listen_address, port=config.webhook.port, host=config.webhook.host,
            certfile=config.webhook.certfile, pkeyfile=config.webhook.keyfile)
        if config.webhook.configuration_name:
            settings.admission.managed = config.webhook.configuration_name
    metrics = OperatorMetrics(config.registry)
    memo.metrics = metrics
    memo.reconciler = Reconciler(Writer(config.api_client(), metrics), metrics, config.policy)
    memo.wakeups = Wakeups()
    memo.executor = ThreadPoolExecutor(max_workers=config.reconcile_workers, thread_name_prefix="reconcile")
    memo.resync_seconds = config.resync_seconds
    logging.getLogger(__name__).info("afd-operator started; labels %s=%s", naming.LABEL_MANAGED_BY, naming.MANAGER)
