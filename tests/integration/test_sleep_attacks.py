"""Sessions that sleep, read adversarially: a woken session is confined and
served as at its first start, whatever happened meanwhile."""

from __future__ import annotations

import contextlib
import os
import re
import resource
import select
import shlex
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import dispatch
from dispatchd import protocol
from dispatchd.worker.fork_server import ORPHAN_SWEEP_S
from tests.conftest import Daemon, shell
from tests.sleeping import daemon_with_policies


def _daemon(tmp_path: Path) -> Daemon:
    return daemon_with_policies(tmp_path, nap='description = "sleeps after 0.3 s"\n[limits]\nsleep_after_s = 0.3\n')


def _raw_channel(client: dispatch.Client, sid: str) -> protocol.FrameSocket:
    """A channel to session ``sid``, as frames (an attach through the client's connection)."""
    _, fd = client._daemon_request(lambda rid: protocol.Attach(id=rid, session=sid))
    assert fd is not None
    return protocol.FrameSocket(socket.socket(fileno=fd))


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _asleep(client: dispatch.Client, sid: str) -> bool:
    return any(s["id"] == sid and s.get("asleep") for s in client.list_sessions())


def _until_asleep(d: Daemon, client: dispatch.Client, sid: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not _asleep(client, sid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _asleep(client, sid), d.log()[-3000:]


def test_proc_after_a_wake_and_sleeps_again(tmp_path: Path, worktree: Path) -> None:
    """The woken /proc is granted as the first (it was refused: a rule on the
    directory it is mounted on does not cover it, Landlock's walk skips the
    mount point), and the session sleeps and wakes again, naps after naps
    (a pid namespace each: the budget holds)."""
    d = _daemon(tmp_path)
    try:
        with d.connect() as client:
            s = client.open_session(str(worktree), policy="nap")
            probe = "head -1 /proc/self/status; ls /proc | grep -c '^[0-9]'; echo out > /dev/stdout"
            before = shell(s, probe)
            assert before.is_success, before.error
            # Not counted: a wake for this first call. Its tool server's idle
            # time runs from its start, before the open's reply, and the
            # channel comes with the first call: on a loaded machine it may
            # sleep (0.3 s) before that call, which wakes it.
            woken = d.log().count(f"event=session_woken session={s.id}")
            for nap in range(6):
                _until_asleep(d, client, s.id)
                after = shell(s, probe)
                assert after.is_success, (nap, after.error, d.log()[-2000:])
                # /proc/self is the caller's own, and /proc lists the session's
                # pid namespace only: a few processes (how many of the
                # pipeline's have started when ls reads it varies), not the host's
                name, count, out = after.output.splitlines()
                assert (name, out) == ("Name:\thead", "out") and 2 <= int(count) <= 8, (nap, after.output)
            assert d.log().count(f"event=session_woken session={s.id}") - woken == 6, \
                "\n".join(line for line in d.log().splitlines() if f"session={s.id}" in line)
            # The fork server reaped every nap's pid 1 and intermediate: its
            # children are this session's pid 1 (if awake) and the pool's.
            fork_server = _children(d.proc.pid)
            assert len(fork_server) == 1, fork_server
            time.sleep(ORPHAN_SWEEP_S * 2)
            kids = _children(fork_server[0])
            states = {k: Path(f"/proc/{k}/stat").read_text().rsplit(")", 1)[1].split()[0] for k in kids}
            assert "Z" not in states.values(), states
            assert len(kids) <= 1 + 2 * 2, states  # the session (awake or not) and the pool: 2 kinds of 2
            s.detach()
    finally:
        assert d.stop() == 0, d.log()


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def _napping_with_channels(tmp_path: Path, worktree: Path
                           ) -> Iterator[tuple[Daemon, dispatch.Client, dispatch.Session, list[protocol.FrameSocket]]]:
    """A daemon, a client, a session of the "nap" policy that has served one
    call, and a list for the raw channels the test opens: closed, and the
    daemon stopped (cleanly), at the end."""
    d = _daemon(tmp_path)
    kept: list[protocol.FrameSocket] = []
    try:
        with d.connect() as client:
            s = client.open_session(str(worktree), policy="nap")
            assert shell(s, "true").is_success
            yield d, client, s, kept
            s.detach()
    finally:
        for frames in kept:
            frames.close()
        assert d.stop() == 0, d.log()


def test_an_out_of_band_byte_does_not_spin_the_watch(tmp_path: Path, worktree: Path) -> None:
    """A byte sent MSG_OOB to a sleeping session's channel: poll says
    readable, a peek finds nothing (the kernel skips the OOB byte). The watch
    spun on it at a whole CPU, and the session was never woken by it."""
    with _napping_with_channels(tmp_path, worktree) as (d, client, s, _):
        _until_asleep(d, client, s.id)
        s._channel._frames.sock.send(b"!", socket.MSG_OOB)  # type: ignore[union-attr]
        time.sleep(0.2)
        before = _cpu_s(d.proc.pid)
        time.sleep(1.0)
        used = _cpu_s(d.proc.pid) - before
        assert used < 0.3, f"the daemon used {used:.2f} s of CPU in 1 s with one sleeping session"
        # Woken by it at most once (its read drops the byte), then asleep again.
        assert d.log().count(f"event=session_woken session={s.id}") <= 1
        _until_asleep(d, client, s.id)
        r = shell(s, "echo after")  # the next request wakes it, whole
        assert r.is_success and r.output == "after\n", r.error


def _held(pid: int) -> dict[str, int]:
    """The daemon's descriptors of a wake kit's kinds: rulesets, namespaces."""
    counts: dict[str, int] = {}
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        kind = "ruleset" if "landlock-ruleset" in target else target.split(":")[0] if ":[" in target else ""
        if kind in ("ruleset", "user", "mnt", "ipc", "net"):
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def test_a_replaced_sandbox_lets_go_of_its_wake_kit(tmp_path: Path, worktree: Path) -> None:
    """A network switch that replaces the sandbox (to or from "domains") gives
    the session a new wake kit; the old one (ruleset, user, mount, IPC and
    network namespaces) was kept open for good: descriptors, and the old
    sandbox's namespaces with their mounts, held by the daemon for each switch."""
    d = _daemon(tmp_path)
    try:
        with d.connect() as client:
            s = client.open_session(str(worktree), policy="nap")
            assert shell(s, "true").is_success
            s.set_network("domains", domains=["example.com"])
            assert shell(s, "true").is_success
            s.set_network(False)
            assert shell(s, "true").is_success
            first = _held(d.proc.pid)
            for _ in range(3):
                s.set_network("domains", domains=["example.com"])
                assert shell(s, "true").is_success
                s.set_network(False)
                assert shell(s, "true").is_success
            now = _held(d.proc.pid)
            # The pool of sandboxes made ahead holds a user and a network
            # namespace of its own for each it keeps, refilled at its own
            # pace: one more or less of those between the two looks is the
            # pool, not a kit (a kit kept would be six more of each: every
            # switch above replaced the sandbox). Rulesets are the kits' alone.
            assert now.get("ruleset", 0) == first.get("ruleset", 0), (first, now)
            assert all(abs(now.get(k, 0) - first.get(k, 0)) <= 1 for k in ("user", "mnt", "ipc", "net")), (first, now)
            assert now.get("ruleset", 0) <= 1 + 4, now  # this session's kit (and the pool's, none kept)
            s.close()
            assert _held(d.proc.pid).get("ruleset", 0) == 0, _held(d.proc.pid)
    finally:
        assert d.stop() == 0, d.log()


def test_a_wake_that_fails_on_the_daemons_side_ends_the_session(tmp_path: Path, worktree: Path) -> None:
    """A wake that failed with an error other than the daemon's own (here the
    daemon out of descriptors: its socketpair for the new control channel,
    EMFILE) killed the wake's thread and left the session asleep, watched by
    nobody: its request never answered, never woken, never expired. It ends,
    saying why, as a wake that failed otherwise does."""
    with _napping_with_channels(tmp_path, worktree) as (d, client, s, _):
        _until_asleep(d, client, s.id)
        pid = d.proc.pid
        soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        done: list[dispatch.Result] = []
        caller = threading.Thread(target=lambda: done.append(shell(s, "echo woken")), daemon=True)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (3, hard))  # no new descriptor at all
        try:
            caller.start()
            deadline = time.monotonic() + 5
            while "event=wake_failed" not in d.log() and "Traceback" not in d.log() \
                    and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        caller.join(10)
        assert not caller.is_alive(), "the request hangs: the session is stuck asleep\n" + d.log()[-3000:]
        assert done and done[0].is_failure and "could not be woken" in done[0].error, done
        assert s.id not in [x["id"] for x in client.list_sessions()]


def test_the_watch_outlives_a_wake_it_could_not_start(tmp_path: Path, worktree: Path) -> None:
    """The daemon at its process limit when a request comes for a sleeping
    session: the wake's thread cannot start. That ended the one thread that
    watches every sleeping session: none woke again, their calls hung."""
    d = _daemon(tmp_path)
    try:
        with d.connect() as client:
            a = client.open_session(str(worktree), policy="nap")
            (tmp_path / "other").mkdir()
            b = client.open_session(str(tmp_path / "other"), policy="nap")
            assert shell(a, "true").is_success and shell(b, "true").is_success
            _until_asleep(d, client, a.id)
            _until_asleep(d, client, b.id)
            pid = d.proc.pid
            soft, hard = resource.prlimit(pid, resource.RLIMIT_NPROC)
            done: list[dispatch.Result] = []
            caller = threading.Thread(target=lambda: done.append(shell(a, "echo a")), daemon=True)
            resource.prlimit(pid, resource.RLIMIT_NPROC, (1, hard))  # no new thread in the daemon
            try:
                caller.start()
                time.sleep(1.0)
            finally:
                resource.prlimit(pid, resource.RLIMIT_NPROC, (soft, hard))
            woken: list[dispatch.Result] = []
            other = threading.Thread(target=lambda: woken.append(shell(b, "echo b")), daemon=True)
            other.start()
            other.join(10)
            assert woken and woken[0].is_success, "the other session is never woken\n" + d.log()[-3000:]
            caller.join(10)
            assert done and (done[0].is_success or "could not be woken" in done[0].error), done
            a.detach()
            b.detach()
    finally:
        assert d.stop() == 0, d.log()


_CONFINEMENT = r"""
for who in self 1; do
  grep -E '^(Cap(Inh|Prm|Eff|Bnd|Amb)|NoNewPrivs|Seccomp|Seccomp_filters|Uid|Gid|Groups):' /proc/$who/status | sed "s/^/$who /"
done
cat /proc/self/limits
for n in user mnt ipc net uts cgroup time; do echo "$n $(readlink /proc/self/ns/$n)"; done
cat /proc/self/cgroup
awk '{$1 = $2 = $3 = ""; print}' /proc/self/mountinfo | sort
touch /etc/dispatch-x 2>&1 | sed 's/.*: //'; ls /root 2>&1 | sed 's/.*: //'; ls /home 2>&1 | head -3
for f in fd environ maps; do ls /proc/1/$f > /dev/null 2>&1 && echo "1/$f readable" || echo "1/$f refused"; done
kill -TERM 1 2>&1 | sed 's/.*: //'; echo "pid 1 still here: $(test -d /proc/1 && echo yes)"
"""


def test_a_woken_session_is_confined_as_at_its_start(tmp_path: Path, worktree: Path) -> None:
    """What a command sees of its own and of the tool server's (pid 1's)
    confinement, before a sleep and after each of two wakes: the same
    capabilities, no_new_privs, seccomp filters, ids, limits, namespaces
    (user, mount, IPC, network, UTS, cgroup, time), cgroup, every mount and
    its options, and the
    same refusals; only the pid namespace is new, owned by the same user
    namespace."""
    d = _daemon(tmp_path)
    try:
        with d.connect() as client:
            s = client.open_session(str(worktree), policy="nap")
            owner = ("import fcntl, os; fd = os.open('/proc/self/ns/pid', os.O_RDONLY); "
                     "u = fcntl.ioctl(fd, 0xb701); print(os.fstat(u).st_ino == os.stat('/proc/self/ns/user').st_ino)")
            first = shell(s, _CONFINEMENT)
            assert first.is_success, first.error
            pid_ns = shell(s, "readlink /proc/self/ns/pid").output
            for _ in range(2):
                _until_asleep(d, client, s.id)
                again = shell(s, _CONFINEMENT)
                assert again.is_success, again.error
                assert again.output == first.output
                now = shell(s, "readlink /proc/self/ns/pid").output
                assert now != pid_ns
                pid_ns = now
                assert probe_out(s, owner) == "True"
            s.detach()
    finally:
        assert d.stop() == 0, d.log()


def probe_out(s: dispatch.Session, code: str) -> str:
    r = shell(s, f"python3 -c {shlex.quote(code)}")
    assert r.is_success, r.error
    return r.output.strip()


def test_a_sleep_after_beyond_a_timeval_still_serves(tmp_path: Path, worktree: Path) -> None:
    """limits.sleep_after_s is any finite number: one past what a socket
    timeout holds (a 64-bit count of seconds) made every channel the tool
    server was given fail (struct.error), so the session served nothing."""
    d = daemon_with_policies(tmp_path, late='description = "never sleeps in practice"\n[limits]\nsleep_after_s = 1e20\n')
    try:
        with d.connect() as client:
            s = client.open_session(str(worktree), policy="late")
            r = shell(s, "echo served")
            assert r.is_success and r.output == "served\n", (r.error, d.log()[-2000:])
            s.detach()
    finally:
        assert d.stop() == 0, d.log()


def test_a_tiny_sleep_after_neither_spins_nor_loops(tmp_path: Path, worktree: Path) -> None:
    """limits.sleep_after_s of a microsecond passes the policy's check. The
    woken tool server asked to sleep again before the daemon had handed it
    the channel that woke it, so it went back to sleep with the request
    unread, woke for it again, and so on, until the wakes came faster than
    the kernel frees pid namespaces (ENOSPC): the session ended without
    serving its first call. The least idle time (MIN_SLEEP_AFTER_S) did not
    end that on a loaded machine: a daemon slower than 50 ms to hand back the
    channel still saw the woken server ask to sleep first, and it woke twice
    or three times a call; it is now told to stay awake until it has taken
    every channel sent to it (MaySleep.added). And a tool server kept awake
    (a process in the background) ran its idle check every half microsecond:
    a whole CPU."""
    d = daemon_with_policies(tmp_path, tiny='description = "sleeps at once"\n[limits]\nsleep_after_s = 0.000001\n')
    try:
        with d.connect() as client:
            s = client.open_session(str(worktree), policy="tiny")
            for i in range(3):
                time.sleep(0.3)
                r = shell(s, f"echo {i}")
                assert r.is_success and r.output == f"{i}\n", r.error
            # One wake a call at most, and each serves its call: a wake then
            # a sleep with no write_lock (each shell_exec of a woken tool
            # server asks for it) between them slept with the request unread.
            events = [line for line in d.log().splitlines() if f"session={s.id}" in line]
            assert sum("event=session_woken" in line for line in events) <= 3, "\n".join(events)
            kinds = [k for line in events for k in ("session_woken", "write_lock", "session_asleep")
                     if f"event={k} " in line]
            assert ("session_woken", "session_asleep") not in zip(kinds, kinds[1:]), "\n".join(events)
            assert shell(s, "sleep 60 > /dev/null 2>&1", background=True).is_success  # awake while it runs
            time.sleep(0.3)
            pid = d.worker_pid(s.id)
            before = _cpu_s(pid)
            time.sleep(1.0)
            used = _cpu_s(pid) - before
            assert used < 0.2, f"an idle tool server used {used:.2f} s of CPU in 1 s"
            s.detach()
    finally:
        assert d.stop() == 0, d.log()


def test_replies_left_unread_do_not_use_up_the_wakes(tmp_path: Path, worktree: Path) -> None:
    """A reply left unread in a client's socket holds its sender's pid: a
    client that leaves one after each of several naps (a handle given up
    but not closed) must not use up the session's pid namespaces (a budget
    of 4 at a wake). Checked: the kernel does not count them."""
    with _napping_with_channels(tmp_path, worktree) as (d, client, s, kept):
        for nap in range(6):
            _until_asleep(d, client, s.id)
            frames = _raw_channel(client, s.id)
            kept.append(frames)
            frames.send(protocol.CallTool(id=1, tool="read_file", params={"path": "README.md"}))
            assert _readable_now(frames, 30), (nap, d.log()[-1500:])  # answered; left unread
        _until_asleep(d, client, s.id)
        r = shell(s, "echo served")
        assert r.is_success and r.output == "served\n", (r.error, d.log()[-1500:])


def _readable_now(frames: protocol.FrameSocket, timeout: float = 0.0) -> bool:
    return bool(select.select([frames.sock], [], [], timeout)[0])


def test_naps_in_quick_succession(tmp_path: Path, worktree: Path) -> None:
    """Sleeps and wakes as fast as a policy allows (sleep_after_s at its least,
    a call right after each sleep): the pid namespaces of ended naps, which
    the kernel frees a while later, do not use up the wake's budget."""
    d = daemon_with_policies(tmp_path, quick='description = "sleeps at once"\n[limits]\nsleep_after_s = 0.05\n')
    try:
        with d.connect() as client:
            s = client.open_session(str(worktree), policy="quick")
            woken = 0
            for i in range(30):
                deadline = time.monotonic() + 30
                while d.log().count(f"event=session_asleep session={s.id}") <= woken and time.monotonic() < deadline:
                    time.sleep(0.002)
                r = shell(s, f"echo {i}")
                assert r.is_success and r.output == f"{i}\n", (i, r.error)
                woken = d.log().count(f"event=session_woken session={s.id}")
            assert woken >= 20, woken
            s.detach()
    finally:
        assert d.stop() == 0, d.log()


def test_more_channels_than_one_message_carries(tmp_path: Path, worktree: Path) -> None:
    """More channels than one message's 253 descriptors: handed over in two
    messages, every one held while asleep and served again after."""
    with _napping_with_channels(tmp_path, worktree) as (d, client, s, kept):
        for _ in range(255):
            kept.append(_raw_channel(client, s.id))
        for nap in range(5):
            _until_asleep(d, client, s.id)
            if re.findall(rf"event=session_asleep session={s.id} channels=(\d+)", d.log())[-1] == "256":
                break
            # It slept while the channels were being attached (a loaded machine):
            # those attached since are the daemon's. A call wakes it with all of
            # them, and its next sleep hands every one over.
            kept[0].send(protocol.CallTool(id=100 + nap, tool="read_file", params={"path": "README.md"}))
            kept[0].sock.settimeout(30)
            assert kept[0].recv(protocol.channel_reply_decoder).success
        assert re.findall(rf"event=session_asleep session={s.id} channels=(\d+)", d.log())[-1] == "256"
        for i, frames in enumerate([kept[0], kept[200], kept[-1]]):
            frames.send(protocol.CallTool(id=i + 1, tool="read_file", params={"path": "README.md"}))
        for i, frames in enumerate([kept[0], kept[200], kept[-1]]):
            frames.sock.settimeout(30)
            msg = frames.recv(protocol.channel_reply_decoder)
            assert isinstance(msg, protocol.ToolReply) and msg.id == i + 1 and msg.success, msg
