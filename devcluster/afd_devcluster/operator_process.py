"""Run the real `afd-operator` as a separate process against a dev control plane.

Used by the tests (which also kill and restart it) and by the README's main job.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

from .ports import free_port

READY_TIMEOUT_SECONDS = 60


class OperatorProcess:
    def __init__(self, kubeconfig: Path, log_path: Path, namespaces: tuple[str, ...] = (),
                 resync_seconds: float = 1.0, extra_args: tuple[str, ...] = ()):
        self.kubeconfig = kubeconfig
        self.log_path = log_path
        self.namespaces = namespaces
        self.resync_seconds = resync_seconds
        self.extra_args = extra_args
        self.metrics_port = free_port()
        self.health_port = free_port()
        self.proc: Optional[subprocess.Popen] = None

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self) -> "OperatorProcess":
        args = [sys.executable, "-m", "afd_operator.run", "--kubeconfig", str(self.kubeconfig),
                "--metrics-port", str(self.metrics_port),
                "--liveness", f"http://127.0.0.1:{self.health_port}/healthz",
                "--resync-seconds", str(self.resync_seconds), *self.extra_args]
        for ns in self.namespaces:
            args += ["--namespace", ns]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"afd-operator exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"afd-operator not healthy after {READY_TIMEOUT_SECONDS}s; see {self.log_path}")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as resp:
            return resp.read().decode()

    def kill(self) -> None:
        """Crash it (SIGKILL): no cleanup, as when a node or the container dies."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> "OperatorProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
