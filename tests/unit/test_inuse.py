"""dispatchd.daemon.inuse: the worktrees every daemon on one state directory
has sessions on. Two ``InUse`` on one directory stand for two daemons (their
flocks are on descriptors of their own, so they exclude each other within
one process as across two); a daemon killed is a child process that ends."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from dispatchd.daemon import inuse
from dispatchd.daemon.inuse import InUse, Use

REPO = "/home/u/repo/.git"


def _two(tmp_path: Path) -> tuple[InUse, InUse]:
    return InUse(str(tmp_path / "u"), pid=111), InUse(str(tmp_path / "u"), pid=222)


def _claims(d: Path) -> dict[str, str]:
    """The sessions the entries in ``d`` hold, by file name (spares hold none)."""
    return {n: json.loads(text)["session"] for n in os.listdir(d) if n.endswith(".uses")
            if (text := (d / n).read_text()).strip()}


def test_another_daemon_s_session_is_refused_and_named(tmp_path: Path) -> None:
    a, b = _two(tmp_path)
    before = time.time()
    assert a.claim("s1", "/home/u/repo", REPO) == (None, [])
    other, dead = b.claim("s2", "/home/u/repo", REPO)
    assert other is not None and dead == []
    assert (other.session, other.pid, other.worktree, other.common) == ("s1", 111, "/home/u/repo", REPO)
    assert before <= other.since <= time.time()
    assert [n for n in os.listdir(tmp_path / "u") if n.startswith(b.token)] == []  # nothing of b's recorded
    assert list(_claims(tmp_path / "u").values()) == ["s1"]


def test_an_entry_not_the_user_s_is_never_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry another user made while the table's mode let others write
    there (a session's chmod in degraded mode): not read, so it can neither
    refuse an open nor name a state directory for a recovery to read."""
    a, b = _two(tmp_path)
    assert a.claim("s1", "/home/u/repo", REPO) == (None, [])
    real = os.getuid()
    monkeypatch.setattr(inuse.os, "getuid", lambda: real + 1)  # as if every entry were another user's
    assert b.claim("s2", "/home/u/repo", REPO) == (None, [])
    monkeypatch.setattr(inuse.os, "getuid", lambda: real)
    b.release("s2")
    other, _ = b.claim("s3", "/home/u/repo", REPO)  # the twin: the user's own entry refuses it
    assert other is not None and other.session == "s1"


@pytest.mark.parametrize(("path", "common", "refused"), [
    ("/home/u/repo", REPO, True),
    ("/home/u/repo/sub", REPO, True),  # inside
    ("/home/u", "", True),  # around
    ("/", "", True),
    ("/home/u/linked", REPO, True),  # another worktree of the same repository
    ("/home/u/repo2", "/home/u/repo2/.git", False),  # a sibling with a shared prefix
    ("/home/v", "", False),
], ids=["same", "inside", "around", "root", "same_repository", "sibling_with_shared_prefix", "elsewhere"])
def test_a_claim_is_refused_when_related(tmp_path: Path, path: str, common: str, refused: bool) -> None:
    a, b = _two(tmp_path)
    assert a.claim("s1", "/home/u/repo", REPO)[0] is None
    assert (b.claim("s2", path, common)[0] is not None) is refused


def test_a_release_lets_the_other_daemon_claim_and_leaves_no_file(tmp_path: Path) -> None:
    a, b = _two(tmp_path)
    assert a.claim("s1", "/home/u/repo", REPO)[0] is None
    assert b.claim("s2", "/home/u/repo", REPO)[0] is not None
    a.release("s1")
    assert b.claim("s2", "/home/u/repo", REPO) == (None, [])
    assert list(_claims(tmp_path / "u").values()) == ["s2"]
    b.release("s2")
    b.release("s2")  # a no-op
    assert _claims(tmp_path / "u") == {}  # each entry kept as a spare (spaces): nothing claimed
    assert sorted(n.split(".")[0] for n in os.listdir(tmp_path / "u") if n.endswith(".uses")) == \
        sorted([a.token, b.token])


