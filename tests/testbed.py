"""A real control plane for tests: etcd + kube-apiserver 1.20.2 on free loopback ports.

The kube-apiserver binary is built from Debian's source package by
scripts/build-kube-apiserver.sh (cached outside the clone); its path comes from
$AFD_KUBE_APISERVER or from running that script. One server is shared per test session.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
ADMIN_TOKEN = "afd-test-admin-token"
READY_TIMEOUT_SECONDS = 90


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kube_apiserver_binary() -> str:
    configured = os.environ.get("AFD_KUBE_APISERVER")
    if configured:
        return configured
    out = subprocess.run(
        [str(REPO_ROOT / "scripts" / "build-kube-apiserver.sh")],
        check=True, capture_output=True, text=True,
    )
    return out.stdout.strip().splitlines()[-1]


def _stop(proc: Optional[subprocess.Popen]) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@dataclass
class ControlPlane:
    workdir: Path
    server: str = ""
    kubeconfig: Path = field(default_factory=Path)
    etcd: Optional[subprocess.Popen] = None
    apiserver: Optional[subprocess.Popen] = None

    def start(self) -> "ControlPlane":
        self.workdir.mkdir(parents=True, exist_ok=True)
        etcd_port, etcd_peer, api_port = free_port(), free_port(), free_port()
        etcd_log = open(self.workdir / "etcd.log", "wb")
        self.etcd = subprocess.Popen(
            [shutil.which("etcd") or "/usr/bin/etcd",
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
        tokens.write_text(f'{ADMIN_TOKEN},afd-test-admin,1,"system:masters"\n')
        api_log = open(self.workdir / "kube-apiserver.log", "wb")
        self.apiserver = subprocess.Popen(
            [kube_apiserver_binary(),
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
             "--profiling=false"],
            stdout=api_log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.server = f"https://127.0.0.1:{api_port}"
        self._wait_ready()
        self.kubeconfig = self.workdir / "kubeconfig"
        self.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "afd-test",
            "clusters": [{"name": "afd-test", "cluster": {"server": self.server, "insecure-skip-tls-verify": True}}],
            "users": [{"name": "admin", "user": {"token": ADMIN_TOKEN}}],
            "contexts": [{"name": "afd-test", "context": {"cluster": "afd-test", "user": "admin"}}],
        }))
        return self

    def _wait_ready(self) -> None:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        last = ""
        while time.monotonic() < deadline:
            if self.apiserver.poll() is not None:
                raise RuntimeError(f"kube-apiserver exited: see {self.workdir / 'kube-apiserver.log'}")
            req = urllib.request.Request(f"{self.server}/readyz", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
            try:
                with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError as err:
                last = str(err)
            time.sleep(0.5)
        raise RuntimeError(f"kube-apiserver not ready after {READY_TIMEOUT_SECONDS}s: {last}")

    def stop(self) -> None:
        _stop(self.apiserver)
        _stop(self.etcd)

    def kubectl(self, *args: str, input_text: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["kubectl", f"--kubeconfig={self.kubeconfig}", *args],
            input=input_text, capture_output=True, text=True, check=check, timeout=120,
        )


@contextlib.contextmanager
def control_plane(workdir: Path) -> Iterator[ControlPlane]:
    cp = ControlPlane(workdir)
    try:
        yield cp.start()
    finally:
        cp.stop()
