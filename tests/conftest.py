"""Test tiers (a marker on every test) and shared fixtures: one real etcd + kube-apiserver per test session."""

from __future__ import annotations

import os
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
# Every test is in exactly one tier, by what it needs (the first that applies):
#   whole_machine  real vLLM servers (an engine beside FFN server processes), the real node, or
#                  FFN pods of 16 ranks (23 rank processes and 22 Attention ranks at once):
#                  each uses most of this machine's memory and cores;
#   vllm           runs the vLLM venv's python ($AFD_VLLM_PYTHON) in single processes;
#   apiserver      the real etcd + kube-apiserver (the `cluster` fixture);
#   unit           none of these.
# README.md ("Test tiers") has each tier's command and time.
WHOLE_MACHINE_MODULES = ("tests/plugin/test_ffn_supervisor.py", "tests/plugin/test_vllm_e2e_offline.py",
                         "tests/plugin/test_vllm_ffn_multi_rank.py",
                         "tests/plugin/test_vllm_model_families.py", "tests/plugin/test_vllm_serve_e2e.py",
                         "tests/realnode/")
# Modules that run the vLLM venv's python (the whole-machine ones among them).
VLLM_MODULES = ("tests/plugin/test_vllm_ascend_context.py", "tests/plugin/test_vllm_cpu_patches.py",
                "tests/plugin/test_vllm_engine_flags.py",
                "tests/plugin/test_vllm_e2e_offline.py", "tests/plugin/test_vllm_ffn_experts.py",
                "tests/plugin/test_vllm_ffn_multi_rank.py", "tests/plugin/test_vllm_model_families.py",
                "tests/plugin/test_vllm_model_support.py", "tests/plugin/test_vllm_serve_e2e.py",
                "tests/plugin/test_vllm_stage_glue.py")
WHOLE_MACHINE_SCOPE = "whole-machine"
NO_VLLM_VENV = ('needs the vLLM venv: set AFD_VLLM_PYTHON="$(scripts/vllm-env.sh)/bin/python" '
                "(scripts/test.sh does)")


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def is_whole_machine(nodeid: str) -> bool:
    return module_of(nodeid).startswith(WHOLE_MACHINE_MODULES)


def tier_of(item: pytest.Item) -> str:
    if is_whole_machine(item.nodeid):
        return "whole_machine"
    if module_of(item.nodeid).startswith(VLLM_MODULES):
        return "vllm"
    if "cluster" in getattr(item, "fixturenames", ()):
        return "apiserver"
    return "unit"


def vllm_venv_given() -> bool:
    python = os.environ.get("AFD_VLLM_PYTHON", "")
    return bool(python) and os.access(python, os.X_OK)


class WholeMachineUnit(LoadScopeScheduling):
    """xdist's scope scheduler with one scope for all whole-machine tests, one per other module.
    (xdist_group cannot do it here: xdist 3.8 tags the group into `_nodeid`, which pytest 9.2
    no longer reads.)

    Under xdist (pyproject: -n 2) the whole-machine tests are one work unit, run in order on one
    worker, while the other worker runs every other test. The unit is handed out first (and a
    worker gets more work only when it has two tests left), so the other tests end while the
    vLLM servers run, well before the real node measures the host's memory. A module stays on
    one worker, so its module-scoped fixtures (FFN pod worlds, engines) start once, also when
    one tier runs on both workers."""

    def _split_scope(self, nodeid: str) -> str:
        return WHOLE_MACHINE_SCOPE if is_whole_machine(nodeid) else module_of(nodeid)

    def _assign_work_unit(self, node) -> None:
        # xdist orders units by test count; a light module may hold more tests than the unit.
        if WHOLE_MACHINE_SCOPE in self.workqueue:
            self.workqueue.move_to_end(WHOLE_MACHINE_SCOPE, last=False)
        super()._assign_work_unit(node)


def pytest_xdist_make_scheduler(config: pytest.Config, log) -> Optional[LoadScopeScheduling]:
    # xdist's default mode only; an explicit --dist keeps xdist's own scheduler.
    return WholeMachineUnit(config, log) if config.getvalue("dist") == "load" else None


@pytest.hookimpl(tryfirst=True)  # before -m selects by markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # One tier marker per test: -m unit, -m apiserver, -m vllm, -m whole_machine.
    have_vllm = vllm_venv_given()
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item)))
        if not have_vllm and module_of(item.nodeid).startswith(VLLM_MODULES):
            item.add_marker(pytest.mark.skip(reason=NO_VLLM_VENV))


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
