"""A restore beside the user's own git: another worktree of the repository
is not written (its index, HEAD, logs; its branch not moved, and said), and
every ref the restore sets is set under git's lock (a lock the user's git
holds leaves that ref, said; without it the ref is set and the value it
held kept). Each with its twin: the session's own worktree restored as before."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import dispatch
import pytest

from tests.conftest import Daemon, _refuse_root
from tests.integration.test_checkpoints import IDENTITY, git, ok, repo  # noqa: F401 (a fixture)
from tests.conftest import shell


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    _refuse_root()
    d = Daemon(tmp_path_factory.mktemp("checkpoints-worktrees"))
    yield d
    assert d.stop() == 0, d.log()


def _state(admin: Path) -> dict[str, bytes]:
    """Every file of a linked worktree's admin directory, byte for byte."""
    out: dict[str, bytes] = {}
    for dirpath, _, files in os.walk(admin):
        for name in files:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, admin)] = Path(path).read_bytes()
    return out


def _linked(repo: Path) -> tuple[Path, Path]:
    """A linked worktree on ``feature``, with content staged there that is
    neither committed nor on disk (``git add -p`` leaves that)."""
    wt2 = repo.parent / "wt2"
    git(repo, "worktree", "add", "-q", str(wt2), "feature")
    (wt2 / "notes.txt").write_text("staged\n")
    git(wt2, "add", "notes.txt")
    (wt2 / "notes.txt").write_text("staged, then edited\n")
    return wt2, repo / ".git" / "worktrees" / "wt2"


def test_a_restore_leaves_another_worktrees_state_and_branch_and_says_so(client: dispatch.Client,
                                                                        repo: Path) -> None:
    """The session on the main worktree checkpoints; the user then adds a
    linked worktree on ``feature``, stages a file there and commits on
    ``feature``; the session restores. The linked worktree's admin
    directory (index, HEAD, logs) is byte for byte as the user left it, its
    staged blob still staged, ``feature`` still on the user's commit, and
    the reply says it was left. Twin: the session's own worktree (main,
    its index, its files) is restored as before."""
    with client.open_session(str(repo)) as s:
        cid = s.checkpoint()
        wt2, admin = _linked(repo)
        (wt2 / "f.txt").write_text("the user's\n")
        git(wt2, "add", "f.txt")
        git(wt2, "commit", "-qm", "the user's on feature", "--", "f.txt")
        users = git(wt2, "rev-parse", "HEAD").strip()
        staged = git(wt2, "rev-parse", ":notes.txt").strip()
        ok(shell(s, f"echo session > src/main.py && git add -A && {IDENTITY} git commit -qm session"))
        session_commit = git(repo, "rev-parse", "main").strip()
        linked_before = _state(admin)
        done = s.restore(cid)
        assert _state(admin) == linked_before  # index, HEAD, logs, gitdir: not a byte written
        assert git(wt2, "rev-parse", "feature").strip() == users
        assert git(wt2, "rev-parse", ":notes.txt").strip() == staged
        assert git(wt2, "status", "--porcelain") == "AM notes.txt\n"
        assert done["not_restored"] == [f"refs/heads/feature: checked out in the worktree {wt2}; left as it is "
                                        "(a restore moves no other worktree's branch)"]
        # Twin: the session's own worktree is restored: its branch, index and files.
        assert git(repo, "log", "--format=%s", "main") == "init\n"
        assert git(repo, "status", "--porcelain") == ""
        assert (repo / "src" / "main.py").read_text() == "def main():\n    return 42\n"
        [kept] = done["displaced"]
        assert kept.endswith("/refs/heads/main") and git(repo, "rev-parse", kept).strip() == session_commit
        git(repo, "fsck", "--no-dangling")


def test_a_reflog_is_appended_to_not_replaced(client: dispatch.Client, repo: Path) -> None:
    """The restore moves main back: main's reflog keeps every entry it had
    (the session's commit among them) and gains one of the restore's."""
    with client.open_session(str(repo)) as s:
        cid = s.checkpoint()
        ok(shell(s, f"echo x > x.txt && git add -A && {IDENTITY} git commit -qm session"))
        log = repo / ".git" / "logs" / "refs" / "heads" / "main"
        before = log.read_bytes()
        s.restore(cid)
        after = log.read_bytes()
        assert after.startswith(before) and after.count(b"\n") == before.count(b"\n") + 1
        assert after.endswith(f"\tdispatchd: restore checkpoint {cid}\n".encode())
        assert git(repo, "reflog", "show", "--format=%gs", "main").splitlines()[:2] == [
            f"dispatchd: restore checkpoint {cid}", "commit: session"]


@pytest.mark.parametrize("locked", [True, False])
def test_a_ref_the_users_git_holds_locked_is_left_and_said(client: dispatch.Client, repo: Path,
                                                           locked: bool) -> None:
    """The user's git holds ``main.lock`` (a commit in flight): the restore
    does not write main, waits briefly, leaves it and says so; the lock is
    the user's, left in place. Twin: without the lock main is set back and
    the value it held kept under refs/dispatchd/displaced/."""
    with client.open_session(str(repo)) as s:
        cid = s.checkpoint()
        ok(shell(s, f"echo x > x.txt && git add -A && {IDENTITY} git commit -qm session"))
        moved = git(repo, "rev-parse", "main").strip()
        lock = repo / ".git" / "refs" / "heads" / "main.lock"
        if locked:
            lock.write_text("")  # as git's O_EXCL create leaves it while it writes
        done = s.restore(cid)
    if locked:
        assert lock.exists() and lock.read_text() == ""
        lock.unlink()
        assert git(repo, "rev-parse", "main").strip() == moved
        assert done["not_restored"] == ["refs/heads/main: locked by another git (refs/heads/main.lock, held over 1 s); "
                                        "left as it is: restore again, or set it by hand"]
        assert done["displaced"] == []
    else:
        assert not lock.exists()
        assert git(repo, "log", "--format=%s", "main") == "init\n"
        assert done["not_restored"] == []
        [kept] = done["displaced"]
        assert kept.endswith("/refs/heads/main") and git(repo, "rev-parse", kept).strip() == moved
