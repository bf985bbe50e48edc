"""The pure half of per-session cgroups: which cgroup to manage, and what each session's gets."""

from __future__ import annotations

import pytest

from dispatchd.confine.cgroups import Delegation, SessionCgroup, choose, plan_session_cgroup

MOUNT = "/sys/fs/cgroup"
OWN = "/user.slice/user-1000.slice/user@1000.service/app.slice/dispatchd.service"
SERVICE = MOUNT + OWN


def test_auto_takes_a_delegated_cgroup_the_daemon_is_alone_in() -> None:
    assert choose("auto", own=OWN, mount=MOUNT, pid=42, occupants=[42], writable=True) == (SERVICE, "")


@pytest.mark.parametrize(("kwargs", "why"), [
    ({"occupants": [42, 7]}, "holds other processes than the daemon"),
    ({"occupants": None}, "holds other processes than the daemon"),
    ({"writable": False}, "is not delegated to this user"),
    ({"own": ""}, "this process is in no cgroup v2"),
    ({"mount": ""}, "cgroup v2 is not mounted"),
])
def test_auto_declines_and_says_why(kwargs: dict[str, object], why: str) -> None:
    args: dict[str, object] = {"own": OWN, "mount": MOUNT, "pid": 42, "occupants": [42], "writable": True}
    args.update(kwargs)
    path, reason = choose("auto", **args)  # type: ignore[arg-type]
    assert path == "" and why in reason


def test_off_is_off_even_when_delegated() -> None:
    assert choose("off", own=OWN, mount=MOUNT, pid=42, occupants=[42], writable=True) == \
        ("", "not used (--cgroup off)")


def test_an_explicit_path_must_be_inside_the_hierarchy() -> None:
    assert choose(f"{MOUNT}/ci/daemon-1/", own="", mount=MOUNT, pid=1, occupants=None, writable=False) == \
        (f"{MOUNT}/ci/daemon-1", "")
    for outside in ("/tmp/cg", MOUNT, f"{MOUNT}/../etc", "/sys/fs/cgroupx/a"):
        path, why = choose(outside, own="", mount=MOUNT, pid=1, occupants=None, writable=False)
        assert path == "" and why == f"{outside} is not inside the cgroup v2 hierarchy at {MOUNT}"


def test_a_session_gets_each_limit_whose_controller_is_delegated() -> None:
    every = Delegation(path=SERVICE, controllers=("pids", "memory", "cpu"))
    assert plan_session_cgroup(every, "abc", max_processes=64, memory_bytes=2**30, cpu_weight=50) == SessionCgroup(
        path=f"{SERVICE}/session-abc",
        settings={"pids.max": "64", "memory.max": str(2**30), "memory.swap.max": "0", "cpu.weight": "50"})
    some = Delegation(path=SERVICE, controllers=("pids",))
    assert plan_session_cgroup(some, "abc", max_processes=64, memory_bytes=2**30, cpu_weight=50).settings == \
        {"pids.max": "64"}
    bare = Delegation(path=SERVICE, controllers=())
    assert plan_session_cgroup(bare, "abc", max_processes=64, memory_bytes=2**30, cpu_weight=50) == \
        SessionCgroup(path=f"{SERVICE}/session-abc", settings={})


def test_no_delegation_no_cgroup() -> None:
    assert plan_session_cgroup(Delegation(note="x"), "abc", max_processes=1, memory_bytes=1, cpu_weight=1) is None


def test_describe() -> None:
    assert Delegation(note="not used (--cgroup off)").describe() == "no: not used (--cgroup off)"
    assert Delegation(path=SERVICE, controllers=("pids", "cpu"), note="controllers memory are not available").describe() \
        == f"in use at {SERVICE} (controllers: pids, cpu); controllers memory are not available"
    assert Delegation(path=SERVICE).describe() == f"in use at {SERVICE} (controllers: none)"


def test_create_leaves_nothing_when_a_limit_cannot_be_written(tmp_path) -> None:
    """A plain directory stands in for cgroupfs: mkdir works, and a settings
    file that does not exist cannot be opened for writing in a read-only
    directory, as in cgroupfs, where only the kernel makes files."""
    import os

    from dispatchd.confine import cgroups
    from dispatchd.errors import ConfinementError

    base = tmp_path / "base"
    base.mkdir()
    path = base / "session-x"
    # memory.swap.max is optional (no swap accounting): its absence is fine...
    optional = SessionCgroup(path=str(path), settings={"memory.swap.max": "0"})
    real_write = cgroups._write

    def cgroupfs_write(file: str, value: str) -> None:
        if not os.path.exists(file):
            raise FileNotFoundError(2, "No such file or directory", file)
        real_write(file, value)

    cgroups._write = cgroupfs_write
    try:
        cgroups.create(optional)
        assert path.is_dir()
        path.rmdir()
        # ...but a missing pids.max is an error, and the cgroup is not left behind.
        with pytest.raises(ConfinementError) as info:
            cgroups.create(SessionCgroup(path=str(path), settings={"pids.max": "10"}))
    finally:
        cgroups._write = real_write
    assert info.value.step == "cgroup" and info.value.path == f"{path}/pids.max"
    assert not path.exists()
