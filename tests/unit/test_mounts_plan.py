"""dispatchd.confine.mounts: plan_mounts by equality, read_mountinfo and _unescape.

read_mountinfo only reads ``/proc/self/mountinfo``; it is run for real (and
cross-checked with ``statvfs``) and on a crafted file with every escape.
"""

from __future__ import annotations

import io
import os
from typing import Any

import pytest

from dispatchd.confine import mounts
from dispatchd.confine.mounts import MountPlan, _unescape, plan_mounts, read_mountinfo

WT = "/home/u/src/wt"
SCRATCH = "/home/u/.local/state/dispatchd/sessions/s1"
TMP = SCRATCH + "/tmp"
RUNTIME = "/run/user/1000"


def test_plain_plan():
    got = plan_mounts(writable=[WT, SCRATCH], visible=[WT], private_tmp=TMP, hide=[RUNTIME], proc=True)
    assert got == MountPlan(writable=[WT, SCRATCH], visible=[SCRATCH, WT], private_tmp=TMP, hide=[RUNTIME], proc=True)


def test_visible_is_the_sorted_union_without_duplicates():
    got = plan_mounts(writable=["/b", "/a"], visible=["/c", "/a"], private_tmp=TMP, hide=[], proc=False)
    assert got == MountPlan(writable=["/b", "/a"], visible=["/a", "/b", "/c"], private_tmp=TMP, hide=[], proc=False)


def test_writable_keeps_its_order():
    got = plan_mounts(writable=["/z", "/a"], visible=[], private_tmp=TMP, hide=[], proc=True)
    assert got.writable == ["/z", "/a"]


def test_hide_dir_holding_the_worktree_is_dropped():
    wt = RUNTIME + "/projects/wt"
    got = plan_mounts(writable=[wt, SCRATCH], visible=[wt], private_tmp=TMP, hide=[RUNTIME, "/run/user/1000/bus"],
                      proc=True)
    assert got.hide == ["/run/user/1000/bus"]


def test_hide_dir_holding_a_visible_read_only_worktree_is_dropped():
    wt = RUNTIME + "/wt"
    got = plan_mounts(writable=[SCRATCH], visible=[wt], private_tmp=TMP, hide=[RUNTIME], proc=True)
    assert got.hide == []


def test_hide_dir_equal_to_a_kept_path_is_dropped():
    got = plan_mounts(writable=[RUNTIME], visible=[], private_tmp=TMP, hide=[RUNTIME], proc=True)
    assert got.hide == []


def test_hide_dir_holding_a_writable_extra_path_is_dropped():
    got = plan_mounts(writable=[WT, "/run/user/1000/cache"], visible=[WT], private_tmp=TMP, hide=[RUNTIME], proc=True)
    assert got.hide == []


def test_hide_dir_holding_the_private_tmp_is_dropped():
    got = plan_mounts(writable=[WT], visible=[WT], private_tmp=RUNTIME + "/s1/tmp", hide=[RUNTIME], proc=True)
    assert got.hide == []


def test_a_shared_prefix_is_not_containment():
    # /run/user/10 does not hold /run/user/1000/wt: it stays hidden.
    got = plan_mounts(writable=[RUNTIME + "/wt"], visible=[RUNTIME + "/wt"], private_tmp=TMP,
                      hide=["/run/user/10", "/run/user/1000/w"], proc=True)
    assert got.hide == ["/run/user/10", "/run/user/1000/w"]


def test_a_hide_dir_with_a_trailing_slash_still_holds_its_children():
    got = plan_mounts(writable=[RUNTIME + "/wt"], visible=[], private_tmp=TMP, hide=[RUNTIME + "/"], proc=True)
    assert got.hide == []


def test_hide_dirs_keep_their_order():
    got = plan_mounts(writable=[WT], visible=[WT], private_tmp=TMP, hide=["/run/user/1000", "/run/a", "/mnt/x"],
                      proc=True)
    assert got.hide == ["/run/user/1000", "/run/a", "/mnt/x"]


