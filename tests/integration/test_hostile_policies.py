"""Policy files the daemon cannot use, in the user's policies directory:
nested thousands deep, not UTF-8, a FIFO, a directory, a character device
behind a symlink, over the size bound. A real daemon: at its start each is
one line naming the file and exit 2 (a FIFO no longer hangs it before it
listens); made after its start, an open or a listing naming one is refused
at once with that line (``bad_policy``), no traceback in the log, and the
daemon serves and stops as usual. The twins: the same directory without
them starts; the default policy, and a policy that is a symlink to a
regular file, open."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dispatch
from dispatchd.policy import MAX_POLICY_BYTES
from tests.conftest import REPO, Daemon, _refuse_root
from tests.integration.test_cli import assert_error, run

DEEP = "nested too deeply (arrays or inline tables within each other, past what the parser reads)"


def _make(policies: Path, kind: str) -> str:
    """Put a policy file of ``kind`` in ``policies``; what the daemon says of it (after the path)."""
    path = policies / f"{kind}.toml"
    if kind == "deeparr":
        path.write_text("tools = " + "[" * 1500 + "]" * 1500 + "\n")
        return f"not valid TOML: {DEEP}"
    if kind == "deeptab":
        path.write_text("description = " + "{a = " * 1500 + "1" + "}" * 1500 + "\n")
        return f"not valid TOML: {DEEP}"
    if kind == "badutf8":
        path.write_bytes(b'description = "\xff\xfe"\n')
        return "not valid TOML: not UTF-8 (byte 0xff at offset 15)"
    if kind == "fifo":
        os.mkfifo(path)
        return "not a regular file (a FIFO): a policy is a TOML file"
    if kind == "dir":
        path.mkdir()
        return "not a regular file (a directory): a policy is a TOML file"
    if kind == "zero":
        path.symlink_to("/dev/zero")
        return "not a regular file (a character device): a policy is a TOML file"
    assert kind == "big"
    path.write_text("#" * MAX_POLICY_BYTES + "\n")
    return f"{MAX_POLICY_BYTES + 1} bytes, over the {MAX_POLICY_BYTES}-byte limit for a policy file"


KINDS = ("deeparr", "deeptab", "badutf8", "fifo", "dir", "zero", "big")


def _policies(tmp_path: Path) -> Path:
    policies = tmp_path / "policies"
    shutil.copytree(REPO / "policies", policies)
    return policies


@pytest.mark.parametrize("kind", KINDS)
def test_at_start_a_hostile_policy_is_one_line_and_exit_2(tmp_path: Path, kind: str) -> None:
    _refuse_root()
    policies = _policies(tmp_path)
    said = _make(policies, kind)
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "dispatchd", "--socket", str(tmp_path / "run" / "d.sock"),
                          "--policies", str(policies)], capture_output=True, text=True, timeout=60,
                         stdin=subprocess.DEVNULL, env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")})
    assert time.monotonic() - started < 30  # a FIFO: read without waiting for a writer
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-1] == f"dispatchd: {policies / kind}.toml: {said}"


def test_at_start_the_same_directory_without_them_starts(tmp_path: Path, worktree: Path) -> None:
    """The twin, with a policy that is a symlink to a regular file elsewhere
    (links are followed: a user may keep policies with their dotfiles)."""
    policies = _policies(tmp_path)
    elsewhere = tmp_path / "dotfiles" / "linked.toml"
    elsewhere.parent.mkdir()
    elsewhere.write_text('description = "kept elsewhere"\ntools = ["read_file"]\n')
    (policies / "linked.toml").symlink_to(elsewhere)
    (tmp_path / "d").mkdir()
    d = Daemon(tmp_path / "d", "--policies", str(policies))
    try:
        with d.connect() as client:
            assert [t["name"] for t in client.tools(policy="linked")] == ["read_file"]
            with client.open_session(str(worktree), policy="linked") as s:
                assert s.call_tool("read_file", {"path": "README.md"}).output == "0: hello\n1: world"
    finally:
        assert d.stop() == 0, d.log()


def test_made_after_start_each_is_refused_at_once_and_the_daemon_serves_and_stops(
    tmp_path: Path, worktree: Path
) -> None:
    policies = _policies(tmp_path)
    (tmp_path / "d").mkdir()
    d = Daemon(tmp_path / "d", "--policies", str(policies))
    try:
        said = {kind: _make(policies, kind) for kind in KINDS}
        with d.connect() as client:
            for kind in KINDS:
                expected = f"{policies / kind}.toml: {said[kind]}"
                for attempt in (lambda: client.open_session(str(worktree), policy=kind),
                                lambda: client.tools(policy=kind)):
                    started = time.monotonic()
                    with pytest.raises(dispatch.RequestFailed) as info:
                        attempt()
                    assert time.monotonic() - started < 5, kind
                    assert (info.value.code, info.value.message) == ("bad_policy", expected)
                out = run(d, "session", "open", "--worktree", str(worktree), "--policy", kind)
                assert assert_error(out) == f"dispatch: {expected}"
            # The twin: the default policy opens, on the same connection, beside them.
            with client.open_session(str(worktree)) as s:
                assert s.call_tool("read_file", {"path": "README.md"}).output == "0: hello\n1: world"
        log = d.log()
        assert "Traceback" not in log and "event=internal_error" not in log
        assert len(log) < 200_000, len(log)  # no page of frames per refusal
    finally:
        assert d.stop() == 0, d.log()  # no thread left waiting in open(2) on the FIFO
