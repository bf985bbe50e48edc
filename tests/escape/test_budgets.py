"""Per-user kernel budgets: a session cannot take the
user's whole inotify budget, and cannot make namespaces; what stays open is
listed in ``leaves_open``. The session still makes a few inotify instances
(the allowed twin), and the user's own programs keep the rest."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import REPO, Daemon, _refuse_root, shell, wait_until
from tests.escape.conftest import connect, mode_daemon

# The budgets measured here are the user's, shared by every process of the
# user's: the tests that measure them take turns across workers and runs.
pytestmark = pytest.mark.usefixtures("user_budgets")

# Opens inotify instances until the kernel refuses; prints how many and the errno.
INOTIFY_HOG = r"""
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
fds = []
while len(fds) < 1000:
    fd = libc.inotify_init1(0)
    if fd < 0:
        break
    fds.append(fd)
print(len(fds), ctypes.get_errno() if len(fds) < 1000 else 0, flush=True)
time.sleep(float(sys.argv[1]))
"""


@pytest.fixture(scope="module", params=["full", "woken"])
def full(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[tuple[Daemon, dispatch.Client]]:
    """A full-mode daemon without a cgroup (the budgets are the kernel's per
    user); woken: its sessions are opened asleep (tests/escape/conftest.py)."""
    _refuse_root()
    base = tmp_path_factory.mktemp(f"budgets-{request.param}")
    d = mode_daemon(base, request.param, "--cgroup", "off",
                    policies={"smallmem": "[limits]\nsession_memory_bytes = 67108864\n",
                              "fewfds": "[limits]\nmax_open_files = 256\n"})
    try:
        with connect(d, request.param) as c:
            yield d, c
    finally:
        assert d.stop() == 0, d.log()


def _instances_left_for_the_user() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    fds = []
    try:
        while len(fds) < 200:
            fd = libc.inotify_init1(0)
            if fd < 0:
                assert ctypes.get_errno() == errno.EMFILE
                break
            fds.append(fd)
        return len(fds)
    finally:
        for fd in fds:
            os.close(fd)


def test_a_session_takes_at_most_its_inotify_share_and_the_user_keeps_the_rest(
        full: tuple[Daemon, dispatch.Client], worktree: Path) -> None:
    _, client = full
    before = _instances_left_for_the_user()
    with client.open_session(str(worktree)) as session:
        assert "inotify 32 instances" in session.info["protections"]["limits"]["kernel_budgets"]
        # The allowed twin: a few instances are fine.
        few = shell(session, f"/usr/bin/python3 -c {_q(INOTIFY_HOG.replace('1000', '5'))} 0")
        assert few.is_success and few.output.split() == ["5", "0"], few
        # Holding as many as it can (in the background), it gets 31 (the tool
        # server holds one, its watch of what calls change), then EMFILE.
        shell(session, f"/usr/bin/python3 -c {_q(INOTIFY_HOG)} 30 > hog.out", background=True)
        hog = worktree / "hog.out"
        assert wait_until(lambda: hog.exists() and hog.read_text().strip() != "")
        out = hog.read_text()
        taken, err = out.split()
        assert int(taken) == 31 and int(err) == errno.EMFILE, out
        # The user's own programs still have what the session could not take.
        assert _instances_left_for_the_user() >= min(before, 128) - 32 - 4  # 4: sessions beside it, one each
    # Closed: its 32 are the user's again. The count is the whole user's, and
    # tests beside this one (other workers, other runs) open and close
    # theirs meanwhile: compared with a little room, far from 32.
    assert wait_until(lambda: _instances_left_for_the_user() >= before - 4), (_instances_left_for_the_user(), before)


def _user_limit() -> int:
    """The user's inotify instances (confine/ucounts.py's reading of it)."""
    values = []
    for path in ("/proc/sys/fs/inotify/max_user_instances", "/proc/sys/user/max_inotify_instances"):
        values.append(int(Path(path).read_text()))
    return min(values)


def test_all_sessions_together_take_at_most_half_of_the_users_inotify_instances(
        full: tuple[Daemon, dispatch.Client], tmp_path: Path) -> None:
    _, client = full
    half = _user_limit() // 2
    assert client.status()["kernel"]["shared_budgets"].startswith(f"all sessions together at most {half:,} inotify")
    n = half // 32 + 1  # one session more than their shares of 32 need to reach the half
    assert n <= 8, f"the user may have {_user_limit()} inotify instances: more sessions than this test opens"
    before = _instances_left_for_the_user()
    sessions = []
    try:
        taken = []
        for i in range(n):
            wt = tmp_path / f"wt{i}"
            wt.mkdir()
            sessions.append(client.open_session(str(wt)))
            session = sessions[-1]
            assert f"at most {half:,} inotify instances" in session.info["protections"]["limits"]["kernel_budgets"]
            shell(session, f"/usr/bin/python3 -c {_q(INOTIFY_HOG)} 30 > hog.out", background=True)
            hog = wt / "hog.out"
            assert wait_until(lambda: hog.exists() and hog.read_text().strip() != "")
            got, err = (int(x) for x in hog.read_text().split())
            assert err == errno.EMFILE, hog.read_text()
            taken.append(got)
        # The first takes its whole share (the allowed twin: 31 and its tool
        # server's watch); the sessions together never more than the half,
        # and the last finds none left, however many are open.
        assert taken[0] == 31, taken
        assert sum(taken) <= half and taken[-1] == 0, (taken, half)
        # The user's own programs keep the other half (4: sessions of other tests beside these).
        assert _instances_left_for_the_user() >= min(before, _user_limit() - half) - 4, (before, half)
    finally:
        for session in sessions:
            session.close()
    assert wait_until(lambda: _instances_left_for_the_user() >= before - 4), (_instances_left_for_the_user(), before)


def _status_of(pid: int) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)


def _fork_server_pid(client: dispatch.Client) -> int:
    helpers = client.status()["daemon"]["helpers"]
    return int(helpers.split("fork server pid ", 1)[1].split(":", 1)[0])


def test_the_fork_server_is_below_a_user_namespace_of_its_own_with_no_capability(
        full: tuple[Daemon, dispatch.Client], tmp_path: Path) -> None:
    daemon, client = full
    fork_server = _fork_server_pid(client)
    assert os.readlink(f"/proc/{fork_server}/ns/user") != os.readlink(f"/proc/{daemon.proc.pid}/ns/user")
    status = _status_of(fork_server)
    # Nothing gained in it: no capability, none an exec could get, only the user's own ids.
    assert status["CapEff"] == status["CapPrm"] == status["CapBnd"] == "0000000000000000", status
    assert Path(f"/proc/{fork_server}/uid_map").read_text().split() == [str(os.getuid()), str(os.getuid()), "1"]
    # The twin: a degraded daemon's (below).


def test_without_user_namespaces_the_sum_is_not_bounded_and_status_says_so(tmp_path: Path) -> None:
    _refuse_root()
    d = mode_daemon(tmp_path, "degraded", "--cgroup", "off")
    try:
        with d.connect() as client:
            kernel = client.status()["kernel"]
            assert kernel["shared_budgets"] == "" and kernel["shared_budgets_missing"] == "no user namespaces"
            fork_server = _fork_server_pid(client)
            assert os.readlink(f"/proc/{fork_server}/ns/user") == os.readlink(f"/proc/{d.proc.pid}/ns/user")
            wt = tmp_path / "wt"
            wt.mkdir()
            with client.open_session(str(wt)) as session:
                gaps = session.info["protections"]["limits"]["leaves_open"]
                assert any(g.startswith("inotify and fanotify budgets (128 inotify instances by default) are "
                                        "shared with the user's other programs") for g in gaps), gaps
    finally:
        assert d.stop() == 0, d.log()


def test_a_session_cannot_make_namespaces_and_budgets_left_open_are_listed(
        full: tuple[Daemon, dispatch.Client], worktree: Path) -> None:
    _, client = full
    with client.open_session(str(worktree)) as session:
        read = shell(session, "cat /proc/sys/user/max_user_namespaces /proc/sys/user/max_inotify_instances")
        assert read.is_success and read.output.split() == ["0", "32"]
        # Nothing in the session can raise its maxima back: /proc/sys is read-only, and it has no capability.
        raised = shell(session, "echo 128 > /proc/sys/user/max_inotify_instances")
        assert raised.is_failure and "Read-only file system" in raised.metadata["stderr"], raised
        gaps = session.info["protections"]["limits"]["leaves_open"]
        assert any(g.startswith("epoll watches") for g in gaps)
        assert any("socket buffers" in g for g in gaps)
        # Each with its number: what a session may hold of what it shares with the user.
        assert any(g.startswith("descriptors in flight") and "up to 4,349 in flight" in g for g in gaps), gaps
        assert any(g.startswith("pipe buffers") and "16,384 pages" in g for g in gaps)
        assert any(g.startswith("open files") and "4,096 per process x 1,024 processes = 4,194,304" in g
                   for g in gaps)
        assert any(g.startswith("TCP buffer memory") for g in gaps)


# Opens POSIX message queues (default size, about 80 KiB each) until refused.
MQ_HOG = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
n, err = 0, 0
while n < 50:
    fd = libc.mq_open(f"/dispatchd-test-{os.getpid()}-{n}".encode(), os.O_CREAT | os.O_RDWR, 0o600, None)
    if fd < 0:
        err = ctypes.get_errno()
        break
    n += 1
for i in range(n):
    libc.mq_unlink(f"/dispatchd-test-{os.getpid()}-{i}".encode())
print(n, err)
"""
# Queues real-time signals to itself (blocked) until refused.
SIGQUEUE_HOG = r"""
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])
n, err = 0, 0
while n < 200000:
    if libc.sigqueue(os.getpid(), int(signal.SIGRTMIN), ctypes.c_long(0)) != 0:
        err = ctypes.get_errno()
        break
    n += 1
print(n, err)
"""


