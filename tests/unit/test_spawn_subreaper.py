"""The C helper's command launch (tools/_spawn.c, ``spawn_subreaper``) and
the vfork frame it shares with ``spawn_confined``: a started command is a
child subreaper in a session of its own under the limits it was given; a
step that fails before the exec is the caller's OSError, the child reaped;
the caller's signal mask and descriptors are as they were. What a call's
processes do once started is tests/unit/test_tool_shell.py's."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest

from dispatchd import procfs
from dispatchd.tools import native
from tests.unit.test_spawn_confined import run_to_end

pytestmark = [pytest.mark.process,
              pytest.mark.skipif(native.lines is None, reason="the C helper is not built (test_native_lines says so)")]

_ENV = [b"PATH=/usr/bin:/bin", b"LC_ALL=C"]


def _spawn(argv: list[str], cwd: str = "/", nproc: int = -1, nofile: int = -1) -> int:
    """``argv`` started by the helper, its stdio /dev/null and a pipe: its pid."""
    assert native.lines is not None
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        return native.lines.spawn_subreaper(os.fsencode(argv[0]), [os.fsencode(a) for a in argv], _ENV,
                                            os.fsencode(cwd), null, null, null, nproc, nofile)
    finally:
        os.close(null)


def _run(command: str, cwd: str = "/", nproc: int = -1, nofile: int = -1) -> tuple[int, str]:
    """bash -c ``command`` started by the helper: its exit code and stdout."""
    assert native.lines is not None
    lines = native.lines
    return run_to_end(lambda null, out: lines.spawn_subreaper(
        b"/bin/bash", [b"bash", b"-c", os.fsencode(command)], _ENV, os.fsencode(cwd), null, out, null, nproc, nofile))


def _children() -> set[int]:
    """This process's children and theirs, zombies included: one left unreaped shows."""
    return set(procfs.descendants(os.getpid())[1:])


def test_a_command_runs_in_a_session_of_its_own_as_a_subreaper_under_its_limits(tmp_path: Path) -> None:
    code, out = _run("echo $$ $(ps -o sid= -p $$) $(ulimit -n) $(ulimit -Hn) $(pwd); ls /proc/self/fd",
                     cwd=str(tmp_path), nofile=64)
    assert code == 0, out
    first, fds = out.splitlines()[0].split(), out.split()[5:]
    pid, sid, soft, hard, cwd = first
    assert sid == pid and soft == hard == "64" and cwd == str(tmp_path)
    # ls's own: stdio and the directory it lists; nothing of the caller's.
    assert len(fds) <= 4 and {"0", "1", "2"} <= set(fds), fds


def test_an_exec_that_fails_is_the_callers_oserror_naming_the_program_the_child_reaped() -> None:
    before = _children()
    with pytest.raises(FileNotFoundError) as info:
        _spawn(["/nonexistent/program"])
    assert info.value.errno == errno.ENOENT and info.value.filename == b"/nonexistent/program"
    assert _children() == before  # reaped: no zombie left for the caller


def test_a_working_directory_that_cannot_be_entered_fails_before_the_exec(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        _spawn(["/bin/true"], cwd=str(tmp_path / "gone"))
    assert info.value.errno == errno.ENOENT
    # The twin: the same start where it can enter.
    pid = _spawn(["/bin/true"], cwd=str(tmp_path))
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def test_the_callers_signal_mask_and_descriptors_are_as_they_were(tmp_path: Path) -> None:
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    fds = set(os.listdir("/proc/self/fd"))
    for argv in (["/bin/true"], ["/nonexistent/program"]):
        try:
            pid = _spawn(argv)
        except FileNotFoundError:
            continue
        os.waitpid(pid, 0)
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask
    assert set(os.listdir("/proc/self/fd")) == fds  # the error pipe's two ends closed, whatever the outcome


def test_descriptors_below_three_are_refused_before_any_process() -> None:
    assert native.lines is not None
    before = _children()
    with pytest.raises(ValueError, match="3 or above"):
        native.lines.spawn_subreaper(b"/bin/true", [b"true"], _ENV, b"/", 0, 1, 2, -1, -1)
    assert _children() == before


def test_the_process_limit_is_a_blocking_io_error_and_its_twin_starts() -> None:
    """At RLIMIT_NPROC the vfork fails with EAGAIN: BlockingIOError, which
    the tool server tells from any other failure (its reserve, proctree).
    Run in a child of this test, whose limit alone is lowered."""
    import resource

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            os.close(r)
            outcome = []
            hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
            for limit in (1, hard):  # this user runs more than one process already
                resource.setrlimit(resource.RLIMIT_NPROC, (limit, hard))
                try:
                    started = _spawn(["/bin/true"])
                    os.waitpid(started, 0)
                    outcome.append("started")
                except BlockingIOError as exc:
                    outcome.append(f"BlockingIOError {exc.errno}")
                except OSError as exc:
                    outcome.append(f"OSError {exc.errno}")
            os.write(w, ",".join(outcome).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        said = f.read().decode()
    os.waitpid(pid, 0)
    if os.geteuid() == 0:
        pytest.fail("run as root: RLIMIT_NPROC is not enforced (the suite runs as its test user)")
    assert said == f"BlockingIOError {errno.EAGAIN},started", said
