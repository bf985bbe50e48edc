"""``dispatchd check``: the row of docs/support.md a kernel probe puts a machine in."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from dispatchd.kernel import KernelFeatures, force_for_testing, with_network_modes
from dispatchd.support import DOC, classify, describe, os_name

REPO = Path(__file__).resolve().parent.parent.parent
HERE = with_network_modes(KernelFeatures(release="6.18.0", landlock_abi=7, user_namespaces=True,
                                         user_namespaces_note="available", seccomp=True, seccomp_actions=["errno"],
                                         cgroup2="/sys/fs/cgroup", network_stack_missing="", nftables_missing="",
                                         host_tree_missing=""))


@pytest.mark.parametrize(("spec", "row"), [
    ("", "A"), ("landlock=6", "A"), ("landlock=5", "B"), ("landlock=1", "B"),
    ("user_namespaces=no", "C"), ("landlock=6,user_namespaces=no", "C"), ("landlock=5,user_namespaces=no", "D"),
    ("landlock=3,user_namespaces=no", "D"), ("landlock=2,user_namespaces=no", "E"),
    ("landlock=1,user_namespaces=no", "E"), ("landlock=0", "X"),
])
def test_each_forced_kernel_is_in_its_row(spec: str, row: str) -> None:
    got = classify(force_for_testing(HERE, spec))
    assert got.name == row
    assert (got.full_mode == "") is (row == "A")


def test_every_row_is_in_the_document() -> None:
    text = (REPO / DOC).read_text()
    for row in "ABCDEX":
        assert re.search(rf"^\| \*\*{row}\*\* \|", text, re.M), row


def test_the_lines_printed() -> None:
    k = force_for_testing(HERE, "landlock=4,user_namespaces=no")
    lines = describe(k, classify(k), "Ubuntu 24.04.1 LTS")
    assert lines[0] == ("support row D (docs/support.md): degraded; Landlock ABI 4, user namespaces no (forced off "
                        "for testing); network modes: off, on, ports; Ubuntu 24.04.1 LTS, kernel 6.18.0")
    assert lines[1] == ("  leaves open: the host's /proc, file metadata, chmod/utime/xattr on the user's files, git "
                        "metadata writable; signals to every process of the user's (the daemon included)")
    assert lines[2].startswith("  for full mode: allow unprivileged user namespaces (Ubuntu: the AppArmor profile")
    assert lines[3] == ("  network domains unavailable: network 'domains' needs a network namespace of its own (user "
                        "namespaces), and sessions have none here")
    assert describe(HERE, classify(HERE), "Debian")[1:] == ["  leaves open: nothing beyond the list every mode shares"]


def test_os_name(tmp_path: Path) -> None:
    (tmp_path / "os-release").write_text('NAME="Debian GNU/Linux"\nPRETTY_NAME="Debian GNU/Linux 13 (trixie)"\n')
    assert os_name(str(tmp_path / "os-release")) == "Debian GNU/Linux 13 (trixie)"
    assert os_name(str(tmp_path / "absent")) == "unknown distribution"


def test_check_names_the_network_stack_where_sessions_use_one() -> None:
    k = msgspec.structs.replace(HERE, network_stack="slirp4netns")
    assert describe(k, classify(k), "Debian")[1:] == [
        "  leaves open: nothing beyond the list every mode shares",
        "  network stack: slirp4netns (dispatchd --network-stack; docs/network.md)"]
