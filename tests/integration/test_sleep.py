"""Sessions that sleep: an idle session costs no process.

In full mode a session whose tool server has had no call for the policy's
``limits.sleep_after_s`` hands its client channels to the daemon and exits;
the next byte a client writes on one of them wakes it in a new tool server
(pid 1 of a new pid namespace, in the session's other namespaces, confined
again). Each behaviour here stands beside its twin: what keeps a session
awake beside the same session without it, what survives a sleep read back
after a wake, degraded mode (which never sleeps) beside full mode.

The sessions' state is read from ``list_sessions()`` against a deadline
(tests/sleeping.py); "stays awake" is judged against a twin that fell
asleep in the same minutes, never against a fixed sleep alone.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import dispatch
from dispatchd.worker.tool_server import max_channels
from tests.conftest import REPO, Daemon, _refuse_root, cgroup_daemon_for, probe, shell, wait_until
from tests.integration.test_network import TcpListener, tcp_probe
from tests.integration.test_pool_parity import fingerprint
from tests.sleeping import is_asleep, stays_asleep, stays_awake, wait_until_asleep, with_sleep_after

SLEEP_AFTER_S = 0.3
# How long a session that must not sleep is watched once its twin slept:
# several times sleep_after_s.
WATCH_S = 5 * SLEEP_AFTER_S
IDLE_TIMEOUT_S = 2.0


def _policies(directory: Path) -> Path:
    """The repository's policies, and: ``nap`` (the default policy sleeping
    after SLEEP_AFTER_S), ``nap-idle`` (the same, ending idle after
    IDLE_TIMEOUT_S), ``slow-nap`` (sleeping after 1.5 s: time for a whole
    probe before the first sleep)."""
    shutil.copytree(REPO / "policies", directory)
    default = (directory / "default.toml").read_text()
    (directory / "nap.toml").write_text(with_sleep_after(default, SLEEP_AFTER_S))
    (directory / "nap-idle.toml").write_text(with_sleep_after(
        default.replace("idle_timeout_s = 3600", f"idle_timeout_s = {IDLE_TIMEOUT_S}"), SLEEP_AFTER_S))
    (directory / "slow-nap.toml").write_text(with_sleep_after(default, 1.5))
    return directory


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    _refuse_root()
    base = tmp_path_factory.mktemp("sleep")
    policies = _policies(base / "policies")
    (base / "d").mkdir()
    d = Daemon(base / "d", "--policies", str(policies))
    with d.connect() as c:
        if not c.status()["kernel"]["user_namespaces"]:
            d.stop()
            pytest.skip("sessions sleep in full mode only, and this kernel refuses user namespaces")
    yield d
    assert d.stop() == 0, d.log()


def _asleep(d: Daemon, client: dispatch.Client, s: dispatch.Session) -> None:
    wait_until_asleep(client, s.id, log=d.log()[-3000:])


def _woken(d: Daemon, sid: str) -> list[float]:
    """The milliseconds of each wake of session ``sid``, as the daemon logged them."""
    return [float(ms) for ms in re.findall(rf"event=session_woken session={sid} ms=([\d.]+)", d.log())]


def _wakes(d: Daemon, sid: str, expect: int | None = None) -> int:
    """How many times session ``sid`` woke so far. Tests count wakes from a
    moment they chose (``_asleep``), not from the open: on a loaded machine a
    session may sleep between its open and its first call (more than
    SLEEP_AFTER_S apart), and wake once more than a count from the open says.
    With ``expect``, waits (10 s at most) until that many are logged: the woken
    tool server answers the call itself, so its reply can reach the test
    before the daemon has logged the wake."""
    deadline = time.monotonic() + 10
    while expect is not None and len(_woken(d, sid)) < expect and time.monotonic() < deadline:
        time.sleep(0.02)
    return len(_woken(d, sid))


def _gone(pid: int, timeout: float = 5.0) -> bool:
    """True once ``pid`` has exited (a zombie its parent has not reaped yet counts)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def _read(s: dispatch.Session, path: str = "README.md") -> str:
    r = s.registry.get("read_file").call({"path": path})
    assert r.is_success, r.error
    return r.output