def test_queued_signals_and_message_queues_are_the_sessions_share_only(
        full: tuple[Daemon, dispatch.Client], worktree: Path) -> None:
    _, client = full
    with client.open_session(str(worktree)) as session:
        limits = shell(session, "ulimit -i; ulimit -q")
        assert limits.output.split() == ["4096", "204800"], limits
        # POSIX message queues cannot even be made here (the session's IPC
        # namespace's queue file system is not its own): the rlimit is a second wall.
        mq = shell(session, f"/usr/bin/python3 -c {_q(MQ_HOG)}")
        assert mq.is_success and mq.output.split() == ["0", str(errno.EACCES)], mq
        sig = shell(session, f"/usr/bin/python3 -c {_q(SIGQUEUE_HOG)}")
        taken, err = (int(x) for x in sig.output.split())
        assert 4000 <= taken <= 4096 and err == errno.EAGAIN, sig


# Queues as much as each of 400 socketpairs takes (about 200 KiB each: 80 MiB),
# then holds it; prints the bytes queued.
SOCKBUF_HOG = r"""
import socket, time
pairs, total = [], 0
for _ in range(400):
    a, b = socket.socketpair(); a.setblocking(False)
    try:
        while True: total += a.send(b"x" * 65536)
    except BlockingIOError: pass
    pairs.append((a, b))
print(total, flush=True); time.sleep(30)
"""
ALLOC = "/usr/bin/python3 -c 'import time; b = bytearray(96 * 2**20); b[::4096] = b\"x\" * len(b[::4096]); print(1, flush=True); time.sleep(30)'"


