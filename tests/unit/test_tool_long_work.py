"""shell_exec's streaming and cancel, the process-tree kill, and background jobs,
run directly (no daemon, no sandbox) with real processes."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from dispatchd.policy import Limits
from dispatchd.tools import jobs as jobs_mod
from dispatchd.tools import jobwindow
from dispatchd.tools import proctree
from dispatchd.tools import shell as shell_mod
from dispatchd.tools.base import CallControl, Outcome, ToolContext, run_tool
from dispatchd.tools.jobs import Jobs
from dispatchd.tools.table import TOOLS
from tests.unit.adopting import sleeping
from tests.conftest import gone, sleepers

pytestmark = pytest.mark.process  # starts processes (git, a compiler, commands, forks)


@pytest.fixture
def ctx(tmp_path: Path) -> Iterator[ToolContext]:
    root = tmp_path / "wt"
    root.mkdir()
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    jobs = Jobs(str(scratch))
    yield ToolContext(root=os.path.realpath(root), limits=Limits(), env={"PATH": "/usr/bin:/bin"},
                      scratch=str(scratch), jobs=jobs)
    jobs.close()


def run(ctx: ToolContext, tool: str, **params: Any) -> Outcome:
    return run_tool(TOOLS[tool], ctx, params)


def streaming(ctx: ToolContext) -> tuple[ToolContext, list[tuple[str, str]], CallControl]:
    seen: list[tuple[str, str]] = []
    control = CallControl(lambda stream, text: seen.append((stream, text)))
    return dataclasses.replace(ctx, call=control), seen, control


marked = sleeping


def gone_within(marker: str, seconds: float) -> bool:
    """Whether they are gone in time; the deadline is generous (a sleep
    left behind would run for minutes), so load never fails the test."""
    return gone(lambda: sleepers(marker), max(seconds, 30.0))


# ----------------------------------------------------------------- streaming


def test_output_is_passed_on_as_it_comes_and_the_outcome_is_unchanged(ctx: ToolContext) -> None:
    live, seen, _ = streaming(ctx)
    r = run(live, "shell_exec", command="echo a; sleep 0.2; echo b >&2; sleep 0.2; echo c")
    plain = run(ctx, "shell_exec", command="echo a; sleep 0.2; echo b >&2; sleep 0.2; echo c")
    assert seen == [("stdout", "a\n"), ("stderr", "b\n"), ("stdout", "c\n")]
    assert (r.success, r.output) == (plain.success, plain.output)


def test_a_character_cut_between_reads_is_passed_on_whole(ctx: ToolContext) -> None:
    live, seen, _ = streaming(ctx)
    run(live, "shell_exec", command="printf '\\xc3'; sleep 0.2; printf '\\xa9\\n'")
    assert "".join(t for _, t in seen) == "é\n"
    assert all("\ufffd" not in t for _, t in seen)


def test_streamed_output_stops_at_the_cap(ctx: ToolContext) -> None:
    small = dataclasses.replace(ctx, limits=msgspec.structs.replace(ctx.limits, output_cap_bytes=1000))
    live, seen, _ = streaming(small)
    r = run(live, "shell_exec", command="head -c 5000 /dev/zero | tr '\\0' x")
    assert "".join(t for _, t in seen) == "x" * 1000
    assert r.metadata["truncated"] is True


def test_a_failing_callback_stops_the_stream_not_the_command(ctx: ToolContext) -> None:
    def broken(_s: str, _t: str) -> None:
        raise OSError("the client went away")

    live = dataclasses.replace(ctx, call=CallControl(broken))
    r = run(live, "shell_exec", command="echo one; echo two")
    assert r.output == "one\ntwo\n"


# ----------------------------------------------------------------- cancel


def test_cancel_ends_the_command_and_everything_it_started(ctx: ToolContext) -> None:
    live, _, control = streaming(ctx)
    threading.Timer(0.5, control.cancel).start()
    started = time.monotonic()
    r = run(live, "shell_exec", command="setsid sleep 401.1 & (sleep 401.1 &) ; sleep 401.1")
    assert time.monotonic() - started < 0.9  # woken at once, not at a poll
    assert not r.success
    assert r.metadata["cancelled"] is True and r.metadata["timed_out"] is False
    assert r.error.startswith("command was cancelled\n[cancelled after ")
    assert gone_within("401.1", 1.0)


def test_a_cancel_that_comes_after_bash_exited_reports_the_command_as_completed(
        ctx: ToolContext, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cancel is made the moment the capture sees bash's exit, while a
    process it left still holds the output open (so the capture looks at
    the cancel again before it returns): the command completed, and says
    so, with its status. Before, "command was cancelled" with exit_code 0
    and the whole output. The twin, a cancel while the command runs, is
    the test above."""
    live, _, control = streaming(ctx)
    seen = shell_mod._Capture._on_ready

    def cancel_at_the_exit(capture: shell_mod._Capture, fd: int) -> None:
        seen(capture, fd)
        if fd == capture._pidfd:
            control.cancel()

    monkeypatch.setattr(shell_mod._Capture, "_on_ready", cancel_at_the_exit)
    for command, code in (("echo done; (sleep 0.6 &)", 0), ("echo done; (sleep 0.6 &); exit 3", 3)):
        control.cancelled.clear()
        r = run(live, "shell_exec", command=command)
        assert control.cancelled.is_set()
        assert (r.success, r.metadata["exit_code"], "cancelled" in r.metadata) == (code == 0, code, False), r
        assert r.metadata["stdout"] == "done\n"
        assert (r.output if code == 0 else r.error).startswith("done\n" if code == 0 else "command exited with status 3")


