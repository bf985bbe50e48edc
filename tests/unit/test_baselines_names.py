"""The trusted baseline with names that are not UTF-8 and with a record it
cannot write (daemon/gitguard/baselines.py, refsback.py), on real
repositories made by git: a branch ``bad\\xff`` is recorded, put back and
taken out as any other, a join that fails for any reason leaves no trace
in the domain, and an end that cannot rewrite the record says so and
still reports what its check did."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import msgspec
import pytest

from dispatchd import recordjson
from dispatchd.daemon.gitguard import baselines, recordfiles
from tests.unit.gitrepo import ENV, make_repo
from tests.unit.test_baselines import _join

pytestmark = pytest.mark.process  # git makes the repositories

BAD = "bad\udcff"  # the branch b"bad\xff", as Python reads its name
NAMES = [BAD, "caf\u00e9"]  # and its twin, valid UTF-8
IDS = ["not-utf8", "utf8"]


def git(cwd: Path, *args: str) -> str:
    """git, its output read as names are (``surrogateescape``): it prints ``bad\\xff`` raw."""
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          errors="surrogateescape", env=ENV).stdout


def _rev(repo: Path, ref: str) -> str:
    out = subprocess.run(["git", "rev-parse", "--verify", "-q", ref], cwd=repo, capture_output=True, text=True)
    return out.stdout.strip()


def _records(state: Path) -> list[Path]:
    return sorted((state / "baselines").glob("*.json"))


@pytest.mark.parametrize("name", NAMES, ids=IDS)
def test_a_branch_a_session_makes_leaves_the_next_open_working(tmp_path: Path, name: str) -> None:
    repo = make_repo(tmp_path / "r")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "s1", repo)
    git(repo, "branch", name)  # the session's
    assert store.leave("s1") == []  # a new branch is the session's work, and stays
    _join(store, "s2", repo)  # recorded, with it: the open works
    record = recordfiles.read(str(_records(tmp_path / "state")[0]))
    assert record.sessions == ["s2"] and f"refs/heads/{name}" in record.histories[0].refs
    store.leave("s2")
    assert store._domains == {} and _records(tmp_path / "state") == []


@pytest.mark.parametrize("packed", [False, True], ids=["loose", "packed"])
@pytest.mark.parametrize("name", NAMES, ids=IDS)
def test_the_users_branch_is_put_back_under_its_own_bytes(tmp_path: Path, name: str, packed: bool) -> None:
    repo = make_repo(tmp_path / "r")
    git(repo, "branch", name)
    if packed:
        git(repo, "pack-refs", "--all")
    before = _rev(repo, f"refs/heads/{name}")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "s", repo)
    git(repo, "branch", "-D", name)  # the session deletes it (out of packed-refs, too), and its reflog
    found = store.leave("s")
    assert _rev(repo, f"refs/heads/{name}") == before  # the very ref, not one named with U+FFFD
    shown = f"refs/heads/{name}".replace("\udcff", "\\xff")
    assert [(p.path, p.why) for p in found] == [
        (shown, f"deleted by a session; put back at {before[:12]}"),
        ("logs", f"1 reflogs a session cut put back (1 lines of your `git reflog`, and the commits only they name): "
                 f"{shown}")]
    assert git(repo, "reflog", "show", "--format=%H", f"refs/heads/{name}").split() == [before]
    assert "\ufffd" not in git(repo, "for-each-ref", "--format=%(refname)")


@pytest.mark.parametrize("name", NAMES, ids=IDS)
def test_a_remote_tracking_ref_a_session_packs_is_taken_out(tmp_path: Path, name: str) -> None:
    repo = make_repo(tmp_path / "r")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "s", repo)
    git(repo, "update-ref", f"refs/remotes/origin/{name}", "HEAD")
    git(repo, "pack-refs", "--all")  # only packed-refs names it now
    found = store.leave("s")
    assert _rev(repo, f"refs/remotes/origin/{name}") == ""  # taken out of packed-refs, whatever its bytes
    assert [p.path for p in found] == [f"refs/remotes/origin/{name}".replace("\udcff", "\\xff")]


def _unencodable(record: object) -> bytes:
    raise ValueError("a value no record can hold")


def test_a_join_that_fails_for_any_reason_leaves_no_session_in_the_domain(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The record's write raises what is no OSError (as msgspec's
    UnicodeEncodeError did for a branch ``bad\\xff``): the open is refused
    with why, and the next open of the worktree works. Before, the failed
    session stayed in the domain, which was never discarded, and every
    later open joined it and failed the same way until a restart."""
    repo = make_repo(tmp_path / "r")
    store = baselines.Baselines(str(tmp_path / "state"))
    monkeypatch.setattr(recordjson, "encode", _unencodable)
    with pytest.raises(baselines.WorktreeError) as refused:
        _join(store, "s1", repo)
    assert refused.value.message == (f"{repo}: its baseline cannot be recorded in {tmp_path / 'state' / 'baselines'} "
                                     "(ValueError: a value no record can hold); no session opened")
    assert store._domains == {} and os.listdir(tmp_path / "state" / "baselines") == []
    monkeypatch.undo()
    _join(store, "s2", repo)  # the twin: the next open works
    assert recordfiles.read(str(_records(tmp_path / "state")[0])).sessions == ["s2"]
    store.leave("s2")


