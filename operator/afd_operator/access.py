"""What an AFDDeployment asks of its nodes (host paths, host networking) and of its cluster
(service accounts, service exposure, priority, tolerated taints, Secrets), against what the
cluster admin's chart values allow (policy.HostAccess): one problem per field, naming the chart
value."""

from __future__ import annotations

from .api import AFDDeploymentSpec
from .planner import uses_host_network
from .policy import HostAccess, under
from .problems import Problem


def host_access_problems(spec: AFDDeploymentSpec, access: HostAccess) -> list[Problem]:
    """What the pods would use of their nodes, against what the cluster admin allows."""
    problems = []

    def path_allowed(field: str, host_path: str, prefixes: tuple[str, ...], value: str) -> None:
        if not any(under(host_path, prefix) for prefix in prefixes):
            allowed = ", ".join(prefixes) if prefixes else "none"
            problems.append(Problem(field, f"host path '{host_path}' is not allowed in this cluster (chart value "
                                           f"{value}: {allowed})"))

    volume = spec.model.volume
    if volume is not None and volume.host_path is not None:
        path_allowed("spec.model.volume.hostPath", volume.host_path, access.host_path_prefixes,
                     "hostAccess.hostPathPrefixes")
    for role in ("attention", "ffn"):
        overrides = getattr(spec, role).pod_template
        for i, user_volume in enumerate(overrides.volumes):
            if user_volume.host_path is not None:
                path_allowed(f"spec.{role}.podTemplate.volumes[{i}].hostPath.path", user_volume.host_path.path,
                             access.host_path_prefixes, "hostAccess.hostPathPrefixes")
        account = overrides.service_account_name
        if account is not None and account != "default" and account not in access.service_accounts:
            allowed = ", ".join(access.service_accounts) or "none besides 'default'"
            problems.append(Problem(f"spec.{role}.podTemplate.serviceAccountName",
                                    f"'{account}' is not allowed in this cluster (chart value "
                                    f"hostAccess.serviceAccounts: {allowed})"))
    if spec.platform == "ascend":
        for i, driver_path in enumerate(spec.ascend.driver_host_paths):
            path_allowed(f"spec.ascend.driverHostPaths[{i}]", driver_path, access.ascend_host_paths,
                         "hostAccess.ascendHostPaths")
        if spec.ascend.mount_hccn_conf:
            path_allowed("spec.ascend.mountHccnConf", "/etc/hccn.conf", access.ascend_host_paths,
                         "hostAccess.ascendHostPaths")
        if spec.ascend.run_as_root and not access.ascend_run_as_root:
            problems.append(Problem("spec.ascend.runAsRoot", "root with DAC_OVERRIDE on a writable root filesystem is "
                                                             "not allowed in this cluster (chart value "
                                                             "hostAccess.ascendRunAsRoot: false); set it to false"))
    problems += _cluster_access_problems(spec, access)
    if uses_host_network(spec) and not access.host_network:
        problems.append(Problem("spec.ascend.hostNetwork", "host networking is not allowed in this cluster (chart "
                                                           "value hostAccess.hostNetwork: false); set it to false"))
    return problems


def _cluster_access_problems(spec: AFDDeploymentSpec, access: HostAccess) -> list[Problem]:
    """What the pods would ask of the cluster (service exposure, priority, taints, Secrets),
    against what the cluster admin allows."""
    problems = []

    def allowed(field: str, what: str, value: str, allow: tuple[str, ...], chart_value: str) -> None:
        if value not in allow:
            problems.append(Problem(field, f"{what} is not allowed in this cluster (chart value hostAccess."
                                           f"{chart_value}: {', '.join(allow) or 'none'})"))

    allowed("spec.service.type", f"'{spec.service.type}'", spec.service.type, access.service_types, "serviceTypes")
    if spec.scheduling.priority_class_name is not None:
        allowed("spec.scheduling.priorityClassName", f"'{spec.scheduling.priority_class_name}'",
                spec.scheduling.priority_class_name, access.priority_class_names, "priorityClassNames")
    for role in ("attention", "ffn"):
        role_spec = getattr(spec, role)
        for i, toleration in enumerate(role_spec.pod_template.tolerations):
            what = f"tolerating '{toleration.key}'" if toleration.key else "tolerating every taint (no key)"
            allowed(f"spec.{role}.podTemplate.tolerations[{i}].key", what, toleration.key or "",
                    access.toleration_keys, "tolerationKeys")
        for i, volume in enumerate(role_spec.pod_template.volumes):
            if volume.secret is not None:
                allowed(f"spec.{role}.podTemplate.volumes[{i}].secret.secretName", f"Secret '{volume.secret.secret_name}'",
                        volume.secret.secret_name, access.secret_names, "secretNames")
        for i, env in enumerate(role_spec.env):
            ref = env.value_from.secret_key_ref if env.value_from is not None else None
            if ref is not None:
                allowed(f"spec.{role}.env[{i}].valueFrom.secretKeyRef.name", f"Secret '{ref.name}'", ref.name,
                        access.secret_names, "secretNames")
    return problems
