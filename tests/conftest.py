"""Shared fixtures: one real etcd + kube-apiserver per test session."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from testbed import REPO_ROOT, ControlPlane, control_plane

EXAMPLES = sorted((REPO_ROOT / "examples").glob("*.yaml"))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with control_plane(tmp_path_factory.mktemp("control-plane")) as cp:
        yield cp


@pytest.fixture(scope="session")
def api_client(cluster: ControlPlane):
    from kubernetes import client, config

    api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
    yield api
    api.close()


@pytest.fixture(scope="session")
def examples() -> list[Path]:
    assert EXAMPLES, "examples/ holds no YAML file"
    return EXAMPLES
