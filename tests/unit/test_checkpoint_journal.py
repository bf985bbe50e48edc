"""The record of a restore in progress (dispatchd/daemon/checkpoints/journal.py):
its encoding, what is recognised, what counts as changed since; then the
store on a temporary directory with a restore cut short (no daemon: the
real daemon and a real SIGKILL are tests/integration/test_checkpoint_crash.py's)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import pytest

from dispatchd.daemon import checkpoints as cp
from dispatchd.daemon.checkpoints import gitplan, journal, store as store_module
from dispatchd.daemon.checkpoints.plan import RestorePlan
from dispatchd.daemon.checkpoints.restoring import apply_restore
from dispatchd.daemon.gitguard import reftemp
from dispatchd.errors import CheckpointError
from dispatchd.policy import Checkpoints
from tests.unit.gitrepo import git

E = cp.Entry
POLICY = Checkpoints()


def record(**over: object) -> journal.Record:
    fields: dict[str, object] = dict(session="0123456789ab", checkpoint="c0001-deadbeef", worktree="/home/u/wt",
                                     dev=64769, ino=1234, started_ns=10**18, max_files=200_000, max_depth=256)
    fields.update(over)
    return journal.Record(**fields)  # type: ignore[arg-type]


# --- the record, pure -------------------------------------------------------------


def test_a_record_round_trips_and_names_what_it_needs():
    r = record(fsync=False, pid=42)
    assert journal.decode(journal.encode(r)) == r
    assert set(journal.encode(r).decode().strip("{}").replace('"', "").split(",")) >= {
        "version:1", "session:0123456789ab", "checkpoint:c0001-deadbeef", "worktree:/home/u/wt", "dev:64769",
        "ino:1234"}


def test_a_record_keeps_the_baseline_s_alternates_for_its_finish():
    """What ``keep_refs`` asks besides the repository's objects at a finish
    (``Baselines.borrowed`` at the restore's start); an older daemon's
    record, which has none, reads as none (a move is then kept, not lost)."""
    r = record(borrowed=["/home/u/src/.git/objects"])
    assert journal.decode(journal.encode(r)).borrowed == ["/home/u/src/.git/objects"]
    older = journal.encode(record()).replace(b',"borrowed":[]', b"")
    assert b"borrowed" not in older and journal.decode(older).borrowed == []


def test_a_record_of_an_older_daemon_without_the_time_of_its_displaced_refs_is_read():
    r = record(stamp="20250601T101500")
    assert journal.decode(journal.encode(r)).stamp == "20250601T101500"
    older = json.loads(journal.encode(r))
    del older["stamp"]
    assert journal.decode(json.dumps(older).encode()) == record()  # its refs kept under the finish's time


@pytest.mark.parametrize("data, why", [
    (b"half a rec", "not a restore record: "),
    (b'{"session": "s"}', "not a restore record: Object missing required field"),
    (journal.encode(record(version=2)), "a restore record of version 2; this daemon reads 1"),
    (journal.encode(record(session="../x")), "a restore record naming no valid session: '../x'"),
    (journal.encode(record(session="")), "a restore record naming no valid session: ''"),
    (journal.encode(record(checkpoint="../pool")), "a restore record naming no valid checkpoint: '../pool'"),
    (journal.encode(record(checkpoint=".tmp-c1")), "a restore record naming no valid checkpoint: '.tmp-c1'"),
    (journal.encode(record(worktree="wt")), "a restore record naming a relative worktree: 'wt'"),
    (journal.encode(record(stamp="../../../hooks")),
     "a restore record naming no valid time for its displaced refs: '../../../hooks'"),
])
def test_what_is_not_a_record_is_refused_saying_why(data, why):
    with pytest.raises(ValueError) as err:
        journal.decode(data)
    assert str(err.value).startswith(why)


def test_the_worktree_is_recognised_by_its_device_and_inode(tmp_path):
    wt = tmp_path / "wt"
    wt.mkdir()
    st = os.lstat(wt)
    r = record(worktree=str(wt), dev=st.st_dev, ino=st.st_ino)
    assert journal.recognise(r, os.lstat(wt)) is None
    os.rename(wt, tmp_path / "aside")
    wt.mkdir()
    other = os.lstat(wt)
    assert journal.recognise(r, other) == (
        f"another directory is at the worktree's path (device {other.st_dev} inode {other.st_ino}, "
        f"the restore began on device {st.st_dev} inode {st.st_ino})")
    wt.rmdir()
    os.symlink(tmp_path / "aside", wt)
    assert journal.recognise(r, os.lstat(wt)) == "the worktree's path is now a symlink (not followed)"
    wt.unlink()
    wt.write_text("")
    assert journal.recognise(r, os.lstat(wt)) == "the worktree's path is no longer a directory"


def f(path: bytes, ctime: int, size: int = 3, mtime: int = 5, mode: int = 0o644, ino: int = 1) -> cp.Entry:
    return E(path=path, kind="f", mode=mode, size=size, mtime_ns=mtime, ctime_ns=ctime, dev=1, ino=ino)


def test_changed_since_names_what_someone_else_wrote_after_the_restore_began():
    start = 1000
    saved = [E(path=b"", kind="d", mode=0o755), f(b"a", 1), f(b"b", 1), E(path=b"l", kind="l", target=b"a"),
             E(path=b"d", kind="d", mode=0o755)]
    now = [
        E(path=b"", kind="d", mode=0o700, ctime_ns=2000),  # widened by the restore: directories never count
        f(b"a", 2000, ino=9),  # written back by the restore (new inode, same size, mtime, mode)
        f(b"b", 10),  # not yet restored: changed before the restore began
        E(path=b"l", kind="l", target=b"a", ctime_ns=2000),  # put back
        E(path=b"new", kind="d", ctime_ns=2000),  # a directory: judged by what it holds
        f(b".c.dispatchd-0123abcd.tmp", 2000),  # the restore's own temporary file
        f(b"d/.x.dispatchd-0123abcd.tmp", 2000),
        f(b"old-new", 10),  # made by the session before the restore: the restore removes it
        f(b".git/refs/dispatchd/displaced/20250101T000000/refs/heads/main", 2000),  # a value it kept
    ]
    assert journal.changed_since(saved, now, start) == []
    later = [
        f(b"a", 2000, mtime=7),  # rewritten since
        f(b"b", 1000, mode=0o600),  # a chmod since (at the very start counts)
        E(path=b"l", kind="l", target=b"elsewhere", ctime_ns=2000),
        f(b"new/work.txt", 3000),  # made since, in a new directory
        E(path=b"p", kind="p", ctime_ns=2000),
        f(b"d/.x.dispatchd-0123abcd.tmp.bak", 2000),  # not our name
        f(b".git/refs/heads/topic", 2000),  # a ref: judged by its value (gitplan.refs_changed)
        f(b".git/logs/refs/heads/main", 2000),  # a reflog: appended to, never written over
        f(b".git/worktrees/wt2/index", 2000),  # another worktree's: a restore never writes it
    ]
    assert journal.changed_since(saved, later, start) == [
        b"a", b"b", b"d/.x.dispatchd-0123abcd.tmp.bak", b"l", b"new/work.txt", b"p"]


def test_refs_changed_names_refs_set_after_the_restore_began_but_not_another_worktrees_branch():
    one, two, three = "1" * 40, "2" * 40, "3" * 40
    before = {"refs/heads/main": two, "refs/heads/feature": one, "refs/heads/gone": one}
    want = {"HEAD": "ref: refs/heads/main", "refs/heads/main": one, "refs/heads/feature": one,
            "refs/heads/gone": one}
    # Not yet restored, or restored: nothing someone else did.
    assert gitplan.refs_changed(before, want, dict(before), set()) == []
    assert gitplan.refs_changed(before, want, {n: v for n, v in want.items() if n != "HEAD"}, set()) == []
    now = {"refs/heads/main": three, "refs/heads/feature": three, "refs/heads/topic": one,
           "refs/dispatchd/displaced/20250101T000000/refs/heads/main": two, "HEAD": three}
    assert gitplan.refs_changed(before, want, now, set()) == [
        "HEAD", "refs/heads/feature", "refs/heads/gone", "refs/heads/main", "refs/heads/topic"]
    # A branch checked out in another worktree is the user's there, whatever it holds.
    assert gitplan.refs_changed(before, want, now, {"refs/heads/feature"}) == [
        "HEAD", "refs/heads/gone", "refs/heads/main", "refs/heads/topic"]


# --- the store and the start, on a temporary directory ---------------------------


def _tree(root: str) -> dict[str, tuple[str, int, bytes]]:
    out: dict[str, tuple[str, int, bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = ("l", 0, os.fsencode(os.readlink(p)))
            elif os.path.isdir(p):
                out[rel] = ("d", st.st_mode & 0o7777, b"")
            else:
                out[rel] = ("f", st.st_mode & 0o7777, Path(p).read_bytes())
    return out


def _worktree(tmp_path: Path) -> str:
    wt = tmp_path / "wt"
    for i in range(40):
        (wt / f"d{i % 4}").mkdir(parents=True, exist_ok=True)
        (wt / f"d{i % 4}" / f"f{i:02d}").write_text(f"original {i}\n")
    os.symlink("d0/f00", wt / "link")
    return str(wt)


def _change(wt: str) -> None:
    for i in range(40):
        p = os.path.join(wt, f"d{i % 4}", f"f{i:02d}")
        if i % 10 == 3:
            os.unlink(p)
        else:
            Path(p).write_text(f"changed {i}\n")
    os.makedirs(os.path.join(wt, "made", "deep"))
    Path(wt, "made", "deep", "n").write_text("new\n")
    Path(wt, "d1", "new").write_text("new\n")


def _cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next restore stops half way through its writes, as a killed daemon's would."""
    def half(worktree: str, top: str, plan: RestorePlan, fsync_each: bool = False,
             expect: tuple[int, int] | None = None) -> dict[str, int]:
        cut = RestorePlan(remove=plan.remove, make=plan.make, write=plan.write[:len(plan.write) // 2])
        apply_restore(worktree, top, cut, fsync_each, expect)
        raise CheckpointError("killed", "restore_failed")

    monkeypatch.setattr(store_module, "apply_restore", half)


def _die(store: cp.Store, sid: str) -> None:
    """The daemon's death, as far as the record goes: its lock released."""
    fd = store._of(sid).record_fd
    assert fd >= 0
    os.close(fd)
    store._of(sid).record_fd = -1


@pytest.fixture
def state(tmp_path: Path) -> Path:
    s = tmp_path / "state"
    s.mkdir()
    return s


def test_a_restore_done_leaves_no_record(state, tmp_path):
    store = cp.Store(str(state), str(state / "keep"))
    wt = _worktree(tmp_path)
    info = store.take("s1", wt, POLICY)
    _change(wt)
    store.restore("s1", wt, info.id, POLICY)
    assert not os.path.lexists(state / "checkpoints" / "s1" / journal.RECORD)
    assert store._of("s1").record_fd == -1


def test_a_restore_cut_half_way_is_finished_at_the_next_start(state, tmp_path, monkeypatch, caplog):
    store = cp.Store(str(state), str(state / "keep"))
    wt = _worktree(tmp_path)
    before = _tree(wt)
    info = store.take("s1", wt, POLICY)
    _change(wt)
    _cut(monkeypatch)
    with pytest.raises(CheckpointError):
        store.restore("s1", wt, info.id, POLICY)
    half = _tree(wt)
    assert half != before and "made" not in half  # really cut: removals done, writes half
    assert sum(half.get(k) == v for k, v in before.items()) not in (0, len(before))
    top = state / "checkpoints" / "s1"
    r = journal.decode((top / journal.RECORD).read_bytes())
    assert (r.session, r.checkpoint, r.worktree) == ("s1", info.id, wt)
    # While its daemon lives (the lock held), another start leaves it alone.
    assert journal.finish_all(str(state / "checkpoints")) == []
    assert _tree(wt) == half
    _die(store, "s1")
    monkeypatch.undo()
    with caplog.at_level(logging.INFO, logger="dispatchd.checkpoints"):
        cp.finish_restores(str(state))
    assert _tree(wt) == before
    assert not (top / journal.RECORD).exists()
    assert f"event=restore_finished session=s1 checkpoint={info.id} worktree={wt} " in caplog.text
    cp.Store(str(state), str(state / "keep"))  # then the old checkpoints go
    assert os.listdir(state / "checkpoints") == []


def _failed_restore(state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, taken: Checkpoints = POLICY
                    ) -> tuple[cp.Store, str, str, dict[str, tuple[str, int, bytes]]]:
    """A store whose restore of a checkpoint (taken under ``taken``) stopped
    half way: (the store, the worktree, the checkpoint, the tree it holds)."""
    store = cp.Store(str(state), str(state / "keep"))
    wt = _worktree(tmp_path)
    before = _tree(wt)
    info = store.take("s1", wt, taken)
    _change(wt)
    _cut(monkeypatch)
    with pytest.raises(CheckpointError):
        store.restore("s1", wt, info.id, POLICY)
    monkeypatch.undo()
    return store, wt, info.id, before


def test_restore_again_completes_a_failed_restore_and_removes_its_record(state, tmp_path, monkeypatch):
    store, wt, cid, before = _failed_restore(state, tmp_path, monkeypatch)
    store.restore("s1", wt, cid, POLICY)
    assert _tree(wt) == before
    assert not (state / "checkpoints" / "s1" / journal.RECORD).exists()


def test_a_failed_restores_checkpoint_outlives_keep_and_goes_with_the_session(state, tmp_path, monkeypatch):
    store, wt, cid, _ = _failed_restore(state, tmp_path, monkeypatch, taken=Checkpoints(keep=1))
    later = store.take("s1", wt, Checkpoints(keep=1))
    assert [i.id for i in store.infos("s1")] == [cid, later.id]  # the record's stays
    assert (state / "checkpoints" / "s1" / cid).exists()
    held = store._of("s1")
    assert held.record_fd >= 0
    store.drop("s1")
    assert not (state / "checkpoints" / "s1").exists()
    assert held.record_fd == -1  # the record's lock let go with it


def _cut_and_die(state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                 ) -> tuple[str, str, dict[str, tuple[str, int, bytes]]]:
    store, wt, cid, before = _failed_restore(state, tmp_path, monkeypatch)
    _die(store, "s1")
    return wt, cid, before


def test_a_replaced_worktree_is_left_untouched_and_the_record_kept(state, tmp_path, monkeypatch, caplog):
    wt, cid, _ = _cut_and_die(state, tmp_path, monkeypatch)
    os.rename(wt, tmp_path / "aside")
    os.mkdir(wt)
    Path(wt, "mine").write_text("someone's\n")
    with caplog.at_level(logging.INFO, logger="dispatchd.checkpoints"):
        cp.finish_restores(str(state))
    assert _tree(wt) == {"mine": ("f", 0o644 & ~_umask(), b"someone's\n")}
    assert "event=restore_unfinished session=s1 " in caplog.text
    assert "another directory is at the worktree's path" in caplog.text
    top = state / "checkpoints" / "s1"
    cp.Store(str(state), str(state / "keep"))  # the start's removal spares it: the next start tries again
    assert (top / journal.RECORD).exists() and (top / cid).exists()


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


@pytest.mark.parametrize("how", ["gone", "symlink", "changed", "manifest"])
def test_what_cannot_be_finished_is_never_written_and_says_why(state, tmp_path, monkeypatch, caplog, how):
    wt, cid, _ = _cut_and_die(state, tmp_path, monkeypatch)
    top = state / "checkpoints" / "s1"
    why = {"gone": "the worktree is gone",
           "symlink": "the worktree's path is now a symlink (not followed)",
           "changed": "d0/f04 changed after the restore began (not by it): finishing it would overwrite that work",
           "manifest": "the checkpoint's manifest cannot be read: "}[how]
    if how == "gone":
        shutil.rmtree(wt)
    elif how == "symlink":
        os.rename(wt, tmp_path / "aside")
        os.symlink(tmp_path / "aside", wt)
    elif how == "changed":
        time.sleep(0.01)
        Path(wt, "d0", "f04").write_text("the user's work since\n")
    else:
        (top / cid).unlink()
    seen = _tree(str(tmp_path))
    with caplog.at_level(logging.INFO, logger="dispatchd.checkpoints"):
        outcomes = journal.finish_all(str(state / "checkpoints"))
    assert [(o.session, o.why) for o in outcomes] == [("s1", outcomes[0].why)] and outcomes[0].why
    assert _tree(str(tmp_path)) == seen  # nothing written, nothing removed
    assert f"why={why!r}" in caplog.text or f"why={why!r}"[:-1] in caplog.text, caplog.text
    assert (top / journal.RECORD).exists()


def test_a_restore_bound_to_a_directory_writes_nowhere_else(state, tmp_path):
    """The identity is checked on the descriptor the restore then works
    through: another directory put at the path is refused, untouched."""
    store = cp.Store(str(state), str(state / "keep"))
    wt = _worktree(tmp_path)
    info = store.take("s1", wt, POLICY)
    manifest = store.find("s1", info.id)
    _change(wt)
    now, _ = cp.list_tree(wt, POLICY, "restore")
    plan = cp.plan_restore(manifest.entries, now)
    top = str(state / "checkpoints" / "s1")
    mine = os.stat(wt)
    os.rename(wt, f"{wt}-moved")
    shutil.copytree(f"{wt}-moved", wt, symlinks=True)  # another directory, the same contents
    other = _tree(wt)
    with pytest.raises(CheckpointError, match="restore stopped: another directory is at .* nothing was written"):
        apply_restore(wt, top, plan, expect=(mine.st_dev, mine.st_ino))
    assert _tree(wt) == other
    # The twin: bound to the directory that is there, it is restored.
    there = os.stat(wt)
    apply_restore(wt, top, plan, expect=(there.st_dev, there.st_ino))
    assert _tree(wt) != other


def test_a_restore_finished_at_start_is_planned_from_the_directory_it_writes_in(state, tmp_path, monkeypatch):
    """Another directory put at the worktree's path only while the finish
    lists it, then taken away: the plan is still made from the worktree
    (listed through the descriptor proven to be it), and the restore ends
    whole. Listed by the path, the plan would be the other directory's."""
    wt, cid, before = _cut_and_die(state, tmp_path, monkeypatch)
    other = tmp_path / "other"
    other.mkdir()
    (other / "decoy").write_text("not the worktree\n")
    real = journal.list_tree

    def listed_while_swapped(*args: object, **kwargs: object) -> object:
        os.rename(wt, f"{wt}-real")
        os.rename(other, wt)
        try:
            return real(*args, **kwargs)
        finally:
            os.rename(wt, other)
            os.rename(f"{wt}-real", wt)
    monkeypatch.setattr(journal, "list_tree", listed_while_swapped)
    cp.finish_restores(str(state))
    assert _tree(wt) == before
    assert not (state / "checkpoints" / "s1" / journal.RECORD).exists()
    assert _tree(str(other)) == {"decoy": ("f", 0o644 & ~_umask(), b"not the worktree\n")}


def test_a_listing_bound_to_a_descriptor_lists_that_directory_not_the_path(tmp_path):
    wt = _worktree(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    (other / "decoy").write_text("x\n")
    fd = os.open(wt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        bound, _ = cp.list_tree(str(other), POLICY, "restore", root_fd=fd)
    finally:
        os.close(fd)
    by_path, _ = cp.list_tree(str(other), POLICY, "restore")
    paths = {e.path for e in bound}
    assert {os.fsencode(p) for p in _tree(wt)} <= paths and b"decoy" not in paths
    assert b"decoy" in {e.path for e in by_path}  # the twin: by path, the path's directory


def test_a_cut_restore_is_not_finished_under_another_daemon_s_session(state, tmp_path, monkeypatch, caplog):
    """Another daemon on the state directory has a session on the worktree
    (daemon/inuse.py): finishing the restore would write under it; the
    record is kept for the next start. The twin: once that session has
    ended, the restore is finished, the worktree claimed meanwhile."""
    from dispatchd.daemon.inuse import InUse

    store, wt, cid, before = _failed_restore(state, tmp_path, monkeypatch)
    _die(store, "s1")
    half = _tree(wt)
    other, mine = InUse(str(state / "inuse"), pid=222), InUse(str(state / "inuse"), pid=111)
    assert other.claim("t1", wt, "") == (None, [])
    with caplog.at_level(logging.INFO, logger="dispatchd.checkpoints"):
        said = cp.finish_restores(str(state), mine)
    assert said == [(wt, f"the restore of checkpoint {cid}, cut short by a daemon's death, was not finished: "
                         f"session t1 of another dispatchd (pid 222) uses {wt}; the worktree is left as it was "
                         f"found and the checkpoint kept in {state / 'checkpoints' / 's1'} (each start tries "
                         "again; remove that directory to give up)")]
    assert _tree(wt) == half and (state / "checkpoints" / "s1" / journal.RECORD).exists()
    other.release("t1")
    real = journal.apply_restore
    during: list[object] = []

    def watched(*args: object, **kwargs: object) -> dict[str, int]:
        during.append(other.claim("t2", wt, "")[0])  # another daemon's open meanwhile: refused
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(journal, "apply_restore", watched)
    assert cp.finish_restores(str(state), mine) == [
        (wt, f"the restore of checkpoint {cid}, cut short by a daemon's death, was finished")]
    assert len(during) == 1 and during[0] is not None and during[0].session == "restore-s1"
    assert _tree(wt) == before
    assert not [n for n in os.listdir(state / "inuse") if (state / "inuse" / n).read_text().strip()]  # released


@pytest.mark.process
def test_a_cut_restore_waits_for_another_daemon_s_session_on_a_worktree_of_its_repository(state, tmp_path,
                                                                                          monkeypatch):
    """The restore puts objects back from the keep, which another daemon's
    open of a linked worktree of the same repository records anew: its claim
    names the repository too. The twin: a session elsewhere does not stop it."""
    import subprocess

    from dispatchd.daemon.inuse import InUse

    store = cp.Store(str(state), str(state / "keep"))
    wt = _worktree(tmp_path)
    subprocess.run(["git", "init", "-q", wt], check=True, timeout=30)
    info = store.take("s1", wt, POLICY)
    _change(wt)
    _cut(monkeypatch)
    with pytest.raises(CheckpointError):
        store.restore("s1", wt, info.id, POLICY)
    monkeypatch.undo()
    _die(store, "s1")
    other, mine = InUse(str(state / "inuse"), pid=222), InUse(str(state / "inuse"), pid=111)
    common = os.path.realpath(os.path.join(wt, ".git"))
    assert other.claim("t1", str(tmp_path / "linked"), common)[0] is None
    (said,) = cp.finish_restores(str(state), mine)
    assert f"session t1 of another dispatchd (pid 222) uses {tmp_path / 'linked'}" in said[1]
    other.release("t1")
    assert other.claim("t2", str(tmp_path / "elsewhere"), "")[0] is None
    assert cp.finish_restores(str(state), mine) == [
        (wt, f"the restore of checkpoint {info.id}, cut short by a daemon's death, was finished")]


def _displaced(wt: str) -> list[str]:
    return git(Path(wt), "for-each-ref", "--format=%(refname) %(objectname)", "refs/dispatchd/").split("\n")[:-1]


@pytest.mark.process
@pytest.mark.parametrize("older", [False, True])
def test_a_restore_cut_after_it_kept_the_moved_refs_keeps_them_once_when_finished(state, tmp_path, monkeypatch,
                                                                                  older):
    """The daemon dies after the restore kept the refs it moved, before its
    record went. The finish leaves them (a restore never removes a kept
    value) and finds main restored already: one set, those names. The twin:
    a record of an older daemon (no time in it, its refs written as files)
    is finished all the same, the refs it moved kept as that daemon kept
    them, under the finish's time."""
    wt = _worktree(tmp_path)
    git(Path(wt), "init", "-q", "-b", "main")
    git(Path(wt), "add", "d0")
    git(Path(wt), "commit", "-qm", "one")
    one = git(Path(wt), "rev-parse", "main").strip()
    store = cp.Store(str(state), str(state / "keep"))
    info = store.take("s1", wt, POLICY)
    Path(wt, "d0", "f00").write_text("mine\n")
    git(Path(wt), "commit", "-qam", "two")  # the user's commit beside the session
    two = git(Path(wt), "rev-parse", "main").strip()

    def killed(top: str, fd: int, sync: object) -> None:  # the death: its lock dropped, the record left
        os.close(fd)
        raise CheckpointError("killed", "restore_failed")

    monkeypatch.setattr(journal, "done", killed)
    with pytest.raises(CheckpointError):
        store.restore("s1", wt, info.id, POLICY)
    monkeypatch.undo()
    path = state / "checkpoints" / "s1" / journal.RECORD
    r = journal.decode(path.read_bytes())
    assert _displaced(wt) == [f"refs/dispatchd/displaced/{r.stamp}/refs/heads/main {two}"]  # kept by the cut run
    if older:
        data = json.loads(path.read_bytes())
        del data["stamp"], data["refs_under_lock"]
        path.write_text(json.dumps(data))
    monkeypatch.setattr(reftemp, "stamp", lambda: "20990101T000000")  # the finish's time: not the cut run's
    assert cp.finish_restores(str(state)) == [
        (wt, f"the restore of checkpoint {info.id}, cut short by a daemon's death, was finished")]
    kept = [f"refs/dispatchd/displaced/{r.stamp}/refs/heads/main {two}"]
    if older:  # its refs were files, not kept as they moved: kept again as that daemon did, at the finish's time
        kept.append(f"refs/dispatchd/displaced/20990101T000000/refs/heads/main {two}")
    assert _displaced(wt) == kept
    assert git(Path(wt), "rev-parse", "main").strip() == one
    assert not path.exists()


def test_a_killed_daemon_s_locks_of_git_s_files_are_not_someone_s_work():
    """A restore killed while it rewrote packed-refs left its temporary and
    the lock beside it: counted as changed since, they kept the restore from
    ever finishing, and a tag's lock of two names blocked the user's git."""
    start = 1000
    saved = [E(path=b"", kind="d", mode=0o755), E(path=b".git", kind="d", mode=0o755)]
    now = [*saved,
           f(b".git/packed-refs.dispatchd-4fd84fc4028752ad.lock", 2000),
           f(b".git/packed-refs.lock", 2000, ino=2)]
    assert journal.changed_since(saved, now, start) == []
    # The twin: a lock with no temporary of ours beside it is a running git's, someone's work.
    assert journal.changed_since(saved, [*saved, f(b".git/packed-refs.lock", 2000, ino=2)], start) == [
        b".git/packed-refs.lock"]
