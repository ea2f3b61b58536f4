"""The project's cache outside the clone (scripts/common.sh: $AFD_CACHE_DIR), shared by fresh
clones of the same machine: Kubernetes builds, environments, the real node's state, checkpoints."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    base = os.environ.get("AFD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "afd-operator")
    return Path(base)