@pytest.mark.known_limit
def test_socket_buffers_are_outside_the_memory_watchdog_known_limit(
        full: tuple[Daemon, dispatch.Client], worktree: Path) -> None:
    import time

    _, client = full
    with client.open_session(str(worktree), policy="smallmem") as session:
        shell(session, f"/usr/bin/python3 -c {_q(SOCKBUF_HOG)} > q.out", background=True)
        for _ in range(200):
            if (worktree / "q.out").exists() and (worktree / "q.out").read_text():
                break
            time.sleep(0.05)
        queued = int((worktree / "q.out").read_text())
        assert queued > 64 * 2**20  # more than the session's whole memory limit, in kernel buffers
        time.sleep(1.5)  # several looks of the watchdog
        assert session.id in [s["id"] for s in client.list_sessions()]
        assert shell(session, "true").is_success
    # The twin: the same amount in a process's own memory ends the session.
    with client.open_session(str(worktree), policy="smallmem") as session:
        result = shell(session, ALLOC, timeout=30)
        assert result.is_failure and "memory watchdog" in result.error, result.error


def _q(s: str) -> str:
    import shlex

    return shlex.quote(s)


_ = (REPO, shutil)  # the module shares the suite's imports


# Linux AIO through libaio's system calls, and a plain write as the control.
AIO = r"""
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
ctx = ctypes.c_ulong(0)
r = libc.syscall(ctypes.c_long(206), ctypes.c_long(8), ctypes.byref(ctx))  # io_setup(8, &ctx)
setup = 0 if r == 0 else ctypes.get_errno()
if r == 0:
    libc.syscall(ctypes.c_long(207), ctx)  # io_destroy
r = libc.syscall(ctypes.c_long(209), ctypes.c_ulong(0), ctypes.c_long(0), None)  # io_submit(0, 0, NULL)
submit = ctypes.get_errno() if r < 0 else 0
fd = os.open("aio.txt", os.O_WRONLY | os.O_CREAT, 0o600)
os.write(fd, b"sync")
os.close(fd)
print(setup, submit, open("aio.txt").read())
"""


