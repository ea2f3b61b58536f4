"""A real control plane on loopback: etcd + kube-apiserver 1.20.2 on free ports.

The kube-apiserver binary comes from $AFD_KUBE_APISERVER or, in a checkout of this
repository, from scripts/build-kube-apiserver.sh (which builds it once from Debian's source
package and caches it). Two bearer tokens are served: an admin (`kubeconfig`) and the
operator (`operator_kubeconfig`), so that the audit log tells the operator's requests apart.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import yaml

from afd_devcluster.daemons import log_tail
from afd_devcluster.ports import free_port

ADMIN_USER = "afd-admin"
OPERATOR_USER = "afd-operator"
READY_TIMEOUT_SECONDS = 90
WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})
# devcluster/ -> afd_operator/ -> operator/ -> the repository root, when run from a checkout.
_BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build-kube-apiserver.sh"
# Metadata (who, verb, object; no bodies) for every request except what would only bloat the
# log: the server's own loopback requests (bootstrap roles, priority levels), health probes,
# and reads of events and leases.
_AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "None", "users": ["system:apiserver"]},
        {"level": "None", "nonResourceURLs": ["/healthz*", "/livez*", "/readyz*"]},
        {"level": "None", "verbs": ["get", "list", "watch"],
         "resources": [{"group": "", "resources": ["events"]},
                       {"group": "coordination.k8s.io", "resources": ["leases"]}]},
        {"level": "Metadata"},
    ],
}


def kube_apiserver_binary() -> str:
    configured = os.environ.get("AFD_KUBE_APISERVER")
    if configured:
        return configured
    if not _BUILD_SCRIPT.is_file():
        raise RuntimeError(
            "no kube-apiserver: set $AFD_KUBE_APISERVER to a kube-apiserver 1.20 binary "
            f"({_BUILD_SCRIPT} is not there to build one; it exists in a checkout of the repository)")
    out = subprocess.run([str(_BUILD_SCRIPT)], check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def _audit_time(timestamp: str) -> float:
    # MicroTime in RFC 3339 with a "Z" suffix, which fromisoformat accepts only from Python 3.11.
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def _stop(proc: Optional[subprocess.Popen]) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _kubeconfig(server: str, user: str, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Config", "current-context": "afd-dev",
        "clusters": [{"name": "afd-dev", "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "afd-dev", "context": {"cluster": "afd-dev", "user": user}}],
    }


@dataclass
class ControlPlane:
    workdir: Path
    server: str = ""
    kubeconfig: Path = field(default_factory=Path)
    operator_kubeconfig: Path = field(default_factory=Path)
    audit_log: Path = field(default_factory=Path)
    etcd: Optional[subprocess.Popen] = None
    apiserver: Optional[subprocess.Popen] = None
    etcd_endpoint: str = ""
    _apiserver_command: list[str] = field(init=False, repr=False, default_factory=list)
    _admin_token: str = field(init=False, repr=False, default_factory=lambda: secrets.token_hex(16))
    _operator_token: str = field(init=False, repr=False, default_factory=lambda: secrets.token_hex(16))

    def start(self) -> "ControlPlane":
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        etcd_binary = shutil.which("etcd")
        if etcd_binary is None:
            raise RuntimeError("etcd is not on PATH (Debian package etcd-server)")
        apiserver_binary = kube_apiserver_binary()
        etcd_port, etcd_peer, api_port = free_port(), free_port(), free_port()
        self.etcd_endpoint = f"http://127.0.0.1:{etcd_port}"
        with open(self.workdir / "etcd.log", "wb") as etcd_log:
            self.etcd = subprocess.Popen(
                [etcd_binary,
                 "--data-dir", str(self.workdir / "etcd-data"),
                 "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
                 "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                 "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
                 "--initial-cluster", f"default=http://127.0.0.1:{etcd_peer}",
                 "--unsafe-no-fsync"],
                stdout=etcd_log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        certs = self.workdir / "certs"
        certs.mkdir(exist_ok=True)
        sa_key, sa_pub = certs / "sa.key", certs / "sa.pub"
        subprocess.run(["openssl", "genrsa", "-out", str(sa_key), "2048"], check=True, capture_output=True)
        subprocess.run(["openssl", "rsa", "-in", str(sa_key), "-pubout", "-out", str(sa_pub)],
                       check=True, capture_output=True)
        tokens = self.workdir / "tokens.csv"
        # The operator is in system:masters until least-privilege RBAC exists for it.
        tokens.write_text(f'{self._admin_token},{ADMIN_USER},1,"system:masters"\n'
                          f'{self._operator_token},{OPERATOR_USER},2,"system:masters"\n')
        audit_policy = self.workdir / "audit-policy.yaml"
        audit_policy.write_text(yaml.safe_dump(_AUDIT_POLICY))
        self.audit_log = self.workdir / "audit.log"
        self._apiserver_command = [
            apiserver_binary,
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", f"--secure-port={api_port}", "--insecure-port=0",
            f"--cert-dir={certs}", f"--token-auth-file={tokens}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={sa_pub}",
            f"--service-account-signing-key-file={sa_key}",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--allow-privileged=true",
            # No controller-manager runs here to mint service-account tokens, which the
            # ServiceAccount admission plugin of 1.20 insists on for every pod.
            "--disable-admission-plugins=ServiceAccount",
            f"--audit-policy-file={audit_policy}",
            f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json",
            "--profiling=false",
        ]
        self.server = f"https://127.0.0.1:{api_port}"
        self._start_apiserver()
        self.kubeconfig = self.workdir / "kubeconfig"
        self.kubeconfig.write_text(yaml.safe_dump(_kubeconfig(self.server, ADMIN_USER, self._admin_token)))
        self.operator_kubeconfig = self.workdir / "operator-kubeconfig"
        self.operator_kubeconfig.write_text(
            yaml.safe_dump(_kubeconfig(self.server, OPERATOR_USER, self._operator_token)))

    def _start_apiserver(self) -> None:
        with open(self.workdir / "kube-apiserver.log", "ab") as api_log:
            self.apiserver = subprocess.Popen(self._apiserver_command, stdout=api_log, stderr=subprocess.STDOUT,
                                              start_new_session=True)
        self._wait_ready()

    def restart_apiserver(self, while_down: Optional[Callable[[], None]] = None) -> None:
        """Stop kube-apiserver and start it again on the same port, etcd and keys (what its
        clients see of an upgrade or a crash); `while_down()` runs in between."""
        _stop(self.apiserver)
        if while_down is not None:
            while_down()
        self._start_apiserver()

    def etcdctl(self, *args: str) -> subprocess.CompletedProcess:
        """etcd's own client (v3 API) against this control plane's etcd."""
        return subprocess.run(["etcdctl", f"--endpoints={self.etcd_endpoint}", *args], capture_output=True,
                              text=True, check=True, timeout=60, env={**os.environ, "ETCDCTL_API": "3"})

    def _wait_ready(self) -> None:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        api_log = self.workdir / "kube-apiserver.log"
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        last = ""
        while time.monotonic() < deadline:
            if self.apiserver.poll() is not None:
                raise RuntimeError(f"kube-apiserver exited with {self.apiserver.returncode}; "
                                   f"log {api_log}:\n{log_tail(api_log, 20)}")
            req = urllib.request.Request(f"{self.server}/readyz",
                                         headers={"Authorization": f"Bearer {self._admin_token}"})
            try:
                with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError as err:
                last = str(err)
            time.sleep(0.5)
        etcd_state = "running" if self.etcd.poll() is None else f"exited with {self.etcd.returncode}"
        raise RuntimeError(f"kube-apiserver not ready after {READY_TIMEOUT_SECONDS}s ({last}); etcd {etcd_state}; "
                           f"logs {api_log} and {self.workdir / 'etcd.log'}:\n{log_tail(api_log, 20)}")

    def stop(self) -> None:
        _stop(self.apiserver)
        _stop(self.etcd)

    def kubectl(self, *args: str, input_text: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["kubectl", f"--kubeconfig={self.kubeconfig}", *args],
            input=input_text, capture_output=True, text=True, check=check, timeout=120,
        )

    def audit_events(self, user: str, since: Optional[float] = None) -> list[dict[str, Any]]:
        """Completed requests of `user` (audit.k8s.io/v1 events, Metadata level), oldest first;
        with `since` (seconds since the epoch), only those the server received at or after it."""
        events = []
        with open(self.audit_log, encoding="utf-8") as log:
            for line in log:
                if not line.endswith("\n"):
                    break  # an event being written right now
                event = json.loads(line)
                if event.get("stage") != "ResponseComplete" or event.get("user", {}).get("username") != user:
                    continue
                if since is not None and _audit_time(event["requestReceivedTimestamp"]) < since:
                    continue
                events.append(event)
        return events

    def write_requests(self, user: str, since: Optional[float] = None) -> list[dict[str, Any]]:
        """The audit events of `user` that changed (or tried to change) state."""
        return [e for e in self.audit_events(user, since) if e.get("verb") in WRITE_VERBS]


@contextlib.contextmanager
def control_plane(workdir: Path) -> Iterator[ControlPlane]:
    cp = ControlPlane(workdir)
    try:
        yield cp.start()
    finally:
        cp.stop()