def test_a_later_session_join_that_fails_leaves_the_others_as_they_were(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = make_repo(tmp_path / "r")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "a", repo)
    monkeypatch.setattr(recordjson, "encode", _unencodable)
    with pytest.raises(baselines.WorktreeError, match=r"\(ValueError: a value no record can hold\); no session"):
        _join(store, "b", repo)
    [domain] = store._domains.values()
    assert domain.record.sessions == ["a"] and "b" not in store._by_session


@pytest.mark.parametrize("fails", [True, False], ids=["disk-full", "twin"])
def test_an_end_that_cannot_rewrite_the_record_reports_its_check_and_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: bool) -> None:
    """Two sessions; the first ends with the disk full: its close still
    lists what its check moved aside, and one more item names the record
    and ENOSPC. The record still names it, which is on the safe side."""
    repo = make_repo(tmp_path / "r")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "a", repo)
    _join(store, "b", repo)
    (repo / "d1" / "n").mkdir()
    git(repo / "d1" / "n", "init", "-q")  # a's plant: a repository the user's git would run
    [path] = _records(tmp_path / "state")
    if fails:
        def full(fd: int, data: bytes) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(baselines.os, "write", full)
    found = store.leave("a")
    monkeypatch.undo()
    assert found[0].path.startswith(str(repo / "d1" / "n" / ".git" / "config.quarantined-by-dispatchd-"))
    assert not (repo / "d1" / "n" / ".git" / "config").exists()
    if fails:
        assert len(found) == 2 and found[1].path == str(path)
        assert found[1].why.startswith("the worktree's baseline record could not be rewritten without this session "
                                       "(No space left on device, ENOSPC): this end's check ran all the same")
    else:
        assert len(found) == 1
    record = msgspec.json.decode(path.read_bytes(), type=baselines.Record)
    assert record.sessions == (["a", "b"] if fails else ["b"])
    assert store.leave("b") == [] and _records(tmp_path / "state") == []  # the last end, as ever


def test_a_dead_daemons_record_naming_a_branch_not_utf8_is_checked_at_start(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    git(repo, "branch", BAD)
    before = _rev(repo, f"refs/heads/{BAD}")
    dead = baselines.Baselines(str(tmp_path / "state"))
    _join(dead, "s", repo)
    git(repo, "branch", "-D", BAD)  # its session's, before the daemon died
    os.close(next(iter(dead._domains.values())).lock_fd)  # what the kernel does for a dead daemon
    found = baselines.Baselines(str(tmp_path / "state")).recover()  # reads the record back whole, or puts nothing back
    assert _rev(repo, f"refs/heads/{BAD}") == before
    assert [p.path for p in found] == ["refs/heads/bad\\xff", "logs"]  # the branch, and its reflog
