"""Helpers shared by the tests that drive the real kube-apiserver."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Optional

import yaml


DELETE = object()  # a value for set_path that removes the key


def set_path(obj: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """Set (or, with DELETE, remove) one dotted path of a nested mapping in place; returns obj."""
    node = obj
    *parents, last = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    if value is DELETE:
        node.pop(last)
    else:
        node[last] = value
    return obj


def delete_afddeployments(cluster: Any, namespace: str, timeout_seconds: int = 90) -> None:
    """Delete every AFDDeployment of a test namespace and wait until they are gone.

    Tests share one apiserver: an object left behind keeps its finalizer once no operator
    runs, and then blocks any later deletion of the CRD (Kubernetes has no namespace
    controller here to clean up either)."""
    cluster.kubectl("delete", "afddeployments", "--all", "-n", namespace, f"--timeout={timeout_seconds}s")


def wait_for(check: Callable[[], Any], what: str, timeout: float = 10.0, interval: float = 0.1) -> Any:
    """Poll `check` until it returns something truthy; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(interval)


class Helm:
    """One official helm binary (scripts/helm.sh fetches and caches it), run with its own
    HOME and XDG folders so that nothing of the machine's helm setup leaks in or out."""

    def __init__(self, repo_root: Path, major: str, home: Path):
        out = subprocess.run([str(repo_root / "scripts" / "helm.sh"), major], check=True, capture_output=True,
                             text=True, timeout=600)
        self.binary = out.stdout.strip().splitlines()[-1]
        self.major = major
        home.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(home / "cache"),
                    "XDG_CONFIG_HOME": str(home / "config"), "XDG_DATA_HOME": str(home / "data")}

    def __call__(self, *args: str, check: bool = True, kubeconfig: Optional[Path] = None) -> subprocess.CompletedProcess:
        extra = [f"--kubeconfig={kubeconfig}"] if kubeconfig else []
        result = subprocess.run([self.binary, *args, *extra], capture_output=True, text=True, env=self.env,
                                timeout=300)
        if check:
            assert result.returncode == 0, f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
        return result


def service_account_kubeconfig(cluster: Any, namespace: str, service_account: str, path: Path) -> Path:
    """A kubeconfig that authenticates as the ServiceAccount, with a token from the TokenRequest
    API (what a pod of that ServiceAccount gets mounted)."""
    token = cluster.kubectl("create", "token", service_account, "-n", namespace, "--duration=2h").stdout.strip()
    user = f"system:serviceaccount:{namespace}:{service_account}"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "dev", "cluster": {"server": cluster.server, "insecure-skip-tls-verify": True}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "dev", "user": user}}],
    }))
    return path
