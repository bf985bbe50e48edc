"""dispatchd.daemon.gitguard.indexfile: the submodules an index records, in indexes
git itself made (every version, SHA-1 and SHA-256), and refusal of bytes that
are no index."""

from __future__ import annotations

from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import indexfile
from tests.unit.gitrepo import add_gitlink, git

pytestmark = pytest.mark.process  # starts processes (git, a compiler, commands, forks)


@pytest.mark.parametrize("version", ["2", "3", "4"])
def test_gitlinks_are_found_in_every_index_version(repo: Path, version: str) -> None:
    add_gitlink(repo, "vendor/nested")
    add_gitlink(repo, "z" * 150 + "/deep")  # a long shared prefix: v4's varint beyond one byte
    (repo / "intent.txt").write_text("x")
    git(repo, "add", "-N", "intent.txt")  # an extended-flags entry (v3)
    git(repo, "update-index", "--index-version", version)
    data = (repo / ".git" / "index").read_bytes()
    assert indexfile.parse_gitlinks(data) == {"vendor/nested", "z" * 150 + "/deep"}


def test_gitlinks_in_a_sha256_repository(tmp_path: Path) -> None:
    r = tmp_path / "r"
    r.mkdir()
    git(r, "init", "-q", "--object-format=sha256")
    (r / "f").write_text("x")
    git(r, "add", "f")
    add_gitlink(r, "m/n", "1" * 64)
    assert indexfile.parse_gitlinks((r / ".git" / "index").read_bytes()) == {"m/n"}


def test_an_index_without_submodules(repo: Path) -> None:
    assert indexfile.parse_gitlinks((repo / ".git" / "index").read_bytes()) == set()


@pytest.mark.parametrize("data", [b"", b"DIRC", b"XXXX\x00\x00\x00\x02\x00\x00\x00\x01", b"DIRC\x00\x00\x00\x09\x00\x00\x00\x00",
                                  b"DIRC\x00\x00\x00\x02\x00\x00\x00\x05" + b"\x00" * 30])
def test_what_is_not_an_index_is_refused(data: bytes) -> None:
    assert indexfile.parse_gitlinks(data) is None


def test_a_truncated_index_is_refused(repo: Path) -> None:
    data = (repo / ".git" / "index").read_bytes()
    assert indexfile.parse_gitlinks(data[:100]) is None
