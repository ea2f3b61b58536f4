"""A node stand-in that plays kubelet (and scheduler) for pods on a kubelet-less control plane.

Like KWOK upstream, nothing runs: `FakeKubelet` registers Node objects, binds each new
unscheduled pod it watches to one of them (round-robin) and reports it Running and Ready
through the status subresource, and finishes graceful deletions the way a kubelet does.
Each node owns a /24 of 127.0.0.0/8 (its `spec.podCIDR`): its InternalIP is the .1 and pod
IPs are taken from .2-.254; they are only strings in the API, nothing connects to them.
Fault injection (`fail_pod`, `set_not_ready`, `lose_node`, ...) writes the same API state
a real failure would. Pods are handled as plain dicts (the API's JSON).
"""

from __future__ import annotations

import heapq
import ipaddress
import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from kubernetes import client, watch
from kubernetes.client import ApiClient, ApiException

from afd_devcluster.kubelet_status import FakeNode, Pod, condition, container_status, readiness, started_at, utc_now

log = logging.getLogger(__name__)

PodPredicate = Callable[[Pod], bool]

_LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
_MAX_PODS_PER_NODE = 253  # the addresses of a /24 less network, broadcast and the node's own
_STRATEGIC_MERGE = "application/strategic-merge-patch+json"
_GONE = (404, 409)  # the pod vanished or changed identity meanwhile: nothing left to do
_UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"
_RETRY_SECONDS = 1.0


def _key(pod: Pod) -> tuple[str, str]:
    return pod["metadata"]["namespace"], pod["metadata"]["name"]


@dataclass
class _BoundPod:
    """What the kubelet remembers of a pod bound to one of its nodes."""
    namespace: str
    name: str
    node: str
    ip: Optional[str] = None
    started: bool = False
    deleting: bool = False


