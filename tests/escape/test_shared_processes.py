"""All sessions of a daemon together run at most half of the processes the
lowest limit they meet allows (confine/sharedprocs.py): a session's fork
bomb, however many sessions run one, leaves the other half to everything
else of the user's. The daemon is started with a lowered ``RLIMIT_NPROC``
(the user's limit on a machine that sets one low): what the user's other
processes run meanwhile is counted against it too, so the limit is what the
user runs at the start plus ``ROOM``, and the test takes turns with the other
tests that measure a budget of the user's (tests/conftest.py, user_budgets)."""

from __future__ import annotations

import errno
import os
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import REPO, Daemon, _refuse_root, shell, wait_until
from tests.sleeping import SLEEP_AFTER_S, stays_asleep, wait_until_asleep, with_sleep_after

pytestmark = pytest.mark.usefixtures("user_budgets")

ROOM = 1200  # over what the user runs at the start: the sessions together get about half of it

# Forks until the kernel refuses or ``n`` run (each child sleeps ``hold``);
# prints how many and the errno (0: none refused), then holds them. Given a
# third argument, a file: once it exists, ends one of its children and waits
# for it (exactly one process to be had), and prints "freed".
HOG = r"""
import os, signal, sys, time
n, hold, free = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
children, err = [], 0
while len(children) < n:
    try:
        pid = os.fork()
    except OSError as exc:
        err = exc.errno
        break
    if pid == 0:
        os.execv("/bin/sleep", ["sleep", hold])
    children.append(pid)
print(len(children), err, flush=True)
if free:
    while not os.path.exists(free[0]):
        time.sleep(0.05)
    os.kill(children[-1], signal.SIGKILL)
    os.waitpid(children[-1], 0)
    print("freed", flush=True)
time.sleep(float(hold))
"""


def _tasks_of_the_user() -> int:
    """What the kernel counts against RLIMIT_NPROC: every thread of every process of ours."""
    count = 0
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == os.getuid():
                count += len(os.listdir(f"/proc/{entry}/task"))
        except OSError:
            continue
    return count


@pytest.fixture()
def limited(tmp_path: Path) -> Iterator[tuple[Daemon, dispatch.Client, int]]:
    """A full-mode daemon whose RLIMIT_NPROC is what the user runs plus
    ``ROOM``, and that limit; its policy "sleepy" sleeps after 0.1 s."""
    _refuse_root()
    limit = _tasks_of_the_user() + ROOM
    policies = tmp_path / "policies"
    shutil.copytree(REPO / "policies", policies)
    (policies / "sleepy.toml").write_text(with_sleep_after("", SLEEP_AFTER_S))
    d = Daemon(tmp_path, "--cgroup", "off", "--policies", str(policies),
               prefix=("prlimit", f"--nproc={limit}", "--"))
    try:
        with d.connect() as c:
            yield d, c, limit
    finally:
        assert d.stop() == 0, d.log()


def _hog(session: dispatch.Session, worktree: Path, n: int) -> tuple[dispatch.Result, int, int]:
    """A background job that forks ``n`` processes, or until refused: the job, how many and the errno."""
    job = shell(session, f"/usr/bin/python3 -c {shlex.quote(HOG)} {n} 120 > hog.out", background=True)
    out = worktree / "hog.out"
    assert wait_until(lambda: out.exists() and out.read_text().strip() != "")
    got, err = (int(x) for x in out.read_text().split())
    return job, got, err


def _hog_outside(limit: int, n: int) -> tuple[int, int]:
    """How many processes the user's own program, under the same limit, can start."""
    out = subprocess.run(["prlimit", f"--nproc={limit}", "--", sys.executable, "-c", HOG, str(n), "0"],
                         capture_output=True, text=True, timeout=60)
    got, err = out.stdout.split()
    return int(got), int(err)


