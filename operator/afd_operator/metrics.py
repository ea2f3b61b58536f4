"""Prometheus metrics of the operator (names checked with `promtool check metrics`)."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .api import Phase
from .decisions import Decision


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.reconciles = Counter("afd_operator_reconciles_total", "Reconciliations by result.",
                                  ["result"], registry=r)
        self.reconcile_duration = Histogram("afd_operator_reconcile_duration_seconds",
                                            "Time to reconcile one AFDDeployment.", registry=r,
                                            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.api_writes = Counter("afd_operator_api_writes_total", "Kubernetes API writes by verb and kind.",
                                  ["verb", "kind"], registry=r)
        self.instances = Gauge("afd_operator_instances", "AFD instances by phase.",
                               ["namespace", "deployment", "phase"], registry=r)
        self.rollout_in_progress = Gauge("afd_operator_rollout_in_progress",
                                         "1 while a rollout or scaling is in progress.",
                                         ["namespace", "deployment"], registry=r)
        self.instance_restarts = Counter("afd_operator_instance_restarts_total",
                                         "Instances recreated after a failure.", ["namespace", "deployment"],
                                         registry=r)
        self.time_to_ready = Histogram("afd_operator_instance_time_to_ready_seconds",
                                       "From an instance's first pod to all of its pods Ready.", registry=r,
                                       buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600))

    def record_decision(self, namespace: str, deployment: str, decision: Decision) -> None:
        phases = [r.phase for r in decision.instances]
        for phase in Phase:
            self.instances.labels(namespace, deployment, phase).set(phases.count(phase))
        self.rollout_in_progress.labels(namespace, deployment).set(int(decision.rollout_in_progress))
        if decision.restarted:
            self.instance_restarts.labels(namespace, deployment).inc(decision.restarted)
        for _, seconds in decision.became_ready:
            self.time_to_ready.observe(seconds)

    def forget(self, namespace: str, deployment: str) -> None:
        """Drop the series of a deleted AFDDeployment."""
        for phase in Phase:
            with contextlib.suppress(KeyError):
                self.instances.remove(namespace, deployment, phase)
        with contextlib.suppress(KeyError):
            self.rollout_in_progress.remove(namespace, deployment)
