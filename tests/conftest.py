"""Shared fixtures: one real etcd + kube-apiserver per test session."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import settings

from afd_devcluster import ControlPlane, control_plane

# Property tests assert results, not speed: hypothesis' per-example deadline (200 ms) fails
# them on a machine that is busy (measured: 2.7 s for one example beside a real-node run).
settings.register_profile("afd", deadline=None)
settings.load_profile("afd")

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO_ROOT / "examples").glob("*.yaml"))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    # A fixture, not an import: every conftest.py here is module `conftest`, so whichever
    # pytest loaded last would answer `from conftest import ...`.
    return REPO_ROOT


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with control_plane(tmp_path_factory.mktemp("control-plane")) as cp:
        yield cp


@pytest.fixture(scope="session")
def api_client(cluster: ControlPlane):
    from kubernetes import config

    api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    yield api
    api.close()


@pytest.fixture(scope="session")
def examples() -> list[Path]:
    assert EXAMPLES, "examples/ holds no YAML file"
    return EXAMPLES