def test_a_claim_writes_a_spare_in_place_and_its_release_gives_it_back(tmp_path: Path) -> None:
    """No file is made on an open's path: the spares ``prepare`` made are
    written, and given back; beyond ``SPARES`` an entry goes with its session."""
    a, b = _two(tmp_path)
    a.prepare()
    spares = sorted(os.listdir(tmp_path / "u"))
    assert len(spares) == inuse.SPARES + 1 and all((tmp_path / "u" / n).stat().st_size == inuse.SIZE
                                                    for n in spares if n != ".mutex")
    sessions = [f"s{i}" for i in range(inuse.SPARES + 2)]
    for i, sid in enumerate(sessions):
        assert a.claim(sid, f"/home/u/w{i}", "")[0] is None
    assert sorted(_claims(tmp_path / "u").values()) == sessions
    assert set(spares) <= set(os.listdir(tmp_path / "u"))  # the spares were written, two files made beyond
    other = b.claim("t", "/home/u/w3/sub", "")[0]  # a spare written is a claim like any other
    assert other is not None and other.session == "s3"
    for sid in sessions:
        a.release(sid)
    assert _claims(tmp_path / "u") == {}
    assert len([n for n in os.listdir(tmp_path / "u") if n.endswith(".uses")]) == inuse.SPARES


def test_a_daemon_s_own_sessions_are_left_to_its_baselines(tmp_path: Path) -> None:
    a = InUse(str(tmp_path / "u"), pid=111)
    assert a.claim("s1", "/home/u/repo", REPO)[0] is None
    assert a.claim("s2", "/home/u/repo", REPO)[0] is None


def _killed_daemon_using(directory: Path, worktree: str) -> int:
    """A child that claims ``worktree``, says so, and sleeps until killed: its pid."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            InUse(str(directory), pid=os.getpid()).claim("dead", worktree, "")
            os.write(w, b"x")
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"x"
    os.close(r)
    return pid


@pytest.mark.process
def test_a_killed_daemon_s_entry_is_listed_dead_until_forgotten(tmp_path: Path) -> None:
    pid = _killed_daemon_using(tmp_path / "u", "/home/u/repo")
    b = InUse(str(tmp_path / "u"), pid=222)
    try:
        other = b.claim("s2", "/home/u/repo", "")[0]
        assert other is not None and other.pid == pid  # the twin: alive, it is in use
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    name = f"{pid}-"
    assert b.claim("s3", "/elsewhere", "") == (None, [])  # dead, but unrelated: not listed
    other, dead = b.claim("s2", "/home/u/repo/sub", "")
    assert other is None and len(dead) == 1 and dead[0][0].startswith(name)
    (entry, use), = dead  # what the entry says, as read (the claim's caller reads it no second time)
    assert (use.session, use.pid, use.worktree) == ("dead", pid, "/home/u/repo") and dead == b.dead()
    assert json.loads((tmp_path / "u" / entry).read_text())["session"] == "dead"
    assert (tmp_path / "u" / entry).exists()  # kept until its baselines are checked
    b.release("s2")
    assert b.claim("s2", "/home/u/repo", "")[1] == dead  # still listed to the next claim
    b.forget_dead([entry])
    assert not (tmp_path / "u" / entry).exists()


def test_forget_dead_leaves_a_live_entry(tmp_path: Path) -> None:
    a, b = _two(tmp_path)
    assert a.claim("s1", "/home/u/repo", "")[0] is None
    assert b.dead() == []
    b.forget_dead([f"{a.token}.s1.uses"])
    assert b.claim("s2", "/home/u/repo", "")[0] is not None


@pytest.mark.process
def test_a_start_notes_the_dead_entries(tmp_path: Path) -> None:
    pid = _killed_daemon_using(tmp_path / "u", "/home/u/repo")
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    b = InUse(str(tmp_path / "u"), pid=222)
    (name, use), = b.dead()
    assert name.startswith(f"{pid}-") and (use.session, use.pid, use.worktree) == ("dead", pid, "/home/u/repo")
    b.forget_dead([name])
    assert b.dead() == []


def test_an_entry_released_while_it_is_looked_at_is_gone_not_dead(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A release that cannot have the mutex (another daemon looking) unlinks,
    then unlocks, outside it: a look that opened the entry before and locks
    it after finds it unlinked, and counts it gone (a dead one would have its
    daemon's remains finished again)."""
    monkeypatch.setattr(inuse, "MUTEX_WAIT_S", 0.05)
    a, b = _two(tmp_path)
    assert a.claim("s1", "/home/u/repo", "")[0] is None
    real = fcntl.flock

    def flock(fd: int, op: int) -> None:
        if op == fcntl.LOCK_SH | fcntl.LOCK_NB:
            a.release("s1")  # between the look's open and its lock
        real(fd, op)

    monkeypatch.setattr(inuse.fcntl, "flock", flock)
    assert b.claim("s2", "/home/u/repo", "") == (None, [])


