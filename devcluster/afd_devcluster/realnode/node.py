"""A real single-node Kubernetes 1.20.2 on this machine.

etcd + kube-apiserver + kube-scheduler + kube-controller-manager, kubelet on containerd + runc
with CNI bridge networking, kube-proxy (iptables), a cluster DNS (dnsmasq fed from the API by
`afd_devcluster.realnode.dns`) and dockerd for image builds. Every daemon is started by this
module and stopped by the PID it recorded; every host change is recorded before the first
one and undone by `stop` (see hoststate.py). One real node per machine: its state lives in
one folder ($AFD_REALNODE_STATE, default /tmp/afd-realnode), its caches (containerd's
images, docker's layers) under $AFD_CACHE_DIR/realnode.

Traffic stays on this machine: the node's address is the gateway of the pod bridge it makes
(10.244.0.1), the API server and kubelet listen only there and on loopback.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

import yaml

from afd_devcluster.cache import cache_root
from afd_devcluster.certs import self_signed_certificate
from afd_devcluster.daemons import Daemons
from afd_devcluster.ports import free_port
from afd_devcluster.realnode.hoststate import HostRecord, mounts_under
from afd_devcluster.realnode.images import PAUSE_IMAGE, ensure_testbed_images

NODE_NAME = "afd-node"
BRIDGE = "afd-cni0"
NODE_IP = "10.244.0.1"
POD_SUBNET = "10.244.0.0/24"
CLUSTER_CIDR = "10.244.0.0/16"
SERVICE_RANGE = "10.96.0.0/16"
DNS_SERVICE_IP = "10.96.0.10"
CLUSTER_DOMAIN = "cluster.local"
DOCKER_CLI = "/usr/bin/docker"  # Debian's docker CLI; a newer one may come first on PATH
READY_TIMEOUT_SECONDS = 120
STOP_TIMEOUT_SECONDS = 20
# kubectl errors of a request that never reached the API server: on these 2-core machines a
# starved API server (a roll starting vLLM engines) can miss kubectl's TLS handshake deadline.
# Retried, since nothing was sent; every other failure is reported at once.
KUBECTL_UNSENT = ("net/http: TLS handshake timeout", "connect: connection refused")
KUBECTL_ATTEMPTS = 4
REPO_ROOT = Path(__file__).resolve().parents[3]
_BUILD_SCRIPT = REPO_ROOT / "scripts" / "build-kube.sh"
KUBE_BINARIES = ("kube-apiserver", "kubelet", "kube-proxy", "kube-scheduler", "kube-controller-manager", "kubectl")
# Stop order: the users of a service before the service.
DAEMONS = ("kube-proxy", "kube-controller-manager", "kube-scheduler", "kubelet", "dns-feeder", "dnsmasq",
           "dockerd", "containerd", "kube-apiserver", "etcd")


def default_state_dir() -> Path:
    return Path(os.environ.get("AFD_REALNODE_STATE", "/tmp/afd-realnode"))


def cache_dir() -> Path:
    return cache_root() / "realnode"


def kube_binaries() -> dict[str, str]:
    """Paths of the Kubernetes 1.20.2 binaries (KUBE_BINARIES): from $AFD_KUBE_BIN_DIR, else
    built (once, cached) by scripts/build-kube.sh."""
    configured = os.environ.get("AFD_KUBE_BIN_DIR")
    if configured:
        return {b: str(Path(configured) / b) for b in KUBE_BINARIES}
    if not _BUILD_SCRIPT.is_file():
        raise RuntimeError(f"no Kubernetes binaries: set $AFD_KUBE_BIN_DIR ({_BUILD_SCRIPT} is not there)")
    out = subprocess.run([str(_BUILD_SCRIPT), *KUBE_BINARIES], check=True, capture_output=True, text=True)
    return dict(zip(KUBE_BINARIES, out.stdout.split()))


def _kubeconfig(server: str, user: str, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Config", "current-context": "afd-realnode",
        "clusters": [{"name": "afd-realnode", "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "afd-realnode", "context": {"cluster": "afd-realnode", "user": user}}],
    }


class RealNode:
    def __init__(self, state_dir: Optional[Path] = None):
        self.state = (state_dir or default_state_dir()).resolve()
        self.cache = cache_dir()
        self.logs = self.state / "logs"
        self.pids = self.state / "pids"
        self.kubeconfig = self.state / "kubeconfig"
        self.record_file = self.state / "host-record.json"
        self.info_file = self.state / "node.json"
        self.containerd_socket = self.state / "containerd.sock"
        self.docker_socket = self.state / "docker.sock"
        self.daemons = Daemons(self.logs, self.pids, READY_TIMEOUT_SECONDS, STOP_TIMEOUT_SECONDS)
        self._bins: dict[str, str] = {}

    # ---- what a started node offers ---------------------------------------------------------

    @property
    def info(self) -> dict[str, Any]:
        return json.loads(self.info_file.read_text())

    @property
    def server(self) -> str:
        return self.info["server"]

    def kubectl(self, *args: str, input_text: Optional[str] = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess:
        for attempt in range(1, KUBECTL_ATTEMPTS + 1):
            proc = subprocess.run([self.info["kubectl"], f"--kubeconfig={self.kubeconfig}", *args],
                                  input=input_text, capture_output=True, text=True, timeout=timeout)
            unsent = any(error in proc.stderr for error in KUBECTL_UNSENT)
            if proc.returncode == 0 or not unsent or attempt == KUBECTL_ATTEMPTS:
                break
            time.sleep(2 * attempt)
        if check and proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def ctr(self, *args: str, check: bool = True, input_bytes: Optional[bytes] = None,
            stdin: Any = None) -> subprocess.CompletedProcess:
        proc = subprocess.run(["ctr", "--address", str(self.containerd_socket), "--namespace", "k8s.io", *args],
                              input=input_bytes, stdin=stdin, capture_output=True)
        if check and proc.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)} failed ({proc.returncode}): "
                               f"{proc.stderr.decode(errors='replace').strip()[-2000:]}")
        return proc

    @property
    def docker_argv(self) -> list[str]:
        """The docker CLI talking to this node's dockerd."""
        return [DOCKER_CLI, "-H", f"unix://{self.docker_socket}"]

    def docker(self, *args: str, check: bool = True, **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.run([*self.docker_argv, *args], check=check, **kwargs)

    def running(self) -> list[str]:
        """The daemons of this node that are alive now."""
        return [name for name in DAEMONS if self.daemons.alive(name)]

    # ---- start ------------------------------------------------------------------------------

    def start(self) -> "RealNode":
        """Start every part not already running (a second call finds them up and returns)."""
        self.state.mkdir(parents=True, exist_ok=True)
        with open(self.state / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self.info_file.exists() and len(self.running()) == len(DAEMONS):
                return self
            if self.running():
                raise RuntimeError(f"the real node in {self.state} is half up ({', '.join(self.running())}); "
                                   f"stop it first (scripts/realnode/stop.sh)")
            try:
                self._start()
            except BaseException:
                self._stop()
                raise
        return self

    def _start(self) -> None:
        for sub in (self.logs, self.pids):
            sub.mkdir(parents=True, exist_ok=True)
        if not self.record_file.exists():  # a crashed run's record is still the true "before"
            HostRecord.capture().save(self.record_file)
        # Every start is a fresh cluster: a previous run's objects (the `kubernetes` Endpoints
        # with an old API port among them) must not come back.
        for stale in ("etcd-data", "certs", "kubelet", "kubelet-pki", "cni", "dns", "containerd-state"):
            shutil.rmtree(self.state / stale, ignore_errors=True)
        self._bins = kube_binaries()
        self._make_bridge()
        tokens = self._write_credentials()
        self._start_containerd()
        self._start_dockerd()
        ensure_testbed_images(self)
        api_port = free_port()
        server = f"https://{NODE_IP}:{api_port}"
        self.info_file.write_text(json.dumps({"server": server, "kubectl": self._bins["kubectl"],
                                              "node": NODE_NAME, "node_ip": NODE_IP}))
        self._start_control_plane(api_port, server, tokens)
        self._start_node(server, tokens)
        self._start_dns()
        self._wait_node_ready()

    def _make_bridge(self) -> None:
        # The CNI bridge plugin adopts an existing bridge; making it first gives the node an
        # address before any pod exists, for the API server and kubelet to listen on.
        if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode != 0:
            subprocess.run(["ip", "link", "add", BRIDGE, "type", "bridge"], check=True)
            subprocess.run(["ip", "addr", "add", f"{NODE_IP}/24", "dev", BRIDGE], check=True)
        subprocess.run(["ip", "link", "set", BRIDGE, "up"], check=True)

    def _write_credentials(self) -> dict[str, str]:
        certs = self.state / "certs"
        certs.mkdir(exist_ok=True)
        sa_key = certs / "sa.key"
        if not sa_key.exists():
            subprocess.run(["openssl", "genrsa", "-out", str(sa_key), "2048"], check=True, capture_output=True)
            subprocess.run(["openssl", "rsa", "-in", str(sa_key), "-pubout", "-out", str(certs / "sa.pub")],
                           check=True, capture_output=True)
        # kubelet trusts only this client certificate (the API server's, for logs and exec).
        self_signed_certificate(certs / "kubelet-client", ["afd-kube-apiserver"])
        users = {  # token owner -> (user name, group)
            "admin": ("afd-admin", "system:masters"),
            "kubelet": (f"system:node:{NODE_NAME}", "system:nodes"),
            "kube-proxy": ("system:kube-proxy", ""),
            "kube-scheduler": ("system:kube-scheduler", ""),
            # The controllers' own bootstrap role assumes per-controller service accounts; one
            # identity with every right is the small-cluster shortcut.
            "kube-controller-manager": ("system:kube-controller-manager", "system:masters"),
        }
        tokens = {owner: secrets.token_hex(16) for owner in users}
        (self.state / "tokens.csv").write_text("".join(
            f'{tokens[o]},{name},{i},"{group}"\n' for i, (o, (name, group)) in enumerate(users.items(), 1)))
        return tokens

    def _start_containerd(self) -> None:
        root = self.cache / "containerd"
        root.mkdir(parents=True, exist_ok=True)
        cni_conf = self.state / "cni" / "net.d"
        cni_conf.mkdir(parents=True, exist_ok=True)
        (cni_conf / "10-afd.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": "afd",
            "plugins": [
                {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": True, "hairpinMode": True,
                 "ipam": {"type": "host-local", "dataDir": str(self.state / "cni" / "ipam"),
                          "ranges": [[{"subnet": POD_SUBNET, "rangeStart": "10.244.0.10", "gateway": NODE_IP}]],
                          "routes": [{"dst": "0.0.0.0/0"}]}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
                # dockerd (elsewhere) may set FORWARD's policy to DROP; bridged pod traffic
                # goes through FORWARD, and this plugin accepts it.
                {"type": "firewall"},
            ]}, indent=1))
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        config = f"""version = 2
root = "{root}"
state = "{self.state / 'containerd-state'}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "{self.containerd_socket}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{self.state / 'containerd-opt'}"
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  # This kernel refuses negative oom_score_adj, which kubelet asks for sandboxes.
  restrict_oom_score_adj = true
[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false
[{cri}.cni]
  bin_dir = "/usr/lib/cni"
  conf_dir = "{cni_conf}"
"""
        (self.state / "containerd.toml").write_text(config)
        # tini reaps the container shims that outlive their parent.
        self.daemons.spawn("containerd", ["tini", "-s", "--", "containerd", "--config", str(self.state / "containerd.toml")])
        self.daemons.wait("containerd", lambda: self.ctr("version", check=False).returncode == 0, "containerd")

    def _start_dockerd(self) -> None:
        data = self.cache / "docker"
        data.mkdir(parents=True, exist_ok=True)
        (self.state / "daemon.json").write_text("{}")
        # No bridge and no iptables: builds run with --network host, the host's firewall stays as is.
        self.daemons.spawn("dockerd", [
            "tini", "-s", "--", "dockerd", "--data-root", str(data), "--exec-root", str(self.state / "docker-exec"),
            "-H", f"unix://{self.docker_socket}", "--pidfile", str(self.state / "dockerd.pid"),
            "--containerd", str(self.containerd_socket), "--config-file", str(self.state / "daemon.json"),
            "--iptables=false", "--ip-forward=false", "--ip-masq=false", "--bridge=none"])
        self.daemons.wait("dockerd", lambda: self.docker("version", check=False, capture_output=True).returncode == 0,
                          "dockerd")

    def _start_control_plane(self, api_port: int, server: str, tokens: dict[str, str]) -> None:
        etcd_port, etcd_peer = free_port(), free_port()
        self.daemons.spawn("etcd", [
            "etcd", "--data-dir", str(self.state / "etcd-data"),
            "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
            "--initial-cluster", f"default=http://127.0.0.1:{etcd_peer}", "--unsafe-no-fsync"])
        certs = self.state / "certs"
        self.daemons.spawn("kube-apiserver", [
            self._bins["kube-apiserver"],
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            f"--bind-address={NODE_IP}", f"--advertise-address={NODE_IP}",
            f"--secure-port={api_port}", "--insecure-port=0",
            # Self-signed serving certificate with SANs for the node address, the first
            # Service IP and kubernetes.default.svc (what pods dial).
            f"--cert-dir={certs}", f"--token-auth-file={self.state / 'tokens.csv'}",
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={certs / 'sa.pub'}",
            f"--service-account-signing-key-file={certs / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_RANGE}", "--allow-privileged=true",
            "--kubelet-preferred-address-types=InternalIP",
            f"--kubelet-client-certificate={certs / 'kubelet-client' / 'tls.crt'}",
            f"--kubelet-client-key={certs / 'kubelet-client' / 'tls.key'}",
            "--profiling=false"])
        admin = _kubeconfig(server, "afd-admin", tokens["admin"])
        self.kubeconfig.write_text(yaml.safe_dump(admin))
        for owner in ("kubelet", "kube-proxy", "kube-scheduler", "kube-controller-manager"):
            (self.state / f"{owner}.kubeconfig").write_text(yaml.safe_dump(_kubeconfig(server, owner, tokens[owner])))
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE

        def ready() -> bool:
            req = urllib.request.Request(f"{server}/readyz", headers={"Authorization": f"Bearer {tokens['admin']}"})
            with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
                return resp.status == 200
        self.daemons.wait("kube-apiserver", ready, "kube-apiserver")
        common = ["--leader-elect=false", "--port=0", "--bind-address=127.0.0.1"]
        self.daemons.spawn("kube-scheduler", [
            self._bins["kube-scheduler"], f"--kubeconfig={self.state / 'kube-scheduler.kubeconfig'}",
            f"--authentication-kubeconfig={self.state / 'kube-scheduler.kubeconfig'}",
            f"--authorization-kubeconfig={self.state / 'kube-scheduler.kubeconfig'}",
            f"--secure-port={free_port()}", *common])
        self.daemons.spawn("kube-controller-manager", [
            self._bins["kube-controller-manager"], f"--kubeconfig={self.state / 'kube-controller-manager.kubeconfig'}",
            f"--secure-port={free_port()}", *common,
            "--controllers=*,-nodeipam,-cloud-node-lifecycle,-route,-service",
            f"--service-account-private-key-file={certs / 'sa.key'}",
            f"--root-ca-file={certs / 'apiserver.crt'}",
            f"--cluster-cidr={CLUSTER_CIDR}", f"--service-cluster-ip-range={SERVICE_RANGE}"])

    def _start_node(self, server: str, tokens: dict[str, str]) -> None:
        (self.state / "resolv.conf").write_text("")  # pods get no search domain of the host
        kubelet_port, healthz_port = free_port(), free_port()
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": NODE_IP, "port": kubelet_port, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": healthz_port,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                               "x509": {"clientCAFile": str(self.state / "certs" / "kubelet-client" / "tls.crt")}},
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "cgroupfs", "failSwapOn": False,
            "clusterDNS": [DNS_SERVICE_IP], "clusterDomain": CLUSTER_DOMAIN,
            "resolvConf": str(self.state / "resolv.conf"),
            "hairpinMode": "hairpin-veth", "serializeImagePulls": False,
            # A small shared disk: never garbage-collect images or evict for disk pressure.
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "protectKernelDefaults": False,
        }
        (self.state / "kubelet.yaml").write_text(yaml.safe_dump(config))
        self.daemons.spawn("kubelet", [
            self._bins["kubelet"], f"--config={self.state / 'kubelet.yaml'}",
            f"--kubeconfig={self.state / 'kubelet.kubeconfig'}",
            "--container-runtime=remote", f"--container-runtime-endpoint=unix://{self.containerd_socket}",
            f"--root-dir={self.state / 'kubelet'}", f"--cert-dir={self.state / 'kubelet-pki'}",
            f"--node-ip={NODE_IP}", f"--hostname-override={NODE_NAME}",
            "--oom-score-adj=0", "--v=1"])
        proxy_health, proxy_metrics = free_port(), free_port()
        self.daemons.spawn("kube-proxy", [
            self._bins["kube-proxy"], f"--kubeconfig={self.state / 'kube-proxy.kubeconfig'}",
            "--proxy-mode=iptables", f"--cluster-cidr={CLUSTER_CIDR}", f"--hostname-override={NODE_NAME}",
            f"--bind-address={NODE_IP}", f"--healthz-bind-address=127.0.0.1:{proxy_health}",
            f"--metrics-bind-address=127.0.0.1:{proxy_metrics}", "--oom-score-adj=0",
            # Leave the kernel's conntrack limits and timeouts as they are.
            "--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0",
            "--conntrack-tcp-timeout-close-wait=0"])

    def _start_dns(self) -> None:
        hosts_dir = self.state / "dns"
        hosts_dir.mkdir(exist_ok=True)
        hosts_dir.chmod(0o755)
        self.daemons.spawn("dnsmasq", [
            "dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv", "--no-hosts",
            f"--hostsdir={hosts_dir}", f"--local=/{CLUSTER_DOMAIN}/", "--domain-needed",
            "--bind-interfaces", f"--listen-address={NODE_IP}", "--port=53", "--user=root",
            f"--log-facility={self.logs / 'dnsmasq-queries.log'}"])
        self.daemons.spawn("dns-feeder", [
            sys.executable, "-m", "afd_devcluster.realnode.dns", "--kubeconfig", str(self.kubeconfig),
            "--hosts-file", str(hosts_dir / "cluster.hosts"), "--domain", CLUSTER_DOMAIN])
        # The kube-dns Service points at dnsmasq on the node address (no selector: its
        # Endpoints are written here), so pods use the usual Service IP.
        manifest = {"apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "kube-dns", "namespace": "kube-system"},
             "spec": {"clusterIP": DNS_SERVICE_IP, "ports": [
                 {"name": "dns", "port": 53, "protocol": "UDP"}, {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]}},
            {"apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": "kube-dns", "namespace": "kube-system"},
             "subsets": [{"addresses": [{"ip": NODE_IP}], "ports": [
                 {"name": "dns", "port": 53, "protocol": "UDP"}, {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]}]},
        ]}
        self.kubectl("apply", "-f", "-", input_text=json.dumps(manifest))

    def _wait_node_ready(self) -> None:
        def ready() -> bool:
            out = self.kubectl("get", "node", NODE_NAME, "-o",
                               "jsonpath={.status.conditions[?(@.type=='Ready')].status}", check=False)
            return out.stdout.strip() == "True"
        self.daemons.wait(f"node {NODE_NAME}", ready, "kubelet")

    # ---- stop -------------------------------------------------------------------------------

    def stop(self) -> list[str]:
        """Stop everything, undo the host changes; returns what still differs from the record
        (empty when the host is back as it was). Safe to call when nothing runs."""
        if not self.state.exists():
            return []
        with open(self.state / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return self._stop()

    def _stop(self) -> list[str]:
        if self.daemons.alive("kubelet") and self.daemons.alive("kube-apiserver"):
            self._drain()
        for name in DAEMONS:
            if name == "containerd":
                self._remove_containers()
            if name == "kube-proxy" and self.daemons.alive(name):
                self.daemons.stop(name)
                # Its iptables rules stay behind when it exits; its own cleanup mode removes them.
                subprocess.run([self._bin_or_cached("kube-proxy"), "--cleanup"], capture_output=True)
                continue
            self.daemons.stop(name)
        self._kill_shims()
        diffs: list[str] = []
        if self.record_file.exists():
            record = HostRecord.load(self.record_file)
            record.restore((BRIDGE,), self.state)
            for point in mounts_under([str(self.cache)]):
                subprocess.run(["umount", "-l", point], capture_output=True)
            diffs = record.differences()
            if not diffs:
                self.record_file.unlink()
        self.info_file.unlink(missing_ok=True)
        return diffs

    def _bin_or_cached(self, name: str) -> str:
        return self._bins.get(name) or kube_binaries()[name]

    def _drain(self) -> None:
        """Delete every pod and wait until kubelet has torn them down (volumes unmounted,
        sandboxes and their network removed through CNI)."""
        self.kubectl("delete", "pods", "--all", "--all-namespaces", "--wait=false", check=False)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = self.kubectl("get", "pods", "--all-namespaces", "-o", "name", check=False)
            sandboxes = self.ctr("containers", "ls", "-q", check=False).stdout.split()
            if out.returncode == 0 and not out.stdout.strip() and not sandboxes:
                return
            time.sleep(0.5)

    def _remove_containers(self) -> None:
        """Kill and delete whatever containerd still runs (a crashed test leaves some)."""
        if not self.daemons.alive("containerd"):
            return
        for namespace in ("k8s.io", "moby"):
            base = ["ctr", "--address", str(self.containerd_socket), "--namespace", namespace]
            for cid in subprocess.run([*base, "tasks", "ls", "-q"], capture_output=True, text=True).stdout.split():
                subprocess.run([*base, "tasks", "kill", "-s", "SIGKILL", cid], capture_output=True)
                subprocess.run([*base, "tasks", "delete", "-f", cid], capture_output=True)
            for cid in subprocess.run([*base, "containers", "ls", "-q"], capture_output=True, text=True).stdout.split():
                subprocess.run([*base, "containers", "delete", cid], capture_output=True)

    def _kill_shims(self) -> None:
        """containerd-shim processes of this node's containerd that outlived it."""
        marker = str(self.state / "containerd-state").encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if cmdline.startswith(b"/usr/bin/containerd-shim") and (
                    marker in cmdline or str(self.containerd_socket).encode() in cmdline):
                try:
                    os.kill(int(proc.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass
