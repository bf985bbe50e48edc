"""The C helper's confined launch (tools/_confined.c, ``spawn_confined``):
each step that fails is named and nothing runs; what the child applies to
itself never reaches the caller; what it is given is checked before the
vfork. Real processes, real Landlock and seccomp; the confinement a stack
gets end to end is in tests/escape/test_stack_confinement.py and
tests/unit/test_stack_launch.py."""

from __future__ import annotations

import errno
import os
import resource
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from dispatchd.confine import landlock, seccomp, stacks
from dispatchd.tools import native

pytestmark = [pytest.mark.process,
              pytest.mark.skipif(native.lines is None, reason="the C helper is not built (test_native_lines says so)")]

_ENV = [b"PATH=/usr/bin:/bin", b"LC_ALL=C"]


def run_to_end(start: Callable[[int, int], int]) -> tuple[int, str]:
    """``start(null, out)`` launched (a pid), with /dev/null and a pipe's
    write end: the exit code and what it wrote there, once ended."""
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        pid = start(null, out_w)
    finally:
        os.close(out_w)
        os.close(null)
    with os.fdopen(out_r, "rb") as f:
        out = f.read().decode()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out


def _spawn(argv: list[str], *, limits: list[tuple[int, int]] | None = None, ruleset: int = -1,
           program: bytes = b"", cgroup_fd: int = -1, keep: list[int] | None = None,
           stdin_fd: int | None = None) -> tuple[int, str]:
    """``argv`` started confined as asked: its exit code and its output."""
    assert native.lines is not None
    lines = native.lines
    return run_to_end(lambda null, out: lines.spawn_confined(
        os.fsencode(argv[0]), [os.fsencode(a) for a in argv], _ENV, null if stdin_fd is None else stdin_fd, out, out,
        keep or [], cgroup_fd, limits or [], ruleset, program, os.getpid()))


def _system_only() -> int:
    """A complete ruleset granting the system's programs and libraries only
    (the stack's, without its own files)."""
    plan = landlock.plan_landlock(abi=landlock.landlock_abi(), read_only=list(stacks.SYSTEM_READ), read_write=[],
                                  devices=[], deny_tcp=False)
    return landlock.build_ruleset(plan)


