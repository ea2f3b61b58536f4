"""Host state the real node changes, recorded before it starts and put back after it stops.

kubelet, kube-proxy, containerd and the CNI plugins change the machine itself: kernel
settings, iptables chains, network links and namespaces, folders at hard-coded paths and
cgroups. The record is a JSON file written once, before the first change; `restore` undoes
whatever differs from it and is safe to run again (a crashed run is cleaned by the next stop).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

# What kubelet (protectKernelDefaults off), kube-proxy and the bridge plugin set.
SYSCTLS = (
    "vm.overcommit_memory", "vm.panic_on_oom", "kernel.panic", "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys", "kernel.keys.root_maxbytes",
    "net.ipv4.conf.all.route_localnet", "net.ipv4.ip_forward",
    "net.bridge.bridge-nf-call-iptables", "net.bridge.bridge-nf-call-ip6tables",
)
# Paths kubelet, containerd's CRI, libcni and dockerd (its trust key) use whatever their flags say.
FIXED_PATHS = ("/var/lib/kubelet", "/var/log/pods", "/var/log/containers", "/var/lib/cni",
               "/run/containerd", "/var/run/netns", "/etc/cni", "/opt/cni", "/etc/docker/key.json")
IPTABLES = ("iptables", "ip6tables")
TABLES = ("filter", "nat", "mangle", "raw")
CGROUP_ROOT = Path("/sys/fs/cgroup")
QOS_CGROUP = "kubepods"


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def _run(*args: str, check: bool = True) -> str:
    return subprocess.run(args, check=check, capture_output=True, text=True).stdout


def iptables_chains(binary: str, table: str) -> dict[str, str]:
    """Chain name -> policy ('-' for user chains) of one table."""
    out = _run(f"{binary}-save", "-t", table, check=False)
    return {m.group(1): m.group(2) for m in re.finditer(r"^:(\S+) (\S+)", out, re.M)}


def _iptables_rules(binary: str, table: str) -> list[str]:
    out = _run(f"{binary}-save", "-t", table, check=False)
    return [line[3:] for line in out.splitlines() if line.startswith("-A ")]


def _links() -> list[str]:
    return [entry["ifname"] for entry in json.loads(_run("ip", "-j", "link", "show") or "[]")]


def _netns() -> list[str]:
    path = Path("/var/run/netns")
    return sorted(p.name for p in path.iterdir()) if path.is_dir() else []


def _qos_cgroups() -> list[str]:
    return sorted(str(p) for p in CGROUP_ROOT.glob(f"*/{QOS_CGROUP}"))


def mounts_under(prefixes: list[str]) -> list[str]:
    """Mount points at or below any of `prefixes`, deepest first (the order to unmount)."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if any(point == p or point.startswith(p.rstrip("/") + "/") for p in prefixes):
            points.append(point)
    return sorted(set(points), key=lambda p: (-p.count("/"), p))


@dataclass
class HostRecord:
    sysctls: dict[str, str] = field(default_factory=dict)
    chains: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)
    existing_paths: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    netns: list[str] = field(default_factory=list)
    qos_cgroups: list[str] = field(default_factory=list)

    @classmethod
    def capture(cls) -> "HostRecord":
        return cls(
            sysctls={n: _sysctl_path(n).read_text().strip() for n in SYSCTLS if _sysctl_path(n).exists()},
            chains={b: {t: iptables_chains(b, t) for t in TABLES} for b in IPTABLES},
            existing_paths=[p for p in FIXED_PATHS if os.path.lexists(p)],
            links=_links(), netns=_netns(), qos_cgroups=_qos_cgroups(),
        )

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> "HostRecord":
        return cls(**json.loads(path.read_text()))

    def differences(self) -> list[str]:
        """What differs now from the record (empty when the host is as it was)."""
        now = HostRecord.capture()
        diffs = [f"sysctl {n} = {now.sysctls.get(n)} (was {v})" for n, v in self.sysctls.items()
                 if now.sysctls.get(n) != v]
        for binary, tables in now.chains.items():
            for table, chains in tables.items():
                before = self.chains.get(binary, {}).get(table, {})
                diffs += [f"{binary} -t {table}: chain {c} added" for c in chains if c not in before]
                diffs += [f"{binary} -t {table}: policy of {c} is {p} (was {before[c]})"
                          for c, p in chains.items() if c in before and before[c] != p]
        diffs += [f"path {p} added" for p in now.existing_paths if p not in self.existing_paths]
        diffs += [f"link {n} added" for n in now.links if n not in self.links]
        diffs += [f"netns {n} added" for n in now.netns if n not in self.netns]
        diffs += [f"cgroup {c} added" for c in now.qos_cgroups if c not in self.qos_cgroups]
        return diffs

    def restore(self, owned_links: tuple[str, ...], state_dir: Path) -> None:
        """Undo every change against the record. Call with the node's processes stopped."""
        for point in mounts_under([str(state_dir), *(p for p in FIXED_PATHS if p not in self.existing_paths)]):
            subprocess.run(["umount", "-l", point], capture_output=True)
        for name in _netns():
            if name not in self.netns:
                subprocess.run(["ip", "netns", "delete", name], capture_output=True)
        for name in _links():
            if name not in self.links and (name in owned_links or name.startswith("veth")):
                subprocess.run(["ip", "link", "delete", name], capture_output=True)
        self._restore_iptables()
        for name, value in self.sysctls.items():
            path = _sysctl_path(name)
            if path.exists() and path.read_text().strip() != value:
                path.write_text(value)
        for path in FIXED_PATHS:
            if path not in self.existing_paths and os.path.lexists(path):
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.unlink(path)
        for cgroup in _qos_cgroups():
            if cgroup not in self.qos_cgroups:
                _remove_cgroup(Path(cgroup))

    def _restore_iptables(self) -> None:
        for binary in IPTABLES:
            for table in TABLES:
                before = self.chains.get(binary, {}).get(table, {})
                added = [c for c in iptables_chains(binary, table) if c not in before]
                # Jumps from the chains that stay into the chains that go come out first.
                for rule in _iptables_rules(binary, table):
                    chain, _, spec = rule.partition(" ")
                    target = re.search(r"(?:^| )-[jg] (\S+)", spec)
                    if chain in before and target and target.group(1) in added:
                        subprocess.run([binary, "-t", table, "-D", chain, *shlex.split(spec)],
                                       capture_output=True)
                for chain in added:
                    subprocess.run([binary, "-t", table, "-F", chain], capture_output=True)
                for chain in added:
                    subprocess.run([binary, "-t", table, "-X", chain], capture_output=True)
                for chain, policy in iptables_chains(binary, table).items():
                    if before.get(chain, "-") not in ("-", policy):
                        subprocess.run([binary, "-t", table, "-P", chain, before[chain]], capture_output=True)


def _remove_cgroup(path: Path) -> None:
    """rmdir a cgroup and its children, deepest first (cgroupfs refuses rm -r)."""
    for child in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        try:
            child.rmdir()
        except OSError:
            pass
    try:
        path.rmdir()
    except OSError:
        pass
