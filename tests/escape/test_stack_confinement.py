"""Escapes through the network stack: slirp4netns taken over by a crafted packet.

A session with the network on sends packets that slirp4netns (libslirp)
parses, outside the sandbox, as the user. Were a bug there to give the
session code execution in it, that code would run under the confinement the
fork server applies before the exec (``stacks.confine_stack``): these tests
apply the same confinement, planned as the daemon plans it, to a process of
their own and try from there what such code would try. Each attempt's twin
runs in the same process before the confinement, or is the allowed case
inside it, so a broken probe cannot pass. The last test reads the running
stack of a real daemon: the confinement is there, and its own filter on top.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from errno import EACCES, ECONNREFUSED, EPERM
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, Daemon, fork_server_of, probe, _refuse_root, wait_until
from tests.listeners import Greeter

# Run by a fresh interpreter: the attempts, each as "before" (unconfined, the
# twin) and "after" (confined), printed as JSON. What the attempts import is
# imported before the confinement (the modules live below the user's home,
# which Landlock then refuses).
#
# Run with "fork", it confines itself as the fork path of the stack's launch
# does (``stacks.confine_stack``, in Python, after a fork); run with "once",
# it makes the attempts once, as it was started: by the launch by vfork
# (``tools/_confined.c``), confined before its exec, or unconfined (the twin).
_PROBE = textwrap.dedent("""
    import ctypes, errno, json, os, socket, sys
    if sys.argv[1] == "fork":
        sys.path.insert(0, {repo!r})
        from dispatchd.confine import seccomp, stacks
        from dispatchd.confine.landlock import landlock_abi

    secret, home, unix_path, tcp_port, victim = {secret!r}, {home!r}, {unix_path!r}, {tcp_port!r}, {victim!r}
    libc = ctypes.CDLL(None, use_errno=True)

    def run(fn):
        try:
            out = fn()
            return "ok" if out is None else out
        except OSError as exc:
            return f"error {{exc.errno}}"

    def read_secret():
        with open(secret, "rb") as f:
            return "read " + f.read().decode()

    def write_beside():
        with open(secret + ".new", "wb") as f:
            f.write(b"x")

    def unix_connect():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(unix_path)

    def abstract_connect():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect("\\0dispatchd-test-absent")

    def tcp_connect():
        with socket.create_connection(("127.0.0.1", tcp_port), timeout=5) as s:
            return "connected " + s.recv(16).decode().strip()

    def netlink():
        socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0).close()

    def signal_victim():
        os.kill(victim, 0)

    # Traced: a child of this process, which any ptrace scope lets a parent trace.
    # It dies with this process, and holds none of its output open.
    tracee = os.fork()
    if tracee == 0:
        import time
        libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 1)
        os.dup2(null, 2)
        time.sleep(60)
        os._exit(0)

    def ptrace_tracee():
        if libc.ptrace(16, tracee, 0, 0) != 0:  # PTRACE_ATTACH
            raise OSError(ctypes.get_errno(), "ptrace")
        os.waitpid(tracee, 0)  # stopped by the attach
        libc.ptrace(17, tracee, 0, 0)  # PTRACE_DETACH

    def new_user_namespace():
        # In a child of its own: this process stays where it is for the rest.
        child = os.fork()
        if child == 0:
            os._exit(0 if libc.unshare(0x10000000) == 0 else ctypes.get_errno())
        code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
        if code:
            raise OSError(code, "unshare")

    def chmod_secret():
        os.chmod(secret, 0o600)  # its mode already: the twin changes nothing

    def truncate_secret():
        os.truncate(secret, 6)  # its length already

    def limit_victim():
        import resource
        resource.prlimit(victim, resource.RLIMIT_CORE, resource.prlimit(victim, resource.RLIMIT_CORE))

    def renice_victim():
        os.setpriority(os.PRIO_PROCESS, victim, os.getpriority(os.PRIO_PROCESS, victim))

    def sigio_to_victim():
        import fcntl
        a, b = socket.socketpair()
        try:
            fcntl.fcntl(a, fcntl.F_SETOWN, victim)
        finally:
            a.close(); b.close()

    def watch_home():
        fd = libc.inotify_init1(0)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        os.close(fd)

    def tcp_listen():
        with socket.socket() as s:
            s.listen(1)

    def tcp_bind():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))

    def fork_once():
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)

    def stat_secret():
        return "size %d" % os.stat(secret).st_size

    def tun():
        os.close(os.open("/dev/net/tun", os.O_RDWR))

    def read_system():
        with open("/usr/bin/env", "rb") as f:
            return "read %d" % len(f.read(4))

    attempts = {{
        "read a file of the user's": read_secret,
        "write beside it": write_beside,
        "list the home directory": lambda: "listed" if os.listdir(home) is not None else "",
        "read /proc": lambda: "read " + open("/proc/self/status").read()[:4],
        "connect to a named Unix socket": unix_connect,
        "connect to an abstract Unix socket": abstract_connect,
        "open a netlink socket": netlink,
        "signal a process of the user's": signal_victim,
        "trace a process of the user's": ptrace_tracee,
        "make a user namespace": new_user_namespace,
        "change a file's mode": chmod_secret,
        "truncate a file": truncate_secret,
        "set a process's limits": limit_victim,
        "set a process's priority": renice_victim,
        "steer SIGIO to a process": sigio_to_victim,
        "watch files": watch_home,
        "listen on the host's network": tcp_listen,
        "bind a TCP port on the host's network": tcp_bind,
        "fork": fork_once,
        "stat a file of the user's": stat_secret,
        "connect to the host's loopback over TCP": tcp_connect,
        "open the tun device": tun,
        "read the system's programs": read_system,
    }}
    if sys.argv[1] == "once":
        print(json.dumps({{name: run(fn) for name, fn in attempts.items()}}))
        sys.exit(0)
    before = {{name: run(fn) for name, fn in attempts.items()}}
    plan = stacks.plan_stack_confinement("slirp4netns", landlock_abi=landlock_abi(),
                                         executable=os.path.realpath({executable!r}))
    stacks.confine_stack(plan, seccomp.compile_seccomp(plan.seccomp))
    after = {{name: run(fn) for name, fn in attempts.items()}}
    print(json.dumps({{"before": before, "after": after}}))
