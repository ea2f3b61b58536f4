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
# The xdist group of the whole_machine tests: real vLLM servers and the real node each use most
# of this machine's memory and cores, so they run one at a time on one worker, while the other
# worker runs the rest (light: the API server tests, plain torch). They come first, so the light
# tests end while the vLLM ones run, long before the real node measures the host's memory.
WHOLE_MACHINE_GROUP = "whole-machine"


@pytest.hookimpl(tryfirst=True)  # before xdist names each test's group from its markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    heavy = [item for item in items if item.get_closest_marker("whole_machine")]
    for item in heavy:
        item.add_marker(pytest.mark.xdist_group(WHOLE_MACHINE_GROUP))
    items[:] = heavy + [item for item in items if not item.get_closest_marker("whole_machine")]


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
