"""Long-running work, with real commands: streamed output, cancellation, background
jobs, detached processes ended at the timeout, and the user's git identity."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from dispatch.client import Cancellation
from tests.conftest import REPO, Daemon, _refuse_root, gone, probe, processes_in, shell, sleepers, wait_until


_sleepers = sleepers  # the name other test modules imported from here before it moved to tests/conftest.py


def _wait_for_sleepers(marker: str, n: int) -> None:
    assert wait_until(lambda: len(sleepers(marker)) >= n), sleepers(marker)
    assert len(sleepers(marker)) == n


# ----------------------------------------------------------------- streaming


def test_a_loop_printing_once_a_second_is_seen_line_by_line(session: dispatch.Session) -> None:
    seen: list[tuple[float, str, str]] = []
    started = time.monotonic()
    r = session.registry.get("shell_exec").call(
        {"command": "for i in 1 2 3; do [ $i = 1 ] || sleep 1; echo line $i; done; echo done >&2"},
        on_output=lambda stream, text: seen.append((time.monotonic() - started, stream, text)),
    )
    assert r.is_success, r.error
    assert r.output == "line 1\nline 2\nline 3\n[stderr]\ndone\n"  # the same Result as without streaming
    lines = [(t, text) for t, stream, text in seen if stream == "stdout"]
    assert [text for _, text in lines] == ["line 1\n", "line 2\n", "line 3\n"]
    # Each line came when it was written, a second apart, not all at the end.
    assert lines[1][0] - lines[0][0] > 0.7
    assert lines[2][0] - lines[1][0] > 0.7
    assert lines[0][0] < 0.9
    assert seen[-1][1:] == ("stderr", "done\n")


def test_stdout_and_stderr_come_in_the_order_written(session: dispatch.Session) -> None:
    seen: list[tuple[str, str]] = []
    r = session.registry.get("shell_exec").call(
        {"command": "echo a; sleep 0.2; echo b >&2; sleep 0.2; echo c; sleep 0.2; echo d >&2"},
        on_output=lambda stream, text: seen.append((stream, text)),
    )
    assert r.is_success, r.error
    assert seen == [("stdout", "a\n"), ("stderr", "b\n"), ("stdout", "c\n"), ("stderr", "d\n")]


def test_streamed_output_obeys_the_cap(client: dispatch.Client, worktree: Path) -> None:
    with client.open_session(str(worktree)) as s:
        cap = s.info["limits"]["output_cap_bytes"]
        got: list[str] = []
        r = s.registry.get("shell_exec").call(
            {"command": f"head -c {cap * 2} /dev/zero | tr '\\0' x"}, on_output=lambda _s, t: got.append(t))
        assert r.metadata["truncated"] is True
        assert "".join(got) == "x" * cap
        assert r.metadata["stdout"] == "x" * cap


def test_concurrent_streaming_calls_each_get_their_own_output(session: dispatch.Session) -> None:
    seen: dict[str, list[tuple[str, int]]] = {"a": [], "b": [], "plain": []}
    results: dict[str, dispatch.Result] = {}

    def run(name: str, stream: bool) -> None:
        on_output = (lambda _s, text: seen[name].append((text, threading.get_ident()))) if stream else None
        results[name] = session.registry.get("shell_exec").call(
            {"command": f"for i in 1 2 3 4 5; do echo {name}$i; sleep 0.1; done"}, on_output=on_output)
        seen[name].append(("end", threading.get_ident()))

    threads = [threading.Thread(target=run, args=(n, n != "plain")) for n in seen]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    for name in ("a", "b"):
        texts = [t for t, _ in seen[name]]
        assert "".join(texts[:-1]) == "".join(f"{name}{i}\n" for i in range(1, 6))
        assert len({ident for _, ident in seen[name]}) == 1  # in the caller's own thread
        assert results[name].output == "".join(f"{name}{i}\n" for i in range(1, 6))
    assert [t for t, _ in seen["plain"]] == ["end"]
    assert results["plain"].output == "".join(f"plain{i}\n" for i in range(1, 6))


def test_a_call_without_streaming_gets_no_output_frames(session: dispatch.Session) -> None:
    # The plain path: one reply, the same Result.
    r = shell(session, "echo hi")
    assert r.output == "hi\n"


# ----------------------------------------------------------------- cancellation


def test_session_cancel_ends_the_command_and_its_children(session: dispatch.Session) -> None:
    results: list[dispatch.Result] = []
    call = threading.Thread(target=lambda: results.append(shell(
        session, "sleep 301.1 & sleep 301.1 & setsid sleep 301.1 & sleep 301.1; echo finished > f", timeout=60)))
    call.start()
    _wait_for_sleepers("301.1", 4)
    cancelled_at = time.monotonic()
    assert session.cancel() == 1
    call.join(5)
    assert not call.is_alive()
    assert gone(lambda: sleepers("301.1"))
    assert time.monotonic() - cancelled_at < 1.5
    (r,) = results
    assert r.is_failure
    assert r.metadata["cancelled"] is True
    assert r.error.startswith("command was cancelled")
    assert not (Path(session.info["worktree"]) / "f").exists()
    # The session goes on.
    assert shell(session, "echo still here").output == "still here\n"


def test_cancellation_handle_ends_one_call(session: dispatch.Session) -> None:
    c = Cancellation()
    threading.Timer(0.5, c.cancel).start()
    started = time.monotonic()
    r = session.registry.get("shell_exec").call({"command": "sleep 302.2"}, {"cancellation": c})
    assert time.monotonic() - started < 2
    assert r.metadata["cancelled"] is True
    assert gone(lambda: sleepers("302.2"))


def test_a_channel_is_read_on_while_a_command_runs_on_its_thread(session: dispatch.Session) -> None:
    # A command runs on the thread that reads its channel until the channel
    # has more to read (calls.Calls._call_here); then a new thread reads on.
    results: list[dispatch.Result] = []
    first = threading.Thread(target=lambda: results.append(shell(session, "sleep 0.8; echo first")))
    first.start()
    time.sleep(0.2)
    started = time.monotonic()
    assert shell(session, "echo second").output == "second\n"  # not held until the first ends
    assert time.monotonic() - started < 0.5
    first.join(5)
    assert [r.output for r in results] == ["first\n"]
    # The channel changed threads: calls, and a cancel, still reach the new reader.
    assert shell(session, "echo third").output == "third\n"
    c = Cancellation()
    threading.Timer(0.3, c.cancel).start()
    r = session.registry.get("shell_exec").call({"command": "sleep 317.8"}, {"cancellation": c})
    assert r.metadata["cancelled"] is True
    assert gone(lambda: sleepers("317.8"))


_CALLER = """
import sys, dispatch
s = dispatch.connect(sys.argv[1]).open_session(sys.argv[2])
print(s.id, flush=True)
s.registry.get("shell_exec").call({"command": "sleep 316.7", "timeout": 60})
"""


def test_a_command_ends_when_its_caller_dies(daemon: Daemon, client: dispatch.Client, worktree: Path) -> None:
    # The call runs on the thread that reads its channel: the channel's close
    # must still reach it (the reading is handed over, and the reader cancels).
    caller = subprocess.Popen([sys.executable, "-c", _CALLER, daemon.socket, str(worktree)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert caller.stdout is not None
        session_id = caller.stdout.readline().strip()
        _wait_for_sleepers("316.7", 1)
        caller.kill()
        assert gone(lambda: sleepers("316.7"))
    finally:
        caller.kill()
        caller.wait()
        caller.stdout.close()  # type: ignore[union-attr]
    client.close_session(session_id)


def test_an_exception_in_on_output_cancels_the_call(session: dispatch.Session) -> None:
    def boom(_stream: str, _text: str) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        session.registry.get("shell_exec").call({"command": "echo go; sleep 303.3"}, on_output=boom)
    assert gone(lambda: sleepers("303.3"))
    assert shell(session, "echo next").output == "next\n"  # the channel is still good


def test_keyboard_interrupt_while_waiting_cancels_the_call(session: dispatch.Session) -> None:
    import ctypes

    main = threading.get_ident()

    def interrupt() -> None:
        _wait_for_sleepers("304.4", 1)
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main), ctypes.py_object(KeyboardInterrupt))
        os.kill(os.getpid(), 0)

    t = threading.Thread(target=interrupt)
    t.start()
    with pytest.raises(KeyboardInterrupt):
        # A streaming call wakes the waiting thread now and then (its output):
        # the async exception is raised there.
        session.registry.get("shell_exec").call(
            {"command": "sleep 304.4 & while true; do echo tick; sleep 0.1; done"}, on_output=lambda s, t: None)
    t.join()
    assert gone(lambda: sleepers("304.4"))


# ----------------------------------------------------------------- detached processes


@pytest.mark.parametrize("how", ["setsid sleep {m} &", "(sleep {m} &)", "nohup sleep {m} > /dev/null 2>&1 &",
                                 "setsid sh -c 'sleep {m} & sleep {m}' &"])
def test_detached_processes_end_when_the_call_times_out(session: dispatch.Session, how: str) -> None:
    marker = "305.5"
    r = shell(session, how.format(m=marker) + "\nsleep 30", timeout=1)
    assert r.metadata["timed_out"] is True
    assert gone(lambda: sleepers(marker))


ENDED_NOTE = ("[dispatchd: ended 1 process the command left running (a call's processes end with it); "
              "to keep one running, start it with background: true]")


def test_processes_left_by_a_call_that_ended_normally_have_ended_when_it_returns(session: dispatch.Session) -> None:
    # Out of the call's group and session, with no environment (no marker),
    # and the call returns at once.
    r = shell(session, "(setsid env -i sleep 306.6 > /dev/null 2>&1 &); echo ok")
    assert r.is_success and r.output == "ok\n" + ENDED_NOTE
    assert r.metadata["ended_processes"] == 1
    assert sleepers("306.6") == []


def test_a_call_still_running_keeps_its_processes_while_another_call_returns(session: dispatch.Session) -> None:
    results: list[dispatch.Result] = []
    long = threading.Thread(target=lambda: results.append(shell(
        session, "(setsid env -i sleep 306.8 > /dev/null 2>&1 &); sleep 1.5; echo done")))
    long.start()
    _wait_for_sleepers("306.8", 1)
    short = shell(session, "(setsid env -i sleep 306.9 > /dev/null 2>&1 &); echo ok")
    assert short.metadata["ended_processes"] == 1 and sleepers("306.9") == []
    assert len(sleepers("306.8")) == 1  # below its call's living bash: untouched
    long.join(10)
    (r,) = results
    assert r.output.startswith("done\n") and r.metadata["ended_processes"] == 1
    assert sleepers("306.8") == []


def test_a_job_keeps_what_a_call_would_end_until_job_stop(session: dispatch.Session) -> None:
    """The allowed twin: the same process, started by a job, runs on past the
    job's end and past other calls, until job_stop."""
    job = shell(session, "(setsid env -i sleep 306.7 > /dev/null 2>&1 &); echo ok", background=True).metadata["job"]
    _wait_for_sleepers("306.7", 1)
    assert shell(session, "sleep 30", timeout=0.5).metadata["timed_out"] is True
    assert shell(session, "true").metadata["ended_processes"] == 0
    assert len(sleepers("306.7")) == 1
    assert session.registry.get("job_stop").call({"job": job}).is_success
    assert gone(lambda: sleepers("306.7"))


