"""dispatchd.daemon.gitguard.fs: the descriptor walk to what an index names (no
symlink, no name git would refuse, absent told from unsearchable), and a
split index read with its shared part."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import fs, indexfile
from tests.unit import permission_bits
from tests.unit.gitrepo import add_gitlink, git

pytestmark = pytest.mark.process  # starts processes (git, a compiler, commands, forks)


@pytest.mark.parametrize("link", ["../victim", "/abs/victim", "a/../../victim", "a//b", "./a", "a/.", ""])
def test_submodule_paths_git_would_refuse_are_never_followed(repo: Path, link: str) -> None:
    assert fs.open_dir_below(str(repo), link) is None


def test_open_dir_below_tells_absent_from_unsearchable(repo: Path) -> None:
    (repo / "a" / "b").mkdir(parents=True)
    (repo / "file").write_text("x")
    assert fs.open_dir_below(str(repo), "missing/b") is None
    assert fs.open_dir_below(str(repo), "file/b") is None  # ENOTDIR
    (repo / "a").chmod(0)
    try:
        with permission_bits.obeyed(), pytest.raises(PermissionError):
            fs.open_dir_below(str(repo), "a/b")
    finally:
        (repo / "a").chmod(0o755)
    fd = fs.open_dir_below(str(repo), "a/b")
    assert fd is not None
    os.close(fd)


def test_a_split_index_is_read_with_its_shared_part(repo: Path) -> None:
    add_gitlink(repo, "in/shared")
    git(repo, "update-index", "--split-index")
    add_gitlink(repo, "in/split", "2" * 40)
    index = str(repo / ".git" / "index")
    assert indexfile.parse_gitlinks((repo / ".git" / "index").read_bytes()) == {"in/split"}  # the split part alone
    assert fs.index_gitlinks(index) == {"in/shared", "in/split"}
    shared = next((repo / ".git").glob("sharedindex.*"))
    shared.unlink()
    assert fs.index_gitlinks(index) is None  # cannot be checked


def test_a_split_index_that_replaces_an_entry_by_a_submodule(repo: Path) -> None:
    # "sub" is a file in the shared index; the split part replaces that entry,
    # by position and with no name, with a submodule.
    (repo / "sub").write_text("f")
    git(repo, "add", "sub")
    git(repo, "update-index", "--split-index")
    add_gitlink(repo, "sub")
    index = repo / ".git" / "index"
    parsed = indexfile.parse_index(index.read_bytes())
    assert parsed is not None and parsed.replaced_gitlink and parsed.links == set()
    links = fs.index_gitlinks(str(index))
    assert links is not None and "sub" in links