def test_linux_aio_is_refused_with_enosys_and_ordinary_io_works(
        full: tuple[Daemon, dispatch.Client], worktree: Path) -> None:
    """One session could take the machine's whole fs.aio-max-nr; ENOSYS, as a
    kernel without AIO answers (its users fall back to synchronous I/O)."""
    import subprocess
    import sys

    _, client = full
    outside = subprocess.run([sys.executable, "-c", AIO], capture_output=True, text=True, cwd=worktree, timeout=30)
    # The twin: outside, io_setup succeeds and io_submit on no context says EINVAL.
    assert outside.stdout.split() == ["0", str(errno.EINVAL), "sync"], outside
    (worktree / "aio.txt").unlink()
    with client.open_session(str(worktree)) as session:
        inside = shell(session, f"/usr/bin/python3 -c {_q(AIO)}")
        assert inside.is_success and inside.output.split() == [str(errno.ENOSYS), str(errno.ENOSYS), "sync"], inside
    _daemon_serves(*full, worktree)


def _daemon_serves(daemon: Daemon, client: dispatch.Client, worktree: Path) -> None:
    """After an attempt: status answers, the socket is there, a new session opens and runs."""
    assert "fork server pid" in client.status()["daemon"]["helpers"]
    assert os.path.exists(daemon.socket)
    fresh = worktree.parent / "after"
    fresh.mkdir(exist_ok=True)
    with client.open_session(str(fresh)) as session:
        assert shell(session, "echo ok").output == "ok\n"


# Sends descriptors over a socketpair nobody reads (200 a message, the same
# one again and again) until the kernel refuses; prints how many are in
# flight and the errno, then holds them.
INFLIGHT_HOG = r"""
import array, errno, os, socket, sys, time
a, b = socket.socketpair()
a.setblocking(False)
fds = array.array("i", [a.fileno()] * 200)
sent, err = 0, 0
while sent < 200000:
    try:
        a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        sent += 200
    except OSError as exc:
        err = exc.errno
        break
print(sent, err, flush=True)
time.sleep(float(sys.argv[1]))
"""


