"""The daemon's testing option that plans as an older kernel would: it only takes away."""

from __future__ import annotations

import pytest

from dispatchd.kernel import KernelFeatures, force_for_testing, with_network_modes

REAL = with_network_modes(KernelFeatures(release="6.18.0", landlock_abi=7, user_namespaces=True,
                                         user_namespaces_note="available", seccomp=True, seccomp_actions=["errno"],
                                         cgroup2="/sys/fs/cgroup", network_stack_missing="", nftables_missing="",
                                         host_tree_missing=""))


@pytest.mark.parametrize("abi", range(8))
def test_an_older_landlock_abi(abi: int) -> None:
    got = force_for_testing(REAL, f"landlock={abi}")
    assert got.landlock_abi == abi and got.forced_for_testing == f"landlock={abi}"
    assert got.user_namespaces and got.host_tree_missing == ""


def test_no_user_namespaces_takes_the_detached_root_and_domains_with_it() -> None:
    got = force_for_testing(REAL, "landlock=4,user_namespaces=no")
    assert (got.landlock_abi, got.user_namespaces, got.user_namespaces_note) == (4, False, "forced off for testing")
    assert got.host_tree_missing == "no user namespaces"
    assert list(got.network_unavailable) == ["domains"]
    assert REAL.network_unavailable == {}  # the allowed twin: every mode


def test_no_detached_mounts() -> None:
    got = force_for_testing(REAL, "detached_mounts=no")
    assert got.host_tree_missing.startswith("binding from a detached copy of the mount tree: forced off")
    assert got.landlock_abi == 7 and got.user_namespaces


@pytest.mark.parametrize(("spec", "why"), [
    ("landlock=8", "landlock=8: this kernel offers ABI 7; forcing only takes away"),
    ("user_namespaces=yes", "'user_namespaces=yes': expected landlock=N, user_namespaces=no or detached_mounts=no"),
    ("seccomp=no", "'seccomp=no': expected landlock=N, user_namespaces=no or detached_mounts=no"),
    ("landlock=-1", "'landlock=-1': expected landlock=N, user_namespaces=no or detached_mounts=no"),
])
def test_it_never_adds_nor_guesses(spec: str, why: str) -> None:
    with pytest.raises(ValueError) as exc:
        force_for_testing(REAL, spec)
    assert str(exc.value) == why
    assert force_for_testing(REAL, "").landlock_abi == 7  # nothing asked: nothing taken


def test_ubuntus_apparmor_restriction_is_named_with_its_fix() -> None:
    from dispatchd.kernel import APPARMOR_FIX, userns_note

    refused = "refused by the kernel: Operation not permitted"
    assert userns_note(False, refused, "", "") == refused  # no AppArmor: the probe's own words
    assert userns_note(False, refused, "0", "unconfined") == refused  # the restriction off
    assert userns_note(False, refused, "1", "unconfined") == (
        f"{refused}: AppArmor restricts them on this machine (kernel.apparmor_restrict_unprivileged_userns = 1) "
        f"and no profile allows dispatchd to make them (this process: unconfined); fix: {APPARMOR_FIX}")
    assert userns_note(True, "available", "1", "dispatchd (unconfined)") == (
        "available (AppArmor restricts them on this machine; this process's profile allows them: "
        "dispatchd (unconfined))")


@pytest.mark.parametrize(("files", "cgroup", "uid_map", "hint"), [
    ((), "0::/init.scope\n", "0 0 4294967295", ""),
    (("/.dockerenv",), "0::/\n", "0 0 4294967295", "docker (/.dockerenv)"),
    (("/run/.containerenv",), "0::/\n", "0 1000 1\n1 100000 65536", "podman (/run/.containerenv), in a user "
                                                                  "namespace (rootless)"),
    ((), "0::/kubepods/besteffort/pod1\n", "0 0 4294967295", "a container (cgroup names kubepods)"),
    ((), "0::/user.slice\n", "1000 1000 1", ""),  # a user namespace alone is no container
])
def test_containers_are_named(files: tuple[str, ...], cgroup: str, uid_map: str, hint: str) -> None:
    from dispatchd.kernel import container_hint

    assert container_hint(lambda path: path in files, cgroup, uid_map) == hint
