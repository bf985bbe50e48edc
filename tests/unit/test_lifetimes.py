"""Pure parts of the lifetime mechanisms: orphan deadlines, exit causes,
stale scratch names, kernel budgets; and the temp-file sweep on a real
directory (it only unlinks our exact names, never through a symlink)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from dispatchd.confine.ucounts import budget_gaps, plan_ucounts
from dispatchd.daemon import exits, leftovers, lifetimes, watchdog
from dispatchd.errors import ConfinementError
from dispatchd.tools.atomic import TEMP_NAME, atomic_write, in_flight
from dispatchd.tempfiles import sweep_temp_files


def test_an_unheld_session_gets_a_deadline_and_a_held_or_detached_one_none() -> None:
    assert lifetimes.plan_orphan_deadline(100.0, detached=False, holders=0, grace_s=60) == 160.0
    assert lifetimes.plan_orphan_deadline(100.0, detached=False, holders=1, grace_s=60) is None
    assert lifetimes.plan_orphan_deadline(100.0, detached=True, holders=0, grace_s=60) is None


def test_the_opener_may_shorten_the_grace_never_lengthen_it() -> None:
    assert lifetimes.effective_grace(60, None) == 60
    assert lifetimes.effective_grace(60, 0) == 0
    assert lifetimes.effective_grace(60, 3600) == 60
    assert lifetimes.effective_grace(60, -5) == 0
    assert lifetimes.effective_grace(60, float("nan")) == 60


def test_holders_end_a_session_after_its_last_connection_and_the_grace() -> None:
    ended: list[str] = []
    done = threading.Event()
    h = lifetimes.Holders(lambda sid: (ended.append(sid), done.set()))
    h.track("a", detached=False, grace_s=0.2, holder=1)
    h.track("b", detached=True, grace_s=0.0, holder=1)
    h.hold("a", 2)
    h.release(1)
    time.sleep(0.4)
    assert ended == []  # connection 2 still holds it
    started = time.monotonic()
    h.release(2)
    assert done.wait(5)
    assert ended == ["a"] and time.monotonic() - started >= 0.19
    assert h.describe("b")["detached"] is True


def test_reattaching_within_the_grace_keeps_the_session() -> None:
    ended: list[str] = []
    h = lifetimes.Holders(ended.append)
    h.track("a", detached=False, grace_s=0.3, holder=1)
    h.release(1)
    h.hold("a", 2)
    time.sleep(0.5)
    assert ended == []


def test_exit_causes_are_named() -> None:
    killed = signal.SIGKILL
    assert exits.describe_exit(killed, idle_timeout_s=1)[0] == "worker_killed signal=9"  # WIFSIGNALED status 9
    assert exits.describe_exit((128 + 9) << 8, idle_timeout_s=1) == (
        "tool_server_killed signal=9", "its tool server was killed by signal 9 (SIGKILL)")
    assert exits.describe_exit(exits.EXIT_IDLE << 8, idle_timeout_s=5)[0] == "idle"
    assert "ended idle" in exits.describe_exit(exits.EXIT_IDLE << 8, idle_timeout_s=5)[1]
    assert exits.describe_exit(1 << 8, idle_timeout_s=1)[0] == "worker_failed code=1"
    # A status not known says which: the kernel cannot tell, or it was not known in time.
    assert exits.describe_exit(exits.Unknown.NO_KERNEL, idle_timeout_s=1) == (
        "worker_exited", "its worker exited (this kernel does not say how: Linux 6.15+ does)")
    assert exits.describe_exit(exits.Unknown.NOT_YET, idle_timeout_s=1) == (
        "worker_exited", "its worker exited (how was not known within 10 s)")


def test_stale_scratch_names_are_ours_only() -> None:
    assert leftovers.plan_stale(["0123456789ab", "notes", "0123456789abc", ".x"],
                                ["ba9876543210.lock", "x.lock", ".0123456789ab.lock.1a2b3c4d"]) == [
        "0123456789ab", "ba9876543210"]


def test_a_stale_scratch_is_removed_and_a_locked_one_kept(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    tmp_path = tmp_path / "state" / "sessions"
    tmp_path.mkdir()
    live = leftovers.ScratchLocks(str(tmp_path))
    live.take("aaaaaaaaaaaa")
    (tmp_path / "aaaaaaaaaaaa").mkdir()
    dead = tmp_path / "bbbbbbbbbbbb" / "tmp" / "locked"
    dead.mkdir(parents=True)
    (dead / "f").write_text("x")
    dead.chmod(0)  # what a session may do to its scratch
    (tmp_path / "cccccccccccc").mkdir()
    os.symlink(tmp_path / "keep", tmp_path / "cccccccccccc" / "link")
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "precious").write_text("y")
    assert leftovers.remove_stale(str(tmp_path)) == 2
    assert sorted(os.listdir(tmp_path)) == ["aaaaaaaaaaaa", "keep"]
    assert os.listdir(leftovers.locks_dir(str(tmp_path))) == ["aaaaaaaaaaaa.lock"]
    assert (tmp_path / "keep" / "precious").read_text() == "y"
    leftovers.remove_tree(str(tmp_path / "aaaaaaaaaaaa"))
    live.release("aaaaaaaaaaaa")
    assert sorted(os.listdir(tmp_path)) == ["keep"] and not os.listdir(leftovers.locks_dir(str(tmp_path)))


def test_the_sweep_removes_our_temp_names_only(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    ours = [tmp_path / ".a.txt.dispatchd-0123abcd.tmp", tmp_path / "sub" / ".b.dispatchd-ffffffff.tmp"]
    for p in ours:
        p.write_text("half")
    theirs = [tmp_path / ".a.txt.dispatchd-0123abcd.tmp.bak", tmp_path / "a.txt.dispatchd-0123abcd.tmp",
              tmp_path / ".a.dispatchd-0123ABCD.tmp", tmp_path / ".a.dispatchd-0123abc.tmp"]
    for p in theirs:
        p.write_text("user")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / ".c.dispatchd-01234567.tmp").write_text("not walked")
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / ".d.dispatchd-01234567.tmp").write_text("outside")
    os.symlink(outside, tmp_path / "link")
    os.symlink(outside / ".d.dispatchd-01234567.tmp", tmp_path / ".e.dispatchd-01234567.tmp")
    removed = sweep_temp_files(str(tmp_path))
    assert sorted(removed) == sorted(str(p) for p in ours)
    assert all(p.read_text() == "user" for p in theirs)
    assert (outside / ".d.dispatchd-01234567.tmp").read_text() == "outside"
    assert os.path.islink(tmp_path / ".e.dispatchd-01234567.tmp")
    assert TEMP_NAME.match(b".x.dispatchd-01234567.tmp") and not TEMP_NAME.match(b"..dispatchd-01234567.tmp")


def test_the_sweep_skips_a_write_in_flight(tmp_path: Path) -> None:
    seen: list[list[str]] = []
    real_write = os.write

    def write_and_sweep(fd: int, data: bytes) -> int:
        seen.append(sweep_temp_files(str(tmp_path), in_flight))
        return real_write(fd, data)

    os.write = write_and_sweep  # type: ignore[assignment]
    try:
        atomic_write(str(tmp_path / "f.txt"), b"new", fsync=False)
    finally:
        os.write = real_write  # type: ignore[assignment]
    assert seen == [[]] and (tmp_path / "f.txt").read_bytes() == b"new"


def test_kernel_budgets_are_planned_in_a_user_namespace_only() -> None:
    plan = plan_ucounts(user_namespace=True, inotify_instances=32, inotify_watches=100, fanotify_groups=4,
                        fanotify_marks=10)
    assert plan.maxima["max_inotify_instances"] == 32 and plan.maxima["max_user_namespaces"] == 0
    assert plan_ucounts(user_namespace=False, inotify_instances=32, inotify_watches=100, fanotify_groups=4,
                        fanotify_marks=10).maxima == {}
    # epoll watches, descriptors in flight, pipes, the file table and TCP memory stay shared in every mode.
    assert len(budget_gaps(user_namespace=True, cgroup_controllers=("memory", "cpu"))) == 5
    assert len(budget_gaps(user_namespace=False, cgroup_controllers=())) == 8
    gaps = budget_gaps(user_namespace=True, cgroup_controllers=(), max_open_files=256, max_processes=10,
                       fd_passing_reserve=512)
    assert any("can hold up to 509 in flight" in g and "keep 512 more" in g for g in gaps)
    assert any("256 per process x 10 processes = 2,560" in g for g in gaps)
    assert any(g.startswith("pipe buffers are counted per user") for g in gaps)
    assert any(g.startswith("TCP buffer memory") and "nothing bounds" in g for g in gaps)


def test_the_watchdog_counts_a_tree_and_names_its_mechanism() -> None:
    pids = watchdog.descendants(os.getpid())
    assert pids[0] == os.getpid()
    assert watchdog.rss_bytes(pids) >= watchdog.pss_bytes([os.getpid()]) > 0
    assert watchdog.over_limit(os.getpid(), 1 << 50) is None
    assert watchdog.over_limit(os.getpid(), 1) is not None
    assert watchdog.mechanism(True, 5).mechanism == "cgroup"
    assert watchdog.mechanism(False, 5).mechanism == "watchdog"


def test_the_daemon_log_file_is_rotated(tmp_path: Path) -> None:
    import argparse
    import logging
    from logging.handlers import RotatingFileHandler

    from dispatchd import cli

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers = []
    try:
        cli._setup_logging(argparse.Namespace(log_file=str(tmp_path / "dispatchd.log"), log_level="info"))
        handler = root.handlers[0]
        assert isinstance(handler, RotatingFileHandler)
        assert (handler.maxBytes, handler.backupCount) == (10 * 2**20, 3)
        logging.getLogger("dispatchd.test").info("event=one")
        handler.doRollover()
        logging.getLogger("dispatchd.test").debug("event=tool_call (not at info)")
        logging.getLogger("dispatchd.test").info("event=two")
        handler.close()
        assert "event=one" in (tmp_path / "dispatchd.log.1").read_text()
        assert (tmp_path / "dispatchd.log").read_text().strip().endswith("event=two")
        assert "tool_call" not in (tmp_path / "dispatchd.log").read_text()
    finally:
        root.handlers, root.level = saved[0], saved[1]


def test_the_process_budget_without_a_user_namespace_counts_threads() -> None:
    """RLIMIT_NPROC counts tasks: a user's threads must be in the base, or a
    degraded session cannot even fork its tool server (found under load)."""
    from dispatchd.confine.limits import _processes_of

    stop = threading.Event()
    threads = [threading.Thread(target=stop.wait) for _ in range(20)]
    for t in threads:
        t.start()
    try:
        mine = len(os.listdir("/proc/self/task"))
        assert _processes_of(os.getuid()) >= mine >= 21
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_a_tool_server_that_is_pid_1_is_told_killed_from_outside_or_crashed() -> None:
    # Full mode: the tool server is the session's pid 1. A signal its own
    # namespace cannot send came from outside; a fault is its own.
    assert exits.describe_exit(9, idle_timeout_s=1, tool_server_is_init=True) == (
        "tool_server_killed signal=9",
        "its tool server was killed by signal 9 (SIGKILL) from outside the session")
    assert exits.describe_exit(11, idle_timeout_s=1, tool_server_is_init=True) == (
        "tool_server_killed signal=11", "its tool server crashed (signal 11, SIGSEGV)")
    assert exits.describe_exit(31, idle_timeout_s=1, tool_server_is_init=True)[1] == (
        "its tool server crashed (signal 31, SIGSYS)")
    # Degraded mode: the init is not the tool server.
    assert exits.describe_exit(9, idle_timeout_s=1)[0] == "worker_killed signal=9"


def test_the_watchdog_sleeps_while_the_daemon_has_no_session_and_looks_again_at_an_open(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With no session at all it waits for the next open instead of waking
    every INTERVAL_S; while any session exists (asleep ones too: they may
    be woken without an open) it looks every INTERVAL_S."""
    monkeypatch.setattr(watchdog, "INTERVAL_S", 0.02)
    looks: list[float] = []
    live: list[tuple[str, int, int, int]] = []

    def sessions() -> list[tuple[str, int, int, int]]:
        looks.append(time.monotonic())
        return list(live)

    any_session = [False]
    dog = watchdog.MemoryWatchdog(sessions, lambda sid, used, limit: None, lambda: any_session[0])
    dog.ensure_running()
    time.sleep(0.3)
    assert 1 <= len(looks) <= 2  # one look, then asleep: not one every 0.02 s
    live.append(("s1", os.getpid(), 1 << 50, 0))
    any_session[0] = True
    dog.ensure_running()  # the open
    time.sleep(0.3)
    assert len(looks) >= 8  # looking every INTERVAL_S again
    live.clear()  # the session asleep: no worker to watch, but a session
    before = len(looks)
    time.sleep(0.3)
    assert len(looks) - before >= 8  # still looking: it may be woken without an open


