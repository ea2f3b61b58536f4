"""Shared fixtures: one real etcd + kube-apiserver per test session."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional

import pytest
import yaml
from hypothesis import settings
from xdist.scheduler import LoadScopeScheduling

from afd_devcluster import ControlPlane, control_plane
from k8s_helpers import EXAMPLES_HOST_ACCESS

# Property tests assert results, not speed: hypothesis' per-example deadline (200 ms) fails
# them on a machine that is busy (measured: 2.7 s for one example beside a real-node run).
settings.register_profile("afd", deadline=None)
settings.load_profile("afd")

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO_ROOT / "examples").glob("*.yaml"))

# Tests that run real vLLM servers (an engine beside FFN server processes) or the real node:
# each uses most of this machine's memory and cores. Under xdist (pyproject: -n 2) they are one
# work unit, run in order on one worker, while the other worker runs every other test (the API
# server tier, plain torch, single vLLM processes). The unit is scheduled first (xdist starts
# the largest), so the other tests end while the vLLM servers run, well before the real node
# measures the host's memory.
WHOLE_MACHINE_MODULES = ("tests/plugin/test_vllm_e2e_offline.py", "tests/plugin/test_vllm_ffn_multi_rank.py",
                         "tests/plugin/test_vllm_graph_modes.py", "tests/plugin/test_vllm_serve_e2e.py",
                         "tests/realnode/")


def is_whole_machine(nodeid: str) -> bool:
    return nodeid.split("::", 1)[0].startswith(WHOLE_MACHINE_MODULES)


class WholeMachineUnit(LoadScopeScheduling):
    """xdist's scope scheduler with one scope for all whole-machine tests, one per other test.
    (xdist_group cannot do it here: xdist 3.8 tags the group into `_nodeid`, which pytest 9.2
    no longer reads.)"""

    def _split_scope(self, nodeid: str) -> str:
        return "whole-machine" if is_whole_machine(nodeid) else nodeid


def pytest_xdist_make_scheduler(config: pytest.Config, log) -> Optional[LoadScopeScheduling]:
    # xdist's default mode only; an explicit --dist keeps xdist's own scheduler.
    return WholeMachineUnit(config, log) if config.getvalue("dist") == "load" else None


@pytest.hookimpl(tryfirst=True)  # before -m selects by markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Selectable with -m whole_machine / -m "not whole_machine".
    for item in items:
        if is_whole_machine(item.nodeid):
            item.add_marker(pytest.mark.whole_machine)


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
def examples_policy_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A chart values file granting what the examples use of their nodes (`--policy`)."""
    path = tmp_path_factory.mktemp("policy") / "values.yaml"
    path.write_text(yaml.safe_dump(EXAMPLES_HOST_ACCESS))
    return path


@pytest.fixture(scope="session")
def examples() -> list[Path]:
    assert EXAMPLES, "examples/ holds no YAML file"
    return EXAMPLES
