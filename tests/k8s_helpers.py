"""Helpers shared by the tests that drive the real kube-apiserver."""

from __future__ import annotations

import time
from typing import Any, Callable


def wait_for(check: Callable[[], Any], what: str, timeout: float = 10.0, interval: float = 0.1) -> Any:
    """Poll `check` until it returns something truthy; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(interval)
