"""Fixtures shared by the integration and escape suites: a real daemon.

Each test module gets its own ``dispatchd`` process on a socket in a
temporary directory, with its own state directory, started as the user that
runs the tests and stopped (SIGTERM, then checked for a clean exit) after.
The suites refuse to run as root: dispatchd refuses root, and the escape
suite must run as the ordinary user it protects (``./scripts/test`` does that).
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

import dispatch
from tests.sleeping import WokenClient, sleepy_policies

_T = TypeVar("_T")

REPO = Path(__file__).resolve().parent.parent


# --- what a run costs, beyond its wall time ---------------------------------
# Figures that do not depend on the machine's load (docs/testing.md): how many
# daemons the run started and how long the tests' own threads slept. Each
# pytest process (each xdist worker too) appends one line to the file named
# by DISPATCH_TEST_STATS; ./scripts/test adds them up with the CPU time.

class _RunStats:
    daemons = 0
    slept = 0.0
    base: str | None = None  # this process's temporary directory (an xdist worker's own)


_real_sleep = time.sleep


def _counted_sleep(seconds: float) -> None:
    if threading.current_thread() is threading.main_thread():
        _RunStats.slept += max(seconds, 0.0)
    _real_sleep(seconds)


time.sleep = _counted_sleep


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("DISPATCH_TEST_STATS")
    if path:
        with open(path, "a", encoding="ascii") as f:
            f.write(f"daemons={_RunStats.daemons} slept={_RunStats.slept:.1f}\n")


@pytest.fixture(scope="session", autouse=True)
def _run_base(tmp_path_factory: pytest.TempPathFactory) -> None:
    _RunStats.base = os.path.realpath(tmp_path_factory.getbasetemp())


# --- parallel runs (pytest-xdist) ---------------------------------------------
# ./scripts/test runs the tests in several processes (`-n`, `--dist loadscope`):
# the tests of one module run on one worker, so a fixture made once per module
# (a daemon, one per mode in the escape suite) is made once, as in a run in
# one process. Each worker has its own temporary directory below the run's,
# so its daemons' sockets, state and worktrees are its own
# (tests/unit/test_parallel.py).


def fork_server_of(pid: int) -> Any:
    """The fork server among the daemon ``pid``'s children (a ``psutil.Process``):
    the one with children of its own. A short-lived child (an ``nft`` run) that
    ends while looked at is passed over, not a test's failure."""
    import psutil

    for child in psutil.Process(pid).children():
        try:
            if child.children():
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"the daemon {pid} has no fork server with children")


def deep_tree(top: Path, levels: int) -> None:
    """``levels`` nested directories ``d`` under ``top`` (by descriptor: no path is that long)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(levels):
            os.mkdir("d", dir_fd=fd)
            nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
    finally:
        os.close(fd)


def listening(path: str) -> bool:
    """Whether something accepts connections on the Unix socket ``path``."""
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


class Daemon:
    def __init__(self, base: Path, *extra: str, prefix: tuple[str, ...] = (), state: Path | None = None) -> None:
        self.base = base
        self.socket = str(base / "run" / "dispatchd.sock")
        self.state = state or base / "state"
        self.log_path = base / "dispatchd.log"
        env = {k: v for k, v in os.environ.items() if k not in ("DISPATCH_SOCKET",)}
        env["XDG_STATE_HOME"] = str(self.state)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        self._log = open(self.log_path, "wb")
        _RunStats.daemons += 1
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "dispatchd", "--socket", self.socket, "--log-level", "debug", *extra],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env,
        )
        deadline = time.monotonic() + 60  # generous: a loaded machine, never a cause of failure
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dispatchd exited with {self.proc.returncode}:\n{self.log()}")
            if listening(self.socket):
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"dispatchd did not listen within 60 s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def worker_pid(self, sid: str | None = None) -> int:
        """The first process of session ``sid`` (default: the last opened), as
        the daemon logged it (tests run it at debug). The fork server's
        children alone do not say: some are sandboxes made ahead (the pool)."""
        log = self.log()
        if sid is None:
            sid = re.findall(r"event=session_open session=(\w+)", log)[-1]
        return int(re.findall(rf"event=worker_ready session={sid} pid=(\d+)", log)[-1])

    def connect(self) -> dispatch.Client:
        return dispatch.connect(self.socket)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def wait_for_pool(client: dispatch.Client, kind: str = "default/off", n: int = 1, timeout: float = 20) -> None:
    """Until the daemon's pool holds ``n`` sandboxes made ahead of ``kind``
    ("policy/network"), as its status says."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(rf"{re.escape(kind)}: (\d+) ready", client.status()["daemon"]["pool"])
        if found and int(found.group(1)) >= n:
            return
        time.sleep(0.01)
    raise AssertionError(f"the pool never held {n} of {kind}: {client.status()['daemon']['pool']}")


