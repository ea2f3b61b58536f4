"""The real node for these tests: one per session, started here (or found running, when
scripts/realnode/start.sh brought it up, and then left running)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from afd_devcluster.realnode import RealNode
from afd_devcluster.realnode.scenario import (RELEASE, RELEASE_NAMESPACE, install_operator, node_helm,
                                              uninstall_operator)
from afd_devcluster.tools import Helm


# A cold first test builds images and imports several GB into containerd before it starts;
# pods then start vLLM on 2 cores. The suite's per-test default is far too short for that.
REAL_NODE_TEST_TIMEOUT_SECONDS = 2700


# Simple before complex: the node itself, then the chart, then the AFDDeployment on both.
MODULE_ORDER = ("test_node.py", "test_operator_chart.py", "test_afd_e2e.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    positions = [i for i, item in enumerate(items) if here in item.path.parents]
    ours = sorted((items[i] for i in positions), key=lambda item: MODULE_ORDER.index(item.path.name))
    for position, item in zip(positions, ours):
        item.add_marker(pytest.mark.timeout(REAL_NODE_TEST_TIMEOUT_SECONDS))
        items[position] = item


@pytest.fixture(scope="session")
def real_node(repo_root: Path) -> Iterator[RealNode]:
    # Debian packages and Kubernetes binaries: installed and built once, cached.
    subprocess.run([str(repo_root / "scripts" / "realnode" / "prepare.sh")], check=True)
    node = RealNode()
    started_here = not node.running()
    node.start()
    yield node
    if started_here:
        left = node.stop()
        assert not left, f"the real node left host changes behind: {left}"


@pytest.fixture(scope="session")
def project_images(real_node: RealNode) -> dict[str, str]:
    """The operator and CPU runtime images, built from images/ on the local Debian 12 base and
    imported into the node's containerd (cached: a rebuild of unchanged sources is a no-op)."""
    from afd_devcluster.realnode.images import ensure_project_images

    return ensure_project_images(real_node)


@pytest.fixture(scope="session")
def helm(real_node: RealNode, tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return node_helm(real_node, tmp_path_factory.mktemp("helm-home"))


@pytest.fixture(scope="session")
def operator_release(real_node: RealNode, project_images: dict[str, str], helm: Helm) -> Iterator[tuple[str, str]]:
    """(release, namespace) of the chart installed with the built operator image; uninstalled
    (CRD kept) at the end."""
    install_operator(real_node, helm)
    yield RELEASE, RELEASE_NAMESPACE
    uninstall_operator(real_node, helm)
