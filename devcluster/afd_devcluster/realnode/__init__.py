"""A real single-node Kubernetes 1.20.2 on this machine (kubelet on containerd + runc, CNI
bridge, kube-proxy, scheduler, controller-manager, a dnsmasq cluster DNS), started and stopped
by PID with every host change undone: `RealNode`. CLI: python -m afd_devcluster.realnode."""

from afd_devcluster.realnode.node import DNS_SERVICE_IP, NODE_IP, NODE_NAME, RealNode, default_state_dir

__all__ = ["DNS_SERVICE_IP", "NODE_IP", "NODE_NAME", "RealNode", "default_state_dir"]
