"""Fixtures of the escape suite: every attempt runs against every mode.

``sandbox`` is a daemon per test module and mode, ``full`` (user, mount,
IPC, pid and network namespaces), ``degraded`` (started with
``--no-user-namespaces``: Landlock and seccomp alone) and ``woken`` (full
mode, every policy with ``[limits] sleep_after_s`` of ``SLEEP_AFTER_S``, and
a client whose sessions are handed over asleep: the test's first call wakes
the session in a new tool server that joins its namespaces and confines
itself again, and the test's own pauses put it to sleep and wake it again).
A woken session must be confined exactly like a fresh one: ``Sandbox.mode``
is ``"full"`` there (what its status reports, what ``expect`` gives), and
``Sandbox.woken`` says which of the two runs. It overrides the root
conftest's ``client``, so the root ``session`` fixture, and every test taking
it, runs once per mode. A test that needs a mark on one mode only (a known
limit) parametrizes ``sandbox`` itself with ``MODES_WITH_LIMIT``.

Each daemon starts with a canary in its environment and an
``XDG_RUNTIME_DIR`` of its own, in the home directory (under ``/tmp`` the
private ``/tmp`` alone would hide it), holding a file that stands for the
user's D-Bus and systemd sockets: the tests look for both from inside.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import dispatch
from tests.conftest import REPO, Daemon, _refuse_root, cgroup_daemon_for, wait_for_pool
from tests.escape.attempts import EACCES, ENOENT, EROFS
from tests.sleeping import WokenClient, sleepy_policies

MODES = ("full", "degraded", "woken")
MODES_WITH_LIMIT = [pytest.param("full", id="full"),
                    pytest.param("degraded", id="degraded", marks=pytest.mark.known_limit),
                    pytest.param("woken", id="woken")]


@dataclass
class Sandbox:
    mode: str  # the sessions' confinement, as their status reports it: "full" or "degraded"
    daemon: Daemon
    client: dispatch.Client
    canary: str  # in the daemon's environment, never in a session's
    runtime_dir: Path  # the daemon's XDG_RUNTIME_DIR: hidden (full) or refused (degraded)
    woken: bool = False  # full mode whose sessions sleep, handed over asleep (the "woken" mode)

    def expect(self, *, full: str, degraded: str) -> str:
        """The verdict this mode must give, where the two modes differ."""
        return full if self.mode == "full" else degraded

    def unreachable(self, path: str | Path) -> str:
        """The verdict for opening a path outside every rule: in full mode it
        does not exist (the session's root holds only what the policy lists);
        in degraded mode Landlock refuses it."""
        return ENOENT if self.mode == "full" else EACCES

    def create_verdict(self, session: dispatch.Session, directory: str | Path) -> str:
        """Creating something in ``directory``, outside every rule. Degraded:
        Landlock's EACCES. Full: the directory is absent from the session's
        root (ENOENT), unless it lies on the way to a path the root holds (the
        home directory, when dispatchd's code lives there): then it is there,
        empty, on the root's read-only tmpfs (EROFS)."""
        if self.mode != "full":
            return EACCES
        d = str(directory).rstrip("/")
        on_the_way = any(r["path"].startswith(d + "/") for r in session.status()["protections"]["root"])
        return EROFS if on_the_way else ENOENT


def mode_daemon(base: Path, mode: str, *extra: str, policies: dict[str, str] | None = None) -> Daemon:
    """A daemon in ``mode`` with the repository's policies and ``policies``
    (name to TOML text), copied to ``base``/policies: degraded, started with
    ``--no-user-namespaces``; woken, every policy sleeping after
    ``SLEEP_AFTER_S`` (tests/sleeping.py)."""
    directory = base / "policies"
    shutil.copytree(REPO / "policies", directory)
    for name, text in (policies or {}).items():
        (directory / f"{name}.toml").write_text(text)
    if mode == "woken":
        sleepy_policies(directory)
    return Daemon(base, "--policies", str(directory), *extra, *(["--no-user-namespaces"] if mode == "degraded" else []))


def connect(daemon: Daemon, mode: str, awake_policies: Collection[str] = ()) -> dispatch.Client:
    """A client of ``daemon``; in woken mode, one whose sessions are opened
    asleep, but for ``awake_policies`` (never asleep by design: checked)."""
    return WokenClient(daemon.socket, awake_policies=awake_policies) if mode == "woken" else daemon.connect()


@pytest.fixture(scope="module", params=MODES)
def sandbox(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    _refuse_root()
    mode = request.param
    canary = f"dispatch-escape-canary-{secrets.token_hex(8)}"
    runtime = Path.home() / f".dispatch-escape-runtime-{secrets.token_hex(6)}"
    runtime.mkdir(mode=0o700)
    (runtime / "bus").write_text(canary)
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("DISPATCH_ESCAPE_CANARY", canary)
            env.setenv("XDG_RUNTIME_DIR", str(runtime))
            base = tmp_path_factory.mktemp(f"daemon-{mode}")
            if mode == "woken":
                daemon = mode_daemon(base, mode)
            else:
                daemon = Daemon(base, *(["--no-user-namespaces"] if mode == "degraded" else []))
        try:
            with connect(daemon, mode) as client:
                if mode != "degraded" and not client.status()["kernel"]["user_namespaces"]:
                    pytest.skip(f"this kernel refuses user namespaces: {client.status()['kernel']['user_namespaces_note']}")
                yield Sandbox("degraded" if mode == "degraded" else "full", daemon, client, canary, runtime,
                              woken=mode == "woken")
        finally:
            code = daemon.stop()
        assert code == 0, f"dispatchd exited with {code}:\n{daemon.log()}"
    finally:
        shutil.rmtree(runtime)


@pytest.fixture(scope="module")
def client(sandbox: Sandbox) -> dispatch.Client:
    return sandbox.client


@pytest.fixture(scope="module", params=MODES)
def cgroup_daemon(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[tuple[dispatch.Client, str]]:
    """The root conftest's ``cgroup_daemon``, in every mode of this suite."""
    yield from cgroup_daemon_for(request.param, tmp_path_factory)


@pytest.fixture
def session(client: dispatch.Client, worktree: Path, sandbox: Sandbox) -> Iterator[dispatch.Session]:
    """The root fixture's session, checked to run in the mode under test. In
    full mode its sandbox is one made ahead (the daemon's pool): every attempt
    runs against what most sessions get (tests/escape/test_pool.py compares
    it with one made at open). Woken: it comes asleep (``WokenClient``), and
    the test must have woken it by its end (the daemon logged it), so that
    every attempt ran in a woken session and none passed against a session
    that never slept."""
    if sandbox.mode == "full":
        wait_for_pool(client)
    with client.open_session(str(worktree)) as s:
        status = s.status()
        assert status["protections"]["mode"] == sandbox.mode
        assert status["protections"].get("made_ahead", False) is (sandbox.mode == "full")
        assert status["asleep"] is sandbox.woken
        yield s
    if sandbox.woken:
        assert f"event=session_woken session={s.id} " in sandbox.daemon.log(), \
            f"session {s.id} never woke:\n{sandbox.daemon.log()[-3000:]}"


def _home_file(kind: str) -> Iterator[Path]:
    path = Path.home() / f"dispatch-escape-{kind}-{secrets.token_hex(8)}"
    path.write_text(f"{kind} {secrets.token_hex(16)}\n")
    path.chmod(0o644)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


@pytest.fixture
def home_secret() -> Iterator[Path]:
    """A file of the user's, in the home directory, that no session may read."""
    yield from _home_file("secret")


@pytest.fixture
def home_owned() -> Iterator[Path]:
    """A file of the user's outside the worktree, for metadata changes."""
    yield from _home_file("owned")


@pytest.fixture
def own_file(worktree: Path) -> Path:
    """A file in the worktree: what every allowed control reads."""
    path = worktree / "own.txt"
    path.write_text(f"own {secrets.token_hex(8)}\n")
    return path


class Victim:
    """A process of the user's, outside every sandbox, that reports the signals it gets."""

    SIGNALS = ("SIGWINCH", "SIGIO", "SIGURG")

    def __init__(self) -> None:
        handlers = "".join(f"signal.signal(signal.{s}, lambda *a: print('GOT {s}', flush=True))\n" for s in self.SIGNALS)
        code = f"import signal, sys, time\n{handlers}print('ready', flush=True)\nsys.stdin.read()\n"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "ready\n"
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def finish(self) -> str:
        """End it (stdin closed) and return what it printed."""
        out, _ = self.proc.communicate(timeout=10)
        return out


@pytest.fixture
def victim() -> Iterator[Victim]:
    v = Victim()
    try:
        yield v
    finally:
        if v.proc.returncode is None:  # finish() not called: end it and close its pipes
            v.proc.kill()
            v.proc.communicate()


@pytest.fixture
def make_worktree(tmp_path: Path) -> Callable[[str], Path]:
    """Another worktree of the same user (another session's, say)."""

    def make(name: str) -> Path:
        path = tmp_path / name
        path.mkdir()
        return path.resolve()

    return make