def test_all_sessions_together_run_at_most_half_and_the_user_keeps_the_rest(
        limited: tuple[Daemon, dispatch.Client, int], tmp_path: Path) -> None:
    _, client, limit = limited
    half = limit // 2
    bound = client.status()["kernel"]["shared_budgets"]
    assert bound.endswith(f"; {half:,} processes and threads (half of the lowest limit they meet, the user's "
                          f"RLIMIT_NPROC {limit:,})"), bound
    for name in "abc":
        (tmp_path / name).mkdir()
    sessions = [client.open_session(str(tmp_path / name)) for name in "abc"]
    a, b, c = sessions
    try:
        # The allowed twin first: with room, c starts a command.
        assert shell(c, "echo ok").output == "ok\n"

        # a starts most of the half, far below its own limit; b forks until
        # refused: b is stopped by the sessions' sum (the fork server, the
        # sandboxes made ahead and c count too), not by its own limit.
        job_a, got_a, err_a = _hog(a, tmp_path / "a", half * 6 // 10)
        assert (got_a, err_a) == (half * 6 // 10, 0)
        job_b, got_b, err_b = _hog(b, tmp_path / "b", half)
        assert err_b == errno.EAGAIN and half - 100 < got_a + got_b < half, (got_a, got_b, err_b)
        # c, a third session, cannot start a process now.
        r = c.registry.get("shell_exec").call({"command": "echo ok"})
        assert "exit_code" not in r.metadata and r.error is not None, r
        assert r.error.endswith("could not start /bin/bash: Resource temporarily unavailable: the session's processes, "
                                "or all sessions' together, are at their limit (dispatch status: kernel budgets); "
                                "stop a job (job_stop) or wait for commands to end, and retry"), r.error
        # The user's own program under the same limit still starts the other
        # half, less what the user ran at the start and the daemon's threads.
        assert _hog_outside(limit, half // 2) == (half // 2, 0)
        # a's processes ended: c starts again.
        assert a.registry.get("job_stop").call({"job": job_a.metadata["job"]}).is_success
        assert wait_until(lambda: shell(c, "echo ok").output == "ok\n", timeout=20)
        assert b.registry.get("job_stop").call({"job": job_b.metadata["job"]}).is_success
    finally:
        for session in sessions:
            session.close()


def test_a_sleeping_session_called_while_every_process_is_taken_waits_and_wakes_after(
        limited: tuple[Daemon, dispatch.Client, int], tmp_path: Path) -> None:
    """Its wake needs a process: refused, it stays asleep with its call
    waiting (before: the session was ended, "bad wake request"), and is woken
    once a process is to be had."""
    daemon, client, limit = limited
    half = limit // 2
    for name in "abc":
        (tmp_path / name).mkdir()
    with client.open_session(str(tmp_path / "a")) as a, client.open_session(str(tmp_path / "c")) as c, \
            client.open_session(str(tmp_path / "b"), policy="sleepy") as b:
        assert shell(b, "echo ok").output == "ok\n"  # the twin: woken with room
        wait_until_asleep(client, b.id)
        # a and c take every process the sessions may have (each alone stops at its own limit).
        job, got_a, _ = _hog(a, tmp_path / "a", half * 6 // 10)
        job_c, got_c, err = _hog(c, tmp_path / "c", half)
        assert err == errno.EAGAIN, (got_a, got_c, err)
        answer: list[dispatch.Result] = []
        caller = threading.Thread(target=lambda: answer.append(shell(b, "echo woken")))
        caller.start()
        assert wait_until(lambda: "event=wake_waiting session=" + b.id in daemon.log()), daemon.log()[-4000:]
        assert stays_asleep(client, b.id, 1.0) and not answer  # waiting, not ended
        assert a.registry.get("job_stop").call({"job": job.metadata["job"]}).is_success
        caller.join(60)
        assert answer and answer[0].output == "woken\n", answer
        assert f"event=wake_failed session={b.id}" not in daemon.log()
        assert c.registry.get("job_stop").call({"job": job_c.metadata["job"]}).is_success


def test_a_network_switch_without_a_process_for_its_stack_is_refused_and_the_session_goes_on(
        limited: tuple[Daemon, dispatch.Client, int], tmp_path: Path) -> None:
    """Off to on starts a stack: with no process to be had it is refused,
    the session unchanged (before: ended, "could not be switched"), and the
    same switch works once one is."""
    _, client, limit = limited
    half = limit // 2
    for name in "abc":
        (tmp_path / name).mkdir()
    with client.open_session(str(tmp_path / "a")) as a, client.open_session(str(tmp_path / "c")) as c, \
            client.open_session(str(tmp_path / "b")) as b:
        job_a, _, _ = _hog(a, tmp_path / "a", half * 6 // 10)
        job_c, _, err = _hog(c, tmp_path / "c", half)
        assert err == errno.EAGAIN
        with pytest.raises(dispatch.RequestFailed) as refused:
            b.set_network("on")
        assert "the session's network is unchanged" in str(refused.value), refused.value
        assert "EAGAIN: the processes all sessions of this daemon may run together" in str(refused.value)
        assert b.status()["network"]["mode"] == "off"
        # To ports: its rules need a process of their own first (nft in the session's namespace).
        with pytest.raises(dispatch.RequestFailed) as refused:
            b.set_network("ports", ports=[443])
        assert "the session's network is unchanged" in str(refused.value), refused.value
        assert b.status()["network"]["mode"] == "off"
        for session, job in ((a, job_a), (c, job_c)):
            assert session.registry.get("job_stop").call({"job": job.metadata["job"]}).is_success
        assert shell(b, "echo ok").output == "ok\n"  # the session went on
        b.set_network("on")  # the twin: with a process to be had
        assert b.status()["network"]["mode"] == "on"


def test_a_switch_on_whose_stack_cannot_fork_is_refused_and_the_session_goes_on(
        limited: tuple[Daemon, dispatch.Client, int], tmp_path: Path) -> None:
    """One process to be had: the fork server starts slirp4netns, whose own
    fork at its start is refused. Before, the session was ended; now the
    switch is refused, the session unchanged, as when the fork server itself
    is refused."""
    _, client, limit = limited
    half = limit // 2
    assert client.status()["kernel"]["network_stack"] == "slirp4netns"  # the stack that forks at its start
    for name in "abc":
        (tmp_path / name).mkdir()
    with client.open_session(str(tmp_path / "a")) as a, client.open_session(str(tmp_path / "c")) as c, \
            client.open_session(str(tmp_path / "b")) as b:
        job_a, _, _ = _hog(a, tmp_path / "a", half * 6 // 10)
        out = tmp_path / "c" / "hog.out"
        job_c = shell(c, f"/usr/bin/python3 -c {shlex.quote(HOG)} {10**9} 120 free > hog.out", background=True)
        assert wait_until(lambda: out.exists() and out.read_text().strip() != "")
        assert out.read_text().split()[1] == str(errno.EAGAIN)
        (tmp_path / "c" / "free").write_text("")
        assert wait_until(lambda: "freed" in out.read_text())
        with pytest.raises(dispatch.RequestFailed) as refused:
            b.set_network("on")
        assert "the session's network is unchanged" in str(refused.value), refused.value
        # The stack's own fork refused, not the fork server's (which the test above sees).
        assert "cannot apply network: start slirp4netns: fork: Resource temporarily unavailable" \
            in str(refused.value), refused.value
        assert b.status()["network"]["mode"] == "off"
        for session, job in ((a, job_a), (c, job_c)):
            assert session.registry.get("job_stop").call({"job": job.metadata["job"]}).is_success
        assert shell(b, "echo ok").output == "ok\n"  # the session went on
        b.set_network("on")  # the twin: with processes to be had
        assert b.status()["network"]["mode"] == "on"
