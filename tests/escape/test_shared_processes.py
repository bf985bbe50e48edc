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
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import Daemon, _refuse_root, shell, wait_until

pytestmark = pytest.mark.usefixtures("user_budgets")

ROOM = 1200  # over what the user runs at the start: the sessions together get about half of it

# Forks until the kernel refuses or ``n`` run (each child sleeps); prints how
# many and the errno (0: none refused), then holds them.
HOG = r"""
import os, sys, time
n, hold = int(sys.argv[1]), sys.argv[2]
got = err = 0
while got < n:
    try:
        pid = os.fork()
    except OSError as exc:
        err = exc.errno
        break
    if pid == 0:
        os.execv("/bin/sleep", ["sleep", hold])
    got += 1
print(got, err, flush=True)
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
    """A full-mode daemon whose RLIMIT_NPROC is what the user runs plus ``ROOM``, and that limit."""
    _refuse_root()
    limit = _tasks_of_the_user() + ROOM
    d = Daemon(tmp_path, "--cgroup", "off", prefix=("prlimit", f"--nproc={limit}", "--"))
    try:
        with d.connect() as c:
            yield d, c, limit
    finally:
        assert d.stop() == 0, d.log()


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

        def hog(session: dispatch.Session, name: str, n: int) -> tuple[dispatch.Result, int, int]:
            job = shell(session, f"/usr/bin/python3 -c {shlex.quote(HOG)} {n} 120 > hog.out", background=True)
            out = tmp_path / name / "hog.out"
            assert wait_until(lambda: out.exists() and out.read_text().strip() != "")
            got, err = (int(x) for x in out.read_text().split())
            return job, got, err

        # a starts most of the half, far below its own limit; b forks until
        # refused: b is stopped by the sessions' sum (the fork server, the
        # sandboxes made ahead and c count too), not by its own limit.
        job_a, got_a, err_a = hog(a, "a", half * 6 // 10)
        assert (got_a, err_a) == (half * 6 // 10, 0)
        job_b, got_b, err_b = hog(b, "b", half)
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
