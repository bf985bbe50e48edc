"""The daemon's modes set back below and above its state directory's own files
(dispatchd/statemodes.py, gitguard/keepdirs.py, daemon/helpers.py).

Each attempt runs from a real degraded session (Landlock ABI <= 7 does not
govern chmod), with its twin showing the chmod happened; then the daemon's
next open or start works, and its log says the repair:
- ``STATE/before-restore`` made 000 crashed every later start;
- the keep's fan-out directories made 000 refused the repository's every
  later open, restarts included;
- the directory holding the user's table of worktrees in use (the default
  state directory) made 000 refused every open of every daemon of the user;
- the socket's runtime directory made 000 is not the daemon's to change: it
  says so, keeps running, and the client says which directory keeps it out.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import dispatch
from dispatchd.daemon.gitguard import fs, history
from tests.conftest import shell, wait_until
from tests.integration.test_state_modes import _chmod_from, _degraded, _mode, _repaired, _repo


def test_restore_preimages_made_000_are_set_back_and_the_next_start_serves(tmp_path: Path) -> None:
    d = _degraded(tmp_path / "d")
    wt = _repo(tmp_path / "w" / "repo")
    kept = d.state / "dispatchd" / "before-restore"
    with d.connect() as client, client.open_session(str(wt)) as s:
        cid = s.checkpoint()
        assert shell(s, "echo x > new.txt").is_success
        assert Path(s.restore(cid)["kept"]).parent == kept  # what the restore replaced, kept
        assert _chmod_from(s, kept, "000") == "0"  # the session really changed it
    assert d.stop() == 0, d.log()
    assert _mode(kept) == 0  # what the next start finds (it crashed there: a PermissionError in the sweep)
    again = _degraded(d.base)
    try:
        assert wait_until(lambda: _repaired(again, kept, 0)), again.log()
        assert _mode(kept) == 0o700
        with again.connect() as client, client.open_session(str(wt)) as s:
            cid = s.checkpoint()
            assert shell(s, "echo y > other.txt").is_success
            assert Path(s.restore(cid)["kept"]).parent == kept  # and a restore keeps its files again
    finally:
        assert again.stop() == 0, again.log()


def _fanout(keep: Path) -> list[Path]:
    return sorted(p for p in keep.iterdir() if p.name in fs.FANOUT)


@pytest.mark.parametrize("restart", [False, True])
def test_keep_directories_made_000_are_set_back_and_the_repository_opens_again(tmp_path: Path,
                                                                               restart: bool) -> None:
    d = _degraded(tmp_path / "d")
    wt = _repo(tmp_path / "w" / "repo")
    keep = Path(history.keep_for(str(d.state / "dispatchd" / "keep"), str(wt / ".git")))
    with d.connect() as client:
        s = client.open_session(str(wt))
        dirs = _fanout(keep)
        assert dirs  # the first commit's objects are kept
        for path in dirs:  # a session can compute its keep's path, and try every fan-out name
            assert _chmod_from(s, path, "000") == "0"
        assert [_mode(p) for p in dirs] == [0] * len(dirs)  # the twin: changed indeed
        if restart:  # killed as it stands: the next start finds them so
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait()
            s.detach()
        else:
            s.close()  # the end's walk of the keep sets them back (it once refused every later open)
            with client.open_session(str(wt)) as t:
                assert shell(t, "cat a.txt").output == "a\n"
    d.stop()
    daemon = _degraded(d.base) if restart else d
    try:
        assert wait_until(lambda: all(_repaired(daemon, p, 0) for p in dirs)), daemon.log()
        assert [_mode(p) for p in dirs] == [0o700] * len(dirs)
        if restart:
            with daemon.connect() as client, client.open_session(str(wt)) as t:
                assert shell(t, "cat a.txt").output == "a\n"
    finally:
        if restart:
            assert daemon.stop() == 0, daemon.log()


def test_the_state_directory_above_the_table_made_000_keeps_no_daemon_out(tmp_path: Path) -> None:
    home = tmp_path / "home"
    top = home / ".local" / "state" / "dispatchd"  # the default state directory, and the table's
    shared = _degraded(tmp_path / "s", state=home / ".local" / "state", home=home)
    other = _degraded(tmp_path / "h", home=home)  # another state directory: the same table
    first, second, third = (_repo(tmp_path / "w" / n) for n in ("first", "second", "third"))
    try:
        with other.connect() as c, c.open_session(str(first)) as s:
            assert _chmod_from(s, top, "000") == "0"
            assert _mode(top) == 0  # the twin: changed indeed
            with c.open_session(str(second)) as t:  # refused before ("its use could not be recorded")
                assert shell(t, "cat a.txt").output == "a\n"
            assert wait_until(lambda: _repaired(other, top, 0)), other.log()
            assert _mode(top) == 0o700
            assert _chmod_from(s, top, "000") == "0"  # again, for the daemon whose state it is
            with shared.connect() as c2, c2.open_session(str(third)) as t:  # refused before ("session-locks")
                assert shell(t, "cat a.txt").output == "a\n"
            # Set back by whichever daemon gets to it first (both heal the same directory).
            said = f"event=state_mode_repaired path={top} was=0o000 "
            assert wait_until(lambda: other.log().count(said) + shared.log().count(said) >= 2), shared.log()
            assert _mode(top) == 0o700
    finally:
        os.chmod(top, 0o700)
        assert other.stop() == 0, other.log()
        assert shared.stop() == 0, shared.log()


def test_the_keep_is_made_0700_so_a_start_repairs_nothing(tmp_path: Path) -> None:
    d = _degraded(tmp_path / "d")
    wt = _repo(tmp_path / "w" / "repo")
    with d.connect() as client, client.open_session(str(wt)):
        pass
    assert _mode(d.state / "dispatchd" / "keep") == 0o700
    assert d.stop() == 0, d.log()
    again = _degraded(d.base)
    try:
        assert "event=state_mode_repaired" not in again.log()  # the log tells of a session's chmod, only
    finally:
        assert again.stop() == 0, again.log()


def test_the_socket_runtime_directory_made_000_is_said_and_waited_out(tmp_path: Path) -> None:
    runtime = tmp_path / "d"  # what $XDG_RUNTIME_DIR is to the service: above the socket's own directory
    d = _degraded(runtime, state=tmp_path / "state", home=tmp_path / "home")
    log = runtime / "dispatchd.log"
    wt = _repo(tmp_path / "w" / "repo")
    try:
        with d.connect() as client, client.open_session(str(wt)) as s:
            assert _chmod_from(s, runtime, "000") == "0"
            time.sleep(2.5)  # two looks of the watch: it changes nothing above the socket's directory
            assert _mode(runtime) == 0  # the twin: changed, and left so
            with pytest.raises(dispatch.DaemonUnavailable) as err:
                dispatch.connect(d.socket)
            assert str(err.value) == (f"cannot connect to dispatchd at {d.socket}: Permission denied: the directory "
                                      f"{runtime} cannot be searched (mode 0000); if it is yours, set its mode "
                                      f"back (chmod 700 {runtime})")
            assert d.proc.poll() is None  # it waits, serving what it holds
            assert shell(s, "cat a.txt").output == "a\n"
            os.chmod(runtime, 0o700)  # the user sets it back
            with dispatch.connect(d.socket) as again:
                assert again.status()["daemon"]
        text = log.read_text()
        assert (f"event=socket_unreachable path={d.socket} why='the directory {runtime} cannot be searched "
                f"(mode 0000); if it is yours, set its mode back (chmod 700 {runtime})'") in text, text
    finally:
        os.chmod(runtime, 0o700)
        assert d.stop() == 0, d.log()


def test_kept_object_files_made_000_and_the_repository_s_deleted_are_put_back(tmp_path: Path) -> None:
    """The session makes the keep's copies unreadable, then deletes the
    repository's own object files: the end gives the copies read back (git's
    own 0444) and puts every object back; the user's repository is whole."""
    import subprocess

    d = _degraded(tmp_path / "d")
    wt = _repo(tmp_path / "w" / "repo")
    keep = Path(history.keep_for(str(d.state / "dispatchd" / "keep"), str(wt / ".git")))
    try:
        with d.connect() as client:
            with client.open_session(str(wt)) as s:
                kept = sorted(p for folder in _fanout(keep) for p in folder.iterdir())
                assert kept
                r = shell(s, " && ".join(f"chmod 000 '{p}'" for p in kept) + " && rm -rf .git/objects/?? && echo done")
                assert r.output == "done\n", r
                assert [_mode(p) for p in kept] == [0] * len(kept)  # the twin: changed indeed
                bad = subprocess.run(["git", "-C", str(wt), "fsck"], capture_output=True, text=True, timeout=60)
                assert bad.returncode != 0  # and the repository broken, before the end
            assert any("object files deleted by a session put back" in p["why"] for p in s.protected), s.protected
        fsck = subprocess.run(["git", "-C", str(wt), "fsck"], capture_output=True, text=True, timeout=60)
        assert fsck.returncode == 0, fsck.stderr
        assert all(_mode(p) == 0o444 for p in kept)
        assert all(f"event=state_mode_repaired path={p} was=0o000 now=0o444" in d.log() for p in kept)
    finally:
        assert d.stop() == 0, d.log()
