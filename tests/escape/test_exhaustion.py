"""Exhaustion: fork bombs, memory, output floods, filling the scratch space.

Every probe is bounded (a tight test policy, short timeouts), and each stands
beside a control that stays within the limit. After each, the daemon and a
second session still answer, and closing the session leaves nothing running.
Every mode: with user namespaces the process limit is the session's own; without,
it is what the user ran at open plus the session's budget; woken, the same
limits hold for the tool server that woke (every session is opened asleep).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import _refuse_root, call_once_started, gone, processes_in, shell, sleepers, wait_until
from tests.escape.conftest import MODES, connect, mode_daemon

# A fork bomb in degraded mode meets the user's process limit, which every
# process of the user's counts: it takes turns with the other tests that
# measure a budget of the user's (tests/conftest.py, user_budgets).
pytestmark = pytest.mark.usefixtures("user_budgets")

TIGHT = """
description = "exhaustion tests: small limits"
[limits]
max_processes = 40
max_data_bytes = 268435456
max_file_bytes = 10485760
output_cap_bytes = 65536
command_timeout_s = 20
"""
# The same but for the process budget, for a test here that is not about it:
# in degraded mode a session's process limit is the user's count at open plus
# its budget, and the user's processes started since (tests beside this one,
# on other workers or in another run, as the same user) take from that
# headroom (SECURITY.md); 2,000 is more than they come to.
ROOMY = TIGHT.replace("max_processes = 40", "max_processes = 2000")


@pytest.fixture(scope="module", params=MODES)
def tight(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dispatch.Client]:
    _refuse_root()
    base = tmp_path_factory.mktemp(f"exhaust-{request.param}")
    d = mode_daemon(base, request.param, policies={"tight": TIGHT, "roomy": ROOMY})
    try:
        with connect(d, request.param) as c:
            yield c
    finally:
        assert d.stop() == 0, d.log()


@pytest.fixture
def session(tight: dispatch.Client, worktree: Path) -> Iterator[dispatch.Session]:
    with tight.open_session(str(worktree), policy="tight") as s:
        yield s


@pytest.fixture
def roomy(tight: dispatch.Client, worktree: Path) -> Iterator[dispatch.Session]:
    """A session of the tight policy but for its process budget (``ROOMY``),
    for the tests of the other limits: their commands fork too."""
    with tight.open_session(str(worktree), policy="roomy") as s:
        yield s


def _stdout(r: dispatch.Result) -> str:
    """A command's stdout alone, once it succeeded: in degraded mode the
    process limit counts every process of the user's, and bash prints "fork:
    retry" on stderr while other tests' processes hold it there (then forks)."""
    assert r.is_success, r
    return str(r.metadata["stdout"])


