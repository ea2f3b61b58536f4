"""Per-deployment wake-up signals and locks, shared by the watch handlers and the reconcile
loops. Everything here lives on kopf's event loop; reconciliations themselves run in a
thread pool (they make blocking API calls)."""

from __future__ import annotations

import asyncio
from typing import Any

# How often a sleeping loop checks whether kopf asked it to stop.
STOP_POLL_SECONDS = 0.5


class Wakeups:
    def __init__(self) -> None:
        self._events: dict[tuple[str, str], asyncio.Event] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    def event(self, namespace: str, name: str) -> asyncio.Event:
        return self._events.setdefault((namespace, name), asyncio.Event())

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self._locks.setdefault((namespace, name), asyncio.Lock())

    def wake(self, namespace: str, name: str) -> None:
        self.event(namespace, name).set()

    def forget(self, namespace: str, name: str) -> None:
        self._events.pop((namespace, name), None)
        self._locks.pop((namespace, name), None)

    @staticmethod
    async def wait(wake: asyncio.Event, stopped: Any, timeout: float) -> None:
        """Sleep until woken, stopped, or `timeout` seconds pass."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not stopped:
            left = deadline - loop.time()
            if left <= 0:
                return
            try:
                await asyncio.wait_for(wake.wait(), min(left, STOP_POLL_SECONDS))
                return
            except asyncio.TimeoutError:
                continue