def _twin_sleeps_and_this_one_does_not(d: Daemon, client: dispatch.Client, awake: dispatch.Session,
                                       twin: dispatch.Session, since: int) -> None:
    """The twin (same policy, same minutes, nothing holding it) falls asleep;
    ``awake`` is then watched for WATCH_S more and never is, nor was since
    the log's first ``since`` characters (written before what holds it
    awake began: on a loaded machine the session may sleep between its
    open and its first call, which then wakes it)."""
    _asleep(d, client, twin)
    assert stays_awake(client, awake.id, WATCH_S), d.log()[-3000:]
    assert f"event=session_asleep session={awake.id} " not in d.log()[since:]


# ------------------------------------------------------------ sleep and wake


def test_an_idle_session_sleeps_and_its_next_call_wakes_it(daemon: Daemon, worktree: Path) -> None:
    with daemon.connect() as client, client.open_session(str(worktree), policy="nap") as s:
        assert _read(s) == "0: hello\n1: world"
        first = daemon.worker_pid(s.id)
        _asleep(daemon, client, s)
        assert s.status()["asleep"] is True
        # logged once asleep: the status can say so first
        assert wait_until(lambda: f"event=session_asleep session={s.id} channels=1" in daemon.log()), daemon.log()
        assert _gone(first), f"session {s.id} is asleep and its tool server {first} still runs"
        slept = _wakes(daemon, s.id)
        # The next call wakes it, in a new tool server, and is answered as before.
        assert _read(s) == "0: hello\n1: world"
        assert _wakes(daemon, s.id, expect=slept + 1) == slept + 1
        second = daemon.worker_pid(s.id)
        assert second != first and psutil.pid_exists(second)
        # As at its first start: in the fork server's session (its parent,
        # whose session it is), leading a process group of its own.
        fork_server = psutil.Process(second).ppid()
        assert (os.getsid(second), os.getpgid(second)) == (fork_server, second)
        assert os.getsid(fork_server) == fork_server
        assert shell(s, "echo $PPID").output == "1\n"  # the new tool server is pid 1 of its namespace
        # And again: each sleep and wake goes the same way.
        _asleep(daemon, client, s)
        assert _read(s, "src/main.py").startswith("0: import os")
        assert _wakes(daemon, s.id, expect=slept + 2) == slept + 2


def test_degraded_mode_never_sleeps(tmp_path: Path, worktree: Path) -> None:
    """The twin of the test above: the same policy on a daemon without user
    namespaces. Its session stays awake, listed ``asleep: False``, for many
    times ``sleep_after_s``, and its tool server stays the same process."""
    policies = _policies(tmp_path / "policies")
    (tmp_path / "d").mkdir()
    d = Daemon(tmp_path / "d", "--policies", str(policies), "--no-user-namespaces")
    try:
        with d.connect() as client, client.open_session(str(worktree), policy="nap") as s:
            assert s.status()["protections"]["mode"] == "degraded"
            assert _read(s) == "0: hello\n1: world"
            first = d.worker_pid(s.id)
            assert stays_awake(client, s.id, WATCH_S)
            assert s.status()["asleep"] is False
            assert _read(s) == "0: hello\n1: world"
            assert d.worker_pid(s.id) == first and psutil.pid_exists(first)
        assert "event=session_asleep" not in d.log() and "event=session_woken" not in d.log()
    finally:
        assert d.stop() == 0, d.log()


def test_a_woken_session_is_confined_like_a_fresh_one(daemon: Daemon, tmp_path: Path) -> None:
    """Everything tests/integration/test_pool_parity.py reads of a session
    (mount table, capabilities, no_new_privs, seccomp, signal dispositions,
    rlimits, namespaces' view, Landlock's rules one by one, the errno of the
    escape suite's system calls, the status), read from a session that never
    slept and from one that slept and woke: the same."""
    wt = tmp_path / "wt"
    wt.mkdir()
    (wt / "README.md").write_text("hello\n")
    with daemon.connect() as client:
        with client.open_session(str(wt), policy="slow-nap") as fresh:
            fresh_print = fingerprint(fresh, wt)
            assert _woken(daemon, fresh.id) == [], "the session slept before its first call: a slow machine?"
        with client.open_session(str(wt), policy="slow-nap") as woken:
            _asleep(daemon, client, woken)
            slept = _wakes(daemon, woken.id)
            woken_print = fingerprint(woken, wt)
            assert _wakes(daemon, woken.id, expect=slept + 1) > slept  # read from a tool server that woke
    # The tool server's own threads come and go (the sweep after a write
    # lock's grant, the reaper of a call's leftovers): when each print was
    # read, not how the session is confined.
    for prints in (woken_print, fresh_print):
        prints["status_1"] = [line for line in prints["status_1"] if not line.startswith("Threads:")]
    assert _differences(woken_print, fresh_print) == {}


