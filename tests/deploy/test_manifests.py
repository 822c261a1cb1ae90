"""What a user deploys (deploy/): the Kubernetes manifests against the Kubernetes API's
schemas (kubernetes-validate, which ships them: no cluster, no network) and against the
Pod Security "baseline" profile, and the pieces that must agree with each other and with
the image.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.pod_security import baseline_violations, pod_of

kubernetes_validate = pytest.importorskip("kubernetes_validate")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
KUBERNETES_VERSION = "1.33.0"
"""A Kubernetes release whose schemas kubernetes-validate ships, and which managed
clusters run."""
SERVER_UID = 10001


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def resources() -> list[tuple[str, dict[str, Any]]]:
    return [(f"{p.name}:{d['kind']}/{d['metadata']['name']}", d)
            for p in MANIFESTS for d in documents(p)]


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [r for _, r in resources() if r["kind"] == kind]


def test_there_are_the_manifests_an_operator_needs():
    kinds = sorted(r["kind"] for _, r in resources())
    assert kinds.count("DaemonSet") == 2 and kinds.count("Deployment") == 2
    assert {"Namespace", "PersistentVolume", "PersistentVolumeClaim"} <= set(kinds)
    assert (DEPLOY / "Containerfile").is_file()


@pytest.mark.parametrize("name, resource", resources(), ids=[n for n, _ in resources()])
def test_each_manifest_is_valid_against_the_kubernetes_schemas(name, resource):
    # strict: a misspelt or misplaced field is an error, not silently dropped.
    kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)


def test_the_schema_check_catches_a_misplaced_field():
    daemonset = copy.deepcopy(by_kind("DaemonSet")[0])
    daemonset["spec"]["template"]["spec"]["containers"][0]["hostNetwork"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("name, resource", resources(), ids=[n for n, _ in resources()])
def test_each_pod_meets_the_pod_security_baseline(name, resource):
    assert baseline_violations(resource) == []


def _pod(resource: dict[str, Any]) -> dict[str, Any]:
    pod = pod_of(resource)
    assert pod is not None
    return pod[0]


BREAKS = {
    "Host Namespaces": lambda pod: pod.update(hostPID=True),
    "HostPath Volumes": lambda pod: pod["volumes"].append(
        {"name": "sockets-host", "hostPath": {"path": "/run/kvdepot"}}),
    "Privileged Containers": lambda pod: pod["containers"][0]["securityContext"].update(
        privileged=True),
    "Capabilities": lambda pod: pod["containers"][0]["securityContext"]["capabilities"].update(
        add=["SYS_PTRACE"]),
    "Host Ports": lambda pod: pod["containers"][0].setdefault("ports", []).append(
        {"containerPort": 5555, "hostPort": 5555}),
    "Seccomp": lambda pod: pod["securityContext"].update(
        seccompProfile={"type": "Unconfined"}),
    "Sysctls": lambda pod: pod["securityContext"].update(
        sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
    "SELinux": lambda pod: pod["containers"][0]["securityContext"].update(
        seLinuxOptions={"type": "spc_t"}),
    "/proc Mount Type": lambda pod: pod["containers"][0]["securityContext"].update(
        procMount="Unmasked"),
    "HostProcess": lambda pod: pod["securityContext"].update(
        windowsOptions={"hostProcess": True}),
    "AppArmor": lambda pod: pod["securityContext"].update(
        appArmorProfile={"type": "Unconfined"}),
}


@pytest.mark.parametrize("control", sorted(BREAKS))
def test_the_baseline_check_catches_each_control(control):
    """Each control of the check fails a copy of the DaemonSet broken for it, and names
    the control: the check can fail, and fails for the right reason."""
    daemonset = copy.deepcopy(by_kind("DaemonSet")[0])
    BREAKS[control](_pod(daemonset))
    found = baseline_violations(daemonset)
    assert found and all(line.startswith(f"{control}:") for line in found), found


def test_the_namespace_enforces_the_baseline_profile():
    (namespace,) = by_kind("Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "baseline"


def _container(resource: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in _pod(resource)["containers"] if c["name"] == name)


def _mount(resource: dict[str, Any], container: dict[str, Any], volume: str) -> str:
    """Where `container` mounts the volume that claims `volume`."""
    names = [v["name"] for v in _pod(resource)["volumes"]
             if (v.get("persistentVolumeClaim") or {}).get("claimName") == volume]
    (path,) = [m["mountPath"] for m in container["volumeMounts"] if m["name"] in names]
    return path


def test_servers_and_engines_share_the_socket_directory_and_nothing_of_the_host():
    (claim,) = by_kind("PersistentVolumeClaim")
    (volume,) = by_kind("PersistentVolume")
    assert claim["spec"]["volumeName"] == volume["metadata"]["name"]
    assert volume["spec"]["claimRef"] == {"namespace": claim["metadata"]["namespace"],
                                          "name": claim["metadata"]["name"]}
    for daemonset in by_kind("DaemonSet"):
        server = _container(daemonset, "kvdepot")
        where = _mount(daemonset, server, claim["metadata"]["name"])
        assert f"--socket-dir={where}" in server["args"]
        # The directory is handed to the server's uid before it starts (it refuses another's).
        chown = next(c for c in _pod(daemonset)["initContainers"]
                     if c["name"] == "socket-directory")
        assert f"chown {SERVER_UID}:{SERVER_UID} {where}" in " ".join(chown["command"])
        assert server["securityContext"]["runAsUser"] == SERVER_UID
    for deployment in by_kind("Deployment"):
        engine = _container(deployment, "vllm")
        where = _mount(deployment, engine, claim["metadata"]["name"])
        config = " ".join(engine["args"])
        assert f'"kvdepot.url": "ipc://{where}/kvdepot.sock"' in config
        credential = re.search(r'"kvdepot.credentials": "([^"]+)"', config)
        assert credential is not None
        mounts = {m["mountPath"]: m for m in engine["volumeMounts"]}
        assert str(Path(credential.group(1)).parent) in mounts
        assert mounts[where].get("readOnly") is True


def test_the_image_runs_the_server_as_the_uid_the_manifests_expect():
    text = (DEPLOY / "Containerfile").read_text()
    assert f"USER {SERVER_UID}:{SERVER_UID}" in text
    assert '"--socket-dir", "/run/kvdepot"' in text
