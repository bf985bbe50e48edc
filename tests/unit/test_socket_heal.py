"""The socket's modes set back by the daemon's watch (``helpers.BoundSocket.heal``).

A real socket bound in a directory of its own, as ``cli.py`` binds the
daemon's: every second the watch looks at both (two ``lstat``s); only a mode
not as made calls the repair, which changes the directory only through a
descriptor whose device and inode are the ones bound in.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from dispatchd import statemodes
from dispatchd.daemon.helpers import BoundSocket
from dispatchd.statemodes import Repair


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


@pytest.fixture
def bound(tmp_path: Path) -> Iterator[BoundSocket]:
    run = Path(os.path.realpath(tmp_path)) / "run"
    run.mkdir(mode=0o700)
    run.chmod(0o700)
    path = run / "dispatchd.sock"
    old = os.umask(0o177)  # as cli.py binds it: 0600
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
    finally:
        os.umask(old)
    st, dst = os.lstat(path), os.lstat(run)
    try:
        yield BoundSocket(str(path), st.st_dev, st.st_ino, dst.st_dev, dst.st_ino)
    finally:
        sock.close()


def _repairs_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "event=state_mode_repaired" in r.getMessage()]


def test_a_chmod_ed_socket_directory_and_socket_are_set_back(bound: BoundSocket,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    run, sock = Path(bound.path).parent, Path(bound.path)
    caplog.set_level(logging.WARNING, logger="dispatchd.statemodes")
    run.chmod(0o777)
    assert bound.heal() == [Repair(str(run), 0o777, 0o700)]
    sock.chmod(0)
    run.chmod(0)  # the socket below it can be looked up only once it is set back
    assert bound.heal() == [Repair(str(run), 0, 0o700), Repair(str(sock), 0, 0o600)]
    assert (_mode(run), _mode(sock)) == (0o700, 0o600)
    assert _repairs_logged(caplog) == [f"event=state_mode_repaired path={run} was=0o777 now=0o700",
                                       f"event=state_mode_repaired path={run} was=0o000 now=0o700",
                                       f"event=state_mode_repaired path={sock} was=0o000 now=0o600"]


def test_modes_as_made_are_looked_at_and_nothing_more(bound: BoundSocket, caplog: pytest.LogCaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The twin of the test above: the same watch on modes as made repairs
    nothing, logs nothing, and never opens the directory to repair it."""
    caplog.set_level(logging.DEBUG, logger="dispatchd")
    repaired: list[str] = []
    monkeypatch.setattr(BoundSocket, "_repair", lambda self, d: repaired.append(d) or [])
    for _ in range(3):
        assert bound.heal() == []
    assert repaired == [] and caplog.records == []
    Path(bound.path).chmod(0o666)  # the control: a mode changed does reach the repair
    assert bound.heal() == [] and repaired == [str(Path(bound.path).parent)]


def test_a_directory_swapped_in_after_the_look_is_never_changed(bound: BoundSocket) -> None:
    """Between the watch's look (the bound directory, 0777) and the repair,
    the directory is renamed away and another put at its name: the repair
    reads the device and inode of the descriptor it would change, and
    changes nothing; the bound one, found at its name again, is set back."""
    run = Path(bound.path).parent
    aside = run.with_name("run-aside")
    run.chmod(0o777)
    run.rename(aside)
    run.mkdir()
    run.chmod(0o777)
    assert bound._repair(str(run)) == []
    assert (_mode(run), _mode(aside)) == (0o777, 0o777)
    run.rmdir()
    aside.rename(run)
    assert bound._repair(str(run)) == [Repair(str(run), 0o777, 0o700)]
    assert _mode(run) == 0o700


def test_as_made_tells_a_heal_would_do_nothing(tmp_path: Path) -> None:
    f, d, link = tmp_path / "f", tmp_path / "d", tmp_path / "link"
    f.write_bytes(b"")
    f.chmod(0o600)
    d.mkdir()
    d.chmod(0o700)
    link.symlink_to(f)
    assert statemodes.as_made(os.lstat(f), 0o600) and statemodes.as_made(os.lstat(d), None)
    assert statemodes.as_made(os.lstat(d), 0o600)  # not of the kind expected: a heal leaves it too
    assert not statemodes.as_made(os.lstat(f), 0o644)
    assert not statemodes.as_made(os.lstat(link), 0o777)  # a symlink: the heal says it leaves it
