"""Small helpers the dev cluster, the real node, the main job and the tests share: polling
until something holds, and the official helm binary run in isolation."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Optional


def wait_for(check: Callable[[], Any], what: str, timeout: float = 10.0, interval: float = 0.1) -> Any:
    """Poll `check` until it returns something truthy (returned); fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what} (last: {result!r})"
        time.sleep(interval)


class Helm:
    """One official helm binary (scripts/helm.sh fetches and caches it), run with its own
    HOME and XDG folders so that nothing of the machine's helm setup leaks in or out."""

    def __init__(self, repo_root: Path, major: str, home: Path, kubeconfig: Optional[Path] = None):
        out = subprocess.run([str(repo_root / "scripts" / "helm.sh"), major], check=True, capture_output=True,
                             text=True, timeout=600)
        self.binary = out.stdout.strip().splitlines()[-1]
        self.major = major
        self.kubeconfig = kubeconfig
        home.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(home / "cache"),
                    "XDG_CONFIG_HOME": str(home / "config"), "XDG_DATA_HOME": str(home / "data")}

    def __call__(self, *args: str, check: bool = True, kubeconfig: Optional[Path] = None) -> subprocess.CompletedProcess:
        config = kubeconfig or self.kubeconfig
        extra = [f"--kubeconfig={config}"] if config else []
        result = subprocess.run([self.binary, *args, *extra], capture_output=True, text=True, env=self.env,
                                timeout=600)
        if check:
            assert result.returncode == 0, f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
        return result