def test_an_entry_a_killed_daemon_left_half_made_or_spare_is_removed(tmp_path: Path) -> None:
    """Made, not yet locked nor written (or a spare of spaces): no session's,
    so nothing to finish. The twin: a dead entry holding a session is kept."""
    d = tmp_path / "u"
    d.mkdir()
    (d / "999-00000000.0.uses").write_text("")
    (d / "999-00000000.1.uses").write_text(" " * inuse.SIZE)
    (d / "999-00000000.2.uses").write_text(json.dumps({"session": "x", "pid": 999, "worktree": "/elsewhere",
                                                       "since": 0.0}))
    b = InUse(str(d), pid=222)
    assert b.claim("s2", "/home/u/repo", "") == (None, [])
    assert sorted(n for n in os.listdir(d) if n.startswith("999-")) == ["999-00000000.2.uses"]


def test_a_locked_entry_that_cannot_be_read_refuses_every_claim(tmp_path: Path) -> None:
    d = tmp_path / "u"
    d.mkdir()
    path = d / "999-00000000.0.uses"
    path.write_text("not json")
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    b = InUse(str(d), pid=222)
    try:
        assert b.claim("s2", "/anywhere/at/all", "")[0] == Use("?", 0, "/", 0.0)
    finally:
        os.close(fd)
    # The twin: unlocked, a dead entry, read as standing for every worktree.
    assert b.claim("s2", "/anywhere/at/all", "") == (None, [("999-00000000.0.uses", Use("?", 0, "/", 0.0))])


