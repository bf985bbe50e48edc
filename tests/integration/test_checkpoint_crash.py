"""A restore cut half way by the daemon's death (a real SIGKILL) is finished
by the next daemon on the same state directory, before it serves; a daemon
killed with no restore running leaves the worktree as it was; a record whose
worktree was replaced leaves that directory untouched and says why
(dispatchd/daemon/checkpoints/journal.py, docs/checkpoints.md)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import dispatch
from dispatchd.daemon.checkpoints import journal
from tests.conftest import Daemon, _refuse_root, shell
from tests.integration.test_checkpoints import git, snapshot

PER_DIR = 200
ATTEMPTS = 3  # a bigger tree each time the kill came too early or too late


def _daemon(base: Path) -> Daemon:
    base.mkdir(parents=True, exist_ok=True)
    return Daemon(base, "--cgroup", "off")


def _name(i: int) -> str:
    return f"d{i // PER_DIR:03d}/f{i:05d}"


def _worktree(root: Path, n: int) -> Path:
    wt = Path(os.path.realpath(root)) / "wt"
    for i in range(n):
        p = wt / _name(i)
        if i % PER_DIR == 0:
            p.parent.mkdir(parents=True)
        p.write_text(f"original {i}\n")
    (wt / "README").write_text("readme\n")
    git(wt, "init", "-q", "-b", "main")
    git(wt, "config", "user.email", "user@example.invalid")
    git(wt, "config", "user.name", "user")
    git(wt, "add", "README")
    git(wt, "commit", "-qm", "init")
    return wt


def _change(wt: Path, n: int) -> None:
    """Every file changed, one in ten deleted, new files and directories, a commit."""
    for i in range(n):
        p = wt / _name(i)
        if i % 10 == 3:
            p.unlink()
        else:
            p.write_text(f"changed {i}\n")
    for j in range(50):
        (wt / "made" / f"m{j % 5}").mkdir(parents=True, exist_ok=True)
        (wt / "made" / f"m{j % 5}" / f"n{j}").write_text("new\n")
        (wt / f"d000/new{j}").write_text("new\n")
    (wt / "README").write_text("readme, changed\n")
    git(wt, "commit", "-qam", "change")


def _is_back(wt: Path, i: int) -> bool:
    try:
        return (wt / _name(i)).read_text() == f"original {i}\n"
    except FileNotFoundError:
        return False


def _cut_part_way(s: dispatch.Session, cid: str, wt: Path, n: int, cut: Callable[[], object],
                  caught: type[Exception]) -> list[object]:
    """Restore ``cid`` on a thread and ``cut`` it part-way (files are written
    back in path order: once an early one is back and the last one is not
    yet); returns the restore's reply or what it raised (``caught``), once
    its thread has ended (empty if it never did)."""
    outcome: list[object] = []

    def restore() -> None:
        try:
            outcome.append(s.restore(cid))
        except caught as exc:
            outcome.append(exc)

    thread = threading.Thread(target=restore)
    thread.start()
    early, last = n // 20 + 1, n - 1
    deadline = time.monotonic() + 120
    while not outcome and time.monotonic() < deadline:
        if _is_back(wt, early) and not _is_back(wt, last):
            cut()
            break
        time.sleep(0.001)
    thread.join(120)
    return outcome


def _checkpoints(d: Daemon) -> Path:
    return d.state / "dispatchd" / "checkpoints"


def test_a_restore_cut_by_sigkill_is_finished_at_the_next_start(tmp_path: Path) -> None:
    _refuse_root()
    n = 3000
    for attempt in range(ATTEMPTS):
        root = tmp_path / f"a{attempt}"
        wt = _worktree(root, n)
        d = _daemon(root / "d")
        with d.connect() as client:
            s = client.open_session(str(wt))
            cid = s.checkpoint()
            before = snapshot(wt)
            _change(wt, n)
            change = git(wt, "rev-parse", "main").strip()  # a commit made beside the session, by hand
            # The daemon's death: the connection goes, whatever the call raises.
            outcome = _cut_part_way(s, cid, wt, n, lambda: d.proc.send_signal(signal.SIGKILL), Exception)
            d.proc.wait()
            s.detach()
        d.stop()
        changed = [i for i in range(n)]
        back = sum(_is_back(wt, i) for i in changed)
        sid = s.id
        record = _checkpoints(d) / sid / journal.RECORD
        if outcome and isinstance(outcome[0], dict) or back in (0, len(changed)) or not record.exists():
            print(f"attempt {attempt}: {n} files, {back} back, record {record.exists()}: again, bigger")
            n *= 2  # the kill came too late (or too early): a bigger tree
            continue
        # Really cut: some files back, others not, and the record on disk.
        assert 0 < back < len(changed)
        assert snapshot(wt) != before
        r = journal.decode(record.read_bytes())
        assert (r.session, r.checkpoint, r.worktree) == (sid, cid, str(wt))
        assert r.refs["refs/heads/main"] == change
        kept = Path(r.kept)  # made before the worktree was touched
        assert kept.parent == d.state / "dispatchd" / "before-restore"
        assert (kept / "worktree" / "README").read_text() == "readme, changed\n"
        again = Daemon(d.base, "--cgroup", "off")
        try:
            with again.connect() as client:
                # A session opened at once sees the worktree restored: the finish came before serving.
                with client.open_session(str(wt)) as after:
                    assert shell(after, "cat d000/f00001 README").output == "original 1\nreadme\n"
                said = [(p["path"], p["why"]) for p in client.status()["protected"]]
                assert (str(wt), f"the restore of checkpoint {cid}, cut short by a daemon's death, was finished; "
                                 f"what the worktree held before it is kept in {kept}") in said, said
            assert snapshot(wt) == before  # contents, deleted ones back, created ones gone, git's refs
            assert git(wt, "log", "--format=%s") == "init\n"
            git(wt, "fsck", "--no-dangling")
            assert not record.exists() and not (_checkpoints(again) / sid).exists()
            # What the restore replaced outlives the session's checkpoints: the files, and the
            # commit by a ref the finish wrote (the one the cut restore may have written went with its files).
            assert (kept / "worktree" / "made" / "m0" / "n0").read_text() == "new\n"
            assert (kept / "worktree" / _name(1)).read_text() == "changed 1\n"
            [ref] = git(wt, "for-each-ref", "--format=%(refname)", "--contains", change).split()
            assert ref == f"refs/dispatchd/displaced/{r.stamp}/refs/heads/main"  # the time the record holds
            log = again.log()
            assert f"event=restore_finished session={sid} checkpoint={cid} worktree={wt} " in log, log
            # ... and before the trusted baseline's record (the killed session's) was re-checked.
            assert log.index("event=restore_resume") < log.index("event=restore_finished") \
                < log.index("event=baseline_recover"), log
        finally:
            assert again.stop() == 0, again.log()
        return
    raise AssertionError(f"no kill landed part-way in {ATTEMPTS} attempts (last tree: {n // 2} files)")


def test_a_daemon_killed_with_no_restore_running_leaves_the_worktree_as_it_was(tmp_path: Path) -> None:
    _refuse_root()
    wt = _worktree(tmp_path, 300)
    d = _daemon(tmp_path / "d")
    with d.connect() as client:
        s = client.open_session(str(wt))
        s.checkpoint()
        _change(wt, 300)
        changed = snapshot(wt)
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        s.detach()
    d.stop()
    again = Daemon(d.base, "--cgroup", "off")
    try:
        with again.connect() as client:
            client.status()  # serving: past start-up
        assert snapshot(wt) == changed
        assert "event=restore_" not in again.log()
        assert os.listdir(_checkpoints(again)) == []  # the dead session's checkpoints went
    finally:
        assert again.stop() == 0, again.log()


def test_what_restores_replaced_is_kept_seven_days_and_swept_at_a_start(tmp_path: Path) -> None:
    """A kept pre-image older than its retention goes at the next start; the
    twin: a younger one stays, whole."""
    _refuse_root()
    wt = _worktree(tmp_path, 20)
    d = _daemon(tmp_path / "d")
    with d.connect() as client, client.open_session(str(wt)) as s:
        cid = s.checkpoint()
        (wt / "a.txt").write_text("a\n")
        old = Path(s.restore(cid)["kept"])
        (wt / "b.txt").write_text("b\n")
        young = Path(s.restore(cid)["kept"])
    assert d.stop() == 0, d.log()
    about = json.loads((old / "about.json").read_text())
    about["created"] -= 7 * 86400 + 60
    (old / "about.json").write_text(json.dumps(about))
    again = Daemon(d.base, "--cgroup", "off")
    try:
        with again.connect() as client:
            client.status()
        assert not old.exists()
        assert (young / "worktree" / "b.txt").read_text() == "b\n" and not (young / "worktree" / "a.txt").exists()
        assert f"event=before_restore_expired path={old}" in again.log()
    finally:
        assert again.stop() == 0, again.log()


def _record_cut_at_its_first_step(tmp_path: Path, n: int) -> tuple[Path, Daemon, str, str, os.stat_result, Path]:
    """A session's checkpoint, the worktree changed, the daemon killed with
    the session open, and the record a restore cut at its first step would
    have left: (worktree, the dead daemon, session id, checkpoint id, the
    worktree's stat, the session's checkpoints directory)."""
    _refuse_root()
    wt = _worktree(tmp_path, n)
    d = _daemon(tmp_path / "d")
    with d.connect() as client:
        s = client.open_session(str(wt))
        cid = s.checkpoint()
        _change(wt, n)
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        s.detach()
    d.stop()
    st = os.stat(wt)
    top = _checkpoints(d) / s.id
    (top / journal.RECORD).write_bytes(journal.encode(journal.Record(
        session=s.id, checkpoint=cid, worktree=str(wt), dev=st.st_dev, ino=st.st_ino, started_ns=time.time_ns(),
        max_files=200_000, max_depth=256)))
    return wt, d, s.id, cid, st, top


def test_a_record_whose_worktree_was_replaced_leaves_that_directory_untouched(tmp_path: Path) -> None:
    wt, d, sid, cid, st, top = _record_cut_at_its_first_step(tmp_path, 300)
    # ... and another directory at the worktree's path since.
    os.rename(wt, tmp_path / "aside")
    wt.mkdir()
    (wt / "d000").mkdir()
    (wt / "d000" / "f00001").write_text("someone else's\n")
    replaced, aside = snapshot(wt), snapshot(tmp_path / "aside")
    again = Daemon(d.base, "--cgroup", "off")
    try:
        with again.connect() as client:
            said = [(p["path"], p["why"]) for p in client.status()["protected"]]  # started all the same
        assert snapshot(wt) == replaced and snapshot(tmp_path / "aside") == aside
        # ... and says so in status until it stops. The worktree's baseline is
        # not checked against the directory there now (another one): dropped, and said.
        dropped = ("another directory than at its baseline (removed, and made or cloned anew at its path): the "
                   "baseline a daemon that stopped kept of it was dropped, and nothing of it written here")
        assert (str(wt), dropped) in said and not any(why.startswith("NOT checked whole") for _, why in said), said
        assert [why for path, why in said if path == str(wt) and why != dropped] == [
            f"the restore of checkpoint {cid}, cut short by a daemon's death, was not finished: another directory "
            f"is at the worktree's path (device {st.st_dev} inode {os.stat(wt).st_ino}, the restore began on device "
            f"{st.st_dev} inode {st.st_ino}); the "
            f"worktree is left as it was found and the checkpoint kept in {top} (each start tries again; remove "
            "that directory to give up)"], said
        log = again.log()
        assert f"event=restore_unfinished session={sid} checkpoint={cid} worktree={wt} why=\"another directory " \
               f"is at the worktree's path (device {st.st_dev} inode {os.stat(wt).st_ino}" in log, log
        # Kept for the next start (the user may put the worktree back), not removed with the old checkpoints.
        assert (top / journal.RECORD).exists() and (top / cid).exists()
    finally:
        assert again.stop() == 0, again.log()


def test_a_second_daemon_on_the_state_directory_leaves_a_live_daemons_checkpoints(tmp_path: Path) -> None:
    """A second daemon on the same state directory (its own socket) removes
    only dead daemons' checkpoints (and finishes only their restores: a live
    daemon holds the lock of its records)."""
    _refuse_root()
    wt = _worktree(tmp_path, 20)
    first = _daemon(tmp_path / "a")
    try:
        with first.connect() as client, client.open_session(str(wt)) as s:
            cid = s.checkpoint()
            top = _checkpoints(first) / s.id
            (tmp_path / "b").mkdir()
            second = Daemon(tmp_path / "b", "--cgroup", "off", state=first.state)
            try:
                with second.connect() as other:
                    other.status()
            finally:
                assert second.stop() == 0, second.log()
            assert (top / cid).exists()
            assert s.restore(cid)["checkpoint"] == cid  # the twin: its own daemon still has it
    finally:
        assert first.stop() == 0, first.log()


def test_a_failed_restore_leaves_its_record_to_its_daemon_and_restore_again_completes_it(tmp_path: Path) -> None:
    """A symlink swapped in while the restore runs (from outside the session:
    a paused session cannot) stops it half way, ELOOP, nothing written
    through; its record stays, held by the live daemon: a second daemon on
    the same state directory leaves it; "restore again" completes the
    worktree and removes it."""
    _refuse_root()
    n = 3000
    for attempt in range(ATTEMPTS):
        root = tmp_path / f"a{attempt}"
        wt = _worktree(root, n)
        d = _daemon(root / "d")
        try:
            with d.connect() as client, client.open_session(str(wt)) as s:
                cid = s.checkpoint()
                before = snapshot(wt)
                _change(wt, n)
                last = n - 1
                target = wt / _name(last).partition("/")[0]
                aside = root / "aside"

                def swap() -> None:
                    os.rename(target, aside)
                    os.symlink(aside, target)
                outcome = _cut_part_way(s, cid, wt, n, swap, dispatch.RequestFailed)
                if not (outcome and isinstance(outcome[0], dispatch.RequestFailed)):
                    n *= 2  # the swap came too late: a bigger tree
                    continue
                err = outcome[0]
                assert err.code == "restore_failed", err.message
                assert "a symlink on the way (not followed)" in err.message, err.message
                assert not any(_is_back(aside, i) for i in range(last - PER_DIR + 1, last + 1))  # not written through
                record = _checkpoints(d) / s.id / journal.RECORD
                assert record.exists()
                target.unlink()
                os.rename(aside, target)
                half = snapshot(wt)
                (root / "b").mkdir()
                second = Daemon(root / "b", "--cgroup", "off", state=d.state)
                try:
                    with second.connect() as other:
                        other.status()
                finally:
                    assert second.stop() == 0, second.log()
                assert "event=restore_resume" not in second.log()
                assert record.exists() and snapshot(wt) == half  # left to the daemon that holds it
                s.restore(cid)
                assert snapshot(wt) == before
                assert not record.exists()
        finally:
            assert d.stop() == 0, d.log()
        return
    raise AssertionError(f"no swap landed part-way in {ATTEMPTS} attempts (last tree: {n // 2} files)")


def test_a_restore_whose_baseline_was_checked_before_is_not_finished_unchecked(tmp_path: Path) -> None:
    """A restore cut short whose worktree's baseline an earlier start already
    checked and dropped (the finish was blocked then, the blocker gone
    since): finishing it now would write the checkpoint's files (a session's
    planted config, hooks, `.envrc`) with no check after. It is kept, not
    finished, and said. The twin: with the dead daemon's baseline on disk,
    the same record is finished (the tests above)."""
    wt, d, _, _, _, top = _record_cut_at_its_first_step(tmp_path, 30)
    baselines = d.state / "dispatchd" / "baselines"
    assert list(baselines.glob("*.json"))  # the dead daemon's record: the twin's case
    for record in baselines.glob("*.json"):  # what an earlier start's check did
        record.unlink()
    changed = snapshot(wt)
    again = Daemon(d.base, "--cgroup", "off")
    try:
        with again.connect() as client:
            said = [why for path, why in ((p["path"], p["why"]) for p in client.status()["protected"])
                    if path == str(wt)]
        assert snapshot(wt) == changed
        assert len(said) == 1 and "no baseline of it is left to check what the restore would write" in said[0], said
        assert (top / journal.RECORD).exists()
    finally:
        assert again.stop() == 0, again.log()


def _locks_in(gitdir: Path) -> list[str]:
    """Every lock of git's and temporary of ours in ``gitdir``."""
    return sorted(os.path.relpath(os.path.join(at, name), gitdir) for at, dirs, files in os.walk(gitdir)
                  for name in files + dirs if name.endswith(".lock") or ".dispatchd-" in name)