def daemon_with_nons(base: Path) -> Daemon:
    """A full-mode daemon whose policies also hold ``nons``, whose sessions
    run without namespaces (degraded) beside the full-mode ones."""
    _refuse_root()
    (base / "d").mkdir()
    policies = base / "policies"
    shutil.copytree(REPO / "policies", policies)
    (policies / "nons.toml").write_text("description = 'no namespaces'\n[sandbox]\nuser_namespaces = \"never\"\n")
    return Daemon(base / "d", "--policies", str(policies))


def _refuse_root() -> None:
    if os.geteuid() == 0:
        pytest.fail("the integration and escape suites run as an unprivileged user: use ./scripts/test, "
                    "which creates one and runs them as it", pytrace=False)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    _refuse_root()
    d = Daemon(tmp_path_factory.mktemp("daemon"))
    yield d
    code = d.stop()
    assert code == 0, f"dispatchd exited with {code}:\n{d.log()}"


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[dispatch.Client]:
    with daemon.connect() as c:
        yield c


@pytest.fixture
def worktree(tmp_path: Path) -> Path:
    wt = tmp_path / "worktree"
    wt.mkdir()
    (wt / "README.md").write_text("hello\nworld\n")
    (wt / "src").mkdir()
    (wt / "src" / "main.py").write_text("import os\n\ndef main():\n    return 42\n")
    return Path(os.path.realpath(wt))


@pytest.fixture
def session(client: dispatch.Client, worktree: Path) -> Iterator[dispatch.Session]:
    with client.open_session(str(worktree)) as s:
        yield s


def shell(session: dispatch.Session, command: str, **params: object) -> dispatch.Result:
    """``shell_exec`` of ``command``, tried again while refused at its start
    (``call_once_started``): no test is about a start refused for want of a
    process, and in degraded mode another run's processes can cause one."""
    return call_once_started(session, "shell_exec", {"command": command, **params})


# How long a call refused at its start for want of a process or a thread is
# tried again: in degraded mode another run's tests (as the same user) can
# hold the user's count above a session's headroom for tens of seconds on a
# loaded machine. Only a refused start waits this long.
RETRY_S = 120


def refused_at_start(r: dispatch.Result) -> bool:
    """Whether a call was refused before it ran anything, for want of a
    process ("could not start /bin/bash: Resource temporarily unavailable")
    or of a thread (the tool server's, for the call or its channel)."""
    error = r.error or ""
    return "exit_code" not in r.metadata and (
        ("could not start " in error and "Resource temporarily unavailable" in error)
        or "tool server cannot start a thread" in error)


def call_once_started(session: dispatch.Session, tool: str, params: dict[str, object]) -> dispatch.Result:
    """A call of ``tool``, tried again while it is refused at its start
    (``refused_at_start``): in degraded mode a session's process limit is the
    user's count at open plus its budget, and tests beside this one as the
    same user (other workers, other runs) can take that headroom a while. A
    refused call ran nothing, so trying it again changes no outcome; a call
    that ran is never tried again. For tests that are not about a refused start."""
    deadline = time.monotonic() + RETRY_S
    r = session.registry.get(tool).call(params)
    while refused_at_start(r) and time.monotonic() < deadline:
        time.sleep(0.2)
        r = session.registry.get(tool).call(params)
    return r


