"""`afd-operator`: run the AFDDeployment operator.

Run exactly one replica (Deployment strategy Recreate): kopf's peering only pauses other
instances, it is not leader election.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional

from .policy import PolicyError, load_policy
from .settings import OperatorConfig, WebhookConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="afd-operator",
        description="Kubernetes operator for AFDDeployment (Attention-FFN-disaggregated MoE serving). "
                    "Run exactly one replica with the Recreate strategy: peering is not leader election.",
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable); default: all namespaces")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch all namespaces (default)")
    p.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"),
                   help="kubeconfig file (default: $KUBECONFIG, else the in-cluster service account)")
    p.add_argument("--in-cluster", action="store_true", help="use the pod's service account even if KUBECONFIG is set")
    p.add_argument("--metrics-port", type=int, default=8080, help="Prometheus /metrics port (0 disables; default 8080)")
    p.add_argument("--liveness", metavar="URL", default="http://0.0.0.0:8081/healthz",
                   help="liveness probe endpoint served by kopf (default http://0.0.0.0:8081/healthz)")
    p.add_argument("--resync-seconds", type=float, default=10.0,
                   help="reconcile each AFDDeployment at least this often (default 10)")
    p.add_argument("--reconcile-workers", type=int, default=8,
                   help="threads that run reconciliations concurrently (default 8)")
    p.add_argument("--watch-timeout-seconds", type=int, default=300, help="server-side watch timeout (default 300)")
    p.add_argument("--webhook-port", type=int, help="serve the validating admission webhook on this port")
    p.add_argument("--webhook-host", help="host name or IP the apiserver uses to reach the webhook "
                                          "(must be in the certificate's SANs)")
    p.add_argument("--webhook-listen", default="0.0.0.0", help="webhook listen address (default 0.0.0.0)")
    p.add_argument("--webhook-cert", help="TLS certificate (PEM) for the webhook")
    p.add_argument("--webhook-key", help="TLS private key (PEM) for the webhook")
    p.add_argument("--operator-username", metavar="USER",
                   help="the user the API server names this operator's requests by (in a cluster "
                        "system:serviceaccount:NAMESPACE:NAME; the chart sets it): the webhook refuses pods "
                        "with afd.inference.dev labels, or changes of those labels, from anyone else")
    p.add_argument("--webhook-configuration", metavar="NAME",
                   help="create and maintain this ValidatingWebhookConfiguration, a fully qualified name "
                        "such as validation.afd.inference.dev (default: none; "
                        "the Helm chart installs its own)")
    p.add_argument("--policy", metavar="FILE",
                   help="chart values (YAML) whose hostAccess and networkPolicy say what AFDDeployments may use of "
                        "the nodes and how their pods are isolated (default: the chart's defaults; the chart mounts "
                        "its own)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def config_from_args(args: argparse.Namespace) -> OperatorConfig:
    webhook = None
    if args.webhook_port is not None:
        missing = [flag for flag, value in (("--webhook-host", args.webhook_host), ("--webhook-cert", args.webhook_cert),
                                            ("--webhook-key", args.webhook_key),
                                            ("--operator-username", args.operator_username)) if not value]
        if missing:
            raise SystemExit(f"afd-operator: --webhook-port needs {', '.join(missing)}")
        webhook = WebhookConfig(port=args.webhook_port, host=args.webhook_host, certfile=args.webhook_cert,
                                keyfile=args.webhook_key, operator_username=args.operator_username,
                                listen_address=args.webhook_listen,
                                configuration_name=args.webhook_configuration)
    if args.resync_seconds <= 0:
        raise SystemExit("afd-operator: --resync-seconds must be > 0")
    if args.reconcile_workers < 1:
        raise SystemExit("afd-operator: --reconcile-workers must be >= 1")
    try:
        policy = load_policy(args.policy) if args.policy else None
    except (OSError, PolicyError) as err:
        raise SystemExit(f"afd-operator: --policy {args.policy}: {err}") from None
    return OperatorConfig(
        namespaces=list(args.namespace),
        kubeconfig=None if args.in_cluster else args.kubeconfig,
        metrics_port=args.metrics_port,
        liveness_endpoint=args.liveness or None,
        resync_seconds=args.resync_seconds,
        watch_timeout_seconds=args.watch_timeout_seconds,
        reconcile_workers=args.reconcile_workers,
        webhook=webhook,
        **({"policy": policy} if policy else {}),
    )


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        # kopf logs every handler run at INFO: one line per watch event.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    import kopf
    from prometheus_client import start_http_server

    from .main import register

    register(config)
    if config.metrics_port:
        start_http_server(config.metrics_port, registry=config.registry)
    kopf.run(
        standalone=True,
        clusterwide=not config.namespaces,
        namespaces=config.namespaces,
        liveness_endpoint=config.liveness_endpoint,
        memo=kopf.Memo(config=config),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
