"""An open takes the worktree's trusted baseline while its sandbox is given
the session (dispatchd/daemon/beside.py), with a real daemon: a baseline
refused refuses the open as before, and leaves no sandbox of it running;
the open answers before the baseline's record is durable, and nothing that
can change the worktree runs before it is."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import psutil
import pytest

import dispatch
from tests.conftest import Daemon, deep_tree, shell, wait_for_pool, wait_until


def test_a_baseline_refused_beside_the_sandbox_refuses_the_open_and_ends_it(
        tmp_path: Path, worktree: Path) -> None:
    d = Daemon(tmp_path, "--cgroup", "off", "--log-level", "debug")
    try:
        with d.connect() as client:
            wait_for_pool(client, "default/off", 2)
            deep_tree(worktree, 4100)  # deeper than the baseline's walk goes (runnables.MAX_DEPTH)
            with pytest.raises(dispatch.DispatchError, match=(
                    r"deeper than 4096 directories \(below d/d/d/...; remove that chain to open sessions here\), "
                    "more than dispatchd checks for repositories and files your tools run; no session opened")):
                client.open_session(str(worktree))
            assert client.list_sessions() == []
            # The sandbox it was given (made ahead) is gone, not left waiting.
            adopted = re.findall(r"event=worker_ready session=(\w+) pid=(\d+) made_ahead=1", d.log())
            assert adopted, d.log()
            deadline = time.monotonic() + 10
            pid = int(adopted[-1][1])
            while time.monotonic() < deadline and psutil.pid_exists(pid) and \
                    psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                time.sleep(0.05)
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            # The allowed twin: the same worktree without the deep tree opens, and its calls run.
            subprocess.run(["rm", "-rf", str(worktree / "d")], check=True)  # shutil.rmtree recurses
            with client.open_session(str(worktree)) as s:
                assert shell(s, "echo ok").output == "ok\n"
    finally:
        assert d.stop() == 0, d.log()


# --- the baseline made durable after the open's reply ------------------------------------

DELAY_S = 5.0  # the record's fsyncs made this much later (dispatchd --baseline-sync-delay-for-testing)


def _records(d: Daemon) -> tuple[list[str], list[str]]:
    """The baseline records in place (``*.json``) and those still being written (``*.tmp``)."""
    top = d.state / "dispatchd" / "baselines"
    names = os.listdir(top) if top.exists() else []
    return sorted(n for n in names if n.endswith(".json")), sorted(n for n in names if n.endswith(".tmp"))


def _lands_after_the_record(d: Daemon, call: Callable[[], dispatch.Result], landed: Callable[[], bool]) -> float:
    """Run ``call`` on a thread while watching the worktree (``landed``: its
    write is there) and the record's directory; fails if the write was ever
    seen while no record was in place. Returns how long the call took."""
    out: list[dispatch.Result] = []
    started = time.monotonic()
    t = threading.Thread(target=lambda: out.append(call()))
    t.start()
    while t.is_alive():
        if landed():  # the record looked at after: one renamed in meanwhile counts, as it should
            assert _records(d)[0], "the call wrote the worktree before the baseline's record was in place"
        time.sleep(0.001)
    t.join()
    took = time.monotonic() - started
    assert out and out[0].is_success, out
    assert landed() and _records(d)[0]
    return took


def test_a_write_right_after_the_open_waits_for_the_baseline_on_disk(tmp_path: Path, worktree: Path) -> None:
    """The open answers before the baseline's record is durable; a read is
    answered meanwhile (the allowed twin); every call that can change the
    worktree (write_file, shell_exec, a checkpoint's restore) waits for the
    record, fsynced and in place, before it runs."""
    d = Daemon(tmp_path, "--cgroup", "off", "--baseline-sync-delay-for-testing", str(DELAY_S))
    try:
        assert wait_until(lambda: "event=testing_baseline_sync_delay" in d.log()), d.log()
        with d.connect() as client:
            wait_for_pool(client, "default/off", 1)
            # write_file
            t0 = time.monotonic()
            with client.open_session(str(worktree)) as s:
                assert time.monotonic() - t0 < DELAY_S, "the open waited for the record's fsyncs"
                done, pending = _records(d)
                assert done == [] and len(pending) == 1, (done, pending)
                # The allowed twin: a read is answered before the record is durable.
                read = s.registry.get("read_file").call({"path": "README.md"})
                assert read.is_success and "hello" in (read.output or ""), read
                assert _records(d)[0] == []  # answered before the record was in place
                took = _lands_after_the_record(d, lambda: s.registry.get("write_file").call(
                    {"path": "new.txt", "content": "x"}), (worktree / "new.txt").exists)
                assert took > DELAY_S / 4, took  # it waited (the delay began at the open)
                record = msgspec.json.decode((d.state / "dispatchd" / "baselines" / _records(d)[0][0]).read_bytes())
                assert record["sessions"] == [s.id]
                assert [p["root"] for p in record["parts"]] == [str(worktree)]
            # The last end drops it, just after the close's reply.
            assert wait_until(lambda: _records(d) == ([], [])), _records(d)
            # shell_exec, in a session of its own (a new baseline)
            with client.open_session(str(worktree)) as s:
                assert _records(d)[0] == []
                _lands_after_the_record(d, lambda: shell(s, "echo y > by-shell.txt"), (worktree / "by-shell.txt").exists)
            assert wait_until(lambda: _records(d) == ([], [])), _records(d)  # removed after the reply, as above
            # a checkpoint's restore writes the worktree too: it waits as well
            with client.open_session(str(worktree)) as s:
                cid = s.checkpoint()  # reads the worktree: no wait for the record
                assert _records(d)[0] == []
                (worktree / "README.md").write_text("changed\n")  # by the user: the restore puts it back
                _lands_after_the_record(d, lambda: dispatch.Result.success(str(s.restore(cid))),
                                        lambda: (worktree / "README.md").read_text() == "hello\nworld\n")
            # A session closed while its record is made durable leaves nothing behind.
            with client.open_session(str(worktree)) as s:
                assert s.registry.get("read_file").call({"path": "README.md"}).is_success
            assert wait_until(lambda: _records(d) == ([], [])), _records(d)
    finally:
        assert d.stop() == 0, d.log()

