"""packaging/kubernetes/daemonset.yaml in rootless Podman's words: for each
security setting and each volume of the DaemonSet, the ``podman run`` flags
that stand for it here (tests/integration/test_image.py runs the image with
them; tests/unit/test_daemonset.py checks that every setting of the manifest
has its counterpart in this table, and no more). Not a test module itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
MANIFEST = REPO / "packaging" / "kubernetes" / "daemonset.yaml"
SECCOMP = REPO / "packaging" / "containers" / "seccomp.json"

# The image's user; the host user running the test stands for the node's uid
# 1000, which owns the worktrees and the socket's directory on the node.
UID = 1000


def _idmap(flag: str) -> list[str]:
    # Rootless Podman's maps are into the user's own namespace: 0 there is the
    # user, 1... its subordinate ids. The container's 1000 is the user, as an
    # idmapped host path shows the node's 1000 to a pod's 1000.
    return [flag, f"0:1:{UID}", flag, f"{UID}:0:1", flag, f"{UID + 1}:{UID + 1}:{65536 - UID - 1}"]


# (where in the pod spec, the value the manifest gives) -> podman's flags.
SECURITY: dict[tuple[str, object], list[str]] = {
    # rootless Podman always runs a container in a user namespace of its own
    ("spec.hostUsers", False): _idmap("--uidmap") + _idmap("--gidmap"),
    ("spec.securityContext.runAsUser", UID): ["--user", f"{UID}:{UID}"],
    ("spec.securityContext.runAsGroup", UID): [],  # in --user above
    ("spec.securityContext.runAsNonRoot", True): [],  # --user is not 0; the test checks `id` in the container
    ("spec.securityContext.seccompProfile.type", "Localhost"): ["--security-opt", f"seccomp={SECCOMP}"],
    ("spec.securityContext.seccompProfile.localhostProfile", "dispatchd.json"): [],  # the file above
    ("spec.securityContext.appArmorProfile.type", "Unconfined"): ["--security-opt", "apparmor=unconfined"],
    ("containers.dispatchd.securityContext.allowPrivilegeEscalation", False): ["--security-opt", "no-new-privileges"],
    ("containers.dispatchd.securityContext.procMount", "Unmasked"): ["--security-opt", "unmask=ALL"],
    ("containers.dispatchd.securityContext.capabilities.drop", ("ALL",)): ["--cap-drop", "ALL"],
}


def load() -> list[dict[str, Any]]:
    with open(MANIFEST) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def daemonset() -> dict[str, Any]:
    (ds,) = [d for d in load() if d["kind"] == "DaemonSet"]
    return ds


def container() -> dict[str, Any]:
    (c,) = daemonset()["spec"]["template"]["spec"]["containers"]
    return c  # type: ignore[no-any-return]


def _leaves(prefix: str, value: object) -> list[tuple[str, object]]:
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(f"{prefix}.{k}", v)]
    if isinstance(value, list):
        return [(prefix, tuple(value))]
    return [(prefix, value)]


def security_settings() -> list[tuple[str, object]]:
    """Every security setting the manifest gives, as (path, value)."""
    pod = daemonset()["spec"]["template"]["spec"]
    found = [("spec.hostUsers", pod["hostUsers"])] if "hostUsers" in pod else []
    found += _leaves("spec.securityContext", pod.get("securityContext", {}))
    for c in pod["containers"]:
        found += _leaves(f"containers.{c['name']}.securityContext", c.get("securityContext", {}))
    return found


def security_flags() -> list[str]:
    """podman's flags for the manifest's settings; KeyError names one without."""
    return [flag for setting in security_settings() for flag in SECURITY[setting]]


def volume_flags(node: Path) -> list[str]:
    """podman's flags for the manifest's volumes: each host path below ``node``
    (the node's disk here), ``/dev/net/tun`` as the device it is, an
    ``emptyDir`` as an anonymous volume. KeyError names a volume of a kind
    without a counterpart."""
    pod = daemonset()["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in container()["volumeMounts"]}
    flags: list[str] = []
    for v in pod["volumes"]:
        target = mounts[v["name"]]
        if "emptyDir" in v:
            flags += ["-v", target]
        elif v["hostPath"].get("type") == "CharDevice":
            flags += ["--device", f"{v['hostPath']['path']}:{target}"]
        else:
            flags += ["-v", f"{node_path(node, v['hostPath']['path'])}:{target}"]
    return flags


def node_path(node: Path, host_path: str) -> Path:
    """Where a host path of the manifest is on this test's stand-in for the node."""
    return node / host_path.lstrip("/")


def host_paths() -> dict[str, str]:
    """name -> host path of every directory the manifest takes from the node."""
    pod = daemonset()["spec"]["template"]["spec"]
    return {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]
            if "hostPath" in v and v["hostPath"].get("type") == "Directory"}


def env_flags() -> list[str]:
    return [f for e in container().get("env", []) for f in ("-e", f"{e['name']}={e['value']}")]


def args() -> list[str]:
    return [str(a) for a in container().get("args", [])]


def readiness_probe() -> list[str]:
    return [str(a) for a in container()["readinessProbe"]["exec"]["command"]]