# ----------------------------------------------------------------- background jobs


def test_background_job_returns_at_once_and_reports_its_output(session: dispatch.Session) -> None:
    started = time.monotonic()
    r = shell(session, "echo one; sleep 0.5; echo two >&2; exit 3", background=True)
    assert time.monotonic() - started < 1
    assert r.is_success, r.error
    job = r.metadata["job"]
    assert isinstance(job, str) and job in r.output
    out = session.registry.get("job_output").call({"job": job, "wait": 5})
    assert out.is_success, out.error
    # The first read may come before "two": read on until the end.
    offset = out.metadata["next_offset"]
    got = out.output.split("[job ")[0]
    while out.metadata["running"]:
        out = session.registry.get("job_output").call({"job": job, "offset": offset, "wait": 5})
        got += out.output.split("[job ")[0]
        offset = out.metadata["next_offset"]
    assert got == "one\ntwo\n"
    assert out.metadata["exit_code"] == 3
    assert out.metadata["running"] is False
    assert out.output.endswith(f"[job {job} exited 3; next_offset {offset}]")
    listed = session.registry.get("job_list").call({})
    assert listed.output == f"{job}\texited 3\techo one; sleep 0.5; echo two >&2; exit 3"


def test_job_output_waits_for_new_output(session: dispatch.Session) -> None:
    job = shell(session, "sleep 1; echo late", background=True).metadata["job"]
    started = time.monotonic()
    out = session.registry.get("job_output").call({"job": job})  # wait 0: at once
    assert time.monotonic() - started < 0.5
    assert out.metadata["running"] is True and out.metadata["exit_code"] is None
    assert out.metadata["next_offset"] == 0
    out = session.registry.get("job_output").call({"job": job, "wait": 10})
    assert out.output.startswith("late\n")
    assert 0.5 < time.monotonic() - started < 5