""")


@pytest.fixture(scope="module", params=["fork", "vfork"])
def outcome(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """What each attempt got before and after the stack's confinement, as
    each launch applies it: the fork's child confining itself in Python, and
    the vfork's child confined before its exec (the daemon's way where the C
    helper is built)."""
    _refuse_root()
    if shutil.which("slirp4netns") is None:
        pytest.fail("slirp4netns is not installed: the set-up installs it (scripts/_common.sh)", pytrace=False)
    base = tmp_path_factory.mktemp("stack")
    secret = base / "id_ed25519"
    secret.write_text("SECRET")
    unix_path = str(base / "agent.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(unix_path)
    listener.listen(4)
    greeter = Greeter()
    victim = subprocess.Popen(["sleep", "60"])
    try:
        code = _PROBE.format(repo=str(REPO), secret=str(secret), home=str(Path.home()), unix_path=unix_path,
                             tcp_port=greeter.port, victim=victim.pid, executable=shutil.which("slirp4netns"))
        if request.param == "vfork":
            return {"before": _once(code), "after": _once_by_vfork(code)}
        out = subprocess.run([sys.executable, "-c", code, "fork"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        result: dict[str, dict[str, str]] = json.loads(out.stdout)
        return result
    finally:
        victim.kill()
        victim.wait()
        greeter.close()
        listener.close()


@pytest.mark.parametrize("attempt, before, after", [
    ("read a file of the user's", "read SECRET", f"error {EACCES}"),
    ("write beside it", "ok", f"error {EACCES}"),
    ("list the home directory", "listed", f"error {EACCES}"),
    ("read /proc", "read Name", f"error {EACCES}"),
    ("connect to a named Unix socket", "ok", f"error {EPERM}"),
    ("open a netlink socket", "ok", f"error {EPERM}"),
    ("signal a process of the user's", "ok", f"error {EPERM}"),
    ("change a file's mode", "ok", f"error {EPERM}"),
    ("truncate a file", "ok", f"error {EPERM}"),
    ("set a process's limits", "ok", f"error {EPERM}"),
    ("set a process's priority", "ok", f"error {EPERM}"),
    ("steer SIGIO to a process", "ok", f"error {EPERM}"),
    ("watch files", "ok", f"error {EPERM}"),
    ("listen on the host's network", "ok", f"error {EPERM}"),
    ("bind a TCP port on the host's network", "ok", f"error {EACCES}"),
])
def test_a_stack_taken_over_reaches_nothing_of_the_users(outcome, attempt: str, before: str, after: str) -> None:
    assert (outcome["before"][attempt], outcome["after"][attempt]) == (before, after)


@pytest.mark.parametrize("attempt, before, after", [
    ("trace a process of the user's", "ok", f"error {EPERM}"),  # its own child: any ptrace scope allows it before
    ("make a user namespace", "ok", f"error {EPERM}"),
    ("connect to an abstract Unix socket", f"error {ECONNREFUSED}", f"error {EPERM}"),  # before: no such name
])
def test_a_stack_taken_over_cannot_trace_or_make_namespaces(outcome, attempt: str, before: str, after: str) -> None:
    assert (outcome["before"][attempt], outcome["after"][attempt]) == (before, after)


@pytest.mark.parametrize("attempt, expected", [
    ("connect to the host's loopback over TCP", "connected hello"),  # its work: the host's loopback at the gateway
    ("open the tun device", "ok"),
    ("read the system's programs", "read 4"),
])
def test_what_the_stack_needs_still_works_confined(outcome, attempt: str, expected: str) -> None:
    assert (outcome["before"][attempt], outcome["after"][attempt]) == (expected, expected)


@pytest.mark.known_limit
def test_a_stack_taken_over_can_fork_and_stat_known_limit(outcome) -> None:
    """What the confinement leaves: slirp4netns forks its child after our
    filter is installed (so ``fork`` cannot be refused), and a taken-over
    stack could fork more: up to its session's ``pids.max`` where the session
    has a cgroup (tests/integration/test_cgroups.py), else up to the user's
    process limit; it can ``stat`` a path it can name (the size, never the
    contents or a listing: the attempts above). pasta's own allowlist
    refuses both."""
    assert (outcome["before"]["fork"], outcome["after"]["fork"]) == ("ok", "ok")
    assert (outcome["before"]["stat a file of the user's"], outcome["after"]["stat a file of the user's"]) == (
        "size 6", "size 6")


# The system's interpreter, isolated: the confined probe reads nothing below
# the home directory (a venv's site-packages, the user's).
_PYTHON = ["/usr/bin/python3", "-I", "-c"]


def _once(code: str) -> dict[str, str]:
    """The attempts made once, unconfined: the twin of ``_once_by_vfork``."""
    out = subprocess.run([*_PYTHON, code, "once"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result: dict[str, str] = json.loads(out.stdout)
    return result


def _once_by_vfork(code: str) -> dict[str, str]:
    """The attempts made once by a process the launch by vfork started under
    the stack's confinement, planned as the daemon plans it."""
    from dispatchd.confine import landlock, seccomp, stacks
    from dispatchd.tools import native

    if native.lines is None:
        pytest.fail("the C helper is not built: the set-up builds it (gcc, python3-dev)", pytrace=False)
    plan = stacks.plan_stack_confinement("slirp4netns", landlock_abi=landlock.landlock_abi(),
                                         executable=os.path.realpath(shutil.which("slirp4netns") or "slirp4netns"))
    assert plan is not None
    ruleset = landlock.build_ruleset(plan.landlock)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        pid = native.lines.spawn_confined(
            os.fsencode(_PYTHON[0]), [os.fsencode(a) for a in [*_PYTHON, code, "once"]],
            [b"PATH=/usr/bin:/bin", b"LC_ALL=C"], null, out_w, err_w, [], -1, stacks.stack_limits(plan),
            ruleset, seccomp.compile_seccomp(plan.seccomp), os.getpid())
    finally:
        for fd in (ruleset, out_w, err_w, null):
            os.close(fd)
    with os.fdopen(out_r, "rb") as out, os.fdopen(err_r, "rb") as err:
        printed, complaint = out.read(), err.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, complaint.decode(errors="replace")
    result: dict[str, str] = json.loads(printed)
    return result


