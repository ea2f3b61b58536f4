"""Per-deployment wake-up signals and locks shared by the watch handlers and the
reconcile loops (which run in kopf's daemon threads)."""

from __future__ import annotations

import threading
import time
from typing import Any

# How often a sleeping loop checks whether kopf asked it to stop.
STOP_POLL_SECONDS = 0.5


class Wakeups:
    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._events: dict[tuple[str, str], threading.Event] = {}
        self._locks: dict[tuple[str, str], threading.Lock] = {}

    def event(self, namespace: str, name: str) -> threading.Event:
        with self._guard:
            return self._events.setdefault((namespace, name), threading.Event())

    def lock(self, namespace: str, name: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def wake(self, namespace: str, name: str) -> None:
        self.event(namespace, name).set()

    def forget(self, namespace: str, name: str) -> None:
        with self._guard:
            self._events.pop((namespace, name), None)
            self._locks.pop((namespace, name), None)

    @staticmethod
    def wait(wake: threading.Event, stopped: Any, timeout: float) -> None:
        """Sleep until woken, stopped, or `timeout` seconds pass."""
        deadline = time.monotonic() + timeout
        while not stopped:
            left = deadline - time.monotonic()
            if left <= 0 or wake.wait(min(left, STOP_POLL_SECONDS)):
                return
