"""dispatchd.daemon.writers: the write locks of every daemon on one state
directory. Two ``Writers`` on one directory stand for two daemons (their
flocks are on descriptors of their own, so they exclude each other within
one process as across two); a daemon killed is a child process that ends."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from dispatchd.daemon import writers
from dispatchd.daemon.writelock import WriteLocks
from dispatchd.daemon.writers import Foreign, Writers


def _two(tmp_path: Path) -> tuple[Writers, Writers]:
    return Writers(str(tmp_path / "w"), pid=111), Writers(str(tmp_path / "w"), pid=222)


def test_another_daemon_s_holder_is_refused_and_named(tmp_path: Path) -> None:
    a, b = _two(tmp_path)
    before = time.time()
    assert a.grant("s1", "/home/u/wt") == (None, False)
    foreign, stands = b.grant("s2", "/home/u/wt")
    assert (foreign is not None) and not stands
    assert (foreign.session, foreign.pid, foreign.worktree, foreign.loose) == ("s1", 111, "/home/u/wt", False)
    assert before <= foreign.since <= time.time()
    # Nothing of b's was recorded: a, asking for the same again elsewhere, sees no entry of b's.
    assert [n for n in os.listdir(tmp_path / "w") if n.startswith(b.token)] == []


@pytest.mark.parametrize(("path", "refused"), [
    ("/home/u/wt", True),
    ("/home/u/wt/sub", True),  # inside the held one
    ("/home/u", True),  # around it
    ("/", True),
    ("/home/u/wt2", False),  # a sibling with a shared prefix
    ("/home/v", False),
], ids=["same", "inside", "around", "root", "sibling_with_shared_prefix", "elsewhere"])
def test_overlap_is_the_rule_within_one_daemon(tmp_path: Path, path: str, refused: bool) -> None:
    a, b = _two(tmp_path)
    assert a.grant("s1", "/home/u/wt")[0] is None
    assert (b.grant("s2", path)[0] is not None) is refused


def test_a_release_lets_the_other_daemon_write_and_leaves_no_file(tmp_path: Path) -> None:
    a, b = _two(tmp_path)
    assert a.grant("s1", "/home/u/wt")[0] is None
    assert b.grant("s2", "/home/u/wt")[0] is not None
    a.release("s1")
    assert b.grant("s2", "/home/u/wt")[0] is None
    assert sorted(n for n in os.listdir(tmp_path / "w") if not n.startswith(".")) == \
        sorted(["grants", f"{b.token}.s2.held"])


def test_one_daemon_s_own_entries_are_left_to_its_memory(tmp_path: Path) -> None:
    a = Writers(str(tmp_path / "w"), pid=111)
    assert a.grant("s1", "/home/u/wt")[0] is None
    assert a.grant("s2", "/home/u/wt")[0] is None  # writelock.py's table refuses s2 first (below)


def _killed_daemon_holding(directory: Path, worktree: str, kind: str = "held") -> int:
    """A child that records a grant, says so, and is killed: its pid."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            other = Writers(str(directory), pid=os.getpid())
            other.grant("dead", worktree)
            if kind == "loose":
                other.give_back("dead")
            os.write(w, b"x")
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"x"
    os.close(r)
    return pid


@pytest.mark.process
def test_a_killed_daemon_s_entry_counts_no_more_and_is_removed(tmp_path: Path) -> None:
    pid = _killed_daemon_holding(tmp_path / "w", "/home/u/wt")
    b = Writers(str(tmp_path / "w"), pid=222)
    try:
        foreign = b.grant("s2", "/home/u/wt")[0]
        assert foreign is not None and foreign.pid == pid  # the twin: alive, it holds
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert b.grant("s2", "/home/u/wt")[0] is None  # its flock went with it
    assert not [n for n in os.listdir(tmp_path / "w") if ".dead." in n]


