"""What a session's IPC namespace holds in System V memory, as its tool
server tells the daemon (worker/ipcwatch.py), and how the memory watchdog
adds it (daemon/watchdog.py)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from dispatchd.daemon import watchdog
from dispatchd.worker import ipcwatch

SHM = """       key      shmid perms                  size  cpid  lpid nattch   uid   gid  cuid  cgid      atime      dtime      ctime                   rss                  swap
         0          1   600               8388608    12    12      0  1000  1000  1000  1000 1764580000 1764580001 1764580000               8388608                     0
         0          2   600               8388608    12    12      1  1000  1000  1000  1000 1764580000          0 1764580000               4194304               1048576
"""
MSG = """       key      msqid perms      cbytes       qnum lspid lrpid   uid   gid  cuid  cgid      stime      rtime      ctime
         0          0   600       16384          4    12     0  1000  1000  1000  1000 1764580000          0 1764580000
         0          1   600           0      16384    12     0  1000  1000  1000  1000 1764580000          0 1764580000
"""
SEM = """       key      semid perms      nsems   uid   gid  cuid  cgid      otime      ctime
         0          0   600      32000  1000  1000  1000  1000          0 1764580000
"""


def test_every_object_counts_with_what_the_kernel_takes_for_it(tmp_path: Path) -> None:
    (tmp_path / "sysvipc").mkdir()
    (tmp_path / "sysvipc" / "shm").write_text(SHM)
    (tmp_path / "sysvipc" / "msg").write_text(MSG)
    (tmp_path / "sysvipc" / "sem").write_text(SEM)
    header = ipcwatch.OBJECT_COST
    # Segments attached or not (the daemon subtracts what the session's processes map).
    shm = (8388608 + header) + (4194304 + 1048576 + header)
    # A queue's bytes and each message's header: 16,384 empty messages hold 1 MiB, their bytes 0.
    msg = (16384 + 4 * ipcwatch.MESSAGE_COST + header) + (16384 * ipcwatch.MESSAGE_COST + header)
    sem = 32000 * ipcwatch.SEMAPHORE_COST + header  # 2 MiB for one set of 32,000
    assert ipcwatch.held_bytes(str(tmp_path)) == shm + msg + sem


def test_each_task_but_the_tool_server_counts_an_undo_record_for_each_semaphore_set(tmp_path: Path) -> None:
    (tmp_path / "sysvipc").mkdir()
    (tmp_path / "sysvipc" / "sem").write_text(SEM)
    for pid, tasks in ((str(os.getpid()), 3), ("7", 1), ("8", 2)):  # this process's threads do not count
        for tid in range(tasks):
            (tmp_path / pid / "task" / str(tid + 100)).mkdir(parents=True)
    # 64 bytes of header and 2 a semaphore, rounded up as kmalloc does: 64 KiB for 32,000.
    assert ipcwatch._undo_cost(32000) == 65536
    assert ipcwatch._undo_cost(1) == 128
    own = 32000 * ipcwatch.SEMAPHORE_COST + ipcwatch.OBJECT_COST
    assert ipcwatch.held_bytes(str(tmp_path)) == own + 3 * 65536  # one thread of pid 7, two of pid 8
    (tmp_path / "sysvipc" / "sem").write_text(SEM.splitlines()[0] + "\n")
    assert ipcwatch.held_bytes(str(tmp_path)) == 0  # no set: no undo record, whatever runs


def test_a_kernel_without_system_v_ipc_holds_nothing(tmp_path: Path) -> None:
    assert ipcwatch.held_bytes(str(tmp_path)) == 0
    (tmp_path / "sysvipc").mkdir()
    (tmp_path / "sysvipc" / "shm").write_text(SHM.splitlines()[0] + "\n")  # the header only: none held
    assert ipcwatch.held_bytes(str(tmp_path)) == 0


def test_the_watch_sends_changes_while_commands_run_then_sleeps_until_the_next() -> None:
    sent: list[int] = []
    spawned = threading.Event()
    state = {"running": True, "held": 0}
    looks: list[float] = []

    def held() -> int:
        looks.append(time.monotonic())
        return state["held"]

    thread = threading.Thread(target=ipcwatch.watch, args=(sent.append, spawned, 0, lambda: state["running"], held),
                              daemon=True)
    thread.start()
    time.sleep(0.1)
    assert looks == [] and sent == []  # no command yet: no look at all
    spawned.set()
    time.sleep(0.05)
    state["held"] = 1 << 20
    assert _until(lambda: sent == [1 << 20])  # sent once changed, not at every look
    state["running"] = False
    state["held"] = 2 << 20  # the last command's last write, seen at the look after it ended
    assert _until(lambda: sent == [1 << 20, 2 << 20])
    time.sleep(3 * ipcwatch.INTERVAL_S)
    settled = len(looks)
    time.sleep(3 * ipcwatch.INTERVAL_S)
    assert len(looks) == settled  # nothing runs: no look until the next command


def test_a_long_look_spaces_the_next_but_never_past_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    # The look's CPU, not its wall time: 5 ms, 30 ms, then 200 ms a look.
    costs = iter([0.005, 0.030, 0.200])
    clock = {"now": 0.0}
    slept: list[float] = []

    class _Time:
        @staticmethod
        def thread_time() -> float:
            return clock["now"]

        @staticmethod
        def sleep(s: float) -> None:
            slept.append(s)
            if len(slept) == 4:
                raise StopIteration  # out of the loop: the test has seen enough

    def held() -> int:
        clock["now"] += next(costs)
        return 0

    monkeypatch.setattr(ipcwatch, "time", _Time)
    spawned = threading.Event()
    spawned.set()
    with pytest.raises(StopIteration):
        ipcwatch.watch(lambda n: None, spawned, 0, lambda: True, held)
    # The first look an interval after the command's start, then spaced by the look before.
    assert slept == [ipcwatch.INTERVAL_S, ipcwatch.INTERVAL_S, pytest.approx(0.6), ipcwatch.MAX_INTERVAL_S]


def _until(predicate: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_the_watchdog_adds_what_the_namespace_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    me = os.getpid()
    assert watchdog.over_limit(me, 1 << 40) is None
    # The same process under the same limit, with 2 TiB held in segments no process maps.
    used = watchdog.over_limit(me, 1 << 40, ipc=2 << 40)
    assert used is not None and used > 2 << 40
    # A segment the processes map is in their PSS already: subtracted, not counted twice.
    monkeypatch.setattr(watchdog, "_mapped_files", lambda pids: (set(), [me]))
    monkeypatch.setattr(watchdog, "_sysv_pss", lambda pids: (2 << 40) - (1 << 20))
    assert watchdog.over_limit(me, 1 << 40, ipc=2 << 40) is None


def test_a_woken_session_looks_at_once_a_new_one_only_at_its_first_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ipcwatch, "held_bytes", lambda proc="/proc": 5 << 20)
    hooks: list[object] = []
    sent: list[int] = []
    ipcwatch.start(sent.append, threading.Event(), hooks.append, look_now=True)
    assert sent == [5 << 20] and len(hooks) == 1  # what was held before the sleep, said before any command
    sent.clear()
    ipcwatch.start(sent.append, threading.Event(), hooks.append)
    assert sent == [] and len(hooks) == 2  # a new namespace: nothing to say until a command runs


def test_no_command_starts_while_the_watch_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from dispatchd import threads

    class NoThread:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def start(self) -> None:
            raise RuntimeError("can't start new thread")

    checks: list[object] = []
    w = ipcwatch.start(lambda held: None, threading.Event(), checks.append)
    assert checks == [w.ensure]
    real = threads.Thread
    monkeypatch.setattr(threads, "Thread", NoThread)
    with pytest.raises(OSError) as refused:
        w.ensure()
    assert refused.value.errno == errno.EAGAIN and "System V watch cannot start a thread" in str(refused.value)
    assert not w.started
    monkeypatch.setattr(threads, "Thread", real)  # the twin: a thread to be had
    w.ensure()
    assert w.started


def test_a_segment_is_known_by_its_device_and_the_kernels_name_not_by_a_name_alone() -> None:
    dev = watchdog._shm_device()
    shm = f"{os.major(dev):02x}:{os.minor(dev):02x}".encode()
    segment = b"7f00a000-7f10a000 rw-s 00000000 " + shm + b" 7   /SYSV00000000 (deleted)\n"
    assert watchdog._is_segment(segment)
    # A file of the worktree, or of the session's own /dev/shm, whose name reads as one: another device.
    assert not watchdog._is_segment(b"7f00a000-7f10a000 r--s 00000000 fd:01 1234 /home/u/wt/sp /SYSVfile\n")
    assert not watchdog._is_segment(b"7f00a000-7f10a000 rw-s 00000000 00:2f 7   /SYSV00000000 (deleted)\n"
                                    if shm != b"00:2f" else b"7f00a000-7f10a000 rw-s 00000000 00:30 7 /SYSV0\n")
    # A memfd named like one is on the shmem device, but the kernel names it /memfd:.
    assert not watchdog._is_segment(b"7f00a000-7f10a000 rw-s 00000000 " + shm + b" 9 /memfd: /SYSV (deleted)\n")
