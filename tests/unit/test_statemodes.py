"""statemodes: modes set back parents first, never through a symlink (dispatchd/statemodes.py)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dispatchd import statemodes
from dispatchd.statemodes import Repair


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


@pytest.fixture
def state(tmp_path: Path) -> Path:
    top = tmp_path / "dispatchd"
    (top / "inuse").mkdir(parents=True, mode=0o700)
    top.chmod(0o700)
    (top / "inuse" / ".mutex").write_bytes(b"")
    (top / "inuse" / ".mutex").chmod(0o600)
    return Path(os.path.realpath(top))


def test_a_file_in_a_directory_of_mode_000_is_healed_parents_first(state: Path) -> None:
    mutex = state / "inuse" / ".mutex"
    mutex.chmod(0)
    (state / "inuse").chmod(0)
    assert statemodes.heal(str(mutex), 0o600, top=str(state)) == [
        Repair(str(state / "inuse"), 0, 0o700), Repair(str(mutex), 0, 0o600)]
    assert (_mode(state / "inuse"), _mode(mutex)) == (0o700, 0o600)


def test_an_open_refused_is_healed_and_tried_once_more(state: Path) -> None:
    mutex = state / "inuse" / ".mutex"
    statemodes.own(str(state))
    mutex.chmod(0)
    with pytest.raises(PermissionError):  # the twin: the mode refuses the open
        os.close(os.open(mutex, os.O_RDWR))
    os.close(statemodes.retried(lambda: os.open(mutex, os.O_RDWR), str(mutex), 0o600))
    assert _mode(mutex) == 0o600


def test_a_symlink_is_never_followed(state: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"")
    victim.chmod(0o640)
    link = state / "inuse" / "x.uses"
    link.symlink_to(victim)
    assert statemodes.heal(str(link), 0o600, top=str(state)) == []
    assert _mode(victim) == 0o640
    (state / "inuse" / ".mutex").chmod(0o644)
    assert statemodes.heal_tree(str(state)) == [Repair(str(state / "inuse" / ".mutex"), 0o644, 0o600)]
    assert _mode(victim) == 0o640


def test_the_start_heals_the_layout_and_leaves_the_rest(state: Path) -> None:
    (state / "keep" / "k1").mkdir(parents=True, mode=0o700)
    (state / "keep").chmod(0o777)
    (state / "keep" / "k1").chmod(0o755)
    (state / "keep" / "k1" / ".stamps").write_bytes(b"")
    (state / "keep" / "k1" / ".stamps").chmod(0o644)  # not in the layout: as it was made
    (state / "sessions" / "s1" / "home").mkdir(parents=True, mode=0o755)  # a session's own: not the daemon's
    (state / "sessions").chmod(0)
    state.chmod(0o755)
    got = statemodes.heal_tree(str(state))
    assert got == [Repair(str(state), 0o755, 0o700), Repair(str(state / "sessions"), 0, 0o700),
                   Repair(str(state / "keep"), 0o777, 0o700), Repair(str(state / "keep" / "k1"), 0o755, 0o700)]
    assert _mode(state / "keep" / "k1" / ".stamps") == 0o644
    assert _mode(state / "sessions" / "s1" / "home") == 0o755
    assert statemodes.heal_tree(str(state)) == []  # a second start finds nothing to do
