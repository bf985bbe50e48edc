"""The history keeps are named, held while used and swept once nothing can
need them (dispatchd/daemon/gitguard/keeps.py); the baselines' directory
loses what killed daemons left beside the records (``pending.remove_strays``)."""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from pathlib import Path

import msgspec
import pytest

from dispatchd.daemon.checkpoints.plan import Manifest
from dispatchd.daemon.gitguard import history, keeps, pending
from dispatchd.protocol import CheckpointInfo
from tests.unit.gitrepo import git

_DAY = 86400.0


def _repo(path: Path) -> Path:
    path.mkdir(parents=True)
    git(path, "init", "-q")
    (path / "a").write_text("a\n")
    git(path, "add", "a")
    git(path, "commit", "-qm", "a")
    return path


def _kept(tmp_path: Path, repo: Path) -> Path:
    """``repo``'s keep, brought up to date as an open does."""
    keep = history.keep_for(str(tmp_path / "state" / "keep"), str(repo / ".git"))
    assert history.record(str(repo / ".git"), keep, own=[]).keep == keep
    return Path(keep)


def _sweep(tmp_path: Path, now: float | None = None) -> list[tuple[str, str]]:
    return keeps.sweep(str(tmp_path / "state" / "keep"), str(tmp_path / "state"), now)


@pytest.mark.parametrize(("repo", "gone", "named", "unused_days", "why"), [
    ("/r/.git", True, False, 0, "its repository /r/.git is gone"),
    ("/r/.git", False, False, 400, None),  # the repository is there: its keep is the next open's head start
    ("/r/.git", True, True, 0, None),  # a record names it: a restore may need it
    (None, False, False, 31, "unnamed and unused for 31 days"),
    (None, False, False, 29, None),
    (None, False, True, 400, None),
])
def test_which_keeps_go(repo: str | None, gone: bool, named: bool, unused_days: int, why: str | None) -> None:
    assert keeps.why_remove(repo, gone, named, unused_days * _DAY) == why