def _differences(woken: dict[str, Any], fresh: dict[str, Any]) -> dict[str, Any]:
    """Each key whose value differs: for lists, the items only one side has."""
    differ: dict[str, Any] = {}
    for key in sorted(set(woken) | set(fresh)):
        a, b = woken.get(key), fresh.get(key)
        if a == b:
            continue
        if isinstance(a, list) and isinstance(b, list):
            differ[key] = {"woken only": [x for x in a if x not in b], "fresh only": [x for x in b if x not in a]}
        elif isinstance(a, dict) and isinstance(b, dict):
            differ[key] = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
        else:
            differ[key] = (a, b)
    return differ


# ------------------------------------------------- what keeps a session awake


def test_a_call_in_flight_keeps_a_session_awake(daemon: Daemon, worktree: Path) -> None:
    """A command running longer than sleep_after_s: the session stays awake
    all the while (the twin: once it is answered, the session sleeps)."""
    with daemon.connect() as client, client.open_session(str(worktree), policy="nap") as s:
        results: list[dispatch.Result] = []
        call = threading.Thread(target=lambda: results.append(shell(s, f"touch started; sleep {WATCH_S + 1}; echo done")))
        call.start()
        deadline = time.monotonic() + 10
        while not (worktree / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (worktree / "started").exists()
        assert stays_awake(client, s.id, WATCH_S)
        call.join(30)
        assert [r.output for r in results] == ["done\n"]
        _asleep(daemon, client, s)  # the twin: the call answered, nothing holds it


def test_a_running_background_job_keeps_a_session_awake(daemon: Daemon, tmp_path: Path) -> None:
    """A running job is a process in the session's pid namespace, and its
    output the tool server's to read: the session stays awake; the twin
    opened beside it, without a job, sleeps. Stopped, the job no longer
    holds it."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with daemon.connect() as client, client.open_session(str(tmp_path / "a"), policy="nap") as held, \
            client.open_session(str(tmp_path / "b"), policy="nap") as twin:
        started = shell(held, "sleep 60", background=True)
        assert started.is_success, started.error
        since = len(daemon.log())  # the job runs from here
        name = started.metadata["job"]
        assert shell(twin, "true").is_success
        _twin_sleeps_and_this_one_does_not(daemon, client, held, twin, since)
        assert held.registry.get("job_list").call({}).output == f"{name}\trunning\tsleep 60"
        assert held.registry.get("job_stop").call({"job": name}).is_success
        _asleep(daemon, client, held)
        assert held.registry.get("job_list").call({}).output == f"{name}\tstopped\tsleep 60"


def test_an_ended_job_is_kept_across_a_sleep(daemon: Daemon, worktree: Path) -> None:
    """A job that ended holds no process: the session sleeps, and the woken
    tool server answers ``job_output`` and ``job_list`` as the first one did
    (the daemon kept them), and numbers the next job after it."""
    with daemon.connect() as client, client.open_session(str(worktree), policy="nap") as s:
        started = shell(s, "echo one; echo two >&2; exit 3", background=True)
        assert started.is_success, started.error
        name = started.metadata["job"]
        out = s.registry.get("job_output").call({"job": name, "wait": 10})
        while out.metadata["running"]:
            out = s.registry.get("job_output").call({"job": name, "wait": 10})
        listed = s.registry.get("job_list").call({})
        assert listed.output == f"{name}\texited 3\techo one; echo two >&2; exit 3"
        _asleep(daemon, client, s)
        slept = _wakes(daemon, s.id)
        again = s.registry.get("job_output").call({"job": name})
        assert _wakes(daemon, s.id, expect=slept + 1) == slept + 1
        def same(r: dispatch.Result) -> dict[str, object]:
            return {k: v for k, v in r.metadata.items() if k != "usage"}  # CPU time varies

        assert (again.output, same(again)) == (out.output, same(out))
        assert s.registry.get("job_list").call({}).output == listed.output
        after = shell(s, "true", background=True).metadata["job"]
        assert after != name and int(after.rsplit("_", 1)[1]) == int(name.rsplit("_", 1)[1]) + 1


@pytest.mark.parametrize("start", ["setsid sleep 1000", "nohup sleep 1000"])
def test_an_orphan_keeps_a_session_awake_until_it_ends(daemon: Daemon, tmp_path: Path, start: str) -> None:
    """A process left behind by a job's command (the job has ended: its
    command returned) lives in the session's pid namespace, which would die
    with the tool server: the session stays awake while it runs (its twin
    sleeps), and sleeps once it is ended (its keeper then exits too)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with daemon.connect() as client, client.open_session(str(tmp_path / "a"), policy="nap") as held, \
            client.open_session(str(tmp_path / "b"), policy="nap") as twin:
        job = shell(held, f"{start} >/dev/null 2>&1 & echo $!", background=True).metadata["job"]
        pid = held.registry.get("job_output").call({"job": job, "wait": 5}).output.split()[0]
        assert pid.isdigit(), pid
        since = len(daemon.log())  # the process left behind runs from here
        assert shell(twin, "true").is_success
        _twin_sleeps_and_this_one_does_not(daemon, client, held, twin, since)
        assert shell(held, f"kill {pid}").is_success
        _asleep(daemon, client, held)  # the twin in time: nothing holds it any more


