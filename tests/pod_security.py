"""The Pod Security Standards' rules (baseline and restricted, as the PodSecurity admission
controller of Kubernetes 1.25 and later enforces them at `latest`), over one pod manifest: which
rule each field breaks. Only the rules; no API server of the test bed runs the controller (it is
1.20)."""

from __future__ import annotations

from typing import Any, Iterator

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _containers(spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for i, container in enumerate(spec.get(kind) or []):
            yield f"spec.{kind}[{i}]", container


def _seccomp_type(context: dict[str, Any]) -> Any:
    return (context.get("seccompProfile") or {}).get("type")


def baseline_violations(pod: dict[str, Any]) -> list[str]:
    spec = pod["spec"]
    pod_context = spec.get("securityContext") or {}
    found = [f"spec.{field}: host namespaces" for field in ("hostNetwork", "hostPID", "hostIPC") if spec.get(field)]
    found += [f"spec.volumes[{i}].hostPath: hostPath volumes" for i, v in enumerate(spec.get("volumes") or [])
              if "hostPath" in v]
    if _seccomp_type(pod_context) == "Unconfined":
        found.append("spec.securityContext.seccompProfile.type: Unconfined")
    found += [f"spec.securityContext.sysctls.{s['name']}: unsafe sysctl" for s in pod_context.get("sysctls") or []
              if s["name"] not in SAFE_SYSCTLS]
    selinux = pod_context.get("seLinuxOptions") or {}
    if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
        found.append("spec.securityContext.seLinuxOptions: custom SELinux user, role or type")
    for where, container in _containers(spec):
        context = container.get("securityContext") or {}
        if context.get("privileged"):
            found.append(f"{where}.securityContext.privileged: privileged")
        added = set((context.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES
        if added:
            found.append(f"{where}.securityContext.capabilities.add: {', '.join(sorted(added))} beyond baseline")
        found += [f"{where}.ports[{i}].hostPort: host ports" for i, port in enumerate(container.get("ports") or [])
                  if port.get("hostPort")]
        if _seccomp_type(context) == "Unconfined":
            found.append(f"{where}.securityContext.seccompProfile.type: Unconfined")
        if context.get("procMount", "Default") != "Default":
            found.append(f"{where}.securityContext.procMount: not Default")
        if (context.get("windowsOptions") or {}).get("hostProcess"):
            found.append(f"{where}.securityContext.windowsOptions.hostProcess: host process")
    return found


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """Every baseline violation, then restricted's own."""
    spec = pod["spec"]
    pod_context = spec.get("securityContext") or {}
    found = baseline_violations(pod)
    for i, volume in enumerate(spec.get("volumes") or []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES and "hostPath" not in kinds:  # hostPath: counted by baseline
            found.append(f"spec.volumes[{i}]: volume type {', '.join(sorted(kinds))}")
    if pod_context.get("runAsUser") == 0:
        found.append("spec.securityContext.runAsUser: 0")
    for where, container in _containers(spec):
        context = container.get("securityContext") or {}
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{where}.securityContext.allowPrivilegeEscalation: must be false")
        non_root = context.get("runAsNonRoot", pod_context.get("runAsNonRoot"))
        if non_root is not True:
            found.append(f"{where}.securityContext.runAsNonRoot: must be true (here or in the pod)")
        if context.get("runAsUser") == 0:
            found.append(f"{where}.securityContext.runAsUser: 0")
        if (_seccomp_type(context) or _seccomp_type(pod_context)) not in ("RuntimeDefault", "Localhost"):
            found.append(f"{where}.securityContext.seccompProfile: RuntimeDefault or Localhost (here or in the pod)")
        capabilities = context.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            found.append(f"{where}.securityContext.capabilities.drop: must include ALL")
        added = set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}
        if added:
            found.append(f"{where}.securityContext.capabilities.add: {', '.join(sorted(added))} beyond restricted")
    return found
