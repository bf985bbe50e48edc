"""packaging/kubernetes/daemonset.yaml: it parses, it is the DaemonSet its
README describes, and each of its security settings and volumes has its
rootless Podman counterpart in tests/image_podman.py, which
tests/integration/test_image.py runs the image with (no cluster here)."""

from __future__ import annotations

import json
import os
import re

import pytest

from tests import image_podman
from tests.image_podman import REPO

BUILD = (REPO / "packaging" / "kubernetes" / "build-image.sh").read_text()


def test_the_manifest_parses_into_a_namespace_and_a_daemonset() -> None:
    docs = image_podman.load()
    assert [(d["apiVersion"], d["kind"]) for d in docs] == [("v1", "Namespace"), ("apps/v1", "DaemonSet")]
    ds = image_podman.daemonset()
    assert ds["metadata"]["namespace"] == docs[0]["metadata"]["name"] == "dispatchd"
    assert ds["spec"]["selector"]["matchLabels"] == ds["spec"]["template"]["metadata"]["labels"]


def test_every_security_setting_has_a_podman_counterpart_and_no_more() -> None:
    settings = image_podman.security_settings()
    assert len(settings) == len(set(settings))
    assert set(settings) == set(image_podman.SECURITY)
    flags = image_podman.security_flags()
    for expected in (["--security-opt", "unmask=ALL"], ["--cap-drop", "ALL"], ["--security-opt", "no-new-privileges"],
                     ["--security-opt", f"seccomp={image_podman.SECCOMP}"], ["--user", "1000:1000"]):
        assert any(flags[i:i + 2] == expected for i in range(len(flags))), expected


def test_a_setting_without_a_counterpart_is_named() -> None:
    unknown = ("containers.dispatchd.securityContext.privileged", True)
    assert unknown not in image_podman.SECURITY  # the refusal's allowed twin is the test above
    with pytest.raises(KeyError) as missing:
        [image_podman.SECURITY[s] for s in [*image_podman.security_settings(), unknown]]
    assert missing.value.args[0] == unknown


def test_the_volumes_are_host_paths_a_device_and_scratch() -> None:
    node = REPO / "node"
    flags = image_podman.volume_flags(node)
    assert ["--device", "/dev/net/tun:/dev/net/tun"] == flags[flags.index("--device"):flags.index("--device") + 2]
    assert f"{node}/var/lib/dispatchd/worktrees:/work" in flags
    assert f"{node}/run/dispatchd:/run/dispatchd" in flags
    assert image_podman.host_paths() == {"worktrees": "/var/lib/dispatchd/worktrees", "socket": "/run/dispatchd"}


def test_the_socket_is_in_its_host_path_and_the_image_says_the_same() -> None:
    env = {e["name"]: e["value"] for e in image_podman.container()["env"]}
    mounts = {m["name"]: m["mountPath"] for m in image_podman.container()["volumeMounts"]}
    assert os.path.dirname(env["DISPATCH_SOCKET"]) == mounts["socket"]
    for name in ("HOME", "XDG_STATE_HOME", "DISPATCH_SOCKET"):
        assert f"--change 'ENV {name}={env[name]}'" in BUILD
    assert "--change 'USER 1000:1000'" in BUILD and f"WORKDIR {mounts['worktrees']}" in BUILD


def test_the_image_is_this_version_and_never_pulled() -> None:
    version = re.search(r'__version__ = "(.*)"', (REPO / "dispatchd" / "__init__.py").read_text())
    assert version is not None
    c = image_podman.container()
    assert c["image"] == f"dispatchd:{version.group(1)}" and c["imagePullPolicy"] == "Never"


def test_the_seccomp_profile_named_is_json_and_the_node_set_up_names_each_file() -> None:
    json.loads(image_podman.SECCOMP.read_text())
    readme = (REPO / "packaging" / "kubernetes" / "README.md").read_text()
    manifest = image_podman.MANIFEST.read_text()
    for path in ("/var/lib/kubelet/seccomp/dispatchd.json", *image_podman.host_paths().values(), "/dev/net/tun"):
        assert path in readme and path in manifest, path