def test_job_stop_ends_the_job_and_its_descendants(session: dispatch.Session) -> None:
    job = shell(session, "sleep 307.7 & setsid sleep 307.7 & sleep 307.7", background=True).metadata["job"]
    _wait_for_sleepers("307.7", 3)
    stopped = session.registry.get("job_stop").call({"job": job})
    assert stopped.is_success, stopped.error
    assert stopped.metadata["running"] is False
    assert gone(lambda: sleepers("307.7"))
    assert session.registry.get("job_list").call({}).output == f"{job}\tstopped\tsleep 307.7 & setsid sleep 307.7 & sleep 307.7"


def test_jobs_end_with_their_session(client: dispatch.Client, worktree: Path) -> None:
    with client.open_session(str(worktree)) as s:
        shell(s, "sleep 308.8", background=True)
        _wait_for_sleepers("308.8", 1)
    assert gone(lambda: sleepers("308.8"))


def test_unknown_job_is_a_clear_failure(session: dispatch.Session) -> None:
    r = session.registry.get("job_output").call({"job": "job_99"})
    assert r.error == "no background job 'job_99' in this session (jobs: none)"


def test_a_background_http_server_answers_a_later_call_and_its_log_is_readable(session: dispatch.Session) -> None:
    (Path(session.info["worktree"]) / "hello.txt").write_text("served\n")
    r = shell(session, "exec /usr/bin/python3 -u -m http.server 8765 --bind 127.0.0.1", background=True)
    job = r.metadata["job"]
    fetch = ("/usr/bin/python3 -c \"import time, urllib.request\n"
             "for _ in range(100):\n"
             "    try:\n"
             "        print(urllib.request.urlopen('http://127.0.0.1:8765/hello.txt').read().decode(), end='')\n"
             "        break\n"
             "    except OSError:\n"
             "        time.sleep(0.1)\n\"")
    got = shell(session, fetch, timeout=30)
    assert got.output == "served\n", got
    log = session.registry.get("job_output").call({"job": job, "wait": 2})
    assert "GET /hello.txt HTTP/1.1\" 200" in log.output
    assert log.metadata["running"] is True
    assert session.registry.get("job_stop").call({"job": job}).is_success


