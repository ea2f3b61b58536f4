"""Operator configuration from the command line (see `afd-operator --help`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from kubernetes import client, config as kube_config
from prometheus_client import CollectorRegistry

from .policy import ClusterPolicy

if TYPE_CHECKING:
    import kopf


@dataclass(frozen=True)
class WebhookConfig:
    port: int
    host: str  # the name or address the apiserver dials (must be in the certificate)
    certfile: str
    keyfile: str
    # The user the API server names this operator's requests by: the only one that may create
    # or relabel pods carrying afd.inference.dev labels (membership.py).
    operator_username: str
    listen_address: str = "0.0.0.0"
    # When set, the operator creates and keeps this ValidatingWebhookConfiguration itself;
    # otherwise one is installed separately (the Helm chart does).
    configuration_name: Optional[str] = None


@dataclass
class OperatorConfig:
    namespaces: list[str] = field(default_factory=list)  # empty: all namespaces
    kubeconfig: Optional[str] = None  # None: in-cluster service account
    metrics_port: int = 8080
    liveness_endpoint: Optional[str] = None
    resync_seconds: float = 10.0
    watch_timeout_seconds: int = 300
    reconcile_workers: int = 8  # threads running reconciliations (blocking API calls)
    webhook: Optional[WebhookConfig] = None
    # What AFDDeployments may use of the nodes and how their pods are isolated (the chart's values).
    policy: ClusterPolicy = field(default_factory=ClusterPolicy)
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def client_configuration(self) -> client.Configuration:
        configuration = client.Configuration()
        if self.kubeconfig:
            kube_config.load_kube_config(config_file=self.kubeconfig, client_configuration=configuration)
        else:
            kube_config.load_incluster_config(client_configuration=configuration)
        return configuration

    def api_client(self) -> client.ApiClient:
        configuration = self.client_configuration()
        if not configuration.verify_ssl:
            # The kubeconfig asks for no TLS verification (dev clusters): say so once, not per request.
            import urllib3

            urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
            logging.getLogger(__name__).warning("TLS verification of the API server is disabled by the kubeconfig")
        return client.ApiClient(configuration)

    def connection_info(self) -> kopf.ConnectionInfo:
        """The same credentials for kopf's own watches and writes."""
        import kopf

        c = self.client_configuration()
        header = c.get_api_key_with_prefix("BearerToken") or c.get_api_key_with_prefix("authorization") or ""
        scheme, _, token = header.partition(" ") if " " in header else ("Bearer", "", header)
        return kopf.ConnectionInfo(
            server=c.host, ca_path=c.ssl_ca_cert, insecure=not c.verify_ssl,
            scheme=scheme if token else None, token=token or None,
            certificate_path=c.cert_file, private_key_path=c.key_file,
        )
