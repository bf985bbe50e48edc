"""Escapes through a network stack that forks: a switch to "off" leaves no way out.

A slirp4netns taken over through a crafted packet can fork (slirp4netns must
fork at its start, so its confinement cannot refuse it: docs/network.md, "A
stack that forks"); the process it forked holds the tap device as well as
the stack did. The stand-in here is such a stack: the process the daemon
starts forks, its child runs the real slirp4netns with the same arguments
and descriptors, and the parent waits. After ``set_network("off")``
returns, the session has no interface but its loopback, reaches nothing,
and nothing of the stack is left; the twin is the real slirp4netns, which
does not fork past its start. A stack that forks a chain (each link
waits, and the link below it forks again as soon as its parent is gone)
ends, all of it, with a switch to "off", a close and the daemon's stop.
The last test is the look the daemon takes into the namespace once the
stack was stopped, on namespaces of its own.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

import dispatch
from tests.conftest import Daemon, _refuse_root, probe
from tests.listeners import Greeter

# The option names are in the file, so that the daemon's probe takes it for
# a slirp4netns that knows them (stacks.slirp4netns_lacks).
_FORKING_STACK = r"""
#include <stdio.h>
#include <unistd.h>
__attribute__((used)) const char opts[] = "configure\0mtu\0ready-fd\0enable-seccomp\0netns-type\0userns-path\0";
int main(int argc, char **argv) {
    (void)argc; (void)opts;
    pid_t child = fork();
    if (child < 0) { perror("fork"); return 1; }
    if (child == 0) { execv(REAL, argv); perror("execv"); _exit(127); }
    for (;;) pause();
}
"""
# A chain: the process the daemon starts runs the real slirp4netns in a child
# and starts a link; each link forks one child and waits; a child whose
# parent is gone (now the fork server's) forks at once, so ending direct
# children alone never ends it. Each second the bottom link connects to the
# host's loopback (BEACON). It ends itself after 40 s, whatever happens.
_CHAIN_STACK = r"""
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
__attribute__((used)) const char opts[] = "configure\0mtu\0ready-fd\0enable-seccomp\0netns-type\0userns-path\0";
static time_t end_at;
static void beacon(void) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET; a.sin_port = htons(BEACON); a.sin_addr.s_addr = htonl(0x7f000001);
    if (s >= 0) { (void)!connect(s, (struct sockaddr *)&a, sizeof a); close(s); }
}
static void chain(void) {
    for (;;) {
        pid_t parent = getpid();
        pid_t child = fork();
        if (child < 0) continue;
        if (child > 0) for (;;) { sleep(1); if (time(NULL) > end_at) _exit(0); }
        time_t last = 0;
        while (getppid() == parent) {
            if (time(NULL) > end_at) _exit(0);
            if (time(NULL) != last) { last = time(NULL); beacon(); }
            sched_yield();  /* spins: it forks the moment its parent is gone */
        }
    }
}
int main(int argc, char **argv) {
    (void)argc; (void)opts;
    end_at = time(NULL) + 40;
    if (fork() == 0) { execv(REAL, argv); perror("execv"); _exit(127); }
    if (fork() == 0) chain();
    for (;;) pause();
}
"""
ENETUNREACH = 101
INTERFACES = "import socket; print(' '.join(sorted(name for _, name in socket.if_nameindex())))"


@pytest.fixture(scope="module")
def greeter() -> Iterator[Greeter]:
    served = Greeter()
    yield served
    served.close()


def _stack_processes(daemon: Daemon) -> list[psutil.Process]:
    return [p for p in psutil.Process(daemon.proc.pid).children(recursive=True) if p.name() == "slirp4netns"]


def _stand_in(tmp_path: Path, source: str, *defines: str) -> Path:
    """A stand-in for slirp4netns built from ``source`` (C, running the real
    one as REAL) as ``tmp_path/bin/slirp4netns``; returns that ``bin``.
    Skipped where slirp4netns or gcc is missing (./scripts/test installs both)."""
    real = shutil.which("slirp4netns")
    if real is None or shutil.which("gcc") is None:
        pytest.skip("needs slirp4netns and gcc (./scripts/test installs both)")
    (tmp_path / "bin").mkdir()
    (tmp_path / "stand_in.c").write_text(source)
    subprocess.run(["gcc", "-O0", f'-DREAL="{os.path.realpath(real)}"', *defines, "-o",
                    str(tmp_path / "bin" / "slirp4netns"), str(tmp_path / "stand_in.c")], check=True)
    return tmp_path / "bin"


@pytest.mark.parametrize("stack", ["forks", "does not fork"])
def test_a_switch_to_off_leaves_no_way_out_when_the_stack_forked(stack: str, tmp_path: Path, worktree: Path,
                                                                  greeter: Greeter) -> None:
    _refuse_root()
    built = _stand_in(tmp_path, _FORKING_STACK)  # for both alike: the twin's PATH leaves it out
    path = os.environ["PATH"]
    if stack == "forks":
        path = f"{built}:{path}"
    (tmp_path / "d").mkdir()
    d = Daemon(tmp_path / "d", "--network-stack", "slirp4netns", "--pool", "0", prefix=("env", f"PATH={path}"))
    try:
        with d.connect() as client, client.open_session(str(worktree), network=True) as s:
            reach = (f"import socket\ntry:\n    s = socket.create_connection(('10.0.2.2', {greeter.port}), timeout=5)\n"
                     "    print('connected', s.recv(16).decode())\nexcept OSError as e:\n    print('error', e.errno)")
            assert probe(s, reach) == "connected hello"
            # The stand-in and its child (slirp4netns's own, which joins the
            # namespace, has exited by the time it is ready).
            stacks = _stack_processes(d)
            assert len(stacks) == (2 if stack == "forks" else 1)
            forked = [str(p.pid) for p in stacks if p.ppid() in {q.pid for q in stacks}]
            assert probe(s, INTERFACES) == "eth0 lo"
            accepted = greeter.accepted
            assert s.set_network(False) is False
            assert s.status()["network"]["mode"] == "off"
            assert "its way out (slirp4netns) was stopped: every connection outside the session is cut" \
                in s.status()["note"]
            # Nothing of the stack is left, its fork included: each was
            # waited for before the switch returned.
            assert _stack_processes(d) == []
            assert probe(s, INTERFACES) == "lo"
            assert probe(s, reach) == f"error {ENETUNREACH}"
            assert greeter.accepted == accepted
        left = re.findall(r"ended (\d+) process\(es\) a stopped network stack had left behind \(pids ([\d ]+)\)",
                          d.log())
        if stack == "forks":
            # Said by the switch; or, when the fork server's half-second
            # sweep came first (between the stack's death and the switch's
            # request), ended by that sweep, unsaid: gone either way (above).
            assert left in ([("1", forked[0])], []), left
        else:
            assert left == [] and forked == []
        assert "event=stack_outlived" not in d.log()
    finally:
        assert d.stop() == 0, d.log()


def _chain_links(binary: Path) -> list[int]:
    """The live processes of the chain stand-in (the links are forks of it)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.exe() == str(binary) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except psutil.Error:
            continue
    return found