# ------------------------------------------------------ what a sleep keeps


def test_files_in_tmp_and_home_survive_a_sleep(daemon: Daemon, tmp_path: Path) -> None:
    """/tmp and the home directory are the session's tmpfs, in its mount
    namespace, which outlives its tool server. The twin: another session
    has its own, without them."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with daemon.connect() as client, client.open_session(str(tmp_path / "a"), policy="nap") as s:
        made = shell(s, 'echo in-tmp > /tmp/kept && echo in-home > "$HOME/kept" && mkdir -p /tmp/d/e')
        assert made.is_success, made.error
        _asleep(daemon, client, s)
        slept = _wakes(daemon, s.id)
        assert shell(s, 'cat /tmp/kept "$HOME/kept"; ls /tmp/d').output == "in-tmp\nin-home\ne\n"
        assert _wakes(daemon, s.id, expect=slept + 1) == slept + 1
        with client.open_session(str(tmp_path / "b"), policy="nap") as other:
            r = shell(other, 'cat /tmp/kept "$HOME/kept"')
            assert r.metadata["exit_code"] == 1 and r.metadata["stdout"] == "", r.metadata


_SEGMENT = re.compile(r"^0x[0-9a-f]+\s+(\d+)\s", re.M)  # a row of `ipcs -m`: key, shmid, ...


def test_system_v_ipc_survives_a_sleep(daemon: Daemon, tmp_path: Path) -> None:
    """A shared memory segment lives in the session's IPC namespace, which
    outlives its tool server (as tests/escape/test_ipc.py reads it, the
    session's own). The twin: another session's namespace has none."""
    if shutil.which("ipcmk") is None or shutil.which("ipcs") is None:
        pytest.skip("util-linux's ipcmk and ipcs are not installed")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with daemon.connect() as client, client.open_session(str(tmp_path / "a"), policy="nap") as s:
        made = shell(s, "ipcmk -M 4096")
        found = re.search(r"Shared memory id: (\d+)", made.output)
        assert found, made.metadata
        _asleep(daemon, client, s)
        slept = _wakes(daemon, s.id)
        listed = shell(s, "ipcs -m")
        assert _wakes(daemon, s.id, expect=slept + 1) == slept + 1
        assert _SEGMENT.findall(listed.output) == [found.group(1)], listed.output
        with client.open_session(str(tmp_path / "b"), policy="nap") as other:
            assert _SEGMENT.findall(shell(other, "ipcs -m").output) == []


# Where a full-mode session reaches the host's 127.0.0.1 (test_network.py's HOST), and what "off" answers there.
GATEWAY = "10.0.2.2"
UNREACHABLE = "error 101"  # ENETUNREACH: an off session's namespace has no route out


@pytest.fixture
def tcp() -> Iterator[TcpListener]:
    listener = TcpListener()
    yield listener
    listener.close()


def test_the_network_mode_survives_a_sleep(daemon: Daemon, tmp_path: Path, tcp: TcpListener) -> None:
    """The network namespace (and pasta, for "on") outlives the tool server:
    "on" still reaches the host's listener after a wake, and its twin "off"
    still reaches nothing."""
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    with daemon.connect() as client, client.open_session(str(tmp_path / "on"), policy="nap", network="on") as on, \
            client.open_session(str(tmp_path / "off"), policy="nap", network="off") as off:
        for s in (on, off):
            assert shell(s, "true").is_success
        # Both asleep before either probe, each counted from there: the one
        # waited for second may have slept (and been woken by its first call)
        # while the first was waited for.
        for s in (on, off):
            _asleep(daemon, client, s)
        slept = (_wakes(daemon, on.id), _wakes(daemon, off.id))
        assert probe(on, tcp_probe(tcp.port, GATEWAY)) == "connected hello"
        assert probe(off, tcp_probe(tcp.port, GATEWAY)) == UNREACHABLE
        assert (_wakes(daemon, on.id, expect=slept[0] + 1), _wakes(daemon, off.id, expect=slept[1] + 1)) == \
            (slept[0] + 1, slept[1] + 1)
        assert (on.status()["network"]["mode"], off.status()["network"]["mode"]) == ("on", "off")
    assert tcp.accepted == 1


def test_a_network_switch_while_asleep_holds(daemon: Daemon, worktree: Path, tcp: TcpListener) -> None:
    """Switched while asleep (the daemon has something to tell the session),
    the network is what was asked at the next call: on to off reaches
    nothing, off to on reaches the listener again."""
    with daemon.connect() as client, client.open_session(str(worktree), policy="nap", network="on") as s:
        assert probe(s, tcp_probe(tcp.port, GATEWAY)) == "connected hello"
        _asleep(daemon, client, s)
        s.set_network(False)
        assert probe(s, tcp_probe(tcp.port, GATEWAY)) == UNREACHABLE
        _asleep(daemon, client, s)
        s.set_network(True)
        assert probe(s, tcp_probe(tcp.port, GATEWAY)) == "connected hello"
    assert tcp.accepted == 2


_PROXY_VARS = "env | grep -i _proxy= | sort"


def test_the_command_environment_survives_a_sleep(daemon: Daemon, worktree: Path) -> None:
    """Network "domains" gives commands the proxy variables (the daemon's
    ``SetCommandEnv``): a woken tool server gives them too. The twin: an
    "off" session's commands have none."""
    with daemon.connect() as client, \
            client.open_session(str(worktree), policy="nap", network="domains", domains=["pypi.org"]) as s:
        before = shell(s, _PROXY_VARS).output
        assert "HTTPS_PROXY=http://127.0.0.1:3128" in before
        _asleep(daemon, client, s)
        slept = _wakes(daemon, s.id)
        assert shell(s, _PROXY_VARS).output == before
        assert _wakes(daemon, s.id, expect=slept + 1) == slept + 1
        s.set_network(False)
        assert shell(s, _PROXY_VARS).output == ""


def test_the_write_lock_survives_a_sleep(daemon: Daemon, worktree: Path) -> None:
    """The worktree's one writer is the daemon's to know: asleep, the holder
    keeps its lock (another session is refused with the same message as
    while the holder is awake), and woken it writes on."""
    with daemon.connect() as client, client.open_session(str(worktree), policy="nap") as first, \
            client.open_session(str(worktree), policy="nap") as second:
        write = {"path": "a.txt", "content": "first"}
        assert first.registry.get("write_file").call(write).is_success
        awake = second.registry.get("write_file").call({"path": "a.txt", "content": "second"})
        assert awake.error.startswith(f"write_file: the worktree {worktree} is being written by session {first.id}")
        _asleep(daemon, client, first)
        asleep = second.registry.get("write_file").call({"path": "a.txt", "content": "second"})
        assert (asleep.error, asleep.metadata) == (awake.error, {"write_locked": True})
        assert shell(second, "touch b.txt").error.startswith("shell_exec: the worktree")
        assert {e["id"]: e["writes"] for e in client.list_sessions()} == {first.id: True, second.id: False}
        _asleep(daemon, client, first)
        assert first.registry.get("write_file").call({"path": "a.txt", "content": "first, woken"}).is_success
        assert shell(first, "touch b.txt").is_success
        assert (worktree / "a.txt").read_text() == "first, woken" and (worktree / "b.txt").exists()


# ------------------------------------------------------------------ channels


def test_every_channel_works_after_a_wake(daemon: Daemon, worktree: Path) -> None:
    """As many channels as the session may hold (more than the 253
    descriptors one SCM_RIGHTS message carries): all handed to the daemon at
    the sleep, all answered after the wake."""
    n = max_channels(1024, 4096)  # the default policy's max_processes and max_open_files
    assert n > 253
    with daemon.connect() as client, client.open_session(str(worktree), policy="nap") as s:
        extra = [client.session(s.id) for _ in range(n - 1)]
        try:
            # On a loaded machine the session may sleep before the last attach
            # (its idle time is short): a call wakes it with every channel
            # attached, and the sleep after it hands them all over.
            _asleep(daemon, client, s)
            if not re.search(rf"event=session_asleep session={s.id} channels={n}\b", daemon.log()):
                assert _read(s) == "0: hello\n1: world"
                wait_until(lambda: re.search(rf"event=session_asleep session={s.id} channels={n}\b", daemon.log()))
            assert re.search(rf"event=session_asleep session={s.id} channels={n}\b", daemon.log()), daemon.log()[-2000:]
            answers = [_read(each) for each in reversed([s, *extra])]
            assert answers == ["0: hello\n1: world"] * n
            assert len(_woken(daemon, s.id)) >= 1
        finally:
            for each in extra:
                each.close()


def test_a_channel_attached_while_asleep_works(daemon: Daemon, worktree: Path) -> None:
    with daemon.connect() as client, client.open_session(str(worktree), policy="nap") as s:
        assert _read(s) == "0: hello\n1: world"
        _asleep(daemon, client, s)
        late = client.session(s.id)
        try:
            assert _read(late) == "0: hello\n1: world"
            assert _read(s) == "0: hello\n1: world"  # and the channel it had
        finally:
            late.close()


def test_a_channel_closed_while_asleep_does_not_wake_the_session(daemon: Daemon, worktree: Path) -> None:
    """A client that goes away while the session sleeps: its channel is
    dropped, and the session sleeps on (no process is made for a hang-up).
    The twin: a request on the other channel wakes it."""
    with daemon.connect() as client, client.open_session(str(worktree), policy="nap") as s:
        other = client.session(s.id)
        assert _read(other) == "0: hello\n1: world"
        _asleep(daemon, client, s)
        slept = _wakes(daemon, s.id)
        other.close()
        assert stays_asleep(client, s.id, WATCH_S), daemon.log()[-3000:]
        assert _wakes(daemon, s.id) == slept
        assert _read(s) == "0: hello\n1: world"
        assert _wakes(daemon, s.id, expect=slept + 1) == slept + 1


# ------------------------------------------------------------ how it ends


def test_an_asleep_session_still_ends_idle(daemon: Daemon, worktree: Path) -> None:
    """The idle timeout counts from the last call, asleep or not: the
    session ends then (``reason=idle``), not before, and leaves nothing."""
    with daemon.connect() as client:
        s = client.open_session(str(worktree), policy="nap-idle")
        scratch = daemon.state / "dispatchd" / "sessions" / s.id
        assert _read(s) == "0: hello\n1: world"
        last_call = time.monotonic()
        _asleep(daemon, client, s)
        assert scratch.is_dir()
        deadline = last_call + IDLE_TIMEOUT_S + 15
        while is_asleep(client, s.id) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert is_asleep(client, s.id) is None, daemon.log()[-3000:]
        assert time.monotonic() - last_call > IDLE_TIMEOUT_S - 0.2  # not before its time
        assert f"session={s.id} reason=idle" in daemon.log()
        # Unlisted as its end begins; its scratch directory goes at the end's end.
        gone_by = time.monotonic() + 10
        while scratch.exists() and time.monotonic() < gone_by:
            time.sleep(0.02)
        assert not scratch.exists()
        failed = shell(s, "true")
        assert failed.is_failure and "ended idle" in failed.error, failed.error
        s.detach()


def test_closing_an_asleep_session_leaves_nothing(daemon: Daemon, worktree: Path) -> None:
    with daemon.connect() as client:
        s = client.open_session(str(worktree), policy="nap")
        assert _read(s) == "0: hello\n1: world"
        scratch = daemon.state / "dispatchd" / "sessions" / s.id
        _asleep(daemon, client, s)
        s.close()
        assert is_asleep(client, s.id) is None
        assert wait_until(lambda: not scratch.exists())  # removed after the close's reply
        assert f"event=session_close session={s.id}" in daemon.log()


def _held_by_daemon(daemon: Daemon, link: str) -> bool:
    """Whether a descriptor of the daemon's names ``link`` (``mnt:[INODE]``)."""
    fds = Path(f"/proc/{daemon.proc.pid}/fd")
    found = False
    for fd in fds.iterdir():
        try:
            found = found or os.readlink(fd) == link
        except OSError:
            continue  # closed meanwhile
    return found


def test_the_wake_kit_holds_the_sandboxs_mounts_until_the_close_and_not_after(
        daemon: Daemon, worktree: Path) -> None:
    """The kit holds the sandbox's mount namespace while the session lives
    (the twin: it is there); the close lets go of it, and nothing of it is
    left held. (Closed after the reply instead, the namespace's teardown ran
    into the next open: docs/performance.md.)"""
    with daemon.connect() as client:
        s = client.open_session(str(worktree), policy="nap")
        link = probe(s, "import os; print(os.readlink('/proc/self/ns/mnt'))")
        assert link.startswith("mnt:[")
        assert _held_by_daemon(daemon, link)
        s.close()
        assert wait_until(lambda: not _held_by_daemon(daemon, link)), daemon.log()[-2000:]


@pytest.fixture(scope="module")
def cgroup_woken(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dispatch.Client, str]]:
    """A daemon with a delegated cgroup whose policies sleep after 0.2 s,
    every session opened asleep (tests/conftest.py's ``cgroup_daemon_for``)."""
    yield from cgroup_daemon_for("woken", tmp_path_factory)