def test_an_entry_a_killed_daemon_left_half_made_is_removed(tmp_path: Path) -> None:
    d = tmp_path / "w"
    d.mkdir()
    (d / "999-00000000.sx.held").write_text("")  # made, not yet locked nor written: its daemon killed
    b = Writers(str(d), pid=222)
    assert b.grant("s2", "/home/u/wt")[0] is None
    assert not (d / "999-00000000.sx.held").exists()


def test_the_directory_removed_and_made_again_is_locked_anew(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon that kept the old mutex open would exclude no one."""
    import fcntl
    import shutil
    monkeypatch.setattr(writers, "MUTEX_WAIT_S", 0.05)
    a = Writers(str(tmp_path / "w"), pid=111)
    assert a.grant("s1", "/x")[0] is None
    a.release("s1")
    shutil.rmtree(tmp_path / "w")
    (tmp_path / "w").mkdir()
    fd = os.open(tmp_path / "w" / ".mutex", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another daemon, inside the new one
    try:
        with pytest.raises(OSError, match="held by another daemon"):
            a.grant("s2", "/y")
    finally:
        os.close(fd)
    assert a.grant("s2", "/y")[0] is None


def test_a_locked_entry_that_cannot_be_read_holds_everything(tmp_path: Path) -> None:
    """Fail closed: an entry is whole before it is seen, so one that is not
    is nobody's to guess at while its daemon holds it."""
    import fcntl
    d = tmp_path / "w"
    d.mkdir()
    path = d / "999-00000000.sx.held"
    path.write_text("not json")
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    b = Writers(str(d), pid=222)
    try:
        assert b.grant("s2", "/anywhere/at/all")[0] == Foreign("?", 0, "/", 0.0)
    finally:
        os.close(fd)
    assert b.grant("s2", "/anywhere/at/all")[0] is None  # unlocked: gone
    assert not path.exists()


def test_a_loose_entry_refuses_no_grant(tmp_path: Path) -> None:
    a, b = _two(tmp_path)
    assert a.grant("s1", "/home/u/wt")[0] is None
    a.give_back("s1")
    loose = b.foreign_loose("/home/u/wt/sub")
    assert loose is not None and (loose.session, loose.pid, loose.worktree, loose.loose) == ("s1", 111, "/home/u/wt", True)
    assert not [n for n in os.listdir(tmp_path / "w") if n.endswith(".held")]  # given back: held no more
    assert b.grant("s2", "/home/u/wt")[0] is None
    a.release("s1")
    assert b.foreign_loose("/home/u/wt") is None


def test_the_mutex_held_too_long_is_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fcntl
    a = Writers(str(tmp_path / "w"), pid=111)
    assert a.grant("s1", "/x")[0] is None  # the directory and its mutex exist
    fd = os.open(tmp_path / "w" / ".mutex", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    monkeypatch.setattr(writers, "MUTEX_WAIT_S", 0.05)
    try:
        with pytest.raises(OSError, match=r"the writers' table .* is held by another daemon for over 0.05 s"):
            a.grant("s2", "/y")
    finally:
        os.close(fd)
    assert a.grant("s2", "/y")[0] is None


def test_an_unwritable_directory_raises(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.fail("run the unit tests as an ordinary user: root writes anywhere (./scripts/test)")
    (tmp_path / "w").mkdir(mode=0o500)
    with pytest.raises(PermissionError):
        Writers(str(tmp_path / "w"), pid=111).grant("s1", "/x")


# --- the swept marks: whether another daemon may have written since ----------


def test_a_mark_stands_past_this_daemon_s_grants_and_not_past_another_s(tmp_path: Path) -> None:
    a, b = _two(tmp_path)
    assert a.grant("s1", "/home/u/wt")[0] is None
    mark = a.mark()
    assert mark is not None
    a.release("s1")
    assert a.grant("s3", "/elsewhere")[0] is None  # its own: its memory knows
    assert a.grant("s1", "/home/u/wt", mark) == (None, True)
    a.release("s1")
    mark = a.mark()
    assert mark is not None
    assert b.grant("s2", "/home/u/wt/sub")[0] is None
    b.release("s2")
    assert a.grant("s1", "/home/u/wt", mark) == (None, False)


def test_another_daemon_s_grant_elsewhere_leaves_the_mark(tmp_path: Path) -> None:
    a, b = _two(tmp_path)
    assert a.grant("s1", "/home/u/wt")[0] is None
    mark = a.mark()
    assert mark is not None
    a.release("s1")
    assert b.grant("s2", "/home/u/wt2")[0] is None
    assert a.grant("s1", "/home/u/wt", mark) == (None, True)


def test_a_mark_older_than_the_log_does_not_stand(tmp_path: Path) -> None:
    a, b = _two(tmp_path)
    assert a.grant("s1", "/home/u/wt")[0] is None
    mark = a.mark()
    assert mark is not None
    a.release("s1")
    for i in range(writers.LOG):  # each its own session, released: the log fills with a's own grants
        assert a.grant(f"t{i}", f"/other/{i}")[0] is None
        a.release(f"t{i}")
    assert a.grant("s1", "/home/u/wt", mark) == (None, True)  # the twin: the log still reaches back
    a.release("s1")
    assert a.grant("t", "/other/x")[0] is None  # the 65th grant since: the mark's own is out of the log
    a.release("t")
    assert a.grant("s1", "/home/u/wt", mark) == (None, False)


@pytest.mark.parametrize("damage", ["removed", "unreadable"])
def test_a_log_replaced_or_unreadable_lets_no_mark_stand(tmp_path: Path, damage: str) -> None:
    a = Writers(str(tmp_path / "w"), pid=111)
    assert a.grant("s1", "/home/u/wt")[0] is None
    mark = a.mark()
    assert mark is not None
    a.release("s1")
    log = tmp_path / "w" / "grants"
    if damage == "removed":
        log.unlink()
    else:
        log.write_text("{")
        assert a.mark() is None
    assert a.grant("s1", "/home/u/wt", mark) == (None, False)
    assert json.loads(log.read_text())["count"] == 1  # a new log, under a new epoch
    assert json.loads(log.read_text())["epoch"] != mark[0]


# --- through WriteLocks, as the daemon uses it -------------------------------


def test_write_locks_of_two_daemons_exclude_each_other(tmp_path: Path) -> None:
    one, two = WriteLocks(Writers(str(tmp_path / "w"), pid=111)), WriteLocks(Writers(str(tmp_path / "w"), pid=222))
    assert one.acquire("s1", "/home/u/wt") is None
    assert one.acquire("s1", "/home/u/wt") is None  # its own again: no second entry
    assert len([n for n in os.listdir(tmp_path / "w") if n.endswith(".held")]) == 1
    assert one.acquire("s2", "/home/u/wt") == "s1"  # its own table answers for its own sessions
    refused = two.acquire("s3", "/home/u/wt/src")
    assert isinstance(refused, Foreign) and (refused.session, refused.pid) == ("s1", 111)
    one.release("s1")
    assert two.acquire("s3", "/home/u/wt/src") is None


def test_another_daemon_s_writer_unmarks_a_sweep(tmp_path: Path) -> None:
    one, two = WriteLocks(Writers(str(tmp_path / "w"), pid=111)), WriteLocks(Writers(str(tmp_path / "w"), pid=222))
    assert one.grant("s1", "/home/u/wt") == (None, False)
    assert one.mark_swept("s1", "/home/u/wt")
    one.release("s1")
    assert one.grant("s2", "/home/u/wt") == (None, True)  # the twin: nobody wrote since
    assert one.mark_swept("s2", "/home/u/wt")
    one.release("s2")
    assert two.grant("t1", "/home/u/wt") == (None, False)
    two.release("t1")
    assert one.grant("s3", "/home/u/wt") == (None, False)


def test_another_daemon_s_loose_writer_prevents_a_mark(tmp_path: Path) -> None:
    one, two = WriteLocks(Writers(str(tmp_path / "w"), pid=111)), WriteLocks(Writers(str(tmp_path / "w"), pid=222))
    assert two.acquire("t1", "/home/u/wt/sub") is None
    two.give_back("t1")  # its processes may still write
    assert one.acquire("s1", "/home/u/wt") is None
    assert not one.mark_swept("s1", "/home/u/wt")
    two.release("t1")
    assert one.mark_swept("s1", "/home/u/wt")  # the twin: once it has ended


def test_a_give_back_that_cannot_be_recorded_keeps_the_lock_held_for_the_others(tmp_path: Path) -> None:
    """Fail closed: without its loose entry the give-back would let another
    daemon mark the worktree swept while this session's processes may
    write; so the held entry stays (the others are refused) until its end."""
    if os.geteuid() == 0:
        pytest.fail("run the unit tests as an ordinary user: root writes anywhere (./scripts/test)")
    one, two = WriteLocks(Writers(str(tmp_path / "w"), pid=111)), WriteLocks(Writers(str(tmp_path / "w"), pid=222))
    assert one.acquire("s1", "/home/u/wt") is None
    assert two.acquire("t0", "/elsewhere") is None  # both mutexes open
    os.chmod(tmp_path / "w", 0o500)
    try:
        one.give_back("s1")  # said in the log, not raised
        with pytest.raises(PermissionError):  # its memory has it given back; a new entry cannot be made
            one.acquire("s2", "/home/u/wt")
        assert isinstance(two.acquire("t1", "/home/u/wt"), Foreign)
        assert one.acquire("s1", "/home/u/wt") is None  # asked again: the held entry kept, no second one
    finally:
        os.chmod(tmp_path / "w", 0o700)
    one.release("s1")
    assert two.acquire("t1", "/home/u/wt") is None  # the twin: gone at its end


def test_a_grant_whose_log_cannot_be_written_leaves_no_entry(tmp_path: Path) -> None:
    """The log is written before the entry: a grant that fails there holds
    nothing for the other daemons; the twin, the log writable again, holds."""
    if os.geteuid() == 0:
        pytest.fail("run the unit tests as an ordinary user: root writes anywhere (./scripts/test)")
    a, b = _two(tmp_path)
    assert a.grant("s0", "/elsewhere")[0] is None  # the log exists
    (tmp_path / "w" / "grants").chmod(0o400)
    with pytest.raises(PermissionError):
        a.grant("s1", "/home/u/wt")
    assert not [n for n in os.listdir(tmp_path / "w") if ".s1." in n]
    (tmp_path / "w" / "grants").chmod(0o600)
    assert b.grant("s2", "/home/u/wt")[0] is None  # nothing of s1's holds it
    b.release("s2")
    assert a.grant("s1", "/home/u/wt")[0] is None
    assert b.grant("s2", "/home/u/wt")[0] is not None


def test_an_entry_written_short_is_not_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A short write (the file system full) fails the grant: an entry cut
    short would be read by the others as one that holds every worktree."""
    a, b = _two(tmp_path)
    real = os.pwrite
    monkeypatch.setattr(writers.os, "pwrite", lambda fd, data, at: real(fd, data[:5], at))
    with pytest.raises(OSError, match="a short write"):
        a.grant("s1", "/home/u/wt")
    monkeypatch.undo()
    assert not [n for n in os.listdir(tmp_path / "w") if ".s1." in n]
    assert b.grant("s2", "/home/v")[0] is None  # the twin: nothing of a's holds anything


def test_an_entry_of_its_own_it_could_not_remove_is_made_again(tmp_path: Path) -> None:
    a = Writers(str(tmp_path / "w"), pid=111)
    assert a.grant("s0", "/x")[0] is None  # the directory exists
    (tmp_path / "w" / f"{a.token}.s1.held").write_text("{}")  # left unlocked: an unlink that failed
    assert a.grant("s1", "/home/u/wt")[0] is None
    assert json.loads((tmp_path / "w" / f"{a.token}.s1.held").read_text())["worktree"] == "/home/u/wt"