def probe(session: dispatch.Session, code: str) -> str:
    """Run a Python probe inside the sandbox; return its stdout (stripped)."""
    r = shell(session, f"/usr/bin/python3 -c {_quote(code)}")
    assert "exit_code" in r.metadata, r.error
    return (r.metadata["stdout"] + r.metadata["stderr"]).strip()


def probe_outside(code: str) -> str:
    """The same probe, outside any sandbox: the allowed twin of a denied attempt."""
    out = subprocess.run(["/usr/bin/python3", "-c", code], capture_output=True, text=True, timeout=30)
    return (out.stdout + out.stderr).strip()


def _cwd_and_argv(pid: str) -> tuple[str, list[bytes]] | None:
    """A live process's working directory and command line (None: it is gone,
    a zombie, or not ours to read)."""
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return cwd, f.read().split(b"\0")
    except OSError:
        return None


def _processes(match: Callable[[str, list[bytes]], bool]) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            seen = _cwd_and_argv(pid)
            if seen is not None and match(*seen):
                found.append(int(pid))
    return found


def processes_in(directory: Path) -> list[int]:
    """Host pids of the processes whose working directory is ``directory``: how
    the tests find a session's commands from outside, in any pid namespace."""
    return _processes(lambda cwd, _argv: cwd == str(directory))


def _of_this_run(cwd: str) -> bool:
    base = _RunStats.base
    return base is not None and (cwd == base or cwd.startswith(base + "/"))


def sleepers(marker: str) -> list[int]:
    """Host pids of the live ``sleep MARKER`` processes of this test process
    (any pid namespace). A process counts when its working directory lies
    below this process's temporary directory (where every worktree of its
    tests is), so a test run beside it (another xdist worker, another
    checkout's run as the same user) that sleeps the same marker is not
    counted."""
    return _processes(lambda cwd, argv: len(argv) >= 2 and argv[0] in (b"sleep", b"/bin/sleep", b"/usr/bin/sleep")
                      and argv[1] == marker.encode() and _of_this_run(cwd))


def running(marker: str) -> list[int]:
    """Like ``sleepers``: the processes of this test process whose command line
    holds ``marker`` anywhere (a shell running ``sleep MARKER; ...`` too)."""
    return _processes(lambda cwd, argv: marker.encode() in b"\0".join(argv) and _of_this_run(cwd))


def open_when_free(client: dispatch.Client, root: Path, **request: Any) -> dispatch.Session:
    """A session on ``root`` once another daemon's last session there has
    given it back: after its close's reply, once its baseline's record is
    gone (every daemon of the user shares one table: daemon/inusedir.py)."""
    opened: list[dispatch.Session] = []

    def attempt() -> bool:
        try:
            opened.append(client.open_session(str(root), **request))
        except dispatch.DispatchError as exc:
            assert "of another dispatchd" in str(exc), str(exc)
            return False
        return True
    assert wait_until(attempt, timeout=10)
    return opened[0]