class _RefusedThread(threading.Thread):
    def start(self) -> None:
        raise RuntimeError("can't start new thread")


def test_a_watchdog_that_cannot_start_says_so_and_the_next_open_starts_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """An open calls ``start`` before it makes anything: refused then, it is
    refused; before, the failed thread was kept as started, and every later
    session opened with no watchdog at all."""
    monkeypatch.setattr(watchdog, "INTERVAL_S", 0.02)
    looks: list[float] = []

    def sessions() -> list[tuple[str, int, int, int]]:
        looks.append(time.monotonic())
        return []

    dog = watchdog.MemoryWatchdog(sessions, lambda sid, used, limit: None)
    monkeypatch.setattr(watchdog.threading, "Thread", _RefusedThread)
    with pytest.raises(ConfinementError) as refused:
        dog.start()
    assert str(refused.value) == ("cannot apply the memory bound: the memory watchdog cannot start its thread "
                                  "(can't start new thread): the daemon's processes and threads are at the "
                                  "user's limit; retry once commands or sessions end")
    monkeypatch.undo()
    monkeypatch.setattr(watchdog, "INTERVAL_S", 0.02)
    dog.ensure_running()  # the twin: a thread to be had
    time.sleep(0.3)
    assert len(looks) >= 5


def test_orphan_deadlines_whose_thread_could_not_start_are_met_once_it_can(monkeypatch: pytest.MonkeyPatch) -> None:
    ended: list[str] = []
    done = threading.Event()
    h = lifetimes.Holders(lambda sid: (ended.append(sid), done.set()))
    monkeypatch.setattr(lifetimes.threading, "Thread", _RefusedThread)
    h.track("a", detached=False, grace_s=0.1, holder=None)  # unheld: a deadline, no thread to meet it
    monkeypatch.undo()
    assert not done.wait(0.3) and ended == []
    h.track("b", detached=False, grace_s=0.1, holder=None)  # the next change starts it: both met
    assert done.wait(5)
    time.sleep(0.3)
    assert sorted(ended) == ["a", "b"]


def test_an_orphan_end_that_fails_is_tried_again_and_the_thread_goes_on() -> None:
    """Before, an exception from the end stopped the one thread of every
    deadline: no orphan ended again."""
    ended: list[str] = []
    done = threading.Event()
    failures = [1]

    def end(sid: str) -> None:
        if failures[0]:
            failures[0] -= 1
            raise RuntimeError("can't start new thread")
        ended.append(sid)
        if len(ended) == 2:
            done.set()

    h = lifetimes.Holders(end)
    h.track("a", detached=False, grace_s=0.05, holder=None)
    time.sleep(0.3)
    h.track("b", detached=False, grace_s=0.05, holder=None)
    assert done.wait(5)
    assert sorted(ended) == ["a", "b"]
