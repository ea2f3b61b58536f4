"""Long-running host processes the dev cluster starts and must find again: each has a log file
and a pid file holding its pid and start time, so a pid the kernel reused is never signalled,
and a node started by one process can be stopped by another."""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional


def log_tail(path: Path, lines: int = 25) -> str:
    """The last `lines` lines of a log ("" when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat), None if gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


class Daemons:
    """The daemons of one state folder: `logs/NAME.log` and `pids/NAME.pid`."""

    def __init__(self, logs: Path, pids: Path, ready_timeout: float, stop_timeout: float):
        self.logs, self.pids = logs, pids
        self.ready_timeout, self.stop_timeout = ready_timeout, stop_timeout
        self._procs: dict[str, subprocess.Popen] = {}

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def spawn(self, name: str, argv: list[str], env: Optional[dict[str, str]] = None) -> None:
        with open(self.log(name), "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env={**os.environ, **(env or {})})
        self._procs[name] = proc
        (self.pids / f"{name}.pid").write_text(f"{proc.pid} {start_time(proc.pid)}")

    def pid(self, name: str) -> Optional[int]:
        try:
            pid, started = (self.pids / f"{name}.pid").read_text().split()
        except (OSError, ValueError):
            return None
        return int(pid) if start_time(int(pid)) == started else None

    def alive(self, name: str) -> bool:
        return self.pid(name) is not None

    def wait(self, what: str, check: Callable[[], bool], name: str) -> None:
        """Until `check()` holds; fails with the daemon's log tail when it exits or time runs out."""
        timeout = self.ready_timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive(name):
                raise RuntimeError(f"{name} exited; log {self.log(name)}:\n{log_tail(self.log(name))}")
            try:
                if check():
                    return
            except (OSError, subprocess.SubprocessError, ssl.SSLError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{what} not ready after {timeout}s; log {self.log(name)}:\n{log_tail(self.log(name))}")

    def stop(self, name: str) -> None:
        """SIGTERM to the daemon's process group, SIGKILL after the stop timeout."""
        pid = self.pid(name)
        if pid is None:
            (self.pids / f"{name}.pid").unlink(missing_ok=True)
            return
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + self.stop_timeout
        while time.monotonic() < deadline and self.alive(name):
            if name in self._procs:
                try:
                    self._procs[name].wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
            else:
                time.sleep(0.2)
        if self.alive(name):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if name in self._procs:
                self._procs[name].wait(timeout=10)
        (self.pids / f"{name}.pid").unlink(missing_ok=True)
