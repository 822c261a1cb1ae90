"""The Pod Security Standards' "baseline" profile, as a check of pod specs (test helper).

Written from the published standard (kubernetes.io, "Pod Security Standards", Baseline),
control by control: each function takes a pod spec (and the pod's metadata, for the
AppArmor annotations) and returns one line per violation, naming the field. A manifest
passes when no control returns anything, which is what the cluster's Pod Security
admission in "enforce: baseline" would admit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

Spec = dict[str, Any]

ALLOWED_CAPABILITIES = frozenset({
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"})
"""Capabilities a container may add under baseline (the container runtimes' defaults)."""
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"})
"""Namespaced sysctls the profile allows."""
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t",
                           "container_engine_t"})
CONTAINER_LISTS = ("containers", "initContainers", "ephemeralContainers")
POD_KINDS = {"Pod": ("spec",), "Deployment": ("spec", "template", "spec"),
             "DaemonSet": ("spec", "template", "spec"), "StatefulSet": ("spec", "template", "spec"),
             "ReplicaSet": ("spec", "template", "spec"), "Job": ("spec", "template", "spec"),
             "CronJob": ("spec", "jobTemplate", "spec", "template", "spec")}


def _containers(spec: Spec) -> Iterator[tuple[str, Spec]]:
    for field in CONTAINER_LISTS:
        for i, container in enumerate(spec.get(field) or []):
            yield f"spec.{field}[{i}]", container


def _contexts(spec: Spec) -> Iterator[tuple[str, Spec]]:
    """The pod's security context, then every container's."""
    yield "spec.securityContext", spec.get("securityContext") or {}
    for where, container in _containers(spec):
        yield f"{where}.securityContext", container.get("securityContext") or {}


def host_process(spec: Spec, _: Spec) -> list[str]:
    return [f"{where}.windowsOptions.hostProcess is true" for where, ctx in _contexts(spec)
            if (ctx.get("windowsOptions") or {}).get("hostProcess")]


def host_namespaces(spec: Spec, _: Spec) -> list[str]:
    return [f"spec.{field} is true" for field in ("hostNetwork", "hostPID", "hostIPC")
            if spec.get(field)]


def privileged(spec: Spec, _: Spec) -> list[str]:
    return [f"{where}.securityContext.privileged is true" for where, c in _containers(spec)
            if (c.get("securityContext") or {}).get("privileged")]


def capabilities(spec: Spec, _: Spec) -> list[str]:
    found = []
    for where, container in _containers(spec):
        added = ((container.get("securityContext") or {}).get("capabilities") or {}).get(
            "add") or []
        found += [f"{where}.securityContext.capabilities.add has {cap}" for cap in added
                  if cap not in ALLOWED_CAPABILITIES]
    return found


def host_path_volumes(spec: Spec, _: Spec) -> list[str]:
    return [f"spec.volumes[{i}].hostPath is set" for i, volume in
            enumerate(spec.get("volumes") or []) if "hostPath" in volume]


def host_ports(spec: Spec, _: Spec) -> list[str]:
    return [f"{where}.ports[{i}].hostPort is {port['hostPort']}"
            for where, container in _containers(spec)
            for i, port in enumerate(container.get("ports") or [])
            if port.get("hostPort") not in (None, 0)]


def app_armor(spec: Spec, metadata: Spec) -> list[str]:
    found = [f"{where}.appArmorProfile.type is {ctx['appArmorProfile'].get('type')}"
             for where, ctx in _contexts(spec) if "appArmorProfile" in ctx
             and ctx["appArmorProfile"].get("type") not in (None, "RuntimeDefault",
                                                            "Localhost")]
    for key, value in (metadata.get("annotations") or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
                value == "runtime/default" or value.startswith("localhost/")):
            found.append(f"metadata.annotations[{key}] is {value}")
    return found


def se_linux(spec: Spec, _: Spec) -> list[str]:
    found = []
    for where, ctx in _contexts(spec):
        options = ctx.get("seLinuxOptions") or {}
        if options.get("type", "") not in SELINUX_TYPES:
            found.append(f"{where}.seLinuxOptions.type is {options['type']}")
        found += [f"{where}.seLinuxOptions.{field} is set" for field in ("user", "role")
                  if options.get(field)]
    return found


def proc_mount(spec: Spec, _: Spec) -> list[str]:
    return [f"{where}.securityContext.procMount is {c['securityContext']['procMount']}"
            for where, c in _containers(spec)
            if (c.get("securityContext") or {}).get("procMount") not in (None, "Default")]


def seccomp(spec: Spec, _: Spec) -> list[str]:
    return [f"{where}.seccompProfile.type is Unconfined" for where, ctx in _contexts(spec)
            if (ctx.get("seccompProfile") or {}).get("type") == "Unconfined"]


def sysctls(spec: Spec, _: Spec) -> list[str]:
    return [f"spec.securityContext.sysctls has {s.get('name')}"
            for s in (spec.get("securityContext") or {}).get("sysctls") or []
            if s.get("name") not in SAFE_SYSCTLS]


CONTROLS: dict[str, Callable[[Spec, Spec], list[str]]] = {
    "HostProcess": host_process, "Host Namespaces": host_namespaces,
    "Privileged Containers": privileged, "Capabilities": capabilities,
    "HostPath Volumes": host_path_volumes, "Host Ports": host_ports, "AppArmor": app_armor,
    "SELinux": se_linux, "/proc Mount Type": proc_mount, "Seccomp": seccomp,
    "Sysctls": sysctls}


def pod_of(resource: Spec) -> tuple[Spec, Spec] | None:
    """(pod spec, pod metadata) of a resource that makes pods; None for any other."""
    path = POD_KINDS.get(resource.get("kind", ""))
    if path is None:
        return None
    spec = resource
    for key in path:
        spec = spec[key]
    return spec, _parent(resource, path).get("metadata") or {}


def _parent(resource: Spec, path: tuple[str, ...]) -> Spec:
    """The pod template (the object whose "spec" is the pod spec)."""
    node = resource
    for key in path[:-1]:
        node = node[key]
    return node


def baseline_violations(resource: Spec) -> list[str]:
    """Every way `resource`'s pods break the baseline profile, as "control: field" lines."""
    pod = pod_of(resource)
    if pod is None:
        return []
    spec, metadata = pod
    return [f"{name}: {line}" for name, check in CONTROLS.items()
            for line in check(spec, metadata)]