def _still_serving(client: dispatch.Client, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir(exist_ok=True)
    assert client.status()["daemon_version"]
    with client.open_session(str(other), policy="roomy") as s:  # not about the process limit
        assert _stdout(shell(s, "echo alive")) == "alive\n"


def _job_running(session: dispatch.Session, marker: str) -> int:
    """A background job ``sleep MARKER``, seen running (from here, in any pid
    namespace) before a bomb starts: its own start needs a process, which a
    bomb begun first (or, in degraded mode, the processes of tests beside
    this one as the same user) may hold. Returns its host pid."""
    job = shell(session, f"sleep {marker}", background=True)
    assert job.is_success, job
    assert wait_until(lambda: len(sleepers(marker)) == 1), "the background job never started"
    (pid,) = sleepers(marker)
    return pid


def test_fork_bomb_stops_at_the_process_limit(tight: dispatch.Client, worktree: Path, tmp_path: Path) -> None:
    session = tight.open_session(str(worktree), policy="tight")
    control = shell(session, "for i in $(seq 10); do sleep 0.2 & done; wait; echo ten")
    # stdout only: in degraded mode the limit counts every process of the user's,
    # and other tests' processes can make bash print "fork: retry" before it succeeds.
    assert _stdout(control) == "ten\n", control.output
    bomb = shell(session, "bomb() { bomb | bomb & }; bomb; sleep 2; echo survived", timeout=8)
    assert "fork: Resource temporarily unavailable" in bomb.metadata["stderr"] or \
           "fork: retry" in bomb.metadata["stderr"], bomb.metadata["stderr"][-500:]
    _still_serving(tight, tmp_path)
    session.close()
    assert gone(lambda: processes_in(worktree))


def test_memory_hog_is_stopped_per_process(roomy: dispatch.Session, tight: dispatch.Client, tmp_path: Path) -> None:
    ok = shell(roomy, "python3 -c 'b = bytearray(64 * 2**20); print(len(b) >> 20)'")
    assert _stdout(ok) == "64\n"
    hog = shell(roomy, "python3 -c 'b = bytearray(1024 * 2**20)'")
    assert hog.is_failure and "MemoryError" in hog.metadata["stderr"]
    _still_serving(tight, tmp_path)


def test_output_flood_is_capped(roomy: dispatch.Session, tight: dispatch.Client, tmp_path: Path) -> None:
    small = shell(roomy, "head -c 1000 /dev/zero | tr '\\0' x")
    assert small.metadata["truncated"] is False and len(small.metadata["stdout"]) == 1000
    flood = shell(roomy, "yes flood | head -c 200000000; yes err | head -c 50000000 >&2")
    assert flood.is_success and flood.metadata["truncated"] is True
    assert len(flood.metadata["stdout"]) == 65536 and len(flood.metadata["stderr"]) == 65536
    _still_serving(tight, tmp_path)


def test_a_file_over_the_size_limit_cannot_be_written(roomy: dispatch.Session, worktree: Path) -> None:
    ok = shell(roomy, 'dd if=/dev/zero of="$TMPDIR/five" bs=1M count=5 status=none && echo ok')
    assert _stdout(ok) == "ok\n"
    # RLIMIT_FSIZE: the write past the limit raises SIGXFSZ, which kills dd.
    big = shell(roomy, 'dd if=/dev/zero of="$TMPDIR/big" bs=1M count=20 status=none')
    assert big.error == "command was killed by signal 25 (SIGXFSZ)" and big.metadata["exit_code"] == -25
    in_worktree = shell(roomy, "dd if=/dev/zero of=big.bin bs=1M count=20 status=none")
    assert in_worktree.metadata["exit_code"] == -25
    assert (worktree / "big.bin").stat().st_size == 10 * 2**20  # stopped at the limit


@pytest.mark.known_limit
def test_many_files_can_still_fill_the_disk_known_limit(roomy: dispatch.Session) -> None:
    # RLIMIT_FSIZE bounds each file, not their sum: three files of 8 MiB go
    # through. Only a quota or a size-limited filesystem would bound the total
    # (SECURITY.md, "Known limits").
    r = shell(roomy, 'for i in 1 2 3; do dd if=/dev/zero of="$TMPDIR/f$i" bs=1M count=8 status=none; '
                                  'done; du -sm "$TMPDIR" | cut -f1')
    assert int(_stdout(r)) >= 24


def test_a_timed_out_fork_bomb_ends_with_its_call(session: dispatch.Session, worktree: Path,
                                                  tmp_path: Path, tight: dispatch.Client) -> None:
    """Before, 11 to 16 of a bomb's processes still ran 11 s after its call
    returned; now none does once it has (bash is a child subreaper: its tree
    is ended whole). Its twin, a background job, runs on."""
    # A marker of its own: in degraded mode ps sees every process of the
    # machine, a run beside this one's too.
    marker = f"61.{secrets.randbelow(10**6):06d}"
    job = _job_running(session, marker)
    bomb = shell(session, "bomb() { bomb | bomb & }; bomb; sleep 30", timeout=2)
    assert bomb.metadata.get("timed_out") is True, bomb
    # Read from here: in degraded mode a command in the session may wait
    # long for a process while other tests of the same user hold the limit.
    assert sleepers(marker) == [job]  # the job, alone, the same one
    _still_serving(tight, tmp_path)


def test_a_process_leaving_its_group_with_no_environment_ends_with_its_timed_out_call(
        tight: dispatch.Client, worktree: Path) -> None:
    # Not about the process limit: a roomy budget, which in degraded mode
    # processes of tests beside this one (the user's) do not take up.
    with tight.open_session(str(worktree), policy="roomy") as session:
        # setsid: another session and group; env -i: no marker; the subshell
        # exits: an orphan, started before the timeout ("started").
        r = shell(session, "(setsid env -i /bin/sleep 60 &); echo started; sleep 30", timeout=3)
        assert (r.metadata.get("timed_out"), r.metadata.get("stdout")) == (True, "started\n"), r
        assert gone(lambda: processes_in(worktree))
        # In a call that returns by itself, too: ended before it returns.
        r = shell(session, "(setsid env -i /bin/sleep 60 > /dev/null 2>&1 &); echo ok")
        assert (_stdout(r), r.metadata["ended_processes"]) == ("ok\n", 1), r
        assert "[dispatchd: ended 1 process" in r.output and processes_in(worktree) == []
        # The twin: the same in a background job runs on, until job_stop.
        job = shell(session, "(setsid env -i /bin/sleep 60 > /dev/null 2>&1 &); echo ok", background=True)
        assert wait_until(lambda: len(processes_in(worktree)) == 2)  # the keeper and the sleep
        stop = call_once_started(session, "job_stop", {"job": job.metadata["job"]})
        assert stop.is_success, stop
        assert gone(lambda: processes_in(worktree))


def test_a_fork_bomb_that_returns_at_once_leaves_nothing(session: dispatch.Session, worktree: Path,
                                                         tmp_path: Path, tight: dispatch.Client) -> None:
    """Its bash exits at once, leaving the bomb to grow: every process of it
    has ended when the call returns. Its twin, a background job, runs on."""
    marker = f"61.{secrets.randbelow(10**6):06d}"  # as above: ps may see a run beside this one
    job = _job_running(session, marker)
    # One fork of its bash's own (``&``): the two sides of a pipe are two, and
    # on a loaded machine the first side's bomb can take every process
    # before the second, leaving bash to retry for seconds.
    bomb = shell(session, "bomb() { bomb | bomb & }; bomb &", timeout=20)
    assert bomb.is_success and bomb.metadata["ended_processes"] > 0, bomb.metadata
    assert bomb.output.endswith("to keep one running, start it with background: true]")
    assert sleepers(marker) == [job]  # the job, alone, the same one
    _still_serving(tight, tmp_path)