def test_an_asleep_sessions_cgroup_stays_empty_and_goes_at_close(cgroup_woken: tuple[dispatch.Client, str],
                                                                 worktree: Path) -> None:
    """Asleep, the session's cgroup stays (its limits with it) and holds no
    process at all; awake (a call in flight: the twin), its processes are
    there; closed asleep, the cgroup is removed."""
    client, _ = cgroup_woken
    s = client.open_session(str(worktree))  # handed over asleep
    path = Path(s.status()["protections"]["limits"]["cgroup"])
    assert path.is_dir() and (path / "cgroup.procs").read_text() == ""
    results: list[dispatch.Result] = []
    call = threading.Thread(target=lambda: results.append(shell(s, "touch started; sleep 1; echo done")))
    call.start()
    deadline = time.monotonic() + 10
    while not (worktree / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len((path / "cgroup.procs").read_text().split()) >= 2  # the tool server, the sleep
    call.join(30)
    assert [r.output for r in results] == ["done\n"]
    wait_until_asleep(client, s.id)
    assert (path / "cgroup.procs").read_text() == ""
    s.close()
    assert not path.exists()


def test_a_daemon_stops_cleanly_with_a_session_asleep(tmp_path: Path, worktree: Path) -> None:
    policies = _policies(tmp_path / "policies")
    (tmp_path / "d").mkdir()
    d = Daemon(tmp_path / "d", "--policies", str(policies))
    try:
        with d.connect() as client:
            s = client.open_session(str(worktree), policy="nap", detached=True)
            assert _read(s) == "0: hello\n1: world"
            scratch = d.state / "dispatchd" / "sessions" / s.id
            _asleep(d, client, s)
            s.detach()
    finally:
        assert d.stop() == 0, d.log()
    assert not scratch.exists()
    assert not Path(d.socket).exists()