def test_descriptors_in_flight_stop_below_what_the_session_itself_sends(
        full: tuple[Daemon, dispatch.Client], worktree: Path) -> None:
    """The kernel counts descriptors in flight per user, against the sender's
    RLIMIT_NOFILE: commands (256 here) fill the count and are refused there,
    and the session's own processes, which keep FD_PASSING_RESERVE more, still
    pass theirs: a new session still opens (its worker sends descriptors to
    the daemon), where all opens failed before."""
    import time

    _, client = full
    with client.open_session(str(worktree), policy="fewfds") as session:
        # Soft and hard from its first instruction (set before its exec: proctree.spawn).
        limits = shell(session, "ulimit -Sn; ulimit -Hn")
        assert limits.output.split() == ["256", "256"], limits  # the commands' limit
        shell(session, f"/usr/bin/python3 -c {_q(INFLIGHT_HOG)} 20 > inflight.out", background=True)
        for _ in range(200):
            if (worktree / "inflight.out").exists() and (worktree / "inflight.out").read_text():
                break
            time.sleep(0.05)
        sent, err = (int(x) for x in (worktree / "inflight.out").read_text().split())
        assert err == errno.ETOOMANYREFS and 256 - 200 <= sent <= 256 + 253, (sent, err)
        other = worktree.parent / "other"
        other.mkdir()
        with client.open_session(str(other), policy="fewfds") as second:  # its worker passes descriptors
            assert shell(second, "echo ok").output == "ok\n"
    _daemon_serves(*full, worktree)