def test_a_timeout_ends_detached_processes_too(ctx: ToolContext) -> None:
    r = run(ctx, "shell_exec", command="setsid sleep 402.2 > /dev/null 2>&1 &\nnohup sleep 402.2 > /dev/null 2>&1 &\n"
                                       "sleep 30", timeout=0.5)
    assert r.metadata["timed_out"] is True
    assert gone_within("402.2", 1.0)


def test_the_marker_is_in_the_command_environment(ctx: ToolContext) -> None:
    r = run(ctx, "shell_exec", command="printenv DISPATCH_CALL_ID")
    assert len(r.output.strip()) == 16
    assert r.output != run(ctx, "shell_exec", command="printenv DISPATCH_CALL_ID").output  # one per call


def test_commands_get_the_process_reserve_below_ours(ctx: ToolContext) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    # The soft limit from birth (the first thing bash does), the hard one right after.
    r = run(ctx, "shell_exec", command="ulimit -Su; sleep 0.1; ulimit -Hu")
    if hard == resource.RLIM_INFINITY:
        assert r.output.splitlines()[1] == "unlimited"
    else:
        value = hard - min(proctree.PROCESS_RESERVE, ctx.limits.max_processes // 4)
        assert r.output == f"{min(soft, value)}\n{value}\n"
    assert resource.getrlimit(resource.RLIMIT_NPROC) == (soft, hard)  # ours, put back


def test_a_failed_repository_config_write_says_why(ctx: ToolContext) -> None:
    r = run(ctx, "shell_exec", command="echo 'error: could not write config file .git/config: Device or resource "
                                       "busy' >&2; exit 4")
    assert r.error.endswith("[the repository's .git/config is read-only in the sandbox (it names programs the "
                            "user's own git runs outside). Use `git config --global ...` (this session's own "
                            "config, in its $HOME), or `git -c name=value ...` for one command; commits already "
                            "carry the user's name and email]")
    # The twin: another failure gets no such note.
    assert "read-only" not in run(ctx, "shell_exec", command="echo nope >&2; exit 4").error


# ----------------------------------------------------------------- jobs


def test_a_job_runs_in_the_background_and_its_log_is_in_the_scratch(ctx: ToolContext) -> None:
    started = time.monotonic()
    r = run(ctx, "shell_exec", command="echo hi; sleep 0.3; echo there >&2", background=True)
    assert time.monotonic() - started < 0.5
    assert r.success and r.metadata["job"] == "job_1"
    out = run(ctx, "job_output", job="job_1", wait=0)
    assert out.metadata["running"] is True
    deadline = time.monotonic() + 5
    while out.metadata["running"] and time.monotonic() < deadline:
        out = run(ctx, "job_output", job="job_1", wait=1)
    assert out.output == "hi\nthere\n[job job_1 exited 0; next_offset 9]"
    assert out.metadata["exit_code"] == 0 and out.metadata["next_offset"] == 9
    assert (Path(ctx.scratch) / "jobs" / "job_1.log").read_bytes() == b"hi\nthere\n"
    rest = run(ctx, "job_output", job="job_1", offset=9)
    assert rest.output == "[job job_1 exited 0; next_offset 9]"


def test_job_output_cuts_at_a_character_boundary() -> None:
    cut = jobwindow.char_cut
    assert cut(b"a\xc3") == 1  # the first byte of a two-byte character waits for the next read
    assert cut(b"a\xc3\xa9") == 3
    assert cut(b"\xe2\x82") == 0
    assert cut(b"\xf0\x9f\x98\x80") == 4
    assert cut(b"\xf0\x9f\x98") == 0
    assert cut(b"plain") == 5


def test_job_stop_kills_the_job_and_its_detached_children(ctx: ToolContext) -> None:
    job = run(ctx, "shell_exec", command="setsid sleep 404.4 > /dev/null 2>&1 & sleep 404.4",
              background=True).metadata["job"]
    deadline = time.monotonic() + 2
    while len(marked("404.4")) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    r = run(ctx, "job_stop", job=job)
    assert r.output == f"job {job} stopped"
    assert gone_within("404.4", 1.0)
    assert run(ctx, "job_list").output == f"{job}\tstopped\tsetsid sleep 404.4 > /dev/null 2>&1 & sleep 404.4"


def test_a_job_whose_thread_cannot_start_is_ended_and_the_call_says_why(
        ctx: ToolContext, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session at its process limit may have room for the job's bash but
    not for the thread that reads it: the job is ended and forgotten (none
    runs that nothing reads), and the call says what stands in the way."""
    start = threading.Thread.start

    def no_job_thread(thread: threading.Thread) -> None:
        if thread.name.startswith("job "):
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", no_job_thread)
    r = run(ctx, "shell_exec", command="sleep 505.5", background=True)
    assert r.error == ("shell_exec: the tool server cannot start a thread (can't start new thread): the session is "
                       "at its process limit (its commands hold every process it may have), or all sessions "
                       "together are at theirs (dispatch status: kernel budgets); stop some (job_stop) and retry")
    assert gone_within("505.5", 1.0)
    assert run(ctx, "job_list").output == "no background jobs"
    assert not (Path(ctx.scratch) / "jobs" / "job_1.log").exists()
    # The twin: with its thread, the same call starts a job that runs.
    monkeypatch.undo()
    r = run(ctx, "shell_exec", command="sleep 505.5", background=True)
    assert r.success and run(ctx, "job_list").output == f"{r.metadata['job']}\trunning\tsleep 505.5"
    assert run(ctx, "job_stop", job=r.metadata["job"]).success
    assert gone_within("505.5", 1.0)


def _ended(ctx: ToolContext, job: str) -> Outcome:
    out = run(ctx, "job_output", job=job, wait=5)
    deadline = time.monotonic() + 5
    while out.metadata["running"] and time.monotonic() < deadline:
        out = run(ctx, "job_output", job=job, wait=1)
    return out


def test_a_job_command_killed_by_a_signal_reports_bashs_status(ctx: ToolContext) -> None:
    # The keeper (jobs._KEEPER) reports the command's status as bash's $?.
    job = run(ctx, "shell_exec", command="kill -9 $$", background=True).metadata["job"]
    out = _ended(ctx, job)
    assert out.metadata["exit_code"] == 137 and out.metadata["state"] == "exited 137"


def test_a_jobs_keeper_reads_no_startup_file(ctx: ToolContext, tmp_path: Path) -> None:
    # bash reads ~/.bashrc when its stdin is a socket (as under sshd): the
    # keeper's is, so it runs with --norc. The twin: a login-like bash reads it.
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("echo from-bashrc\n")
    ctx = dataclasses.replace(ctx, env={**ctx.env, "HOME": str(home)})
    job = run(ctx, "shell_exec", command="echo hi", background=True).metadata["job"]
    assert _ended(ctx, job).output == f"hi\n[job {job} exited 0; next_offset 3]"
    assert run(ctx, "shell_exec", command="bash -ic true 2>/dev/null").output == "from-bashrc\n"


def test_a_job_with_a_timeout_is_stopped_at_it(ctx: ToolContext) -> None:
    job = run(ctx, "shell_exec", command="sleep 405.5", background=True, timeout=0.3).metadata["job"]
    out = run(ctx, "job_output", job=job, wait=5)
    assert out.metadata["state"] == "timed out" and out.metadata["running"] is False
    assert gone_within("405.5", 1.0)


def test_the_log_is_capped(ctx: ToolContext) -> None:
    small = dataclasses.replace(ctx, limits=msgspec.structs.replace(ctx.limits, output_cap_bytes=100))
    job = run(small, "shell_exec", command="head -c 1000 /dev/zero | tr '\\0' y", background=True).metadata["job"]
    out = run(small, "job_output", job=job, wait=5)
    while out.metadata["running"]:
        out = run(small, "job_output", job=job, wait=5)
    out = run(small, "job_output", job=job)
    assert out.output == "y" * 100 + "\n[job output truncated at 100 bytes; later output was dropped]\n" \
                         f"[job {job} exited 0; next_offset 100]"
    assert out.metadata["truncated"] is True


def test_at_most_max_running_jobs(ctx: ToolContext, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobs_mod, "MAX_RUNNING", 2)
    a = run(ctx, "shell_exec", command="sleep 406.6", background=True).metadata["job"]
    b = run(ctx, "shell_exec", command="sleep 406.6", background=True).metadata["job"]
    r = run(ctx, "shell_exec", command="sleep 406.6", background=True)
    assert r.error == "2 background jobs already run in this session (the most there can be); stop one with job_stop first"
    for job in (a, b):
        run(ctx, "job_stop", job=job)
    assert run(ctx, "shell_exec", command="true", background=True).success  # room again
    assert gone_within("406.6", 1.0)


def test_ended_jobs_beyond_max_kept_are_forgotten(ctx: ToolContext, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobs_mod, "MAX_KEPT", 2)
    first = run(ctx, "shell_exec", command="true", background=True).metadata["job"]
    run(ctx, "job_output", job=first, wait=5)
    second = run(ctx, "shell_exec", command="true", background=True).metadata["job"]
    run(ctx, "job_output", job=second, wait=5)
    third = run(ctx, "shell_exec", command="true", background=True).metadata["job"]
    assert [line.split("\t")[0] for line in run(ctx, "job_list").output.splitlines()] == [second, third]
    assert not (Path(ctx.scratch) / "jobs" / f"{first}.log").exists()


def test_a_planted_log_or_link_does_not_redirect_a_job(ctx: ToolContext, tmp_path: Path) -> None:
    jobs_dir = Path(ctx.scratch) / "jobs"
    jobs_dir.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    (jobs_dir / "job_1.log").symlink_to(victim)
    job = run(ctx, "shell_exec", command="echo mine", background=True).metadata["job"]
    assert run(ctx, "job_output", job=job, wait=5).output.startswith("mine\n")
    assert victim.read_text() == "keep\n"


def test_job_tools_without_jobs_say_so(tmp_path: Path) -> None:
    bare = ToolContext(root=str(tmp_path), limits=Limits(), env={})
    assert run(bare, "job_list").error == "this session runs no background jobs"
    assert run(bare, "shell_exec", command="true", background=True).error == "this session cannot run background jobs"


def test_ended_jobs_are_kept_across_a_sleep_as_they_were(ctx: ToolContext, tmp_path: Path) -> None:
    """What a tool server going to sleep hands over (Jobs.kept) and the woken
    one takes back (Jobs.restore): the same job_output and job_list, the log
    read through the descriptor handed over, the numbering going on."""
    run(ctx, "shell_exec", command="printf 'one\\ntwo\\n'", background=True)
    run(ctx, "shell_exec", command="exit 3", background=True)
    deadline = time.monotonic() + 5
    while ctx.jobs.running() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not ctx.jobs.running()
    before = (run(ctx, "job_output", job="job_1").output, run(ctx, "job_list").output)
    records, logs, next_number = ctx.jobs.kept()
    woken = Jobs(ctx.scratch)
    woken.restore(records, [os.dup(fd) for fd in logs], next_number)
    other = dataclasses.replace(ctx, jobs=woken)
    try:
        # Renamed by name meanwhile: the log is held by descriptor.
        os.rename(Path(ctx.scratch) / "jobs" / "job_1.log", Path(ctx.scratch) / "jobs" / "moved")
        assert (run(other, "job_output", job="job_1").output, run(other, "job_list").output) == before
        assert run(other, "job_output", job="job_2").metadata["exit_code"] == 3
        assert run(other, "shell_exec", command="true", background=True).metadata["job"] == "job_3"
    finally:
        woken.close()


def test_a_session_with_a_job_running_reports_it(ctx: ToolContext) -> None:
    """The tool server does not sleep while a job runs (Jobs.running); its
    twin: once the job ended, it may."""
    run(ctx, "shell_exec", command="sleep 0.3", background=True)
    assert ctx.jobs.running()
    deadline = time.monotonic() + 5
    while ctx.jobs.running() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not ctx.jobs.running()
