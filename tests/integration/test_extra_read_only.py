"""Extra read-only paths: a toolchain outside the system directories.

``open_session(..., read_only=[...])`` (CLI ``--read-only PATH``) and the
policy's ``filesystem.extra_read_only`` bind a path read-only into the
session's root, and Landlock grants it read-only; the status lists it. A path
that is or holds the user's credentials, the home directory, or dispatchd's
own files refuses the open (``bad_worktree``), naming it.
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from dispatch.errors import RequestFailed
from tests.conftest import REPO, Daemon, _refuse_root, credential_dir, probe, shell


@pytest.fixture
def toolchain() -> Iterator[Path]:
    d = Path.home() / f".dispatch-test-cargo-{secrets.token_hex(4)}"
    (d / "bin").mkdir(parents=True)
    tool = d / "bin" / "cargo-ish"
    tool.write_text("#!/bin/sh\necho toolchain runs\n")
    tool.chmod(0o755)
    yield d
    shutil.rmtree(d)


def test_an_extra_read_only_path_is_visible_readable_and_not_writable(
    client: dispatch.Client, worktree: Path, toolchain: Path,
) -> None:
    with client.open_session(str(worktree), read_only=[str(toolchain)]) as s:
        assert shell(s, f"{toolchain}/bin/cargo-ish").output == "toolchain runs\n"
        root = s.status()["protections"]["root"]
        full = s.status()["protections"]["mode"] == "full"
        if full:
            assert {"path": str(toolchain), "how": "read-only (extra read-only path)"} in root
        w = probe(s, f"open({str(toolchain / 'planted')!r}, 'w')")
        assert ("Read-only file system" if full else "Permission denied") in w
    with client.open_session(str(worktree)) as s:  # the twin: without it, not there
        r = shell(s, f"{toolchain}/bin/cargo-ish")
        assert r.metadata["exit_code"] == (127 if full else 126)  # absent from the root; refused by Landlock


@pytest.mark.parametrize("rel", [".ssh", ".gnupg/private", ".config", ""])
def test_credentials_and_the_home_directory_are_refused(client: dispatch.Client, worktree: Path, rel: str) -> None:
    path = credential_dir(rel) if rel else Path.home()
    with pytest.raises(RequestFailed) as info:
        client.open_session(str(worktree), read_only=[str(path)])
    assert info.value.code == "bad_worktree"
    assert info.value.message.startswith(f"read_only: {path} ")
    assert "credentials" in info.value.message or "whole home directory" in info.value.message


def test_the_policy_lists_extra_read_only_paths(tmp_path_factory: pytest.TempPathFactory, worktree: Path,
                                                toolchain: Path) -> None:
    _refuse_root()
    base = tmp_path_factory.mktemp("extra-ro")
    policies = base / "policies"
    shutil.copytree(REPO / "policies", policies)
    (policies / "rust.toml").write_text(f'[filesystem]\nextra_read_only = ["{toolchain}"]\n')
    (policies / "bad.toml").write_text(f'[filesystem]\nextra_read_only = ["{Path.home() / ".ssh"}"]\n')
    d = Daemon(base, "--policies", str(policies))
    try:
        with d.connect() as c:
            with c.open_session(str(worktree), policy="rust") as s:
                assert shell(s, f"{toolchain}/bin/cargo-ish").output == "toolchain runs\n"
            credential_dir(".ssh")
            with pytest.raises(RequestFailed) as info:
                c.open_session(str(worktree), policy="bad")
            assert info.value.code == "bad_worktree"
            assert info.value.message.startswith(f"filesystem.extra_read_only: {Path.home() / '.ssh'} is or holds")
    finally:
        assert d.stop() == 0, d.log()