# Writes MiB into a memfd it never maps (its own memory stays a few MiB), then holds it.
MEMFD_HOG = r"""
import os, sys, time
fd = os.memfd_create("hog")
chunk = b"x" * 2**20
for _ in range(int(sys.argv[1])):
    os.write(fd, chunk)
print("written", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_memory_written_into_a_memfd_counts_against_the_session(
        full: tuple[Daemon, dispatch.Client], worktree: Path) -> None:
    _, client = full
    with client.open_session(str(worktree), policy="smallmem") as session:
        # The allowed twin: 16 MiB in a memfd, under the 64 MiB limit.
        small = shell(session, f"/usr/bin/python3 -c {_q(MEMFD_HOG)} 16 1", timeout=30)
        assert small.is_success and small.output == "written\n", small
    with client.open_session(str(worktree), policy="smallmem") as session:
        big = shell(session, f"/usr/bin/python3 -c {_q(MEMFD_HOG)} 96 30", timeout=30)
        assert big.is_failure and "memory watchdog" in big.error, big.error
    _daemon_serves(*full, worktree)


# Writes MiB into System V shared memory segments it detaches (no process
# maps them after), then holds them; with a third argument, a queue's bytes too.
SYSV_HOG = r"""
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
for _ in range(int(sys.argv[1]) // 8):
    sid = libc.shmget(0, 8 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    addr = libc.shmat(sid, None, 0)
    assert sid >= 0 and addr not in (None, 2**64 - 1), ctypes.get_errno()
    ctypes.memset(addr, 1, 8 << 20)
    libc.shmdt(ctypes.c_void_p(addr))
print("written", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_system_v_memory_no_process_maps_counts_against_the_session(
        full: tuple[Daemon, dispatch.Client], worktree: Path) -> None:
    _, client = full
    with client.open_session(str(worktree), policy="smallmem") as session:
        # The allowed twin: 16 MiB in detached segments, under the 64 MiB limit.
        small = shell(session, f"/usr/bin/python3 -c {_q(SYSV_HOG)} 16 1", timeout=30)
        assert small.is_success and small.output == "written\n", small
        assert shell(session, "echo ok").output == "ok\n"  # the segments stay; the session too
    with client.open_session(str(worktree), policy="smallmem") as session:
        # 96 MiB no process maps: before, the session went on holding them.
        big = shell(session, f"/usr/bin/python3 -c {_q(SYSV_HOG)} 96 30", timeout=30)
        assert big.is_failure and "memory watchdog" in big.error, big.error
    _daemon_serves(*full, worktree)


# Fills System V queues with empty messages (each a header the kernel keeps),
# or makes semaphore sets of 32,000, until about MiB of kernel memory; holds them.
SYSV_KERNEL_HOG = r"""
import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
mib, kind = int(sys.argv[1]), sys.argv[3]
if kind == "msg":
    buf = ctypes.create_string_buffer(ctypes.c_long(1).value.to_bytes(8, sys.byteorder) + bytes(8))  # mtype 1, no text
    for _ in range(max(1, mib * 2**20 // 64 // 16384)):
        q = libc.msgget(0, 0o1600)
        assert q >= 0, ctypes.get_errno()
        sent = 0
        while libc.msgsnd(q, buf, 0, 0o4000) == 0:  # IPC_NOWAIT: until the queue is full
            sent += 1
        assert sent > 0, ctypes.get_errno()
else:
    for _ in range(max(1, mib * 2**20 // 64 // 32000)):
        assert libc.semget(0, 32000, 0o1600) >= 0, ctypes.get_errno()
print("made", flush=True)
time.sleep(float(sys.argv[2]))
"""


@pytest.mark.parametrize("kind", ["msg", "sem"])
def test_system_v_queues_and_semaphores_count_what_the_kernel_keeps_for_them(
        full: tuple[Daemon, dispatch.Client], worktree: Path, kind: str) -> None:
    _, client = full
    with client.open_session(str(worktree), policy="smallmem") as session:
        # The allowed twin: about 8 MiB, under the 64 MiB limit.
        small = shell(session, f"/usr/bin/python3 -c {_q(SYSV_KERNEL_HOG)} 8 1 {kind}", timeout=60)
        assert small.is_success and small.output == "made\n", small
    with client.open_session(str(worktree), policy="smallmem") as session:
        big = shell(session, f"/usr/bin/python3 -c {_q(SYSV_KERNEL_HOG)} 160 30 {kind}", timeout=60)
        assert big.is_failure and "memory watchdog" in big.error, big.error
    _daemon_serves(*full, worktree)


# Makes semaphore sets of 32,000, then forks processes that each change every
# set once with SEM_UNDO (the kernel keeps an undo record of 64 KiB per set for
# each), and holds them until the processes end.
SEM_UNDO_HOG = r"""
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
class SemBuf(ctypes.Structure):
    _fields_ = [("num", ctypes.c_ushort), ("op", ctypes.c_short), ("flg", ctypes.c_short)]
sets, children, hold = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
ids = [libc.semget(0, 32000, 0o1600) for _ in range(sets)]
assert min(ids) >= 0, ctypes.get_errno()
up = SemBuf(31999, 1, 0x1000)  # SEM_UNDO
r, w = os.pipe()
for _ in range(children):
    if os.fork() == 0:
        os.close(r)
        for i in ids:
            assert libc.semop(i, ctypes.byref(up), 1) == 0, ctypes.get_errno()
        os.write(w, b"x")
        time.sleep(hold)
        os._exit(0)
os.close(w)
got = 0
while got < children:
    got += len(os.read(r, 4096))
print("held", flush=True)
for _ in range(children):
    os.wait()
"""


def test_semaphore_undo_records_count_for_every_task_that_may_hold_them(
        full: tuple[Daemon, dispatch.Client], worktree: Path) -> None:
    _, client = full
    with client.open_session(str(worktree), policy="smallmem") as session:
        # The allowed twin: 10 sets (20 MiB) and 5 processes holding undo
        # records for each (3 MiB), under the 64 MiB limit.
        small = shell(session, f"/usr/bin/python3 -c {_q(SEM_UNDO_HOG)} 10 5 1", timeout=60)
        assert small.is_success and small.output == "held\n", small
    with client.open_session(str(worktree), policy="smallmem") as session:
        # The same sets and 60 processes: 38 MiB of undo records besides
        # the sets and the processes' own 22 MiB. Before, the records went
        # uncounted and the session held them.
        big = shell(session, f"/usr/bin/python3 -c {_q(SEM_UNDO_HOG)} 10 60 30", timeout=60)
        assert big.is_failure and "memory watchdog" in big.error, big.error
    _daemon_serves(*full, worktree)