def _wait_for(what: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if what():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("end", ["switch to off", "close", "daemon's stop"])
def test_a_stack_s_fork_chain_ends_all_of_it(end: str, tmp_path: Path, worktree: Path, greeter: Greeter) -> None:
    """Every link of the chain is gone when the switch returns (within a
    short bound after a close or the daemon's stop, which end it off their
    reply's path), and no beacon reaches the host's loopback afterwards.
    The twin: the real slirp4netns's switch (above), and the chain's beacons
    arriving while the session is on."""
    _refuse_root()
    binary = _stand_in(tmp_path, _CHAIN_STACK, f"-DBEACON={greeter.port}") / "slirp4netns"
    (tmp_path / "d").mkdir()
    d = Daemon(tmp_path / "d", "--network-stack", "slirp4netns", "--pool", "0",
               prefix=("env", f"PATH={tmp_path / 'bin'}:{os.environ['PATH']}"))
    stopped = False
    try:
        with d.connect() as client:
            s = client.open_session(str(worktree), network=True)
            before = greeter.accepted
            assert _wait_for(lambda: greeter.accepted > before, 5), "the chain's beacon never came"
            assert len(_chain_links(binary)) >= 3  # the stand-in, a waiting link, the bottom one
            assert probe(s, INTERFACES) == "eth0 lo"
            if end == "switch to off":
                assert s.set_network(False) is False
                assert _chain_links(binary) == []  # waited for before the switch returned
                assert probe(s, INTERFACES) == "lo"
                s.close()
            elif end == "close":
                s.close()
            else:
                assert d.stop() == 0, d.log()
                stopped = True
                s.detach()  # the handle's channel, to a sandbox gone with the daemon
        assert _wait_for(lambda: _chain_links(binary) == [], 3), _chain_links(binary)
        after = greeter.accepted
        time.sleep(2.5)  # a beacon a second while a bottom link lives
        assert greeter.accepted == after
        assert "event=stack_outlived" not in d.log()
    finally:
        if not stopped:
            assert d.stop() == 0, d.log()
        for pid in _chain_links(binary):  # a failed run's links, ours: by pid
            os.kill(pid, 9)


_HOLDER = r"""
import ctypes, fcntl, os, socket, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.getuid(), os.getgid()
if libc.unshare(0x10000000 | 0x40000000) != 0:  # CLONE_NEWUSER | CLONE_NEWNET
    sys.exit("unshare: " + os.strerror(ctypes.get_errno()))
open("/proc/self/setgroups", "w").write("deny")
open("/proc/self/uid_map", "w").write(f"0 {uid} 1")
open("/proc/self/gid_map", "w").write(f"0 {gid} 1")
def up(name):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sh14x", fcntl.ioctl(s, 0x8913, struct.pack("16sh14x", name, 0)))[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sh14x", name, flags | 1))
up(b"lo")
if sys.argv[1] == "tap":  # a tap device up, as a stack's eth0
    tun = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(tun, 0x400454ca, struct.pack("16sH22x", b"eth0", 0x0002 | 0x1000))  # TUNSETIFF, IFF_TAP|IFF_NO_PI
    up(b"eth0")
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("holds", ["tap", "loopback only"])
def test_the_look_after_a_stop_names_an_interface_still_up(holds: str) -> None:
    """``netstack.links_up_in``, in a child that joins the namespaces as the
    fork server's does: a tap device up is named, a namespace with its
    loopback alone is closed ("")."""
    _refuse_root()
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, "tap" if holds == "tap" else "lo"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        userns = os.open(f"/proc/{holder.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        netns = os.open(f"/proc/{holder.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # single-threaded, as the fork server's child is
            try:
                from dispatchd.confine import netstack

                os.write(write, netstack.links_up_in(userns, netns).encode() or b"closed")
            finally:
                os._exit(0)
        os.close(write)
        os.waitpid(child, 0)
        said = os.read(read, 4096).decode()
        os.close(read)
        os.close(userns)
        os.close(netns)
    finally:
        holder.communicate(timeout=30)
    assert said == ("eth0 still up" if holds == "tap" else "closed")


# A stack that leaves an interface up in the session's namespace, which no
# end of its processes takes down: before it runs the real slirp4netns, a
# child joins the session's namespaces (by the descriptors the daemon gave
# the stack) and makes a persistent tap device, "eth1", up, then exits. Its
# twin is the real slirp4netns (the first test of this file).
_PERSISTING_STACK = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <linux/if_tun.h>
#include <net/if.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
__attribute__((used)) const char opts[] = "configure\0mtu\0ready-fd\0enable-seccomp\0netns-type\0userns-path\0";
static int persist_up(const char *userns, const char *netns) {
    int u = open(userns, O_RDONLY), n = open(netns, O_RDONLY);
    if (u < 0 || n < 0) return 2;
    if (setns(u, CLONE_NEWUSER) != 0 || setns(n, CLONE_NEWNET) != 0) return 3;
    struct ifreq r;
    memset(&r, 0, sizeof r);
    strcpy(r.ifr_name, "eth1");
    r.ifr_flags = IFF_TAP | IFF_NO_PI;
    int t = open("/dev/net/tun", O_RDWR);
    if (t < 0 || ioctl(t, TUNSETIFF, &r) != 0 || ioctl(t, TUNSETPERSIST, 1) != 0) return 4;
    int s = socket(AF_INET, SOCK_DGRAM, 0);
    if (s < 0 || ioctl(s, SIOCGIFFLAGS, &r) != 0) return 5;
    r.ifr_flags |= IFF_UP;
    return ioctl(s, SIOCSIFFLAGS, &r) != 0 ? 6 : 0;
}
int main(int argc, char **argv) {
    const char *userns = NULL;
    for (int i = 1; i < argc; i++)
        if (strncmp(argv[i], "--userns-path=", 14) == 0) userns = argv[i] + 14;
    pid_t child = fork();
    if (child < 0) { perror("fork"); return 1; }
    if (child == 0) _exit(persist_up(userns, argv[argc - 2]));
    int status = 0;
    if (waitpid(child, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "stand-in: eth1 not made (%d)\n", status);
        return 1;
    }
    execv(REAL, argv);
    perror("execv");
    return 127;
}
"""


def test_a_switch_to_off_that_finds_an_interface_still_up_ends_the_session(tmp_path: Path, worktree: Path) -> None:
    """The switch's look fails closed: with eth1 still up once the stack and
    all it forked are gone, ``set_network(False)`` is refused naming the
    interface, the session is ended (never left running, said to be off,
    with a way out), and the daemon says why and serves the next open. The
    twin is the real slirp4netns's switch, which passes the same look
    (``test_a_switch_to_off_leaves_no_way_out_when_the_stack_forked``)."""
    _refuse_root()
    _stand_in(tmp_path, _PERSISTING_STACK)
    (tmp_path / "d").mkdir()
    d = Daemon(tmp_path / "d", "--network-stack", "slirp4netns", "--pool", "0",
               prefix=("env", f"PATH={tmp_path / 'bin'}:{os.environ['PATH']}"))
    try:
        with d.connect() as client, client.open_session(str(worktree), network=True) as s:
            assert probe(s, INTERFACES) == "eth0 eth1 lo"
            with pytest.raises(dispatch.RequestFailed) as refused:
                s.set_network(False)
            assert refused.value.code == "confinement_failed", refused.value
            assert "cannot apply network: stop slirp4netns: its way out is not gone (eth1 still up); " \
                   "the session was ended" in str(refused.value)
            with pytest.raises(dispatch.RequestFailed) as gone:
                client.session(s.id)
            assert "its network could not be switched to off" in str(gone.value)
            assert re.search(rf"event=stack_outlived session={s.id} stack=slirp4netns pid=\d+ error=eth1 still up",
                             d.log()), d.log()
            with client.open_session(str(worktree)) as after:
                assert probe(after, INTERFACES) == "lo"
            # The handle's close, at the end of the block, of a session the
            # daemon ended: its channel let go, nothing asked of the daemon.
    finally:
        assert d.stop() == 0, d.log()
