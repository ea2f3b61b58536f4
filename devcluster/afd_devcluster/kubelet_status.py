"""What the kubelet stand-in (fake_kubelet.py) writes: its nodes' pod address ranges and the
pod status pieces (conditions, container statuses) a kubelet reports."""

from __future__ import annotations

import ipaddress
import itertools
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Mapping, Optional

Pod = dict[str, Any]


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(kind: str, status: str, now: str, reason: Optional[str] = None,
               message: Optional[str] = None) -> dict[str, Any]:
    cond = {"type": kind, "status": status, "lastTransitionTime": now, "lastProbeTime": None}
    if reason:
        cond["reason"] = reason
    if message:
        cond["message"] = message
    return cond


def readiness(ready: bool, now: str, pod: Pod) -> list[dict[str, Any]]:
    if ready:
        return [condition("ContainersReady", "True", now), condition("Ready", "True", now)]
    names = ", ".join(c["name"] for c in pod["spec"]["containers"])
    message = f"containers with unready status: [{names}]"
    return [condition("ContainersReady", "False", now, "ContainersNotReady", message),
            condition("Ready", "False", now, "ContainersNotReady", message)]


def container_status(pod: Pod, container: Mapping[str, Any], state: dict[str, Any], ready: bool,
                      started: bool) -> dict[str, Any]:
    return {"name": container["name"], "image": container.get("image", ""),
            "imageID": f"fake://{container.get('image', '')}",
            "containerID": f"fake://{pod['metadata']['uid']}/{container['name']}",
            "ready": ready, "started": started, "restartCount": 0, "state": state}


def started_at(pod: Pod, container_name: str, default: str) -> str:
    for status in pod.get("status", {}).get("containerStatuses") or []:
        if status["name"] == container_name:
            return status.get("state", {}).get("running", {}).get("startedAt", default)
    return default


@dataclass
class FakeNode:
    name: str
    pod_cidr: ipaddress.IPv4Network
    lost: bool = False
    used_ips: set[str] = field(default_factory=set)

    @property
    def host_ip(self) -> str:
        return str(self.pod_cidr[1])

    def allocate_ip(self) -> Optional[str]:
        for address in itertools.islice(self.pod_cidr.hosts(), 1, None):
            if str(address) not in self.used_ips:
                self.used_ips.add(str(address))
                return str(address)
        return None
