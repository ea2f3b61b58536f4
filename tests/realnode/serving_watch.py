"""The real-node scenario's instruments (test_afd_e2e.py): a bounded load through the Service, a
watch over the deployment's connector worlds and the host's memory, and an outage measured
around one injected fault."""
from __future__ import annotations

import json
import threading
import time
import urllib.request
from dataclasses import dataclass, field

from afd_devcluster.realnode import RealNode
from afd_devcluster.realnode.scenario import afd_pods, complete, is_ready, wait_serving
from afd_devcluster.tools import wait_for

NAMESPACE = "afd-e2e"
NAME = "tiny"
LABEL = "afd.inference.dev/"
READY_TIMEOUT_SECONDS = 900


class BackgroundLoop:
    """`step()` repeated on a thread from `with` entry until exit (or until it returns False)."""

    def step(self) -> bool:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set() and self.step():
            pass

    def __enter__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(90)


# The load's mix. A completion steps every engine of the instance, and with Attention DP 2 the
# engines go on stepping (dummy batches through the FFN side) for up to 32 steps after the last
# request ends, vLLM's DP finish check; their workers spin on vLLM's shared-memory queue for 1 s
# after each read. Back-to-back completions kept the old revision at 2 cores (measured beside
# `vllm serve` DP 2 + one FFN pod: 1.98 cores back to back, 1.43 at one completion per 3 s, 0.11
# at model-list requests alone), so the new revision started on what was left. Model-list
# requests go through the same Service, kube-proxy rules and API server process without an
# engine step: a refused connection, a reset or an error status shows within PROBE_PERIOD_S.
COMPLETION_PERIOD_S = 5.0
PROBE_PERIOD_S = 0.25


def list_models(host: str, port: int) -> None:
    with urllib.request.urlopen(f"http://{host}:{port}/v1/models", timeout=10) as resp:
        assert any(m["id"] == NAME for m in json.loads(resp.read())["data"]), "the model is not listed"


@dataclass
class Load(BackgroundLoop):
    """Requests through the Service, every outcome counted (bounded by `limit`): a completion
    every COMPLETION_PERIOD_S, model-list requests every PROBE_PERIOD_S between them."""

    host: str
    port: int
    limit: int = 20000
    ok: int = 0
    completions: int = 0
    failures: list[str] = field(default_factory=list)
    _next_completion: float = 0.0

    def step(self) -> bool:
        completion = time.monotonic() >= self._next_completion
        try:
            if completion:
                self._next_completion = time.monotonic() + COMPLETION_PERIOD_S
                complete(self.host, self.port, NAME, max_tokens=4, timeout=60)
                self.completions += 1
            else:
                list_models(self.host, self.port)
                time.sleep(PROBE_PERIOD_S)
            self.ok += 1
        except Exception as exc:
            kind = "completion" if completion else "model list"
            self.failures.append(f"{time.strftime('%H:%M:%S')} {kind}: {type(exc).__name__}: {exc}")
            time.sleep(0.5)  # a refused connection fails at once: keep sampling, not spinning
        return self.ok + len(self.failures) < self.limit


def meminfo_bytes(key: str) -> int:
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    return int(fields[key].split()[0]) * 1024


def mem_available_bytes() -> int:
    return meminfo_bytes("MemAvailable")


