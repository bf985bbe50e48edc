"""Baselines.recover and the temporary records: one a killed daemon left is
removed; one a live daemon (another on the state directory, or this one)
is making durable, its domain's lock held, is left where it is."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import Baselines
from dispatchd.daemon.gitguard.pending import held_elsewhere


@pytest.mark.parametrize("held", [True, False], ids=["a_live_daemon_s", "a_killed_daemon_s"])
def test_a_temporary_record_is_removed_only_when_its_lock_is_free(tmp_path: Path, held: bool) -> None:
    d = tmp_path / "dispatchd" / "baselines"
    d.mkdir(parents=True)
    tmp = d / "0123456789abcdef.json.a1b2c3d4.tmp"
    tmp.write_text("{}")
    (d / "0123456789abcdef.lock").write_text("")
    fd = os.open(d / "0123456789abcdef.lock", os.O_RDWR)
    try:
        if held:
            fcntl.flock(fd, fcntl.LOCK_EX)
        assert held_elsewhere(str(d), "0123456789abcdef") is held
        Baselines(str(tmp_path / "dispatchd")).recover()
        assert tmp.exists() is held
    finally:
        os.close(fd)


def test_a_lock_that_is_not_there_is_not_held_nor_made(tmp_path: Path) -> None:
    assert held_elsewhere(str(tmp_path), "0123456789abcdef") is False
    assert os.listdir(tmp_path) == []