def test_job_tools_are_in_every_schema_format_with_their_risk(session: dispatch.Session) -> None:
    reg = session.registry
    assert reg.get("job_output").risk == "read"
    assert reg.get("job_list").risk == "read"
    assert reg.get("job_stop").risk == "execute"
    assert reg.get("shell_exec").risk == "execute"
    for fmt in ("plain", "openai", "openai-responses", "anthropic", "mcp"):
        text = repr(reg.schemas(fmt))
        for name in ("job_output", "job_stop", "job_list"):
            assert f"'{name}'" in text, (fmt, name)


# ----------------------------------------------------------------- git identity


@pytest.fixture(scope="module")
def identity_daemon(tmp_path_factory: pytest.TempPathFactory):
    _refuse_root()
    base = tmp_path_factory.mktemp("identity")
    home = base / "home"
    home.mkdir()
    (home / ".gitconfig").write_text('[user]\n\tname = "Ada Lovelace"\n\temail = ada@example.org ; work\n')
    old = os.environ.get("HOME")
    os.environ["HOME"] = str(home)
    try:
        d = Daemon(base)
    finally:
        os.environ["HOME"] = old or ""
    yield d
    assert d.stop() == 0, d.log()


def test_a_commit_inside_a_session_carries_the_users_identity(identity_daemon: Daemon, tmp_path: Path) -> None:
    wt = tmp_path / "repo"
    wt.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "GIT_CONFIG_NOSYSTEM": "1"}
    subprocess.run(["git", "init", "-q", str(wt)], check=True, env=env)
    with identity_daemon.connect() as c, c.open_session(str(wt)) as s:
        r = shell(s, "echo x > a && git add a && git commit -q -m first && git log -1 --format='%an <%ae>|%cn <%ce>'")
        assert r.is_success, r.error
        assert r.output == "Ada Lovelace <ada@example.org>|Ada Lovelace <ada@example.org>\n"
        # A write to the repository's config is refused by the sandbox, and says why.
        w = shell(s, "git config user.name Someone")
        assert w.is_failure
        assert "could not write config file .git/config: Device or resource busy" in w.error
        assert "the repository's .git/config is read-only in the sandbox" in w.error
        # The session's own global config is writable.
        g = shell(s, "git config --global core.pager cat && git config --global core.pager")
        assert g.output == "cat\n", g.error


