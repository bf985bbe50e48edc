"""dispatchd.daemon.gitguard.snapshots, through the index: submodules a session
records (new, rebuilt, behind a symlink or an unsearchable directory, under a
name git would not write) and indexes that cannot be checked."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import fs, layouts, snapshots
from tests.unit import permission_bits
from tests.unit.gitrepo import add_gitlink, git, one_file_repo

pytestmark = pytest.mark.process  # starts processes (git, a compiler, commands, forks)


def _take(repo: Path) -> snapshots.GitSnapshot:
    return snapshots.take(str(repo), layouts.inspect_git(str(repo), uid=os.getuid()))


def _quarantine(repo: Path, before: snapshots.GitSnapshot) -> tuple[list[str], list[str]]:
    return snapshots.quarantine(str(repo), before, _take(repo))


def _rename_in_index(index: Path, old: str, new: str) -> None:
    """Rewrite an entry's name byte by byte (same length), as a session can,
    with the checksum git checks made right again."""
    data = index.read_bytes()
    assert len(old) == len(new) and data.count(old.encode()) == 1
    body = data[:-20].replace(old.encode(), new.encode())
    index.write_bytes(body + hashlib.sha1(body).digest())


def test_a_new_submodule_is_moved_aside(repo: Path) -> None:
    before = _take(repo)
    nested = one_file_repo(repo / "sub", "a")
    add_gitlink(repo, "sub", git(nested, "rev-parse", "HEAD").strip())
    moved, failed = _quarantine(repo, before)
    assert len(moved) == 1 and moved[0].startswith(str(nested / ".git.quarantined-by-dispatchd-")) and failed == [], moved
    assert not (nested / ".git").exists()


def test_a_submodule_that_was_there_before_is_left_alone(repo: Path) -> None:
    nested = repo / "sub"
    nested.mkdir()
    git(nested, "init", "-q")
    add_gitlink(repo, "sub")
    before = _take(repo)
    assert _quarantine(repo, before) == ([], [])
    assert (nested / ".git").is_dir()
    # ...and so is one replaced by a .git that reads the same configuration
    # (git runs nothing new there)...
    (nested / ".git").rename(repo / "old-git")
    git(nested, "init", "-q")
    assert _quarantine(repo, before) == ([], [])
    # ...but not one whose configuration differs.
    git(nested, "config", "core.fsmonitor", "echo planted")
    moved, failed = _quarantine(repo, before)
    assert failed == [] and len(moved) == 1 and moved[0].startswith(str(nested / ".git.quarantined-by-dispatchd-"))


def test_a_submodule_path_through_a_symlink_never_moves_what_is_outside(repo: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    git(victim, "init", "-q")
    before = _take(repo)
    (repo / "evil").symlink_to("../victim")
    add_gitlink(repo, "evil")
    (repo / "inner").mkdir()
    (repo / "inner" / "link").symlink_to(victim)
    add_gitlink(repo, "inner/link/x")
    assert _quarantine(repo, before) == ([], [])
    assert (victim / ".git").is_dir()  # the daemon left the repository outside alone


@pytest.mark.parametrize("odd", ["a//b", "a/./b", "./a/b", "a/b/"])
def test_a_submodule_name_git_would_not_write_moves_the_index_aside(repo: Path, odd: str) -> None:
    """Git reads such a name from an index it did not write, and walks it to
    a/b: the daemon never follows it, and moves the index aside instead of
    skipping it."""
    before = _take(repo)
    (repo / "a" / "b").mkdir(parents=True)
    git(repo / "a" / "b", "init", "-q")
    placeholder = "x" * len(odd)
    add_gitlink(repo, placeholder)
    _rename_in_index(repo / ".git" / "index", placeholder, odd)
    assert fs.index_gitlinks(str(repo / ".git" / "index")) == {odd}
    moved, failed = _quarantine(repo, before)
    assert failed == [] and len(moved) == 1 and moved[0].startswith(f"{repo}/.git/index.quarantined-by-dispatchd-")
    assert (repo / "a" / "b" / ".git").is_dir()  # untracked now: git runs nothing there


def test_a_gitfile_rewritten_in_place_with_its_mtime_put_back_is_moved_aside(repo: Path) -> None:
    (repo / "s").mkdir()
    (repo / "s" / ".git").write_text("gitdir: ../.git/modules/s\n")
    add_gitlink(repo, "s")
    before = _take(repo)
    assert _quarantine(repo, before) == ([], [])
    st = os.stat(repo / "s" / ".git")
    (repo / "s" / ".git").write_text("gitdir: xxxxxxxxxxxxxxxxx\n")  # the same length, the same inode
    os.utime(repo / "s" / ".git", ns=(st.st_atime_ns, st.st_mtime_ns))
    moved, failed = _quarantine(repo, before)
    assert failed == [] and len(moved) == 1 and moved[0].startswith(f"{repo}/s/.git.quarantined-by-dispatchd-")


@pytest.mark.parametrize("unsearchable", ["a", "a/b"])
def test_a_submodule_that_cannot_be_looked_at_moves_the_index_aside(repo: Path, unsearchable: str) -> None:
    """A new submodule behind a directory the daemon may not search: neither
    it nor the user's git sees the .git now, but the user's git will once the
    directory is searchable again. Never taken for "no submodule there": the
    index that records it is moved aside."""
    before = _take(repo)
    (repo / "a" / "b").mkdir(parents=True)
    git(repo / "a" / "b", "init", "-q")
    add_gitlink(repo, "a/b")
    (repo / unsearchable).chmod(0)
    try:
        with permission_bits.obeyed():
            moved, failed = _quarantine(repo, before)
    finally:
        (repo / unsearchable).chmod(0o755)
    assert failed == [] and len(moved) == 1 and moved[0].startswith(f"{repo}/.git/index.quarantined-by-dispatchd-")
    assert not (repo / ".git" / "index").exists()  # a/b is no submodule of the user's git now
    assert (repo / "a" / "b" / ".git").is_dir()  # and nothing of theirs is lost


def test_a_submodule_unsearchable_before_the_session_too_still_moves_the_index_aside(repo: Path) -> None:
    # The session could have opened it, changed its config and closed it again.
    (repo / "a" / "b").mkdir(parents=True)
    git(repo / "a" / "b", "init", "-q")
    add_gitlink(repo, "a/b")
    (repo / "a").chmod(0)
    try:
        with permission_bits.obeyed():
            before = _take(repo)
            assert before.indexes[".git/index"].startswith(f"a submodule that cannot be looked at ({errno.EACCES})")
            moved, failed = _quarantine(repo, before)
    finally:
        (repo / "a").chmod(0o755)
    assert failed == [] and moved[0].startswith(f"{repo}/.git/index.quarantined-by-dispatchd-")


def test_a_plain_nested_submodule_path_is_followed(repo: Path) -> None:
    (repo / "a" / "b").mkdir(parents=True)
    git(repo / "a" / "b", "init", "-q")
    add_gitlink(repo, "a/b")
    assert "a/b/.git" in _take(repo).gitdirs


def test_an_index_that_cannot_be_checked_after_a_session_is_moved_aside(repo: Path) -> None:
    index = repo / ".git" / "index"
    before = _take(repo)
    assert before.indexes == {}
    index.write_bytes(b"DIRC" + b"\0\0\0\2" + b"\xff" * 64)  # garbled
    moved, failed = _quarantine(repo, before)
    assert failed == [] and len(moved) == 1 and moved[0].startswith(str(index) + ".quarantined-by-dispatchd-")
    assert not index.exists()


def test_the_users_own_unreadable_index_is_left_alone(repo: Path) -> None:
    index = repo / ".git" / "index"
    index.write_bytes(b"not an index")
    before = _take(repo)
    assert list(before.indexes) == [".git/index"]
    assert _quarantine(repo, before) == ([], [])
    assert index.read_bytes() == b"not an index"


def test_work_in_a_submodule_kept_in_place_keeps_its_git_directory(repo: Path) -> None:
    emb = repo / "emb"
    emb.mkdir()
    git(emb, "init", "-q")
    git(emb, "commit", "-q", "--allow-empty", "-m", "1")
    add_gitlink(repo, "emb", git(emb, "rev-parse", "HEAD").strip())
    before = _take(repo)
    git(emb, "commit", "-q", "--allow-empty", "-m", "2")  # the session's normal work there
    (emb / ".git" / "new-file").write_text("changes the directory's mtime")
    assert _quarantine(repo, before) == ([], [])
    assert (emb / ".git").is_dir()