def test_a_restore_killed_while_it_rewrote_packed_refs_is_finished_and_leaves_no_lock(tmp_path: Path) -> None:
    """The session branched, tagged and packed its refs; its restore is
    SIGKILLed once it holds packed-refs.lock. Before, the next start took
    the killed daemon's own lock temporaries for someone's work and never
    finished the restore, and the tag's lock (a ref of the session's, in a
    directory of no ref the baseline held) refused the user's `git tag` at
    every start after."""
    _refuse_root()
    wt = Path(os.path.realpath(tmp_path)) / "wt"
    wt.mkdir()
    git(wt, "init", "-q", "-b", "main")
    (wt / "f").write_text("0\n")
    git(wt, "add", "f")
    git(wt, "-c", "user.name=u", "-c", "user.email=u@e.invalid", "commit", "-qm", "c0")
    d = _daemon(tmp_path / "d")
    with d.connect() as c:
        s = c.open_session(str(wt), detached=True)
        cid = s.checkpoint()
        made = shell(s, "git branch feature && git tag t1 && echo x > f && git pack-refs --all")
        assert made.metadata.get("exit_code") == 0, made
        lock = wt / ".git" / "packed-refs.lock"

        def kill_at_the_lock() -> None:
            deadline = time.monotonic() + 20
            while not lock.exists() and time.monotonic() < deadline and d.proc.poll() is None:
                pass
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGKILL)

        killer = threading.Thread(target=kill_at_the_lock, daemon=True)
        killer.start()
        try:
            s.restore(cid)
        except Exception:  # noqa: BLE001  # the daemon died under it
            pass
        killer.join(30)
        d.proc.wait(10)
        s.detach()  # its channel closed: the daemon is gone
    d.stop()
    again = _daemon(tmp_path / "d")  # the same state directory
    try:
        with again.connect() as c:
            c.status()
        assert _locks_in(wt / ".git") == [], again.log()[-3000:]
        assert "event=restore_unfinished" not in again.log(), again.log()[-3000:]
        assert (wt / "f").read_text() == "0\n"  # the checkpoint's
        git(wt, "tag", "-f", "t1", "HEAD")  # the user's git, no lock in its way (raises if refused)
    finally:
        assert again.stop() == 0, again.log()