def test_confined_it_cannot_read_the_users_file_nor_open_a_unix_socket(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("SECRET")
    ruleset = _system_only()
    program = seccomp.compile_seccomp(stacks.plan_stack_seccomp())
    try:
        code, out = _spawn(["/usr/bin/python3", "-I", "-c", (
            "import socket\n"
            f"try: open({str(secret)!r}).read(); print('read')\n"
            "except OSError as e: print(e.errno)\n"
            "try: socket.socket(socket.AF_UNIX); print('unix')\n"
            "except OSError as e: print(e.errno)\n")], ruleset=ruleset, program=program)
    finally:
        os.close(ruleset)
    assert (code, out.split()) == (0, [str(errno.EACCES), str(errno.EPERM)])


def test_unconfined_the_same_program_reads_it_and_opens_one(tmp_path: Path) -> None:
    """The twin: no ruleset, no program."""
    secret = tmp_path / "secret"
    secret.write_text("SECRET")
    code, out = _spawn(["/usr/bin/python3", "-I", "-c", (
        "import socket\n"
        f"print(open({str(secret)!r}).read())\n"
        "socket.socket(socket.AF_UNIX).close(); print('unix')\n")])
    assert (code, out.split()) == (0, ["SECRET", "unix"])


def test_what_the_child_applies_never_reaches_the_caller(tmp_path: Path) -> None:
    """The child has no_new_privs, a seccomp filter and its limits; after it,
    and after a launch under a ruleset, this process has none of them: it
    reads its files, opens Unix sockets, keeps its own limits."""
    secret = tmp_path / "secret"
    secret.write_text("SECRET")

    def mine() -> tuple[str, str, tuple[int, int], str]:
        with open("/proc/self/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        return (status["NoNewPrivs"].strip(), status["Seccomp"].strip(), resource.getrlimit(resource.RLIMIT_FSIZE),
                secret.read_text())

    before = mine()
    assert before[:2] == ("0", "0")  # else this test would tell nothing
    code, out = _spawn(["/bin/sh", "-c", "grep -E '^(NoNewPrivs|Seccomp):' /proc/self/status; ulimit -f"],
                       limits=[(resource.RLIMIT_FSIZE, 1 << 20)],
                       program=seccomp.compile_seccomp(stacks.plan_stack_seccomp()))
    assert (code, out.split()) == (0, ["NoNewPrivs:", "1", "Seccomp:", "2", str((1 << 20) // 512)])
    ruleset = _system_only()
    try:
        assert _spawn(["/bin/sh", "-c", f"cat {secret}"], ruleset=ruleset)[0] != 0
    finally:
        os.close(ruleset)
    assert mine() == before
    socket.socket(socket.AF_UNIX).close()


def test_the_child_keeps_only_the_descriptors_it_is_given() -> None:
    kept = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    other = os.open(os.devnull, os.O_RDONLY)  # inheritable, and still not passed
    try:
        code, out = _spawn(["/usr/bin/python3", "-I", "-c", (
            "import os\n"
            f"for fd in ({kept}, {other}):\n"
            "    try: os.fstat(fd); print('open', fd)\n"
            "    except OSError: print('closed', fd)\n")], keep=[kept])
    finally:
        os.close(kept)
        os.close(other)
    assert (code, out.split("\n")[:2]) == (0, [f"open {kept}", f"closed {other}"])


# An instruction no BPF machine has: the kernel refuses the program.
_NOT_BPF = b"\xff\xff\x00\x00\x00\x00\x00\x00"
_CLOSED = 1000  # a descriptor number nothing here has open


@pytest.mark.parametrize("step, err", [
    ("landlock: restrict self", errno.EBADFD),  # a descriptor that is no ruleset
    ("limits", errno.EPERM),  # a hard limit raised past the caller's
    ("cgroup", errno.EBADF),  # a cgroup.procs not open for writing
    ("seccomp", errno.EINVAL),
    ("stdio", errno.EBADF),
    ("descriptors", errno.EBADF),  # a descriptor to keep that is not open
    ("exec", errno.ENOENT),
])
def test_a_step_that_fails_is_named_and_nothing_runs(tmp_path: Path, step: str, err: int) -> None:
    marker = tmp_path / "ran"
    not_ruleset = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    read_only = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    argv = ["/bin/sh" if step != "exec" else str(tmp_path / "absent"), "-c", f"touch {marker}"]
    asked: dict[str, object] = {
        "landlock: restrict self": {"ruleset": not_ruleset},
        "limits": {"limits": [(resource.RLIMIT_NOFILE, hard + 1)]},
        "cgroup": {"cgroup_fd": read_only},
        "seccomp": {"program": _NOT_BPF},
        "stdio": {"stdin_fd": _CLOSED},
        "descriptors": {"keep": [_CLOSED]},
        "exec": {},
    }[step]
    with pytest.raises(OSError):
        os.fstat(_CLOSED)  # closed indeed: the failure is the step's, not the test's
    try:
        with pytest.raises(OSError) as caught:
            _spawn(argv, **asked)  # type: ignore[arg-type]
    finally:
        os.close(not_ruleset)
        os.close(read_only)
    assert (caught.value.filename, caught.value.errno) == (step, err)
    assert not marker.exists()


def test_the_twin_of_each_step_runs() -> None:
    """A real ruleset, a limit within the caller's, a program that is there:
    it runs."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ruleset = _system_only()
    try:
        code, out = _spawn(["/bin/sh", "-c", "echo ran"], ruleset=ruleset, limits=[(resource.RLIMIT_NOFILE, hard)])
    finally:
        os.close(ruleset)
    assert (code, out) == (0, "ran\n")


def test_the_child_joins_the_cgroup_before_it_runs() -> None:
    """The twin of the cgroup step: a cgroup.procs open for writing, and the
    program finds itself there (the daemon's own test of a session's stack
    in its cgroup: tests/integration/test_cgroups.py)."""
    from tests.conftest import CGROUP_BASE

    if not CGROUP_BASE:
        pytest.skip("no delegated cgroup v2 subtree: DISPATCHD_TEST_CGROUP is set by ./scripts/test run as root")
    path = f"{CGROUP_BASE}/spawn-{os.getpid()}"
    os.mkdir(path)
    try:
        cgroup_fd = os.open(f"{path}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
        try:
            code, out = _spawn(["/bin/cat", "/proc/self/cgroup"], cgroup_fd=cgroup_fd)
        finally:
            os.close(cgroup_fd)
    finally:
        os.rmdir(path)
    assert code == 0 and out.strip().endswith(f"/spawn-{os.getpid()}"), out


@pytest.mark.parametrize("asked, words", [
    ({"keep": [1]}, "the descriptors kept must be 3 or above"),
    ({"keep": [(1 << 32) + 5]}, "the descriptors kept must be 3 or above"),  # not taken for fd 5
    ({"program": b"1234567"}, "the seccomp program is not a whole BPF program"),
])
def test_what_it_is_given_is_checked_before_the_vfork(asked: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        _spawn(["/bin/true"], **asked)  # type: ignore[arg-type]
