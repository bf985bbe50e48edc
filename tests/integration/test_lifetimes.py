"""Nothing outlives what it belongs to: sessions of dead clients,
memory without a cgroup, leftovers of killed writes and killed daemons, and
errors that name what happened. Real processes, real signals."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import dispatch
from dispatchd.daemon import exits
from tests.conftest import REPO, Daemon, fork_server_of, processes_in, shell, wait_until

POLICIES = {
    "brief": "description = 'orphans end after 1 s'\n[limits]\norphan_grace_s = 1\n",
    "small": ("description = 'a small session memory bound'\n[limits]\norphan_grace_s = 1\n"
              "session_memory_bytes = 268435456\n"),
}


def _daemon(tmp_path: Path, name: str = "d", *extra: str) -> Daemon:
    policies = tmp_path / "policies"
    if not policies.exists():
        shutil.copytree(REPO / "policies", policies)
        for policy, text in POLICIES.items():
            (policies / f"{policy}.toml").write_text(text)
    (tmp_path / name).mkdir(exist_ok=True)
    # --cgroup off: the bounds under test are the ones that hold without a cgroup.
    return Daemon(tmp_path / name, "--policies", str(policies), "--cgroup", "off", *extra)


def _ids(client: dispatch.Client) -> list[str]:
    return [s["id"] for s in client.list_sessions()]


def _client_script(d: Daemon, worktree: Path, body: str) -> subprocess.Popen[str]:
    """A separate client process (one we can kill): opens a session, prints its id."""
    code = textwrap.dedent(f"""
        import sys, dispatch
        client = dispatch.connect({d.socket!r})
        {body}
    """)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env,
                            stdin=subprocess.DEVNULL)


# --- 14.2: sessions end with their clients ------------------------------------


def test_a_client_killed_mid_call_takes_its_session_and_command_with_it(tmp_path: Path, worktree: Path) -> None:
    d = _daemon(tmp_path)
    try:
        proc = _client_script(d, worktree, f"""
        s = client.open_session({str(worktree)!r}, policy="brief")
        print(s.id, flush=True)
        s.registry.get("shell_exec").call({{"command": "sleep 300"}})
        """)
        assert proc.stdout is not None
        sid = proc.stdout.readline().strip()
        proc.stdout.close()
        assert wait_until(lambda: len(processes_in(worktree)) > 0), "the command did not start"
        with d.connect() as client:
            assert sid in _ids(client)
            killed = time.monotonic()
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            assert wait_until(lambda: sid not in _ids(client))
            gone_after = time.monotonic() - killed
            assert wait_until(lambda: not processes_in(worktree)), processes_in(worktree)
        # The grace (1 s) at least; the bound above only tells it from the
        # policy's 60 s, with room for a loaded machine.
        assert 0.9 <= gone_after < 30, gone_after
        assert f"session={sid} reason=orphaned" in d.log()
    finally:
        assert d.stop() == 0, d.log()


def test_a_detached_session_survives_its_opener_and_an_attached_client_holds_one(
        tmp_path: Path, worktree: Path) -> None:
    d = _daemon(tmp_path)
    try:
        proc = _client_script(d, worktree, f"""
        s = client.open_session({str(worktree)!r}, policy="brief", detached=True)
        print(s.id, flush=True)
        s.detach()
        """)
        assert proc.stdout is not None
        detached = proc.stdout.readline().strip()
        proc.stdout.close()
        assert proc.wait() == 0
        with d.connect() as client:
            # Held by no one: a held one (the twin) lives as long as its client.
            held = client.open_session(str(worktree), policy="brief")
            time.sleep(1.5)  # more than the grace (1 s; an orphan ends at its deadline, not at a tick)
            ids = _ids(client)
            assert detached in ids and held.id in ids
            info = [s for s in client.list_sessions() if s["id"] == detached][0]
            assert info["protections"]["lifetime"]["detached"] is True
            assert info["protections"]["lifetime"]["orphan_grace_s"] == 1
            # Another client attaches to the held one and goes: the opener still holds it.
            with d.connect() as other:
                other.session(held.id).detach()
            time.sleep(1.5)
            assert held.id in _ids(client)
            client.close_session(detached)
            held.close()
    finally:
        assert d.stop() == 0, d.log()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_dispatch_exec_killed_ends_its_one_off_session(tmp_path: Path, worktree: Path, sig: signal.Signals) -> None:
    """SIGTERM: the CLI closes its session itself. SIGKILL: the daemon ends it
    at once, as an orphan with a grace of 0 (not the policy's 60 s)."""
    d = _daemon(tmp_path)
    try:
        env = {k: v for k, v in os.environ.items() if k != "DISPATCH_SOCKET"}
        proc = subprocess.Popen([sys.executable, "-m", "dispatch.cli", "--socket", d.socket, "--no-autostart",
                                 "exec", "--worktree", str(worktree), "--", "sleep", "300"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                stdin=subprocess.DEVNULL)
        assert wait_until(lambda: len(processes_in(worktree)) > 0), "the command did not start"
        with d.connect() as client:
            assert len(_ids(client)) == 1
            proc.send_signal(sig)
            assert proc.wait(10) == (128 + signal.SIGTERM if sig == signal.SIGTERM else -signal.SIGKILL)
            assert wait_until(lambda: not _ids(client))
            assert wait_until(lambda: not processes_in(worktree))
        # closed by the CLI itself (SIGTERM), or by the daemon, the grace being 0 (SIGKILL)
        assert ("reason=orphaned" in d.log()) is (sig == signal.SIGKILL)
    finally:
        assert d.stop() == 0, d.log()


# --- 14.3: memory without a cgroup ----------------------------------------------

HOG = "/usr/bin/python3 -c 'import time; b = bytearray(100 * 2**20); b[::4096] = b\"x\" * len(b[::4096]); time.sleep(60)'"


def test_a_session_over_its_memory_is_ended_by_the_watchdog_and_says_so(tmp_path: Path, worktree: Path) -> None:
    d = _daemon(tmp_path)
    try:
        with d.connect() as client:
            with client.open_session(str(worktree), policy="small") as session:
                memory = session.info["protections"]["lifetime"]["memory"]
                assert memory["mechanism"] == "watchdog" and memory["limit_bytes"] == 256 * 2**20
                # The allowed twin: one process of 100 MiB stays under 256 MiB.
                assert shell(session, f"{HOG.replace('time.sleep(60)', 'time.sleep(1)')}").is_success
                assert session.id in _ids(client)
                started = time.monotonic()
                # Three of 100 MiB: 300 MiB over the session, each far under RLIMIT_DATA.
                result = shell(session, f"{HOG} & {HOG} & {HOG} & wait", timeout=60)
                took = time.monotonic() - started
            assert result.is_failure
            assert "over its limit of 256 MiB" in result.error and "memory watchdog" in result.error, result.error
            assert session.id not in _ids(client)
            assert wait_until(lambda: not processes_in(worktree))
            assert took < 20, took
        assert f"session={session.id} reason=memory" in d.log()
        assert "event=memory_exceeded" in d.log()
    finally:
        assert d.stop() == 0, d.log()


# --- 14.4 and 14.6: killed writes, killed workers, killed daemons ----------------


def _nspid(pid: int) -> list[str]:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        return next(line.split()[1:] for line in f if line.startswith("NSpid:"))


def _zombies(d: Daemon) -> list[int]:
    """The zombies among the processes of the daemon's one session."""
    import psutil

    first = psutil.Process(d.worker_pid())
    found = []
    for p in first.children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


def _tool_server(d: Daemon) -> int:
    """The tool server of the daemon's one idle session: its first process
    in full mode, where it is pid 1 of the session's namespace (fork server -
    W1); the leaf under it in degraded mode (fork server - W1 - W2)."""
    import psutil

    first = psutil.Process(d.worker_pid())
    if _nspid(first.pid)[1:] == ["1"]:
        return first.pid
    leaves = [p for p in first.children(recursive=True) if not p.children()]
    assert len(leaves) == 1, leaves
    return leaves[0].pid


def _cut_write(d: Daemon, client: dispatch.Client, worktree: Path) -> tuple[dispatch.Session, dispatch.Result]:
    """Kill the tool server the moment a write's temporary file appears."""
    for _attempt in range(10):
        session = client.open_session(str(worktree))
        assert shell(session, "true").is_success
        server = _tool_server(d)
        results: list[dispatch.Result] = []
        big = "x" * (15 * 2**20)
        writer = threading.Thread(target=lambda: results.append(
            session.registry.get("write_file").call({"path": "big.txt", "content": big})))
        writer.start()
        while writer.is_alive():
            if any(n.startswith(".big.txt.dispatchd-") for n in os.listdir(worktree)):
                os.kill(server, signal.SIGKILL)
                break
        writer.join(15)
        if results[0].is_failure:
            return session, results[0]
        session.close()  # the write won the race: again
    raise AssertionError("every write finished before it could be cut; nothing tested")


def test_a_gone_processs_status_is_read_from_its_pidfd_once_reaped_and_unknown_until_then() -> None:
    # The daemon is not the worker's parent: the status reaches the pidfd
    # with the fork server's reaping. Here the test is the parent and reaps.
    proc = subprocess.Popen(["sh", "-c", "exit 3"])
    pidfd = os.pidfd_open(proc.pid)
    try:
        assert wait_until(lambda: os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None)
        # Exited, not reaped: not known yet (and said so: not "this kernel cannot say").
        assert exits.exit_status(pidfd, timeout_s=0.2) is exits.Unknown.NOT_YET
        assert proc.wait() == 3
        assert exits.exit_status(pidfd, timeout_s=0.2) == 3 << 8
    finally:
        os.close(pidfd)
    # Still running: not known within the timeout, and the call waited no longer.
    sleeper = subprocess.Popen(["sleep", "30"])
    pidfd = os.pidfd_open(sleeper.pid)
    try:
        started = time.monotonic()
        assert exits.exit_status(pidfd, timeout_s=0.2) is exits.Unknown.NOT_YET
        assert time.monotonic() - started < 5
        sleeper.kill()
        sleeper.wait()
        assert exits.exit_status(pidfd, timeout_s=0.2) == signal.SIGKILL
    finally:
        os.close(pidfd)


@pytest.mark.parametrize("mode", ["full", "degraded"])
def test_a_write_whose_tool_server_is_killed_says_so_and_its_temp_file_goes(tmp_path: Path, worktree: Path,
                                                                           mode: str) -> None:
    d = _daemon(tmp_path, "d", *(["--no-user-namespaces"] if mode == "degraded" else []))
    try:
        with d.connect() as client:
            session, result = _cut_write(d, client, worktree)
            assert result.is_failure
            assert "tool server was killed by signal 9 (SIGKILL)" in result.error, result.error
            assert "outcome unknown" in result.error and "re-read the file" in result.error
            assert result.metadata["outcome_unknown"] is True
            assert f"session={session.id} reason=tool_server_killed signal=9" in d.log()
            session.detach()
            # The daemon removes what the cut write left once the session's
            # processes are gone, before it lets the write lock go (the next
            # session's write below); the client may hear why the call failed
            # a moment before that, so this waits for it.
            assert wait_until(lambda: not [p.name for p in worktree.iterdir() if ".dispatchd-" in p.name])
            # The line follows the removal: a loaded machine may show the one before the other.
            assert wait_until(lambda: f"event=temp_files_removed session={session.id} count=1" in d.log())
            # That sweep left the worktree known clean (daemon/writelock.py): the
            # next writer's tool server does not sweep again at its grant. A
            # file of the pattern put there from outside dispatchd meanwhile
            # stays until that writer's end, when the daemon sweeps.
            stray = worktree / ".d.txt.dispatchd-0badcafe.tmp"
            stray.write_text("not from a session")
            with client.open_session(str(worktree)) as again:
                assert again.registry.get("write_file").call({"path": "a.txt", "content": "a"}).is_success
                assert shell(again, "true").is_success
                time.sleep(0.5)  # a sweep started at the grant (2,000 entries at most here) is over
                assert stray.read_text() == "not from a session"
            assert wait_until(lambda: not stray.exists())
    finally:
        assert d.stop() == 0, d.log()
    # What a killed daemon leaves (no end of session to clean up), beside a
    # user's file of a near name and a symlink with our exact name aimed outside:
    # a daemon that starts knows no worktree swept, so the next session granted
    # the write lock removes ours only.
    (worktree / ".c.txt.dispatchd-89abcdef.tmp").write_text("half a write")
    (worktree / ".big.txt.dispatchd-notours.tmp").write_text("mine")
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    os.symlink(outside, worktree / ".x.dispatchd-0123abcd.tmp")
    d = _daemon(tmp_path, "d2", *(["--no-user-namespaces"] if mode == "degraded" else []))
    try:
        with d.connect() as client, client.open_session(str(worktree)) as again:
            assert again.registry.get("write_file").call({"path": "a.txt", "content": "a"}).is_success
            assert wait_until(lambda: not (worktree / ".c.txt.dispatchd-89abcdef.tmp").exists())
        assert (worktree / ".big.txt.dispatchd-notours.tmp").read_text() == "mine"
        assert outside.read_text() == "keep"
    finally:
        assert d.stop() == 0, d.log()


@pytest.mark.parametrize("mode", ["full", "degraded"])
def test_a_worker_killed_from_outside_is_reported_with_its_signal(tmp_path: Path, worktree: Path, mode: str) -> None:
    d = _daemon(tmp_path, "d", *(["--no-user-namespaces"] if mode == "degraded" else []))
    # Full mode: the session's first process is its tool server (and pid 1).
    word, said = (("tool_server_killed", "tool server was killed by signal 9 (SIGKILL) from outside the session")
                  if mode == "full" else ("worker_killed", "worker was killed by signal 9 (SIGKILL)"))
    try:
        with d.connect() as client:
            session = client.open_session(str(worktree))
            assert shell(session, "true").is_success
            os.kill(d.worker_pid(), signal.SIGKILL)  # W1, the session's first process (its init)
            # The kernel tears the session's namespace down asynchronously: a
            # call sent at once may still be served. Wait for the daemon to see it.
            assert wait_until(lambda: f"reason={word}" in d.log()), d.log()
            result = shell(session, "echo hi")
            assert result.is_failure
            assert said in result.error, result.error
            assert f"reason={word} signal=9" in d.log()
            session.detach()
    finally:
        assert d.stop() == 0, d.log()


def test_a_killed_daemon_is_named_and_its_scratch_removed_at_the_next_start(tmp_path: Path, worktree: Path) -> None:
    d = _daemon(tmp_path)
    with d.connect() as client:
        session = client.open_session(str(worktree))
        assert shell(session, "head -c 1048576 /dev/zero > $TMPDIR/junk && mkdir -p $TMPDIR/d && chmod 0 $TMPDIR/d"
                     ).is_success
        scratch = d.state / "dispatchd" / "sessions" / session.id
        assert scratch.is_dir()
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        # The sandbox dies with the daemon (the fork server's parent-death
        # signal, then its own), a few process exits later on a loaded
        # machine: a call made meanwhile still reaches its tool server.
        results = []
        assert wait_until(lambda: results.append(shell(session, "true")) or results[-1].is_failure, timeout=10), \
            results[-1]
        assert "dispatchd is gone" in results[-1].error, results[-1].error
        session.detach()
    assert scratch.is_dir()  # left by the killed daemon
    # ... with those of the sandboxes it had made ahead (daemon/pool.py)
    left = set((d.state / "dispatchd" / "sessions").iterdir())
    assert scratch in left
    d.stop()
    again = Daemon(d.base, "--cgroup", "off")
    try:
        with again.connect() as client:
            client.status()  # serving: past start-up
        assert not any(p.exists() for p in left)
        assert f"event=stale_scratch_removed count={len(left)}" in again.log()
    finally:
        assert again.stop() == 0, again.log()


def test_a_live_daemons_scratch_is_not_taken_for_stale(tmp_path: Path, worktree: Path) -> None:
    first = _daemon(tmp_path, "a")
    try:
        with first.connect() as client, client.open_session(str(worktree)) as session:
            scratch = first.state / "dispatchd" / "sessions" / session.id
            env_state = first.state
            # Another daemon started on the same state directory (its own socket).
            (tmp_path / "b").mkdir()
            second = Daemon(tmp_path / "b", "--cgroup", "off", state=env_state)
            try:
                assert scratch.is_dir()
                assert shell(session, "true").is_success
            finally:
                assert second.stop() == 0, second.log()
    finally:
        assert first.stop() == 0, first.log()


@pytest.mark.parametrize("level", ["info", "debug"])
def test_tool_calls_are_logged_at_debug_only(tmp_path: Path, worktree: Path, level: str) -> None:
    d = _daemon(tmp_path, "d", "--log-level", level)
    try:
        with d.connect() as client, client.open_session(str(worktree)) as session:
            assert session.registry.get("read_file").call({"path": "README.md"}).is_success
            # The worker reports finished calls every 0.5 s: at debug, the
            # line comes (within 10 s on a loaded machine); at info, 1.2 s is
            # more than two batches' time, and the debug twin shows the probe.
            deadline = time.monotonic() + (10 if level == "debug" else 1.2)
            while "event=tool_call" not in d.log() and time.monotonic() < deadline:
                time.sleep(0.05)
        assert ("event=tool_call" in d.log()) == (level == "debug")
        assert "event=session_open" in d.log()
    finally:
        assert d.stop() == 0, d.log()


def test_an_idle_session_is_one_process_the_tool_server_as_pid_1(tmp_path: Path, worktree: Path) -> None:
    """Full mode: the fork server clones the tool server straight into the
    session's namespaces, as their pid 1 (one process a
    session); its twin, degraded mode, keeps an init above the tool server."""
    import psutil

    for extra, expected in (((), 1), (("--no-user-namespaces",), 2)):
        d = _daemon(tmp_path, "d" + str(expected), *extra)
        try:
            with d.connect() as client, client.open_session(str(worktree)) as session:
                assert shell(session, "true").is_success
                first = psutil.Process(d.worker_pid())
                fork_server = fork_server_of(d.proc.pid)
                assert first.ppid() == fork_server.pid
                assert 1 + len(first.children(recursive=True)) == expected
                if expected == 1:
                    assert _nspid(first.pid) == [str(first.pid), "1"]
                    assert _tool_server(d) == first.pid
                    # Seen from inside, a command's parent is pid 1, whose parent is outside.
                    result = shell(session, "echo $PPID; grep ^PPid /proc/1/status")
                    assert result.is_success, result.error
                    assert result.output.split() == ["1", "PPid:", "0"]
                else:
                    assert _nspid(first.pid) == [str(first.pid)]
                    assert _tool_server(d) != first.pid
        finally:
            assert d.stop() == 0, d.log()


@pytest.mark.parametrize("userns", [True, False], ids=["full", "degraded"])
def test_orphans_are_reaped_and_a_commands_exit_status_is_its_own(tmp_path: Path, worktree: Path,
                                                                  userns: bool) -> None:
    """The session's init reaps what commands leave behind (a zombie holds a
    pid of the session's budget), and never takes a command's own status: in
    full mode the tool server is that init, and a status it stole would make
    every command read as exit 0. A job whose leader exits while a background
    child holds its output open leaves its leader unreaped for a while; the
    orphans behind it are reaped all the same."""
    d = _daemon(tmp_path) if userns else _daemon(tmp_path, "d", "--no-user-namespaces")
    try:
        with d.connect() as client, client.open_session(str(worktree)) as session:
            for code in (0, 3, 42):
                result = shell(session, f"(sleep 0.05 &) ; exit {code}")
                assert result.metadata["exit_code"] == code, result
            job = session.registry.get("shell_exec").call({"command": "sleep 30 & exit 0", "background": True})
            assert job.is_success, job.error
            # Orphans that exit at once, many of them, behind the job's unreaped leader.
            burst = shell(session, "for i in $(seq 50); do (true &); done; sleep 0.2")
            assert burst.is_success, burst.error
            # Counted from outside (degraded mode's ps would see the host's
            # processes): at most the job's leader, left to its Popen.
            assert wait_until(lambda: len(_zombies(d)) <= 1), _zombies(d)
            assert shell(session, "exit 7").metadata["exit_code"] == 7
    finally:
        assert d.stop() == 0, d.log()


@pytest.mark.parametrize("userns", [True, False], ids=["full", "degraded"])
def test_closing_a_session_ends_its_processes_without_the_stop_timeouts_sigkill(
        tmp_path: Path, worktree: Path, userns: bool) -> None:
    """The signal the daemon sends ends the session itself: pid 1 of a
    namespace ignores a SIGTERM it has no handler for, so in full mode it
    gets SIGKILL; the degraded init's SIGTERM handler kills its domain. Had
    the signal been ignored, the close would wait STOP_TIMEOUT_S and log it."""
    import psutil

    d = _daemon(tmp_path) if userns else _daemon(tmp_path, "d", "--no-user-namespaces")
    try:
        with d.connect() as client:
            session = client.open_session(str(worktree))
            server = psutil.Process(_tool_server(d))
            assert shell(session, "sleep 60", background=True).is_success
            init = psutil.Process(server.ppid())
            deadline = time.monotonic() + 5
            while not (sleepers := [p for p in init.children(recursive=True) if p.name() == "sleep"]):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            (sleeper,) = sleepers
            session.close()
            # SIGKILL is delivered as the victims are scheduled: on a loaded
            # machine the close may return a moment before the last one is gone.
            _gone, alive = psutil.wait_procs([server, sleeper], timeout=5)
            assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []
        assert "event=session_close" in d.log()
        assert "event=worker_stop_timeout" not in d.log()
    finally:
        assert d.stop() == 0, d.log()