def _limits(pid: int) -> dict[str, tuple[str, str]]:
    """The file size, data and core limits of ``pid`` (soft, hard), from /proc."""
    with open(f"/proc/{pid}/limits", encoding="ascii") as f:
        rows = f.read().splitlines()[1:]
    names = ("Max file size", "Max data size", "Max core file size")
    return {name: tuple(row[len(name):].split()[:2]) for row in rows for name in names
            if row.startswith(name + " ")}


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def test_the_running_stack_is_confined_and_filtered_twice(tmp_path: Path, worktree: Path) -> None:
    """A real daemon's slirp4netns: no new privileges, two seccomp filters
    (the fork server's, then its own --enable-seccomp), its limits, and none
    of the daemon's environment (a token exported where it was started). The
    twin: the daemon itself has neither filter, nor those limits, and has the
    token."""
    _refuse_root()
    greeter = Greeter()
    canary = "DISPATCH_TEST_TOKEN=s3cr3t"
    d = Daemon(tmp_path, "--network-stack", "slirp4netns", "--pool", "0", prefix=("env", canary))
    try:
        with d.connect() as client, client.open_session(str(worktree), network="on") as session:
            code = (f"import socket; s = socket.create_connection(('10.0.2.2', {greeter.port}), timeout=10); "
                    "print('connected', s.recv(16).decode())")
            assert probe(session, code) == "connected hello"
            fork_server = fork_server_of(d.proc.pid)
            found: list[psutil.Process] = []
            assert wait_until(lambda: found.extend(c for c in fork_server.children() if c.name() == "slirp4netns")
                              or found), fork_server.children()
            stack = _status(found[0].pid)
            assert (stack["NoNewPrivs"], stack["Seccomp"], stack["Seccomp_filters"]) == ("1", "2", "2")
            assert stack["CapEff"] == stack["CapPrm"] == "0000000000000000"
            # Its limits, soft = hard (stacks.stack_limits); the daemon's own are not.
            assert _limits(found[0].pid) == {"Max file size": ("1048576", "1048576"),
                                             "Max data size": ("1073741824", "1073741824"),
                                             "Max core file size": ("0", "0")}
            assert _limits(d.proc.pid)["Max file size"] == ("unlimited", "unlimited")
            with open(f"/proc/{found[0].pid}/environ", "rb") as f:
                assert sorted(f.read().split(b"\0")[:-1]) == [b"LC_ALL=C", b"PATH=/usr/sbin:/usr/bin:/sbin:/bin"]
            daemon = _status(d.proc.pid)
            assert (daemon["NoNewPrivs"], daemon["Seccomp"]) == ("0", "0")
            with open(f"/proc/{d.proc.pid}/environ", "rb") as f:
                assert canary.encode() in f.read().split(b"\0")
    finally:
        greeter.close()
        assert d.stop() == 0, d.log()
    assert os.path.exists(worktree)