def test_read_only_paths_default_to_none():
    got = plan_mounts(writable=[WT], visible=[WT], private_tmp=TMP, hide=[], proc=True)
    assert got.read_only == []


def test_read_only_paths_are_carried():
    protect = [WT + "/.git/config", WT + "/.git/hooks"]
    got = plan_mounts(writable=[WT], visible=[WT], private_tmp=TMP, hide=[RUNTIME], proc=True, read_only=protect)
    assert got == MountPlan(writable=[WT], visible=[WT], private_tmp=TMP, hide=[RUNTIME], proc=True,
                            read_only=protect)
    protect.append("/x")
    assert got.read_only == [WT + "/.git/config", WT + "/.git/hooks"]


def test_the_plan_does_not_alias_the_callers_lists():
    writable = [WT]
    got = plan_mounts(writable=writable, visible=[], private_tmp=TMP, hide=[], proc=True)
    writable.append("/x")
    assert got.writable == [WT]


# -- _unescape ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "expected"),
    [
        ("/plain", "/plain"),
        ("/with\\040space", "/with space"),
        ("/tab\\011here", "/tab\there"),
        ("/new\\012line", "/new\nline"),
        ("/back\\134slash", "/back\\slash"),
        ("/a\\040b\\040c", "/a b c"),
        # A literal backslash followed by "040" is escaped as \134040: it must
        # come back as backslash-040, not as a space.
        ("/lit\\134040", "/lit\\040"),
        ("/lit\\134134", "/lit\\134"),
        ("/\\134\\040", "/\\ "),
    ],
)
def test_unescape(field: str, expected: str):
    assert _unescape(field) == expected


# -- read_mountinfo -------------------------------------------------------------

FAKE = (
    "22 27 0:21 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw\n"
    "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
    "40 27 0:40 / /mnt/with\\040space ro,nosuid,noatime shared:5 - tmpfs tmpfs ro\n"
    "41 27 0:41 /sub /home/u/back\\134slash rw,nodiratime,strictatime master:2 - ext4 /dev/vdb rw\n"
    "42 27 0:42 / /tmp rw - tmpfs tmpfs rw\n"
)


def test_read_mountinfo_parses_points_and_flags(monkeypatch: pytest.MonkeyPatch):
    opened: list[str] = []

    def fake_open(path: str, *args: Any, **kwargs: Any) -> io.StringIO:
        opened.append(path)
        return io.StringIO(FAKE)

    monkeypatch.setattr(mounts, "open", fake_open, raising=False)
    assert read_mountinfo() == [
        ("/proc", 2 | 4 | 8 | (1 << 21)),
        ("/", 1 << 21),
        ("/mnt/with space", 2 | 1024),
        ("/home/u/back\\slash", 2048),
        ("/tmp", 0),
    ]
    assert opened == ["/proc/self/mountinfo"]


def test_read_mountinfo_of_this_process():
    entries = read_mountinfo()
    assert entries
    assert all(isinstance(point, str) and isinstance(flags, int) for point, flags in entries)
    points = [point for point, _ in entries]
    assert "/" in points
    assert "/proc" in points


def test_read_mountinfo_agrees_with_statvfs():
    # statvfs reports the same per-mount flags (ST_NOSUID 2, ST_NODEV 4,
    # ST_NOEXEC 8, ST_NOATIME 1024, ST_NODIRATIME 2048) of the top mount at a path.
    last = dict(read_mountinfo())  # the last entry for a point is the one on top
    mask = os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC | os.ST_NOATIME | os.ST_NODIRATIME
    checked = 0
    for point in ("/", "/proc", "/dev", "/sys", "/dev/shm", "/tmp"):
        if point not in last:
            continue
        st = os.statvfs(point)
        assert last[point] & mask == st.f_flag & mask, point
        assert bool(last[point] & (1 << 21)) == bool(st.f_flag & os.ST_RELATIME), point
        checked += 1
    assert checked >= 2