# ----------------------------------------------------------------- both sandbox modes


@pytest.fixture(scope="module", params=["full", "degraded"])
def mode_daemon(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    _refuse_root()
    extra = ("--no-user-namespaces",) if request.param == "degraded" else ()
    d = Daemon(tmp_path_factory.mktemp(f"longwork-{request.param}"), *extra)
    yield request.param, d
    assert d.stop() == 0, d.log()


def test_cancel_timeout_and_jobs_in_both_modes(mode_daemon: tuple[str, Daemon], worktree: Path) -> None:
    mode, daemon = mode_daemon
    with daemon.connect() as client:
        try:
            s = client.open_session(str(worktree))
        except dispatch.RequestFailed as exc:
            raise AssertionError(f"{exc}\n{daemon.log()}") from exc
        _in_both_modes(mode, s)
        s.close()


def _in_both_modes(mode: str, s: dispatch.Session) -> None:
    assert s.status()["protections"]["mode"] == ("full" if mode == "full" else "degraded")
    r = shell(s, "setsid sleep 309.9 &\n(sleep 309.9 &)\nsleep 30", timeout=1)
    assert r.metadata["timed_out"] is True
    assert gone(lambda: sleepers("309.9"))
    c = Cancellation()
    threading.Timer(0.5, c.cancel).start()
    r = s.registry.get("shell_exec").call({"command": "setsid sleep 310.1 & sleep 310.1"}, {"cancellation": c})
    assert r.metadata["cancelled"] is True
    assert gone(lambda: sleepers("310.1"))
    r = shell(s, "(setsid env -i sleep 310.5 > /dev/null 2>&1 &); echo ok")
    assert r.metadata["ended_processes"] == 1 and sleepers("310.5") == []
    job = shell(s, "echo up; setsid sleep 311.2", background=True).metadata["job"]
    assert session_output(s, job).startswith("up\n")
    assert s.registry.get("job_stop").call({"job": job}).is_success
    assert gone(lambda: sleepers("311.2"))


def session_output(s: dispatch.Session, job: str) -> str:
    return s.registry.get("job_output").call({"job": job, "wait": 5}).output


# ----------------------------------------------------------------- the command line


def _cli(daemon: Daemon, *args: str) -> list[str]:
    return [sys.executable, "-m", "dispatch.cli", "--socket", daemon.socket, "--no-autostart", *args]


def _cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DISPATCH_SOCKET"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def test_cli_exec_prints_output_as_it_comes(daemon: Daemon, client: dispatch.Client, worktree: Path) -> None:
    with subprocess.Popen(_cli(daemon, "exec", "--worktree", str(worktree), "--",
                               "bash", "-c", "for i in 1 2 3; do [ $i = 1 ] || sleep 1; echo $i; done"),
                          stdout=subprocess.PIPE, text=True, env=_cli_env()) as proc:
        assert proc.stdout is not None
        times = []
        for line in proc.stdout:
            times.append((time.monotonic(), line))
        assert proc.wait(30) == 0
    assert [line for _, line in times] == ["1\n", "2\n", "3\n"]
    assert times[2][0] - times[0][0] > 1.5  # they came a second apart, not together at the end


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_exec_stopped_by_a_signal_ends_the_command_and_the_one_off_session(
        daemon: Daemon, client: dispatch.Client, worktree: Path, sig: signal.Signals) -> None:
    marker = "312.3" if sig == signal.SIGTERM else "313.4"
    with subprocess.Popen(_cli(daemon, "exec", "--worktree", str(worktree), "--", "bash", "-c",
                               f"setsid sleep {marker} & echo started; sleep {marker}"),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_cli_env()) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline() == "started\n"
        _wait_for_sleepers(marker, 2)
        proc.send_signal(sig)
        assert proc.wait(10) == 128 + sig
        assert gone(lambda: sleepers(marker))
        assert [s for s in client.list_sessions() if s["worktree"] == str(worktree)] == []
        assert f"dispatch: {sig.name}: the command was cancelled" in proc.stderr.read()


def test_cli_jobs(daemon: Daemon, client: dispatch.Client, worktree: Path) -> None:
    with client.open_session(str(worktree)) as s:
        job = shell(s, "echo hello; sleep 314.5", background=True).metadata["job"]
        env = _cli_env()
        listed = subprocess.run(_cli(daemon, "jobs", "--session", s.id), capture_output=True, text=True, env=env)
        assert listed.stdout == f"{job}\trunning\techo hello; sleep 314.5\n", listed.stderr
        out = subprocess.run(_cli(daemon, "jobs", "--session", s.id, "output", job, "--wait", "5"),
                             capture_output=True, text=True, env=env)
        assert out.stdout == "hello\n"
        stop = subprocess.run(_cli(daemon, "jobs", "--session", s.id, "stop", job), capture_output=True, text=True,
                              env=env)
        assert stop.returncode == 0 and stop.stdout == f"job {job} stopped\n"
        assert gone(lambda: sleepers("314.5"))
        called = subprocess.run(_cli(daemon, "call", "--session", s.id, "job_list"), capture_output=True, text=True,
                                env=env)
        assert '"output": "' + job + '\\tstopped\\t' in called.stdout


# ----------------------------------------------------------------- the process limit


@pytest.fixture(scope="module")
def tight_daemon(tmp_path_factory: pytest.TempPathFactory):
    import shutil

    _refuse_root()
    base = tmp_path_factory.mktemp("tight")
    policies = base / "policies"
    shutil.copytree(REPO / "policies", policies)
    (policies / "tight.toml").write_text('[limits]\nmax_processes = 80\ncommand_timeout_s = 20\n')
    d = Daemon(base, "--policies", str(policies))
    yield d
    assert d.stop() == 0, d.log()


def test_a_fork_bomb_with_a_timeout_does_not_take_the_tool_server(tight_daemon: Daemon, worktree: Path) -> None:
    with tight_daemon.connect() as c, c.open_session(str(worktree), policy="tight") as s:
        r = shell(s, "b() { b | b & }; b; sleep 100", timeout=3)
        assert r.metadata["timed_out"] is True
        # The tool server answers, and the bomb is gone: it was this call's.
        after = shell(s, "ps -e -o pid= | wc -l")
        assert after.is_success, after.error
        assert int(after.output.split()[0]) < 20, after.output


def test_a_fork_bomb_left_running_leaves_the_tool_server_its_reserve(tight_daemon: Daemon, worktree: Path) -> None:
    with tight_daemon.connect() as c, c.open_session(str(worktree), policy="tight") as s:
        assert shell(s, "ulimit -Su; sleep 0.1; ulimit -Hu").output == "60\n60\n"  # 80 less the server's reserve (a quarter)
        # The bomb's shell returns at once: a call's processes end with it...
        # Started with one fork (`b &`), made before the bomb exists: bash
        # forks a pipeline's two sides itself, so a bare `b` forks twice, and
        # on a loaded machine the first side's bomb can take the session's 60
        # between the two, leaving bash retrying its second fork (EAGAIN)
        # past the timeout.
        r = shell(s, "b() { b | b & }; b &", timeout=5)
        assert r.metadata["timed_out"] is False and r.metadata["ended_processes"] > 0, r.metadata
        # ... a job's go on, at the limit.
        job = shell(s, "b() { b | b & }; b", background=True).metadata["job"]
        time.sleep(1)
        for _ in range(3):
            alive = shell(s, "echo alive")  # a new bash: the server can still spawn and answer
            assert alive.output == "alive\n", alive
        assert s.registry.get("job_list").call({}).output.startswith(f"{job}\t")
    # Closing the session ends the bomb.
    assert gone(lambda: processes_in(worktree))


# Tasks (threads) of the user outside any session: more than the session's
# whole budget (80) and than its commands' limit (60). No more: a run beside
# this one, as the same user, has degraded sessions whose headroom they take.
_ELSEWHERE = 120
_HOLD = """
import sys, threading
stop = threading.Event()
for _ in range(int(sys.argv[1])):
    threading.Thread(target=stop.wait, daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""
# Forks until refused; prints the refusal's errno name (None: never refused) and how many it made.
_FORK_UNTIL_REFUSED = """
import errno, os, signal
pids, refused = [], None
while len(pids) < 200:
    try:
        pid = os.fork()
    except OSError as exc:
        refused = errno.errorcode[exc.errno]
        break
    if pid == 0:
        signal.pause()
        os._exit(0)
    pids.append(pid)
for pid in pids:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
print(refused, len(pids))
"""


@pytest.fixture
def tasks_elsewhere() -> Iterator[None]:
    """The user runs ``_ELSEWHERE`` more tasks outside the daemon while the test runs."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(_ELSEWHERE)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        yield
    finally:
        holder.kill()
        holder.wait()
        for stream in (holder.stdin, holder.stdout):
            if stream is not None:
                stream.close()


def test_a_session_forks_while_the_user_runs_more_tasks_elsewhere_than_its_limit(
        tight_daemon: Daemon, worktree: Path, tasks_elsewhere: None) -> None:
    # With a user namespace the session's limit counts the session's own
    # tasks; the user's count above it is checked against what the namespace's
    # creator (the fork server, the user's own limit) had, never the session's.
    with tight_daemon.connect() as c, c.open_session(str(worktree), policy="tight") as s:
        r = shell(s, "/bin/true && /bin/true && echo forked")
        assert r.output == "forked\n", r.metadata


def test_the_sessions_own_limit_still_stops_its_forks_while_the_user_runs_tasks_elsewhere(
        tight_daemon: Daemon, worktree: Path, tasks_elsewhere: None) -> None:
    with tight_daemon.connect() as c, c.open_session(str(worktree), policy="tight") as s:
        refused, made = probe(s, _FORK_UNTIL_REFUSED).split()
        # Refused at the commands' 60, less what runs already (the tool
        # server's threads, bash, python): neither at once (the user's 120
        # elsewhere) nor never.
        assert refused == "EAGAIN" and 40 <= int(made) < 60, (refused, made)


