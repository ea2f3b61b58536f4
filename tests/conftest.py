"""Shared fixtures: one real etcd + kube-apiserver per test session."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from afd_devcluster import ControlPlane, control_plane

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