@dataclass
class WorldWatch(BackgroundLoop):
    """The deployment's pods while it runs: for each connector world (instance) the revisions
    of its pods and any pod wired to another world; a timeline of (time, pod, Ready, serving)
    changes to read failed requests against; the host's lowest available memory; the
    termination message (the log's tail) of every container that failed, before the operator
    replaces its pod."""

    node: RealNode
    worlds: dict[str, set[str]] = field(default_factory=dict)
    failed_containers: dict[str, str] = field(default_factory=dict)
    cross_wired: list[str] = field(default_factory=list)
    timeline: list[tuple[str, str, bool, str]] = field(default_factory=list)
    lowest_available: int = field(default_factory=mem_available_bytes)
    _last: dict[str, tuple[bool, str]] = field(default_factory=dict)

    def step(self) -> bool:
        self.lowest_available = min(self.lowest_available, mem_available_bytes())
        seen = afd_pods(self.node, NAMESPACE, NAME)
        instances = {p["metadata"]["labels"][LABEL + "instance"] for p in seen}
        for pod in seen:
            labels = pod["metadata"]["labels"]
            state = (is_ready(pod), labels.get(LABEL + "serving", ""))
            if self._last.get(pod["metadata"]["name"]) != state:
                self._last[pod["metadata"]["name"]] = state
                self.timeline.append((time.strftime("%H:%M:%S"), pod["metadata"]["name"], *state))
            for status in pod["status"].get("containerStatuses") or []:
                ended = status["state"].get("terminated") or {}
                if ended.get("exitCode"):
                    self.failed_containers[f"{pod['metadata']['name']} ({status.get('containerID')})"] = \
                        ended.get("message", "")
            instance = labels[LABEL + "instance"]
            self.worlds.setdefault(instance, set()).add(labels[LABEL + "revision"])
            wiring = json.dumps([c.get("command", []) + c.get("args", []) for c in pod["spec"]["containers"]])
            if instance not in wiring or any(o in wiring for o in instances - {instance}):
                self.cross_wired.append(pod["metadata"]["name"])
        time.sleep(1)
        return True

    def failures(self) -> str:
        return "".join(f"\n--- failed container {name}, its log's tail:\n{message}"
                       for name, message in self.failed_containers.items())


def namespace_events(real_node: RealNode) -> str:
    """The namespace's events, oldest first: the operator's (InstanceFailed names the failed pod
    and why) and the kubelet's (probe failures, kills). They outlive the deleted pods."""
    return real_node.kubectl("get", "events", "-n", NAMESPACE, "--sort-by=.lastTimestamp", "-o",
                             "custom-columns=LAST:.lastTimestamp,TYPE:.type,REASON:.reason,OBJECT:.involvedObject.name,"
                             "MESSAGE:.message", check=False).stdout


@dataclass
class Outage:
    """What the load generator saw around one fault."""

    fault: str
    ok: int
    failures: list[str]
    recovered_after: float  # seconds from the fault until completions were served again
    failed_containers: list[str]  # the containers seen ending with a non-zero exit code

    def report(self) -> str:
        return (f"{self.fault}: {self.ok} requests served, {len(self.failures)} failed, serving again "
                f"{self.recovered_after:.0f}s after the fault; failed containers: {self.failed_containers}"
                + "".join(f"\n  {f}" for f in self.failures[:3]))


def survive(real_node: RealNode, fault: str, inject, host: str, port: int) -> Outage:
    """Load through the Service while `inject()` breaks the instance; until every pod of it is
    new, the deployment serves again and a request through the Service succeeded."""
    before = {p["metadata"]["uid"] for p in afd_pods(real_node, NAMESPACE, NAME)}
    with WorldWatch(real_node) as watch, Load(host, port) as load:
        started = time.monotonic()
        inject()
        try:
            wait_for(lambda: before.isdisjoint(p["metadata"]["uid"] for p in afd_pods(real_node, NAMESPACE, NAME)),
                     f"{fault}: the instance recreated", READY_TIMEOUT_SECONDS, interval=2)
            wait_serving(real_node, NAMESPACE, NAME, READY_TIMEOUT_SECONDS)
            served_before = load.completions
            wait_for(lambda: load.completions > served_before, f"{fault}: completions served again", 120,
                     interval=0.5)
        except AssertionError as err:
            # The failed pods are replaced: their logs' tails and the events are all that is left.
            raise AssertionError(f"{err}\n{watch.failures()}\nevents:\n{namespace_events(real_node)}") from None
        recovered_after = time.monotonic() - started
        time.sleep(5)
    return Outage(fault, load.ok, list(load.failures), recovered_after, list(watch.failed_containers))