@pytest.mark.process
def test_a_keep_is_named_by_its_repository_s_real_path(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    (tmp_path / "link").symlink_to(repo)
    keep = history.keep_for(str(tmp_path / "keep"), str(tmp_path / "link" / ".git"))
    history.record(str(tmp_path / "link" / ".git"), keep, own=[])
    assert (Path(keep) / keeps.REPO).read_text() == os.path.realpath(repo / ".git")
    assert Path(keep) == Path(history.keep_for(str(tmp_path / "keep"), str(repo / ".git")))


@pytest.mark.process
def test_a_removed_repository_s_keep_goes_and_a_present_one_s_stays(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    gone, here = _repo(tmp_path / "gone"), _repo(tmp_path / "here")
    gone_keep, here_keep = _kept(tmp_path, gone), _kept(tmp_path, here)
    (tmp_path / "moved").mkdir()
    os.rename(gone, tmp_path / "moved" / "gone")
    with caplog.at_level(logging.WARNING, logger="dispatchd.keeps"):
        removed = _sweep(tmp_path)
    assert removed == [(gone_keep.name, f"its repository {gone}/.git is gone")]
    assert not gone_keep.exists() and (here_keep / keeps.REPO).is_file()
    assert f"event=keep_removed keep={gone_keep.name}" in caplog.text
    assert os.listdir(here_keep.parent) == [here_keep.name]  # nothing left aside


@pytest.mark.process
def test_a_keep_a_record_names_stays_though_its_repository_is_gone(tmp_path: Path) -> None:
    """A baseline record (a dead daemon's, not yet checked) and a checkpoint's
    manifest each keep theirs; the twin: once they go, so does the keep."""
    by_baseline, by_checkpoint = _repo(tmp_path / "b"), _repo(tmp_path / "c")
    kb, kc = _kept(tmp_path, by_baseline), _kept(tmp_path, by_checkpoint)
    base = tmp_path / "state" / "baselines"
    base.mkdir()
    record = {"id": "d1", "created": 0.0, "histories": [{"common": str(by_baseline / ".git"), "keep": str(kb)}]}
    (base / "d1.json").write_bytes(msgspec.json.encode(record))
    top = tmp_path / "state" / "checkpoints" / "aaaaaaaaaaaa"
    top.mkdir(parents=True)
    info = CheckpointInfo(id="c0001-x", created=0.0)
    (top / "c0001-x").write_bytes(msgspec.msgpack.encode(Manifest(info=info, started_ns=0, entries=[], keep=str(kc))))
    for r in (by_baseline, by_checkpoint):
        os.rename(r, tmp_path / f"{r.name}-moved")
    assert _sweep(tmp_path) == [] and kb.is_dir() and kc.is_dir()
    os.unlink(base / "d1.json")
    os.unlink(top / "c0001-x")
    assert sorted(n for n, _ in _sweep(tmp_path)) == sorted([kb.name, kc.name])


@pytest.mark.process
def test_an_unreadable_record_sweeps_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    repo = _repo(tmp_path / "r")
    keep = _kept(tmp_path, repo)
    os.rename(repo, tmp_path / "r-moved")
    base = tmp_path / "state" / "baselines"
    base.mkdir()
    (base / "d2.json").write_bytes(b"{not json")
    with caplog.at_level(logging.WARNING, logger="dispatchd.keeps"):
        assert _sweep(tmp_path) == []
    assert keep.is_dir() and "event=keeps_not_swept" in caplog.text
    (base / "d2.json.0a0b0c0d.tmp").write_bytes(b"{half")  # a record being written says nothing yet
    os.unlink(base / "d2.json")
    assert [n for n, _ in _sweep(tmp_path)] == [keep.name]


@pytest.mark.process
def test_a_keep_in_use_is_left_and_one_moved_aside_is_made_again(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "r")
    keep = _kept(tmp_path, repo)
    common = str(repo / ".git")
    os.rename(repo, tmp_path / "r-moved")
    with keeps.hold(str(keep), common):
        assert _sweep(tmp_path) == [] and keep.is_dir()  # held: in use
    # A holder that waits for the sweep's lock finds a new keep at the path.
    fd = os.open(keep, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    old = os.fstat(fd).st_ino
    got: list[int] = []

    def holder() -> None:
        with keeps.hold(str(keep), common) as held:
            got.append(os.fstat(held).st_ino)
    t = threading.Thread(target=holder)
    t.start()
    time.sleep(0.2)
    assert not got  # waiting for the lock
    os.rename(keep, tmp_path / "aside")
    os.close(fd)
    t.join(10)
    assert got and got[0] != old and got[0] == os.stat(keep).st_ino
    assert (keep / keeps.REPO).read_text() == os.path.realpath(common)


def test_an_unnamed_keep_goes_only_once_unused_a_month(tmp_path: Path) -> None:
    keep = tmp_path / "state" / "keep" / "0123456789abcdef"
    (keep / "ab").mkdir(parents=True)
    (keep / ".stamps").write_text("[{}, 0]")
    assert _sweep(tmp_path, now=time.time() + 29 * _DAY) == []
    assert _sweep(tmp_path, now=time.time() + 31 * _DAY) == [(keep.name, "unnamed and unused for 31 days")]
    assert not keep.exists()


def test_what_a_killed_sweep_left_aside_goes(tmp_path: Path) -> None:
    aside = tmp_path / "state" / "keep" / ".gone-0123456789abcdef-01020304"
    (aside / "ab").mkdir(parents=True)
    (aside / "ab" / "cd").write_bytes(b"x")
    os.chmod(aside / "ab", 0o500)
    assert _sweep(tmp_path) == [] and not aside.exists()


# --- the baselines' directory ------------------------------------------------


def _lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_what_killed_daemons_left_beside_the_records_goes_and_a_live_one_s_stays(tmp_path: Path) -> None:
    d = tmp_path
    for name in ("lone.lock", "kept.lock", "kept.json", "live.lock", "livetmp.lock", "livetmp.json.00.tmp",
                 "dead.json.00.tmp", ".new.lock.00", ".old.lock.00"):
        (d / name).write_bytes(b"")
    live, livetmp = _lock(d / "live.lock"), _lock(d / "livetmp.lock")
    os.utime(d / ".old.lock.00", (time.time() - 120, time.time() - 120))
    try:
        removed = pending.remove_strays(str(d), sorted(os.listdir(d)))
        assert sorted(removed) == [".old.lock.00", "dead.json.00.tmp", "lone.lock"]
        assert sorted(os.listdir(d)) == [".new.lock.00", "kept.json", "kept.lock", "live.lock", "livetmp.json.00.tmp",
                                         "livetmp.lock"]
    finally:
        os.close(live)
        os.close(livetmp)
    # The live ones' daemon gone: theirs go at the next look.
    assert sorted(pending.remove_strays(str(d), sorted(os.listdir(d)))) == ["live.lock", "livetmp.json.00.tmp",
                                                                            "livetmp.lock"]


@pytest.mark.process
@pytest.mark.parametrize("named_later", [True, False])
def test_a_record_made_after_the_first_reading_keeps_its_keep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              named_later: bool) -> None:
    """The records are read again once the keep's lock is taken: one written
    between the two readings (an open's, whose session then moved its
    repository away) keeps the keep. The twin: still named by none, it goes."""
    repo = _repo(tmp_path / "r")
    keep = _kept(tmp_path, repo)
    os.rename(repo, tmp_path / "r-moved")
    readings = iter([set(), {keep.name} if named_later else set()])
    monkeypatch.setattr(keeps, "named", lambda state_dir: next(readings))
    assert _sweep(tmp_path) == ([] if named_later else [(keep.name, f"its repository {repo}/.git is gone")])
    assert keep.is_dir() == named_later


@pytest.mark.process
def test_a_record_written_under_another_spelling_of_the_state_directory_names_its_keep(tmp_path: Path) -> None:
    """A daemon started with ``XDG_STATE_HOME`` through a symlink wrote the
    record: the keep is named all the same. The twin: a record naming
    another keep does not keep this one."""
    repo = _repo(tmp_path / "r")
    keep = _kept(tmp_path, repo)
    (tmp_path / "alias").symlink_to(tmp_path / "state")
    os.rename(repo, tmp_path / "r-moved")
    base = tmp_path / "state" / "baselines"
    base.mkdir()
    for other, expect in ((False, []), (True, [keep.name])):
        named = "0" * 16 if other else keep.name
        record = {"id": "d3", "created": 0.0, "histories": [{"common": str(repo / ".git"),
                                                             "keep": str(tmp_path / "alias" / "keep" / named)}]}
        (base / "d3.json").write_bytes(msgspec.json.encode(record))
        assert [n for n, _ in _sweep(tmp_path)] == expect


@pytest.mark.process
def test_a_temporary_record_renamed_after_the_listing_is_read_under_its_new_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = _repo(tmp_path / "r")
    keep = _kept(tmp_path, repo)
    base = tmp_path / "state" / "baselines"
    base.mkdir()
    record = {"id": "d4", "created": 0.0, "histories": [{"common": str(repo / ".git"), "keep": str(keep)}]}
    (base / "d4.json").write_bytes(msgspec.json.encode(record))  # the listing saw d4.json.00.tmp
    real = keeps._listing
    monkeypatch.setattr(keeps, "_listing", lambda p: ["d4.json.00.tmp"] if p == str(base) else real(p))
    assert keeps.named(str(tmp_path / "state")) == {keep.name}


@pytest.mark.process
def test_a_keep_moved_and_made_again_before_the_sweep_s_lock_is_left(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Another daemon's sweep moved the keep aside and an open made a new one
    between this sweep's open of the keep and its lock: the new one is left."""
    repo = _repo(tmp_path / "r")
    keep = _kept(tmp_path, repo)
    os.rename(repo, tmp_path / "r-moved")
    real = fcntl.flock

    def swapped(fd: int, op: int) -> None:
        if op == fcntl.LOCK_EX | fcntl.LOCK_NB and not (tmp_path / "aside").exists():
            os.rename(keep, tmp_path / "aside")
            keep.mkdir()
            (keep / keeps.REPO).write_text(str(repo / ".git"))
        real(fd, op)
    monkeypatch.setattr(keeps.fcntl, "flock", swapped)
    assert _sweep(tmp_path) == [] and keep.is_dir()
    monkeypatch.setattr(keeps.fcntl, "flock", real)
    assert [n for n, _ in _sweep(tmp_path)] == [keep.name]  # the twin: unchanged since, it goes


@pytest.mark.process
def test_a_keep_that_cannot_be_named_still_keeps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    repo = _repo(tmp_path / "r")
    real = os.open

    def full(path: str, *args: object, **kwargs: object) -> int:
        if str(path).startswith(keeps.REPO + "."):
            raise OSError(28, "No space left on device")
        return real(path, *args, **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr(keeps.os, "open", full)
    with caplog.at_level(logging.WARNING, logger="dispatchd.keeps"):
        keep = _kept(tmp_path, repo)
    assert "event=keep_not_named" in caplog.text and not (keep / keeps.REPO).exists()
    assert any(p.is_file() for p in keep.rglob("*") if p.name != ".stamps")  # the objects are kept
