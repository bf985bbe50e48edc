"""shell_exec: output and status, caps, timeouts that leave nothing behind, cwd rules.

Every command here ends in well under a second; the timeout cases use 0.5 s.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from dispatchd.policy import Limits
from dispatchd.tools.base import Outcome, ToolContext, run_tool
from dispatchd.tools.table import TOOLS
from tests.unit.adopting import Adopting, sleeping
from tests.conftest import running

pytestmark = pytest.mark.process  # starts processes (git, a compiler, commands, forks)


@pytest.fixture
def ctx(tmp_path: Path) -> ToolContext:
    return ToolContext(root=os.path.realpath(tmp_path), limits=Limits(), env={"PATH": "/usr/bin:/bin"})


def sh(ctx: ToolContext, command: str, **params: Any) -> Outcome:
    return run_tool(TOOLS["shell_exec"], ctx, {"command": command, **params})


def with_limits(ctx: ToolContext, **changes: Any) -> ToolContext:
    return dataclasses.replace(ctx, limits=msgspec.structs.replace(ctx.limits, **changes))


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return False
    return raw[raw.rfind(b")") + 2 :].split()[0] != b"Z"


def gone_soon(pids: list[int], within: float = 1.0) -> bool:
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# -- output and status ---------------------------------------------------------


def test_success_returns_stdout_and_metadata(ctx: ToolContext) -> None:
    r = sh(ctx, "echo hello")
    assert r.success and r.output == "hello\n" and r.error is None
    m = r.metadata
    assert (m["exit_code"], m["timed_out"], m["truncated"]) == (0, False, False)
    assert (m["stdout"], m["stderr"]) == ("hello\n", "")
    assert isinstance(m["duration_s"], float) and 0 <= m["duration_s"] < 2


def test_stderr_is_kept_apart_and_marked(ctx: ToolContext) -> None:
    r = sh(ctx, "echo out; echo err >&2")
    assert r.metadata["stdout"] == "out\n" and r.metadata["stderr"] == "err\n"
    assert r.output == "out\n[stderr]\nerr\n"


def test_stderr_alone(ctx: ToolContext) -> None:
    assert sh(ctx, "echo oops >&2").output == "[stderr]\noops\n"


def test_stdout_without_final_newline_still_separates_stderr(ctx: ToolContext) -> None:
    assert sh(ctx, "printf out; echo err >&2").output == "out\n[stderr]\nerr\n"


def test_no_output_is_an_empty_success(ctx: ToolContext) -> None:
    r = sh(ctx, "true")
    assert r.success and r.output == ""


def test_non_zero_exit_is_a_failure_that_carries_the_output(ctx: ToolContext) -> None:
    r = sh(ctx, "echo partial; echo bad >&2; exit 3")
    assert not r.success and r.output is None
    assert r.error == "command exited with status 3\npartial\n[stderr]\nbad\n"
    assert r.metadata["exit_code"] == 3 and r.metadata["stdout"] == "partial\n"


def test_command_not_found_is_127(ctx: ToolContext) -> None:
    r = sh(ctx, "no-such-command-here")
    assert r.metadata["exit_code"] == 127 and "not found" in r.metadata["stderr"]


def test_death_by_signal_gives_a_negative_exit_code(ctx: ToolContext) -> None:
    r = sh(ctx, "kill -TERM $$")
    assert r.metadata["exit_code"] == -15
    assert r.error.startswith("command was killed by signal 15 (SIGTERM)")


def test_invalid_utf8_output_is_replaced(ctx: ToolContext) -> None:
    assert sh(ctx, r"printf 'caf\xe9'").metadata["stdout"] == "caf\ufffd"


def test_empty_command_fails(ctx: ToolContext) -> None:
    assert sh(ctx, "  ").error == "command is empty"


def test_a_command_holding_a_nul_byte_is_refused_precisely_and_not_run(ctx: ToolContext) -> None:
    """It reached the spawn, whose internal error the caller got
    (``ValueError: spawn_subreaper: ...``). The twin: the same command
    without the NUL runs."""
    r = sh(ctx, "touch ran\0; echo no")
    assert r.error == "command holds a NUL byte (\\0), which no command line can carry; nothing was run"
    assert not os.path.exists(os.path.join(ctx.root, "ran"))
    assert sh(ctx, "touch ran; echo yes").output == "yes\n" and os.path.exists(os.path.join(ctx.root, "ran"))


# -- environment -----------------------------------------------------------------


def test_runs_in_the_worktree_root(ctx: ToolContext) -> None:
    assert sh(ctx, "pwd").output == ctx.root + "\n"


def test_cwd_is_relative_to_the_root(ctx: ToolContext) -> None:
    os.makedirs(os.path.join(ctx.root, "sub", "dir"))
    assert sh(ctx, "pwd", cwd="sub/dir").output == os.path.join(ctx.root, "sub", "dir") + "\n"


@pytest.mark.parametrize("cwd", ["..", "/tmp", "sub/../.."])
def test_cwd_outside_is_refused(ctx: ToolContext, cwd: str) -> None:
    r = sh(ctx, "touch ran-here", cwd=cwd)
    assert not r.success and ("escapes" in r.error or "absolute" in r.error)
    assert "exit_code" not in r.metadata


def test_cwd_through_a_symlink_outside_is_refused(ctx: ToolContext) -> None:
    os.symlink("/tmp", os.path.join(ctx.root, "tmp"))
    assert "symlink" in sh(ctx, "pwd", cwd="tmp").error


def test_cwd_must_be_an_existing_directory(ctx: ToolContext) -> None:
    Path(ctx.root, "file").write_text("")
    assert sh(ctx, "pwd", cwd="missing").error == "cwd missing does not exist"
    assert sh(ctx, "pwd", cwd="file").error == "cwd file is not a directory"


def test_environment_is_the_sessions_only(ctx: ToolContext, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISPATCHD_TEST_LEAK", "leaked")
    env_ctx = dataclasses.replace(ctx, env={"PATH": "/usr/bin:/bin", "GREETING": "hi"})
    r = sh(env_ctx, 'echo "$GREETING ${DISPATCHD_TEST_LEAK:-clean}"')
    assert r.output == "hi clean\n"


def test_stdin_is_empty(ctx: ToolContext) -> None:
    r = sh(ctx, "cat; echo done", timeout=5)
    assert r.output == "done\n" and r.metadata["duration_s"] < 2


def test_no_file_descriptor_of_the_worker_leaks(ctx: ToolContext) -> None:
    read_end, write_end = os.pipe()
    try:
        os.set_inheritable(write_end, True)  # even an inheritable one
        r = sh(ctx, f"test -e /proc/$$/fd/{write_end} && echo leaked || echo closed")
        assert r.output == "closed\n"
    finally:
        os.close(read_end)
        os.close(write_end)


def test_command_leads_its_own_session(ctx: ToolContext) -> None:
    r = sh(ctx, "read -r -a f < /proc/$$/stat; echo $$ ${f[4]} ${f[5]}")
    pid, pgrp, session = r.output.split()
    assert pid == pgrp == session
    assert int(session) != os.getsid(0)


def test_read_only_policy_does_not_stop_shell(ctx: ToolContext) -> None:
    assert sh(dataclasses.replace(ctx, writable=False), "echo ok").success


# -- output cap ------------------------------------------------------------------


def test_output_is_capped_and_the_command_still_finishes(ctx: ToolContext) -> None:
    r = sh(with_limits(ctx, output_cap_bytes=1000), "yes | head -c 3000000; echo done >&2")
    assert r.success and r.metadata["exit_code"] == 0
    assert len(r.metadata["stdout"]) == 1000 and r.metadata["stdout"].startswith("y\ny\n")
    assert r.metadata["stderr"] == "done\n"  # the cap is per stream
    assert r.metadata["truncated"] is True
    assert r.output.endswith("[output truncated at 1000 bytes per stream]")
    assert r.metadata["duration_s"] < 2


def test_stderr_is_capped_on_its_own(ctx: ToolContext) -> None:
    r = sh(with_limits(ctx, output_cap_bytes=10), "echo short; head -c 5000 /dev/zero | tr '\\0' e >&2")
    assert r.metadata["stdout"] == "short\n" and r.metadata["stderr"] == "e" * 10
    assert r.metadata["truncated"] is True


def test_output_at_exactly_the_cap_is_not_truncated(ctx: ToolContext) -> None:
    r = sh(with_limits(ctx, output_cap_bytes=6), "echo 12345")
    assert r.metadata["stdout"] == "12345\n" and r.metadata["truncated"] is False


# -- timeouts --------------------------------------------------------------------


def test_timeout_kills_the_command_and_its_background_child(ctx: ToolContext) -> None:
    started = time.monotonic()
    r = sh(ctx, "sleep 30 & echo $! $$; sleep 30", timeout=0.5)
    assert time.monotonic() - started < 2
    assert not r.success and r.metadata["timed_out"] is True
    assert r.error.startswith("command timed out after 0.5 s\n")
    assert "[timed out after 0.5 s]" in r.error
    child, bash = (int(p) for p in r.metadata["stdout"].split())
    assert gone_soon([child, bash])


def test_timeout_reaches_jobs_in_process_groups_of_their_own(ctx: ToolContext) -> None:
    # With job control on, bash puts each job in a new process group: killpg
    # alone would miss it, the session scan does not.
    r = sh(ctx, "set -m; sleep 30 & echo $!; sleep 30", timeout=0.5)
    assert r.metadata["timed_out"] is True
    assert gone_soon([int(r.metadata["stdout"].split()[0])])


def test_background_job_holding_the_output_does_not_hold_the_call(ctx: ToolContext) -> None:
    # A dev server started with `&` keeps the pipes open; the call returns
    # shortly after bash exits. This process adopts no orphans, so it runs
    # on; in the tool server it is ended (the tests that use ``adopting``).
    started = time.monotonic()
    r = sh(ctx, "echo out; sleep 30 & echo $!", timeout=10)
    pid = int(r.metadata["stdout"].split()[-1])
    try:
        assert r.success and time.monotonic() - started < 2
        assert r.metadata["timed_out"] is False
        assert "background processes it started still run" in r.output
        os.kill(pid, 0)  # still alive
    finally:
        os.kill(pid, 9)


def test_background_job_with_redirected_output_does_not_hold_the_call(ctx: ToolContext) -> None:
    started = time.monotonic()
    r = sh(ctx, "sleep 30 > /dev/null 2>&1 & echo $!", timeout=5)
    try:
        assert r.success and time.monotonic() - started < 2
    finally:
        os.kill(int(r.metadata["stdout"]), 9)


def test_output_before_the_timeout_is_returned(ctx: ToolContext) -> None:
    r = sh(ctx, "echo before; echo warn >&2; sleep 30", timeout=0.5)
    assert r.metadata["stdout"] == "before\n" and r.metadata["stderr"] == "warn\n"
    assert "before\n[stderr]\nwarn\n" in r.error


def test_command_that_closes_its_pipes_is_still_timed(ctx: ToolContext) -> None:
    r = sh(ctx, "exec >&- 2>&-; sleep 30", timeout=0.5)
    assert r.metadata["timed_out"] is True


def test_default_timeout_comes_from_the_policy(ctx: ToolContext) -> None:
    r = sh(with_limits(ctx, command_timeout_s=0.3), "sleep 30")
    assert r.metadata["timed_out"] is True and r.error.startswith("command timed out after 0.3 s")


def test_timeout_over_the_maximum_is_refused(ctx: ToolContext) -> None:
    r = sh(with_limits(ctx, max_command_timeout_s=10.0), "true", timeout=11)
    assert not r.success and "maximum of 10 s" in r.error
    assert sh(with_limits(ctx, max_command_timeout_s=10.0), "true", timeout=10).success


@pytest.mark.parametrize("timeout", [0, -1])
def test_timeout_must_be_positive(ctx: ToolContext, timeout: float) -> None:
    assert "positive" in sh(ctx, "true", timeout=timeout).error


def test_integer_timeout_is_accepted(ctx: ToolContext) -> None:
    assert sh(ctx, "true", timeout=5).success


# -- without pidfd (a kernel or seccomp filter that refuses pidfd_open) -----------


@pytest.fixture
def no_pidfd(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(pid: int, flags: int = 0) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", refused)


@pytest.mark.usefixtures("no_pidfd")
def test_without_pidfd_status_and_output_still_come_back(ctx: ToolContext) -> None:
    r = sh(ctx, "echo out; echo err >&2; exit 4")
    assert r.metadata["exit_code"] == 4 and r.metadata["stdout"] == "out\n" and r.metadata["stderr"] == "err\n"


@pytest.mark.usefixtures("no_pidfd")
def test_without_pidfd_timeouts_still_kill_everything(ctx: ToolContext) -> None:
    r = sh(ctx, "exec >&- 2>&-; sleep 30", timeout=0.3)
    assert r.metadata["timed_out"] is True
    r = sh(ctx, "sleep 30 & echo $!; sleep 30", timeout=0.3)
    assert r.metadata["timed_out"] is True and gone_soon([int(r.metadata["stdout"])])


# -- a call's processes end with it, exactly (bash is a child subreaper) --------


def _running(needle: str) -> list[int]:
    """Live processes of this test process whose command line holds ``needle`` (tests/conftest.py)."""
    return running(needle)


def test_the_c_helper_starts_bash_as_a_child_subreaper(ctx: ToolContext) -> None:
    from dispatchd.tools import native

    assert native.lines is not None and hasattr(native.lines, "spawn_subreaper")
    # THP_enabled is the line before; the attribute itself is not in /proc: a
    # double fork's orphan names bash as its parent instead of the host's init.
    # The subshell has exited when bash goes on (it waits for it); the orphan
    # lives on until killed (a short sleep could end before ps reads it).
    r = sh(ctx, "(sleep 30.7 & echo $! > orphan); ps -o ppid= -p $(cat orphan); echo $$; kill $(cat orphan)")
    ppid, bash = r.metadata["stdout"].split()
    assert ppid == bash, r


def test_a_process_that_leaves_the_group_and_clears_its_environment_ends_at_the_timeout(ctx: ToolContext) -> None:
    # setsid: out of the call's group and session; env -i: no marker; the
    # subshell exits at once: an orphan. Before, it outlived the call.
    r = sh(ctx, "(setsid env -i /bin/sleep 30.123 &); sleep 30", timeout=0.5)
    assert r.metadata["timed_out"] is True
    assert _running("30.123") == []


def test_a_forking_loop_is_ended_whole_at_the_timeout(ctx: ToolContext) -> None:
    # Orphans made as fast as bash can (each detached, environment cleared),
    # bounded by the timeout: none is left once the call has returned.
    r = sh(ctx, "while :; do (setsid env -i /bin/sleep 7.321 &); done", timeout=1)
    assert r.metadata["timed_out"] is True
    assert _running("7.321") == []


# -- ... and when it returns by itself (the tool server adopts orphans) ----------


_sleeping = sleeping


def _wait_for(marker: str, count: int) -> list[int]:
    deadline = time.monotonic() + 5
    while len(found := _sleeping(marker)) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    return found


@pytest.fixture
def adopting(tmp_path: Path) -> Iterator[Adopting]:
    """Tools run in a process that adopts orphans, as the tool server does."""
    (tmp_path / "scratch").mkdir()
    runner = Adopting(os.path.realpath(tmp_path), str(tmp_path / "scratch"))
    yield runner
    runner.close()


LEFT = {
    "sleep &": "sleep 300.11 & echo ok",
    "setsid env -i &": "(setsid env -i /bin/sleep 300.11 > /dev/null 2>&1 &); echo ok",
    "nohup &": "nohup sleep 300.11 > /dev/null 2>&1 & echo ok",
    "holding the output": "setsid sleep 300.11 & echo ok",
}


@pytest.mark.parametrize("command", list(LEFT.values()), ids=list(LEFT))
def test_what_a_call_that_returned_by_itself_left_running_has_ended(adopting: Adopting, command: str) -> None:
    started = time.monotonic()
    r = adopting.call("shell_exec", command=command)
    # Returned, not held until the 300 s sleeper ends (far below it at any load).
    assert r["success"] and time.monotonic() - started < 60, r
    assert _sleeping("300.11") == []  # when the call returns, not later
    assert r["metadata"]["ended_processes"] == 1
    assert r["output"] == ("ok\n[dispatchd: ended 1 process the command left running (a call's processes end "
                           "with it); to keep one running, start it with background: true]")


def test_a_call_that_left_nothing_says_nothing(adopting: Adopting) -> None:
    r = adopting.call("shell_exec", command="sleep 0.05 & wait; echo ok")
    assert r["output"] == "ok\n" and r["metadata"]["ended_processes"] == 0


def test_a_forking_loop_that_returns_at_once_leaves_nothing(adopting: Adopting) -> None:
    # 200 orphans, each out of the call's group with no environment (no
    # marker), and the call returns at once: every one has ended by then.
    r = adopting.call("shell_exec", command="for i in $(seq 200); do (setsid env -i /bin/sleep 300.22 &); done")
    assert r["success"] and r["metadata"]["ended_processes"] == 200, r["metadata"]
    assert _sleeping("300.22") == []


def test_a_background_job_is_the_way_to_keep_a_process_running(adopting: Adopting) -> None:
    """The allowed twin: the same processes started by a job run on, past
    calls that end with leftovers of their own, until job_stop."""
    job = adopting.call("shell_exec", command="sleep 300.33 > /dev/null 2>&1 & (setsid env -i /bin/sleep 300.33 "
                                              "> /dev/null 2>&1 &); nohup sleep 300.33 > /dev/null 2>&1 & echo started",
                        background=True)["metadata"]["job"]
    assert len(_wait_for("300.33", 3)) == 3
    deadline = time.monotonic() + 5
    while adopting.call("job_output", job=job, offset=8, wait=1)["metadata"]["running"]:
        assert time.monotonic() < deadline  # its command exited, and nothing holds its output
    r = adopting.call("shell_exec", command="setsid env -i /bin/sleep 300.44 & echo ok")
    assert r["metadata"]["ended_processes"] == 1 and _sleeping("300.44") == []
    assert len(_sleeping("300.33")) == 3  # the job's, untouched
    assert adopting.call("job_stop", job=job)["output"] == f"job {job} had already ended (exited 0)"
    assert _sleeping("300.33") == []


def test_a_call_still_running_keeps_its_processes_while_another_call_ends(adopting: Adopting) -> None:
    # The long call's orphan (out of its group, no environment) is below its
    # living bash; the short call's sweep must leave it alone.
    long = adopting.send("shell_exec", command="(setsid env -i /bin/sleep 300.55 &); sleep 1.5; echo done")
    assert len(_wait_for("300.55", 1)) == 1
    short = adopting.call("shell_exec", command="(setsid env -i /bin/sleep 300.66 &); echo ok")
    assert short["metadata"]["ended_processes"] == 1 and _sleeping("300.66") == []
    assert len(_sleeping("300.55")) == 1  # untouched while its call runs
    r = adopting.result(long)
    assert r["success"] and r["output"].startswith("done\n") and r["metadata"]["ended_processes"] == 1
    assert _sleeping("300.55") == []


def test_a_process_that_adopts_no_orphans_ends_none_at_a_normal_return(ctx: ToolContext) -> None:
    """The sweep is the tool server's: in a process with children of its own
    (this test runner), a call's end touches nothing but its own tree."""
    r = sh(ctx, "setsid sleep 300.77 > /dev/null 2>&1 & echo ok")
    try:
        assert r.success and r.metadata["ended_processes"] == 0
        assert len(_wait_for("300.77", 1)) == 1
    finally:
        for pid in _sleeping("300.77"):
            os.kill(pid, 9)


def test_job_stop_ends_a_job_process_that_left_its_group_with_no_environment(ctx: ToolContext,
                                                                            tmp_path: Path) -> None:
    from dispatchd.tools.jobs import Jobs

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    jobs = Jobs(str(scratch))
    ctx = dataclasses.replace(ctx, jobs=jobs)
    try:
        r = sh(ctx, "(setsid env -i /bin/sleep 30.789 &); sleep 30", background=True)
        assert r.success, r
        assert len(_wait_for("30.789", 1)) == 1  # the allowed twin: it runs while the job does
        stopped = run_tool(TOOLS["job_stop"], ctx, {"job": r.metadata["job"]})
        assert stopped.success, stopped
        assert _sleeping("30.789") == []
    finally:
        jobs.close()
        for pid in _sleeping("30.789"):
            os.kill(pid, 9)
