"""dispatchd.confine.landlock.plan_landlock: the ruleset per ABI, by equality.

The masks are written out as numbers (from the kernel's uapi
``linux/landlock.h``), not rebuilt from the module's constants, so a wrong
constant fails here instead of being copied into the expectation.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dispatchd.confine import landlock
from dispatchd.confine.landlock import LandlockPlan, PathRule, fs_rights_for_abi, landlock_abi, plan_landlock

# LANDLOCK_ACCESS_FS_* handled per ABI: 13 rights in ABI 1, REFER (bit 13) in 2,
# TRUNCATE (bit 14) in 3, none new in 4, IOCTL_DEV (bit 15) in 5, none since.
HANDLED = {1: 0x1FFF, 2: 0x3FFF, 3: 0x7FFF, 4: 0x7FFF, 5: 0xFFFF, 6: 0xFFFF, 7: 0xFFFF}
RO = 0b1101  # EXECUTE | READ_FILE | READ_DIR
RW_ALL = 0xFFFF & ~0x0040 & ~0x0800  # everything but MAKE_CHAR and MAKE_BLOCK
DEV = 0b0110  # WRITE_FILE | READ_FILE

READ_ONLY = ["/usr", "/etc", "/proc"]
READ_WRITE = ["/home/u/wt", "/home/u/.local/state/dispatchd/sessions/s1"]
DEVICES = ["/dev/null", "/dev/urandom"]


def plan(abi: int, *, deny_tcp: bool = False, connect: list[int] | None = None,
         bind: list[int] | None = None) -> LandlockPlan:
    return plan_landlock(abi=abi, read_only=READ_ONLY, read_write=READ_WRITE, devices=DEVICES, deny_tcp=deny_tcp,
                         connect_ports=connect, bind_ports=bind)


def rules(handled: int) -> list[PathRule]:
    return ([PathRule(path, RO & handled) for path in READ_ONLY]
            + [PathRule(path, RW_ALL & handled) for path in READ_WRITE]
            + [PathRule(path, DEV & handled) for path in DEVICES])


def test_constants_match_the_kernel_uapi():
    assert (landlock.EXECUTE, landlock.WRITE_FILE, landlock.READ_FILE, landlock.READ_DIR) == (1, 2, 4, 8)
    assert (landlock.MAKE_CHAR, landlock.MAKE_BLOCK, landlock.MAKE_SYM) == (0x40, 0x800, 0x1000)
    assert (landlock.REFER, landlock.TRUNCATE, landlock.IOCTL_DEV) == (0x2000, 0x4000, 0x8000)
    assert (landlock.NET_BIND_TCP, landlock.NET_CONNECT_TCP) == (1, 2)
    assert (landlock.SCOPE_ABSTRACT_UNIX_SOCKET, landlock.SCOPE_SIGNAL) == (1, 2)
    assert landlock.READ_ONLY == RO
    assert landlock.READ_WRITE == RW_ALL == 0xF7BF
    assert landlock.DEVICE == DEV
    assert landlock.FILE_RIGHTS == 0x1 | 0x2 | 0x4 | 0x4000 | 0x8000


@pytest.mark.parametrize(("abi", "handled"), sorted(HANDLED.items()))
def test_fs_rights_for_abi(abi: int, handled: int):
    assert fs_rights_for_abi(abi) == handled


@pytest.mark.parametrize("abi", [0, -1])
def test_fs_rights_without_landlock(abi: int):
    assert fs_rights_for_abi(abi) == 0


def test_fs_rights_of_a_future_abi_are_the_newest_known():
    assert fs_rights_for_abi(99) == 0xFFFF


def test_abi_1():
    assert plan(1) == LandlockPlan(
        abi=1, handled_fs=0x1FFF, handled_net=0, scoped=0,
        paths=[PathRule("/usr", RO), PathRule("/etc", RO), PathRule("/proc", RO),
               PathRule("/home/u/wt", 0x17BF), PathRule("/home/u/.local/state/dispatchd/sessions/s1", 0x17BF),
               PathRule("/dev/null", DEV), PathRule("/dev/urandom", DEV)],
        tcp_ports=[],
    )


def test_abi_1_cannot_handle_tcp():
    assert plan(1, deny_tcp=True, connect=[443]) == plan(1)


def test_abi_3_adds_truncate():
    assert plan(3) == LandlockPlan(abi=3, handled_fs=0x7FFF, handled_net=0, scoped=0, paths=rules(0x7FFF))
    assert all(r.access & landlock.TRUNCATE for r in plan(3).paths[3:5])
    assert not any(r.access & landlock.TRUNCATE for r in plan(2).paths)


def test_abi_3_ignores_deny_tcp():
    assert plan(3, deny_tcp=True, connect=[443], bind=[8080]) == plan(3)


def test_abi_4_without_deny_tcp():
    assert plan(4) == LandlockPlan(abi=4, handled_fs=0x7FFF, handled_net=0, scoped=0, paths=rules(0x7FFF))


def test_abi_4_denies_all_tcp():
    assert plan(4, deny_tcp=True) == LandlockPlan(abi=4, handled_fs=0x7FFF, handled_net=0b11, scoped=0,
                                                  paths=rules(0x7FFF), tcp_ports=[])


def test_abi_4_allows_the_listed_ports():
    got = plan(4, deny_tcp=True, connect=[443, 80, 443], bind=[8080, 443])
    assert got.handled_net == 0b11
    # (port, access): 1 bind, 2 connect, 3 both; sorted by port, one entry each.
    assert got.tcp_ports == [(80, 2), (443, 3), (8080, 1)]


def test_ports_without_deny_tcp_are_dropped():
    assert plan(7, connect=[443], bind=[8080]).tcp_ports == []


def test_abi_5_adds_ioctl_dev():
    assert plan(5) == LandlockPlan(abi=5, handled_fs=0xFFFF, handled_net=0, scoped=0, paths=rules(0xFFFF))
    assert plan(5).paths[-1] == PathRule("/dev/urandom", DEV)  # devices get read+write, not ioctl
    assert plan(5).paths[3].access == 0xF7BF


def test_abi_6_adds_scopes():
    assert plan(6) == LandlockPlan(abi=6, handled_fs=0xFFFF, handled_net=0, scoped=0b11, paths=rules(0xFFFF))


def test_abi_7():
    assert plan(7, deny_tcp=True) == LandlockPlan(
        abi=7, handled_fs=0xFFFF, handled_net=0b11, scoped=0b11,
        paths=[PathRule("/usr", 13), PathRule("/etc", 13), PathRule("/proc", 13),
               PathRule("/home/u/wt", 0xF7BF), PathRule("/home/u/.local/state/dispatchd/sessions/s1", 0xF7BF),
               PathRule("/dev/null", 6), PathRule("/dev/urandom", 6)],
        tcp_ports=[],
    )


@pytest.mark.parametrize("abi", [1, 2, 3, 4, 5, 6, 7])
def test_no_rule_grants_a_right_the_abi_does_not_handle(abi: int):
    assert all(r.access & ~HANDLED[abi] == 0 for r in plan(abi).paths)


@pytest.mark.parametrize("abi", [1, 2, 3, 4, 5, 6, 7])
def test_no_rule_allows_device_nodes(abi: int):
    assert all(r.access & (landlock.MAKE_CHAR | landlock.MAKE_BLOCK) == 0 for r in plan(abi).paths)


def test_plan_is_pure():
    assert plan(7, deny_tcp=True, connect=[1]) == plan(7, deny_tcp=True, connect=[1])


def test_empty_plan():
    assert plan_landlock(abi=7, read_only=[], read_write=[], devices=[], deny_tcp=False) == LandlockPlan(
        abi=7, handled_fs=0xFFFF, handled_net=0, scoped=3, paths=[], tcp_ports=[])


def test_landlock_abi_probe_returns_a_version():
    abi = landlock_abi()
    assert isinstance(abi, int)
    assert abi >= 0
    assert landlock_abi() == abi  # a read-only probe: asking twice changes nothing


@pytest.mark.process
def test_a_file_rule_is_refused_when_its_path_is_no_longer_that_file(tmp_path: Path) -> None:
    """``PathRule.file_only`` (a stack's own libraries, planned as files at
    the daemon's start): a directory or a symlink found at the path when the
    rule is added fails the step, where a directory would have granted what
    is below it. Rules are added to a ruleset never enforced (this process
    stays unconfined). The twins: the regular file is added, and a rule
    without ``file_only`` takes the directory as before."""
    from dispatchd.errors import ConfinementError

    plan = landlock.plan_landlock(abi=landlock.landlock_abi(), read_only=[], read_write=[], devices=[],
                                  deny_tcp=False)
    ruleset = landlock._create_ruleset(plan)
    try:
        lib = tmp_path / "libx.so"
        lib.write_bytes(b"\x7fELF")
        rights = landlock.READ_FILE | landlock.EXECUTE
        assert landlock._add_path_rules(ruleset, [landlock.PathRule(str(lib), rights, file_only=True)], {}) == []
        (tmp_path / "dir").mkdir()
        (tmp_path / "link").symlink_to(lib)
        for path in (tmp_path / "dir", tmp_path / "link"):
            with pytest.raises(ConfinementError, match="is no longer a regular file"):
                landlock._add_path_rules(ruleset, [landlock.PathRule(str(path), rights, file_only=True)], {})
        assert landlock._add_path_rules(ruleset, [landlock.PathRule(str(tmp_path / "dir"), rights)], {}) == []
    finally:
        os.close(ruleset)