def wait_until(predicate: Callable[[], object], timeout: float = 30.0, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds have passed;
    return its last truth. The deadline is generous on purpose: it is only
    reached when the awaited event never comes, so a slow, loaded machine
    costs time, never a failure."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return bool(predicate())
        time.sleep(interval)
    return True


def made_each(make: Callable[[], _T], end: Callable[[_T], None]) -> Iterator[Callable[[], _T]]:
    """The body of a fixture that hands out a factory: each call makes one
    more (``make``); after the test, each one made is ended (``end``), in order:
    ``yield from made_each(Pipe, Pipe.close)``."""
    made: list[_T] = []

    def one() -> _T:
        made.append(make())
        return made[-1]

    yield one
    for thing in made:
        end(thing)


def gone(pids: Callable[[], list[int]], timeout: float = 30.0) -> bool:
    """Whether the processes ``pids()`` lists are all gone within ``timeout``
    seconds (polled): ``gone(lambda: sleepers("301.1"))``."""
    return wait_until(lambda: not pids(), timeout)


def credential_dir(rel: str) -> Path:
    """The user's ``~/REL`` (``.ssh``, ``.gnupg/private``...), made (0700) if
    absent and left in place: tests in parallel, and runs beside this one as
    the same user, use the same directory, so none may remove it from under
    another. ./scripts/test runs as a user of its own (dispatchtest), whose
    home holds these empty directories from then on."""
    path = Path.home() / rel
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


@pytest.fixture
def user_budgets() -> Iterator[None]:
    """Held while a test measures a budget the kernel keeps per user
    (inotify instances, descriptors in flight, signals queued): every test of
    the same user's that measures one, on another worker or in another run,
    waits for it, so that none sees another's use as a leak."""
    path = Path.home() / ".cache" / "dispatchd-tests" / "user-budgets.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="ascii") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


# A cgroup v2 subtree delegated to the test user (scripts/_common.sh makes it
# when ./scripts/test runs as root), for the per-session cgroup tests.
CGROUP_BASE = os.environ.get("DISPATCHD_TEST_CGROUP", "")
CGROUP_POLICY = """
description = "cgroup tests: a small process budget"
[limits]
max_processes = 40
command_timeout_s = 20
"""

def cgroup_controllers(path: str) -> list[str]:
    with open(f"{path}/cgroup.controllers", encoding="ascii") as f:
        return f.read().split()


def _rmdir_tree(path: str) -> None:
    for root, dirs, _ in os.walk(path, topdown=False):
        for d in dirs:
            try:
                os.rmdir(os.path.join(root, d))
            except OSError:
                pass
    try:
        os.rmdir(path)
    except OSError:
        pass


@pytest.fixture(scope="module", params=["full", "degraded"])
def cgroup_daemon(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[tuple[dispatch.Client, str]]:
    """A daemon managing CGROUP_BASE/daemon-XXXX, and that path."""
    yield from cgroup_daemon_for(request.param, tmp_path_factory)


def cgroup_daemon_for(mode: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dispatch.Client, str]]:
    """``cgroup_daemon`` in ``mode``: "full", "degraded", or "woken" (full
    mode, every policy sleeping after ``SLEEP_AFTER_S`` and every session
    opened asleep: tests/sleeping.py)."""
    _refuse_root()
    if not CGROUP_BASE:
        pytest.skip("no delegated cgroup v2 subtree: DISPATCHD_TEST_CGROUP is set by ./scripts/test run as root")
    # What a delegating systemd does for the service: offer CGROUP_BASE's controllers to its children.
    for controller in cgroup_controllers(CGROUP_BASE):
        try:
            with open(f"{CGROUP_BASE}/cgroup.subtree_control", "w", encoding="ascii") as f:
                f.write(f"+{controller}")
        except OSError:
            pass
    cgroup = f"{CGROUP_BASE}/daemon-{secrets.token_hex(4)}"
    base = tmp_path_factory.mktemp(f"cgroups-{mode}")
    policies = base / "policies"
    shutil.copytree(REPO / "policies", policies)
    (policies / "tight.toml").write_text(CGROUP_POLICY)
    if mode == "woken":
        sleepy_policies(policies)
    extra = ["--policies", str(policies), "--cgroup", cgroup]
    if mode == "degraded":
        extra.append("--no-user-namespaces")
    d = Daemon(base, *extra)
    try:
        with (WokenClient(d.socket) if mode == "woken" else d.connect()) as c:
            yield c, cgroup
    finally:
        assert d.stop() == 0, d.log()
        # Only the daemon's own leaf is left, empty now that it has exited.
        assert sorted(e for e in os.listdir(cgroup) if not e.startswith(("cgroup.", "cpu.", "io.", "memory.",
                                                                           "pids.", "hugetlb."))) == ["daemon"]
        _rmdir_tree(cgroup)
