"""A ctime is trusted to say "unchanged" only once it is older than the
clock's tick before the look, and, in whole seconds (a file system that
keeps seconds only: ext2, ext3, ext4 with 128-byte inodes, reporting the
ext4 magic), older than two seconds: a change later in the same second
keeps the same ctime there."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from dispatchd import treewalk
from dispatchd.daemon.gitguard import runnables

S = 1_000_000_000
LOOK = 1_700_000_010 * S + 500_000_000  # a look half way through a second


@pytest.mark.parametrize(("ctime", "trusted"), [
    (LOOK - 60_000_000, True), (LOOK - 40_000_000, False),  # fine: the tick
    (LOOK - 500_000_000, False), (LOOK - 1_500_000_000, False),  # whole seconds, the same second or the one before
    (LOOK - 2_500_000_000, True),  # whole seconds, settled
    (LOOK - 500_000_001, True),  # fine, though near a second
])
def test_a_ctime_is_settled_after_the_tick_or_two_seconds_when_in_whole_seconds(ctime: int, trusted: bool) -> None:
    assert treewalk.settled(ctime, LOOK, 50_000_000) is trusted


def test_a_directory_with_a_whole_second_ctime_is_not_remembered_until_settled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As a file system keeping seconds would show it: a directory changed in
    this second is listed again by the next walk (a new ``.envrc`` later in
    the same second keeps its ctime); the twin, the same directory with its
    real (fine) ctime, settled, is remembered."""
    (tmp_path / "wt" / "d").mkdir(parents=True)
    old = time.time_ns() - 200_000_000
    os.utime(tmp_path / "wt" / "d", ns=(old, old))
    time.sleep(0.1)  # its ctime (set by the utime) settles past the tick
    runnables._REMEMBERED.clear()
    runnables.take(str(tmp_path / "wt"), (".envrc",))
    assert len(runnables._REMEMBERED[frozenset({".envrc"})]) == 2  # the twin: the root and d, remembered
    runnables._REMEMBERED.clear()
    fstat = os.fstat

    def whole_seconds(fd: int) -> os.stat_result:
        st = fstat(fd)
        fields = list(st)
        ctime_ns = (time.time_ns() // S - 1) * S  # the second before, as a seconds-only file system keeps it
        return os.stat_result(fields[:7] + [st.st_atime, st.st_mtime, ctime_ns // S],
                              {"st_ctime_ns": ctime_ns, "st_mtime_ns": st.st_mtime_ns, "st_atime_ns": st.st_atime_ns})

    monkeypatch.setattr(runnables.os, "fstat", whole_seconds)
    runnables.take(str(tmp_path / "wt"), (".envrc",))
    assert runnables._REMEMBERED[frozenset({".envrc"})] == {}