class FakeKubelet:
    """Plays kubelet for `node_names` on the pods it watches (all namespaces or `namespace`,
    optionally narrowed by `label_selector`); it never touches any other pod.

    ready_delay_seconds: time between Running and Ready.
    deletion_delay_seconds: time a graceful deletion takes (the containers "stopping").
    watch_timeout_seconds: length of each watch request; bounds how long `stop` can take.
    """

    def __init__(self, api_client: ApiClient, node_names: Sequence[str] = ("afd-node-0",), *,
                 namespace: Optional[str] = None, label_selector: Optional[str] = None,
                 cpu: str = "64", memory: str = "512Gi", max_pods: int = 110,
                 extended_resources: Optional[Mapping[str, int | str]] = None,
                 node_labels: Optional[Mapping[str, str]] = None,
                 ready_delay_seconds: float = 0.0, deletion_delay_seconds: float = 0.0,
                 watch_timeout_seconds: int = 2) -> None:
        if not node_names:
            raise ValueError("a FakeKubelet needs at least one node name")
        if not 0 < max_pods <= _MAX_PODS_PER_NODE:
            raise ValueError(f"max_pods must be within 1..{_MAX_PODS_PER_NODE} (one /24 of pod IPs per node)")
        self._core = client.CoreV1Api(api_client)
        self.node_names = tuple(node_names)
        self.max_pods = max_pods
        self.namespace = namespace
        self.label_selector = label_selector
        self._capacity = {"cpu": str(cpu), "memory": str(memory), "pods": str(max_pods),
                          "ephemeral-storage": "1Ti",
                          **{k: str(v) for k, v in (extended_resources or {}).items()}}
        self._node_labels = dict(node_labels or {})
        self.ready_delay_seconds = ready_delay_seconds
        self.deletion_delay_seconds = deletion_delay_seconds
        self.watch_timeout_seconds = watch_timeout_seconds

        self._lock = threading.RLock()
        self._nodes: dict[str, FakeNode] = {}
        self._bound: dict[str, _BoundPod] = {}  # by pod uid
        self._held: dict[str, tuple[str, str]] = {}  # by pod uid
        self._hold_rules: list[PodPredicate] = []
        self._round_robin = itertools.count()

        self._stopping = threading.Event()
        self._watch: Optional[watch.Watch] = None
        self._threads: list[threading.Thread] = []
        # Delayed actions (Ready after a delay, end of a graceful deletion), run on one thread.
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._due_changed = threading.Condition(self._lock)
        self._sequence = itertools.count()

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> "FakeKubelet":
        if self._threads:
            raise RuntimeError("FakeKubelet already started")
        self._register_nodes()
        self._stopping.clear()
        self._threads = [threading.Thread(target=self._watch_loop, name="fake-kubelet-watch", daemon=True),
                         threading.Thread(target=self._delayed_loop, name="fake-kubelet-timers", daemon=True)]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            self._stopping.set()
            self._due.clear()
            self._due_changed.notify_all()
            if self._watch is not None:
                self._watch.stop()  # shuts the socket: the stream ends now, not at its timeout
        for thread in self._threads:
            thread.join(timeout=self.watch_timeout_seconds + 10)
        self._threads = []

    def __enter__(self) -> "FakeKubelet":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- scheduling holds ------------------------------------------------------------------

    def hold_pending(self, predicate: Optional[PodPredicate] = None) -> None:
        """Leave new unscheduled pods matching `predicate` (all, without one) unbound, as if
        no node had room for them, until `release`."""
        with self._lock:
            self._hold_rules.append(predicate or (lambda pod: True))

    def release(self) -> None:
        """Drop every hold rule and schedule the pods held so far."""
        with self._lock:
            self._hold_rules.clear()
            held, self._held = self._held, {}
        for uid, (namespace, name) in held.items():
            pod = self._read_pod(namespace, name)
            if pod is not None and pod["metadata"]["uid"] == uid:
                self._on_pod("MODIFIED", pod)

    def held_pods(self) -> list[tuple[str, str]]:
        """(namespace, name) of the pods held unbound right now."""
        with self._lock:
            return sorted(self._held.values())

    # --- fault injection -------------------------------------------------------------------

    def fail_pod(self, namespace: str, name: str, exit_code: int = 1, reason: str = "Error") -> None:
        """Every container terminates with `exit_code`; the pod goes Failed and not Ready."""
        pod = self._own_pod(namespace, name)
        now = utc_now()
        containers = [container_status(pod, c, {"terminated": {
            "exitCode": exit_code, "reason": reason, "startedAt": started_at(pod, c["name"], now),
            "finishedAt": now}}, ready=False, started=False) for c in pod["spec"]["containers"]]
        self._patch_pod_status(namespace, name, {
            "phase": "Failed", "conditions": readiness(False, now, pod), "containerStatuses": containers})

    def set_not_ready(self, namespace: str, name: str) -> None:
        """Readiness probes start failing: not Ready, still Running."""
        self._set_readiness(namespace, name, ready=False)

    def set_ready(self, namespace: str, name: str) -> None:
        self._set_readiness(namespace, name, ready=True)

    def delete_pod(self, namespace: str, name: str) -> None:
        """An ordinary (graceful) delete; the kubelet logic finishes it."""
        self._own_pod(namespace, name)
        self._ignore_gone(self._core.delete_namespaced_pod, name, namespace, _preload_content=False)

    def lose_node(self, node_name: str) -> None:
        """The node stops answering: the Node goes NotReady and unreachable-tainted, its pods
        lose readiness (reason NodeLost), and nothing on it is started or deleted any more."""
        with self._lock:
            if node_name not in self._nodes:
                raise ValueError(f"{node_name} is not a node of this FakeKubelet")
            self._nodes[node_name].lost = True
        now = utc_now()
        node = json.loads(self._core.read_node(node_name, _preload_content=False).data)
        taints = [t for t in node["spec"].get("taints") or [] if t["key"] != _UNREACHABLE_TAINT]
        taints += [{"key": _UNREACHABLE_TAINT, "effect": effect, "timeAdded": now}
                   for effect in ("NoSchedule", "NoExecute")]
        self._core.patch_node(node_name, {"spec": {"taints": taints}},
                              _content_type=_STRATEGIC_MERGE, _preload_content=False)
        self._core.patch_node_status(node_name, {"status": {"conditions": [condition(
            "Ready", "Unknown", now, "NodeStatusUnknown", "Kubelet stopped posting node status.")]}},
            _content_type=_STRATEGIC_MERGE, _preload_content=False)
        for pod in self._list_pods(field_selector=f"spec.nodeName={node_name}")["items"]:
            namespace, name = _key(pod)
            self._patch_pod_status(namespace, name, {"conditions": [
                condition("Ready", "False", now, "NodeLost", f"Node {node_name} is unreachable")]})

    # --- nodes -----------------------------------------------------------------------------

    def _register_nodes(self) -> None:
        existing = {n["metadata"]["name"]: n
                    for n in json.loads(self._core.list_node(_preload_content=False).data)["items"]}
        claimed = {ipaddress.ip_network(n["spec"]["podCIDR"])
                   for n in existing.values() if n["spec"].get("podCIDR")}
        # Each node takes the next /24 that no Node claims, leaving 127.0.0.0/24 to the host.
        free_networks = (net for net in itertools.islice(_LOOPBACK.subnets(new_prefix=24), 1, None)
                         if net not in claimed)
        for name in self.node_names:
            current = existing.get(name)
            if current is not None and current["spec"].get("podCIDR"):
                pod_cidr = ipaddress.ip_network(current["spec"]["podCIDR"])
            else:
                pod_cidr = next(free_networks)
            node = FakeNode(name, pod_cidr)
            labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                      "kubernetes.io/arch": "amd64", **self._node_labels}
            if current is None:
                self._core.create_node({"metadata": {"name": name}}, _preload_content=False)
            # Clearing the taints lifts the not-ready one that admission puts on a new Node (the
            # node controller would, once Ready) and any left by an earlier run's lose_node.
            self._core.patch_node(name, {"metadata": {"labels": labels}, "spec": {
                "podCIDR": str(pod_cidr), "podCIDRs": [str(pod_cidr)], "taints": None}},
                _content_type=_STRATEGIC_MERGE, _preload_content=False)
            self._core.patch_node_status(name, {"status": self._node_status(node)},
                                         _content_type=_STRATEGIC_MERGE, _preload_content=False)
            with self._lock:
                self._nodes[name] = node

    def _node_status(self, node: FakeNode) -> dict[str, Any]:
        now = utc_now()
        conditions = [("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                      ("DiskPressure", "False", "KubeletHasNoDiskPressure"),
                      ("PIDPressure", "False", "KubeletHasSufficientPID"),
                      ("Ready", "True", "KubeletReady")]
        return {
            "capacity": self._capacity, "allocatable": self._capacity,
            "conditions": [{**condition(kind, status, now, reason), "lastHeartbeatTime": now}
                           for kind, status, reason in conditions],
            "addresses": [{"type": "InternalIP", "address": node.host_ip},
                          {"type": "Hostname", "address": node.name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {"machineID": node.name, "systemUUID": node.name, "bootID": node.name,
                         "kernelVersion": "fake", "osImage": "fake", "containerRuntimeVersion": "fake://0",
                         "kubeletVersion": "v1.20.2", "kubeProxyVersion": "v1.20.2",
                         "operatingSystem": "linux", "architecture": "amd64"},
        }

    # --- the watch -------------------------------------------------------------------------

    def _list_pods(self, **kwargs: Any) -> dict[str, Any]:
        if self.namespace is None:
            resp = self._core.list_pod_for_all_namespaces(label_selector=self.label_selector,
                                                          _preload_content=False, **kwargs)
        else:
            resp = self._core.list_namespaced_pod(self.namespace, label_selector=self.label_selector,
                                                  _preload_content=False, **kwargs)
        return json.loads(resp.data)

    def _watch_loop(self) -> None:
        resource_version: Optional[str] = None
        while not self._stopping.is_set():
            try:
                if resource_version is None:
                    resource_version = self._relist()
                resource_version = self._watch_from(resource_version)
            except ApiException as err:
                if err.status != 410:  # 410: the watch expired; a fresh list resumes it
                    log.warning("fake kubelet: pod watch failed, relisting: %s", err)
                    self._stopping.wait(_RETRY_SECONDS)
                resource_version = None
            except Exception:  # noqa: BLE001 - the kubelet must outlive a bad response
                if not self._stopping.is_set():
                    log.exception("fake kubelet: pod watch failed, relisting")
                    self._stopping.wait(_RETRY_SECONDS)
                resource_version = None

    def _relist(self) -> str:
        pods = self._list_pods()
        present = {pod["metadata"]["uid"] for pod in pods["items"]}
        with self._lock:  # forget pods deleted while no watch was open
            for uid in [uid for uid in self._bound if uid not in present]:
                self._forget(uid)
            for uid in [uid for uid in self._held if uid not in present]:
                del self._held[uid]
        for pod in pods["items"]:
            self._on_pod("ADDED", pod)
        return pods["metadata"]["resourceVersion"]

    def _watch_from(self, resource_version: str) -> str:
        with self._lock:
            if self._stopping.is_set():
                return resource_version
            self._watch = watch.Watch(return_type=object)  # events as plain dicts
        args = () if self.namespace is None else (self.namespace,)
        func = self._core.list_pod_for_all_namespaces if self.namespace is None else self._core.list_namespaced_pod
        try:
            for event in self._watch.stream(func, *args, label_selector=self.label_selector,
                                            resource_version=resource_version, allow_watch_bookmarks=True,
                                            timeout_seconds=self.watch_timeout_seconds,
                                            _request_timeout=self.watch_timeout_seconds + 10):
                pod = event["object"]
                resource_version = pod["metadata"]["resourceVersion"]
                if event["type"] != "BOOKMARK":
                    self._on_pod(event["type"], pod)
        finally:
            with self._lock:
                self._watch = None
        return resource_version

    # --- kubelet and scheduler logic -------------------------------------------------------

    def _on_pod(self, event_type: str, pod: Pod) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        uid, node_name = meta["uid"], spec.get("nodeName")
        if event_type == "DELETED":
            with self._lock:
                self._forget(uid)
                self._held.pop(uid, None)
            return
        if not node_name:
            if not meta.get("deletionTimestamp"):  # the apiserver deletes unbound pods at once
                self._schedule(pod)
            return
        with self._lock:
            self._held.pop(uid, None)
            node = self._nodes.get(node_name)
            if node is None or node.lost:
                return
            bound = self._remember(pod, node)
            if meta.get("deletionTimestamp"):
                if bound.deleting:
                    return
                bound.deleting = True
            elif bound.started or pod.get("status", {}).get("phase", "Pending") != "Pending":
                return
        if meta.get("deletionTimestamp"):
            self._after(self.deletion_delay_seconds, lambda: self._finish_deletion(bound, uid))
        else:
            self._run_pod(pod, node, bound)

    def _remember(self, pod: Pod, node: FakeNode) -> _BoundPod:
        uid = pod["metadata"]["uid"]
        bound = self._bound.get(uid)
        if bound is None:
            namespace, name = _key(pod)
            bound = self._bound[uid] = _BoundPod(namespace, name, node.name)
            ip = pod.get("status", {}).get("podIP")
            if ip and ipaddress.ip_address(ip) in node.pod_cidr:  # a pod from an earlier run
                node.used_ips.add(ip)
                bound.ip = ip
        return bound

    def _forget(self, uid: str) -> None:
        bound = self._bound.pop(uid, None)
        if bound is not None and bound.ip is not None:
            self._nodes[bound.node].used_ips.discard(bound.ip)

    def _schedule(self, pod: Pod) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:
            if uid in self._held:
                return
            if any(rule(pod) for rule in self._hold_rules):
                self._held[uid] = _key(pod)
                return
            load = {n: 0 for n in self.node_names}
            for bound in self._bound.values():
                load[bound.node] += 1
            candidates = [n for n in self.node_names if not self._nodes[n].lost and load[n] < self.max_pods]
            if not candidates:
                log.warning("fake kubelet: no node can take pod %s/%s", *_key(pod))
                return
            node_name = candidates[next(self._round_robin) % len(candidates)]
        namespace, name = _key(pod)
        binding = client.V1Binding(metadata=client.V1ObjectMeta(name=name),
                                   target=client.V1ObjectReference(api_version="v1", kind="Node", name=node_name))
        # The response is a Status, not the Binding the client would decode.
        self._ignore_gone(self._core.create_namespaced_pod_binding, name, namespace, binding,
                          _preload_content=False)

    def _run_pod(self, pod: Pod, node: FakeNode, bound: _BoundPod) -> None:
        with self._lock:
            if bound.ip is None:
                bound.ip = node.allocate_ip()
            ip = bound.ip
        if ip is None:
            log.warning("fake kubelet: node %s has no pod IP left for %s/%s", node.name, bound.namespace, bound.name)
            return
        now = utc_now()
        ready = self.ready_delay_seconds <= 0
        status: dict[str, Any] = {
            "phase": "Running", "hostIP": node.host_ip, "podIP": ip, "podIPs": [{"ip": ip}], "startTime": now,
            "conditions": [condition("PodScheduled", "True", now), condition("Initialized", "True", now),
                           *readiness(ready, now, pod)],
            "containerStatuses": [container_status(pod, c, {"running": {"startedAt": now}}, ready, True)
                                  for c in pod["spec"]["containers"]],
        }
        init_containers = pod["spec"].get("initContainers") or []
        if init_containers:
            status["initContainerStatuses"] = [container_status(pod, c, {"terminated": {
                "exitCode": 0, "reason": "Completed", "startedAt": now, "finishedAt": now}}, False, False)
                for c in init_containers]
        if self._patch_pod_status(bound.namespace, bound.name, status) is None:
            return
        with self._lock:
            bound.started = True
        if not ready:
            uid = pod["metadata"]["uid"]
            self._after(self.ready_delay_seconds, lambda: self._become_ready(bound, uid))

    def _become_ready(self, bound: _BoundPod, uid: str) -> None:
        pod = self._read_pod(bound.namespace, bound.name)
        if (pod is None or pod["metadata"]["uid"] != uid or pod["metadata"].get("deletionTimestamp")
                or pod["status"].get("phase") != "Running" or self._nodes[bound.node].lost):
            return
        self._set_readiness(bound.namespace, bound.name, ready=True)

    def _finish_deletion(self, bound: _BoundPod, uid: str) -> None:
        if self._nodes[bound.node].lost:
            return
        # The uid precondition spares a new pod that took the name meanwhile.
        options = client.V1DeleteOptions(grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid))
        self._ignore_gone(self._core.delete_namespaced_pod, bound.name, bound.namespace, body=options,
                          grace_period_seconds=0, _preload_content=False)

    # --- API helpers -----------------------------------------------------------------------

    def _ignore_gone(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        except ApiException as err:
            if err.status in _GONE:
                return None
            raise

    def _read_pod(self, namespace: str, name: str) -> Optional[Pod]:
        resp = self._ignore_gone(self._core.read_namespaced_pod, name, namespace, _preload_content=False)
        return None if resp is None else json.loads(resp.data)

    def _own_pod(self, namespace: str, name: str) -> Pod:
        pod = self._read_pod(namespace, name)
        if pod is None:
            raise LookupError(f"pod {namespace}/{name} does not exist")
        with self._lock:
            if pod["metadata"]["uid"] not in self._bound:
                raise ValueError(f"pod {namespace}/{name} is not one this FakeKubelet runs")
        return pod

    def _patch_pod_status(self, namespace: str, name: str, status: dict[str, Any]) -> Optional[Pod]:
        resp = self._ignore_gone(self._core.patch_namespaced_pod_status, name, namespace, {"status": status},
                                 _content_type=_STRATEGIC_MERGE, _preload_content=False)
        return None if resp is None else json.loads(resp.data)

    def _set_readiness(self, namespace: str, name: str, ready: bool) -> None:
        pod = self._own_pod(namespace, name)
        containers = [{**status, "ready": ready} for status in pod["status"].get("containerStatuses") or []]
        self._patch_pod_status(namespace, name, {
            "conditions": readiness(ready, utc_now(), pod), "containerStatuses": containers})

    # --- delayed actions -------------------------------------------------------------------

    def _after(self, delay: float, action: Callable[[], None]) -> None:
        if delay <= 0:
            action()
            return
        with self._due_changed:
            heapq.heappush(self._due, (time.monotonic() + delay, next(self._sequence), action))
            self._due_changed.notify()

    def _delayed_loop(self) -> None:
        while True:
            with self._due_changed:
                while not self._stopping.is_set() and (not self._due or self._due[0][0] > time.monotonic()):
                    self._due_changed.wait(self._due[0][0] - time.monotonic() if self._due else None)
                if self._stopping.is_set():
                    return
                _, _, action = heapq.heappop(self._due)
            try:
                action()
            except Exception:  # noqa: BLE001 - one failed action must not end the others
                log.exception("fake kubelet: delayed action failed")
