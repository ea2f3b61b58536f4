"""A local development cluster: a real etcd + kube-apiserver (`ControlPlane`) and a node
stand-in that plays kubelet and scheduler for the pods it watches (`FakeKubelet`)."""

from afd_devcluster.controlplane import (
    ADMIN_USER, OPERATOR_USER, WRITE_VERBS, ControlPlane, control_plane, kube_apiserver_binary,
)
from afd_devcluster.fake_kubelet import FakeKubelet
from afd_devcluster.ports import free_port

__all__ = [
    "ADMIN_USER", "OPERATOR_USER", "WRITE_VERBS", "ControlPlane", "FakeKubelet", "control_plane", "free_port",
    "kube_apiserver_binary",
]
