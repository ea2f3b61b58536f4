"""What a model's own config.json says about an AFDDeployment, when a copy of it is readable
where ``afdctl`` runs: the answer the pods give at start (the plugin's torch-free
``moe_spec.load_spec``), before any pod is created. The operator itself never sees the model
(it mounts no model volume), so only ``afdctl validate`` uses this."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Optional

from afd_shared_experts.moe_spec import CheckpointError, load_spec

from .api import AFDDeploymentSpec
from .problems import Problem


@dataclass
class CheckpointReport:
    """``config``: the config.json read (None: no copy readable here, nothing checked)."""

    config: Optional[Path] = None
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def local_model_dirs(spec: AFDDeploymentSpec) -> list[Path]:
    """Where the model directory may be readable here: ``model.path`` as the pods see it, and,
    for a hostPath volume, the host directory it is mounted from (``afdctl`` run on the node)."""
    dirs = [Path(spec.model.path)]
    volume = spec.model.volume
    if volume is not None and volume.host_path is not None:
        inside = PurePosixPath(spec.model.path)
        if inside.is_relative_to(volume.mount_path):
            dirs.append(Path(volume.host_path) / inside.relative_to(volume.mount_path))
    return dirs


def check_checkpoint(spec: AFDDeploymentSpec) -> CheckpointReport:
    config = next((d / "config.json" for d in local_model_dirs(spec) if (d / "config.json").is_file()), None)
    if config is None:
        return CheckpointReport()
    try:
        moe = load_spec(config.parent)
    except (CheckpointError, OSError, ValueError) as exc:
        return CheckpointReport(config, [Problem("spec.model.path", str(exc))])
    report = CheckpointReport(config)
    experts = moe.num_routed_experts
    if spec.model.routed_experts is not None and spec.model.routed_experts != experts:
        report.problems.append(Problem("spec.model.routedExperts",
                                       f"the checkpoint ({config}) has {experts} routed experts; got "
                                       f"{spec.model.routed_experts}"))
    if experts % spec.ffn.ranks:
        report.problems.append(Problem("spec.ffn.ranks",
                                       f"must divide the checkpoint's {experts} routed experts ({config}) so every "
                                       f"FFN rank holds the same number of experts; got {spec.ffn.ranks}"))
    if not moe.has_shared_experts:
        report.notes.append(f"spec.sharedExperts.placement: not applicable: {moe.model_type} has no shared experts "
                            f"(routed experts only; {config})")
    return report