def test_the_mutex_held_too_long_is_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = InUse(str(tmp_path / "u"), pid=111)
    assert a.claim("s1", "/x", "")[0] is None
    fd = os.open(tmp_path / "u" / ".mutex", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    monkeypatch.setattr(inuse, "MUTEX_WAIT_S", 0.05)
    try:
        with pytest.raises(OSError, match=r"the table of worktrees in use .* is held by another daemon for over "
                                          r"0.05 s"):
            a.claim("s2", "/y", "")
    finally:
        os.close(fd)
    assert a.claim("s2", "/y", "")[0] is None


def test_the_directory_removed_and_made_again_is_locked_anew(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon that kept locking the old mutex would exclude no one."""
    monkeypatch.setattr(inuse, "MUTEX_WAIT_S", 0.05)
    a = InUse(str(tmp_path / "u"), pid=111)
    assert a.claim("s1", "/x", "")[0] is None
    a.release("s1")
    shutil.rmtree(tmp_path / "u")
    (tmp_path / "u").mkdir()
    fd = os.open(tmp_path / "u" / ".mutex", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another daemon, in the new one
    try:
        with pytest.raises(OSError, match="held by another daemon"):
            a.claim("s2", "/y", "")
    finally:
        os.close(fd)
    assert a.claim("s2", "/y", "")[0] is None


def test_a_directory_out_of_reach_raises(tmp_path: Path) -> None:
    """Its parent cannot be searched (not the daemon's to change): the claim fails."""
    if os.geteuid() == 0:
        pytest.fail("run the unit tests as an ordinary user: root writes anywhere (./scripts/test)")
    (tmp_path / "p" / "u").mkdir(parents=True)
    (tmp_path / "p").chmod(0o600)
    try:
        with pytest.raises(PermissionError):
            InUse(str(tmp_path / "p" / "u"), pid=111).claim("s1", "/x", "")
    finally:
        (tmp_path / "p").chmod(0o700)


def test_an_unwritable_directory_is_set_back_and_the_claim_made(tmp_path: Path) -> None:
    """The daemon's own directory, its mode changed (a degraded session's
    chmod): set back (statemodes.py), and the claim goes through."""
    (tmp_path / "u").mkdir(mode=0o500)
    assert InUse(str(tmp_path / "u"), pid=111).claim("s1", "/x", "")[0] is None
    assert (tmp_path / "u").stat().st_mode & 0o777 == 0o700


def test_an_entry_written_short_is_not_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A short write (the file system full) fails the claim: an entry cut
    short would be read by the others as one that relates to everything."""
    a, b = _two(tmp_path)
    real = os.pwrite
    monkeypatch.setattr(inuse.os, "pwrite", lambda fd, data, at: real(fd, data[:5], at))
    with pytest.raises(OSError, match="a short write"):
        a.claim("s1", "/home/u/repo", "")
    monkeypatch.undo()
    assert not [n for n in os.listdir(tmp_path / "u") if ".s1." in n]
    assert b.claim("s2", "/home/u/repo", "") == (None, [])  # the twin: nothing of a's relates


def test_an_entry_of_its_own_it_could_not_remove_is_made_again(tmp_path: Path) -> None:
    a = InUse(str(tmp_path / "u"), pid=111)
    assert a.claim("s0", "/x", "")[0] is None  # the directory exists; its entry .0
    (tmp_path / "u" / f"{a.token}.1.uses").write_text("{}")  # left unlocked: an unlink that failed
    assert a.claim("s1", "/home/u/repo", "")[0] is None  # made as .1
    assert json.loads((tmp_path / "u" / f"{a.token}.1.uses").read_text())["worktree"] == "/home/u/repo"


def test_a_spare_whose_write_failed_half_way_is_no_claim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page half written would read as an entry that cannot be read, which
    relates to every worktree: the spare is written back to spaces (or
    removed). The twin, the write whole: a claim."""
    a, b = _two(tmp_path)
    a.prepare()
    real = os.pwrite
    calls: list[int] = []

    def half(fd: int, data: bytes, at: int) -> int:
        calls.append(len(data))
        return real(fd, data[:5], at) if len(calls) == 1 else real(fd, data, at)  # the claim's write only

    monkeypatch.setattr(inuse.os, "pwrite", half)
    with pytest.raises(OSError, match="a short write"):
        a.claim("s1", "/home/u/repo", "")
    monkeypatch.undo()
    assert _claims(tmp_path / "u") == {}
    assert b.claim("s2", "/elsewhere", "") == (None, [])
    assert a.claim("s1", "/home/u/repo", "")[0] is None
    assert list(_claims(tmp_path / "u").values()).count("s1") == 1


def test_a_release_rewrites_its_entry_only_under_the_mutex(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every reader holds the mutex: a page rewritten while one reads could be
    read half old, half new. A release that cannot have the mutex removes
    its entry instead of keeping it as a spare; the twin, with it, keeps it."""
    monkeypatch.setattr(inuse, "MUTEX_WAIT_S", 0.05)
    a = InUse(str(tmp_path / "u"), pid=111)
    for sid in ("s1", "s2"):
        assert a.claim(sid, f"/home/u/{sid}", "")[0] is None
    a.release("s1")  # the twin: kept, spaces
    assert len([n for n in os.listdir(tmp_path / "u") if n.endswith(".uses")]) == 2
    fd = os.open(tmp_path / "u" / ".mutex", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another daemon, looking
    try:
        a.release("s2")
    finally:
        os.close(fd)
    assert len([n for n in os.listdir(tmp_path / "u") if n.endswith(".uses")]) == 1
    assert _claims(tmp_path / "u") == {}


def test_a_dead_entry_that_cannot_be_read_is_marked(tmp_path: Path) -> None:
    """It may stand for any worktree: the open that finds it checks every
    record a dead daemon left (daemon/claims.py), not the related ones only."""
    d = tmp_path / "u"
    d.mkdir()
    (d / "999-00000000.0.uses").write_text("{not json")
    (d / "999-00000000.1.uses").write_text(json.dumps({"session": "x", "pid": 999, "worktree": "/w", "since": 0.0}))
    b = InUse(str(d), pid=222)
    other, dead = b.look("/w", "")
    assert other is None and sorted(name for name, _ in dead) == ["999-00000000.0.uses", "999-00000000.1.uses"]
    assert b.unreadable == {"999-00000000.0.uses"}


def test_a_use_longer_than_a_page_gets_a_file_of_its_own(tmp_path: Path) -> None:
    a, b = _two(tmp_path)
    a.prepare()
    deep = "/home/u/" + "/".join(["d" * 200] * 30)  # 6 KB of path: more than a page of JSON
    assert a.claim("s1", deep, "")[0] is None
    other = b.claim("s2", deep + "/sub", "")[0]
    assert other is not None and other.session == "s1" and other.worktree == deep
    before = len(os.listdir(tmp_path / "u"))
    a.release("s1")  # not kept as a spare: removed
    assert len(os.listdir(tmp_path / "u")) == before - 1 and _claims(tmp_path / "u") == {}


def test_a_claim_made_between_a_look_and_a_record_refuses_the_record(tmp_path: Path) -> None:
    """The open looks on its path and records beside the sandbox's start:
    the record looks again, under the same flock as it writes."""
    a, b = _two(tmp_path)
    assert a.look("/home/u/repo", "") == (None, [])
    assert b.claim("t", "/home/u/repo/sub", "")[0] is None  # another daemon's, meanwhile
    other = a.claim("s", "/home/u/repo", "")[0]
    assert other is not None and other.session == "t"
    assert list(_claims(tmp_path / "u").values()) == ["t"]


def test_spares_removed_with_the_directory_are_not_written(tmp_path: Path) -> None:
    """A claim written into an entry nobody can see any more would be no
    claim: the directory removed while the daemons run, the next claim makes
    a new entry, and the other daemon sees it. The twin: its release keeps
    no removed entry as a spare."""
    a, b = _two(tmp_path)
    a.prepare()
    shutil.rmtree(tmp_path / "u")
    assert a.claim("s1", "/w", "")[0] is None
    other = b.look("/w", "")[0]
    assert other is not None and other.session == "s1"
    a.release("s1")
    assert b.look("/w", "") == (None, [])
    assert all(os.fstat(fd).st_nlink == 1 for _, fd in a._spares)


def test_a_worktree_left_refused_is_claimed_once_however_many_sessions_end_near_it(tmp_path: Path) -> None:
    """A failed end's check leaves the worktree refused while the daemon
    runs: the other daemons must refuse it too, by one entry of its own;
    each session's entry goes as usual (none kept for ever, one per
    session: descriptors and files without bound)."""
    from types import SimpleNamespace

    from dispatchd.daemon import claims

    from dispatchd.daemon.gitguard.taints import Taints

    a, b = _two(tmp_path)
    taints = Taints()
    taints.fail(["/repo"], "a file that could not be moved aside", final=True)
    baselines = SimpleNamespace(tainted=taints.why, taints=taints)
    for i in range(20):
        assert a.claim(f"s{i}", "/repo/sub", "")[0] is None
        claims.release(a, baselines, SimpleNamespace(id=f"s{i}", worktree="/repo/sub"),  # type: ignore[arg-type]
                       lambda job: job())
    assert list(_claims(tmp_path / "u").values()) == ["unchecked-" + hashlib.sha256(b"/repo").hexdigest()[:12]]
    assert len(a._fds) == 1
    other = b.claim("t", "/repo/other", "")[0]  # refused, as this daemon refuses it
    assert other is not None and other.worktree == "/repo"
    assert b.claim("t", "/elsewhere", "")[0] is None  # the twin


def test_a_refusal_the_last_end_lifted_gives_its_entry_back(tmp_path: Path) -> None:
    """A check beside a live session of the domain failed (``taints``): the
    worktree is refused, to the other daemons too, until the domain's last
    end passes; then its entry goes with that session's own."""
    from types import SimpleNamespace

    from dispatchd.daemon import claims
    from dispatchd.daemon.gitguard.taints import Taints

    a, b = _two(tmp_path)
    taints = Taints()
    baselines = SimpleNamespace(tainted=taints.why, taints=taints)
    for sid in ("s1", "s2"):
        assert a.claim(sid, "/repo", "")[0] is None
    taints.fail(["/repo"], "a hook that could not be put back", final=False)
    claims.release(a, baselines, SimpleNamespace(id="s1", worktree="/repo"),  # type: ignore[arg-type]
                   lambda job: job())  # the first end, beside s2
    assert sorted(_claims(tmp_path / "u").values()) == ["s2", "unchecked-" + hashlib.sha256(b"/repo").hexdigest()[:12]]
    taints.lift(["/repo"])  # the last end passed
    claims.release(a, baselines, SimpleNamespace(id="s2", worktree="/repo"),  # type: ignore[arg-type]
                   lambda job: job())
    assert _claims(tmp_path / "u") == {} and a._fds == {}
    assert b.claim("t", "/repo", "")[0] is None  # opens through another daemon again


def test_an_entry_names_its_daemon_s_state_directory(tmp_path: Path) -> None:
    """Where a related open finds a dead daemon's baselines, whatever its
    own state directory (the table is every daemon's of the user)."""
    a = InUse(str(tmp_path / "u"), pid=111, state="/home/u/.other-state/dispatchd")
    b = InUse(str(tmp_path / "u"), pid=222, state="/home/u/.local/state/dispatchd")
    assert a.claim("s1", "/home/u/repo", "")[0] is None
    other = b.claim("s2", "/home/u/repo", "")[0]
    assert other is not None and other.state == "/home/u/.other-state/dispatchd"
    (text,) = [t for n in os.listdir(tmp_path / "u")
               if n.endswith(".uses") and (t := (tmp_path / "u" / n).read_text()).strip()]
    legacy = json.loads(text)
    del legacy["state"]  # a daemon that kept the table in its state directory: its parent
    (tmp_path / "u" / "999-00000000.0.uses").write_text(json.dumps(legacy).ljust(inuse.SIZE))
    (name, use), = b.dead()
    assert name == "999-00000000.0.uses" and use.state == str(tmp_path)


def test_a_start_forgets_only_what_it_could_check(tmp_path: Path) -> None:
    """A start checks its own state directory's records: the dead entries
    of daemons on another are left to a related open (or a start there),
    but those whose state directory is gone, which nothing could check."""
    from dispatchd.daemon import claims
    from dispatchd.daemon.gitguard import Baselines

    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    mine.mkdir()
    theirs.mkdir()
    dead = [("own.uses", Use("s1", 1, "/w1", 0.0, "", str(mine))),
            ("spelled.uses", Use("s2", 2, "/w2", 0.0, "", str(tmp_path / "." / "mine"))),
            ("theirs.uses", Use("s3", 3, "/w3", 0.0, "", str(theirs))),
            ("gone.uses", Use("s4", 4, "/w4", 0.0, "", str(tmp_path / "gone"))),
            ("unreadable.uses", Use("?", 0, "/", 0.0))]
    assert claims.finished(dead, Baselines(str(mine)), str(mine)) == ["own.uses", "spelled.uses", "gone.uses",
                                                                       "unreadable.uses"]
