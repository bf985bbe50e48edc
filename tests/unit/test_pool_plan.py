"""What a sandbox made ahead applies before its session, by equality:
``MountPlan.split_binds`` and ``plan.pool_key`` (the sandboxes themselves run
in tests/integration/test_pool.py and tests/escape/test_pool.py)."""

from __future__ import annotations

import pytest

from dispatchd.confine.cgroups import Delegation
from dispatchd.confine.mounts import WORKTREE_FD, Bind, plan_mounts
from dispatchd.confine.plan import GitLayout, SessionPaths, SessionPlan, plan_session, pool_key
from dispatchd.policy import Filesystem, Limits, Policy
from tests.unit.test_plan import CODE, GID, PATHS, RUNTIME, SCRATCH, UID, kernel

WT = "/home/u/src/wt"
TMP = SCRATCH + "/tmp"
SYSTEM = ["/usr", "/bin", "/etc"]


def split(**kw: object) -> tuple[list[Bind], list[Bind]]:
    args: dict[str, object] = dict(root="minimal", worktree=WT, worktree_rw=True, private_tmp=TMP,
                                   read_write=[SCRATCH], read_only=SYSTEM, devices=["/dev/null"], system=SYSTEM)
    args.update(kw)
    return plan_mounts(**args).split_binds()  # type: ignore[arg-type]


def test_the_system_paths_are_shared_and_the_sessions_own_paths_are_not():
    shared, own = split()
    assert shared == [Bind("/bin", "ro"), Bind("/etc", "ro"), Bind("/usr", "ro")]
    assert own == [Bind(SCRATCH, "rw"), Bind(WT, "rw", WORKTREE_FD), Bind("/tmp", "rw", TMP)]


def test_a_read_only_path_that_is_not_a_system_path_is_the_sessions_own():
    # git's common directory of a linked worktree, an extra read-only path
    shared, own = split(read_only=SYSTEM + ["/home/u/src/main/.git", "/home/u/.cargo"])
    assert [b.path for b in shared] == ["/bin", "/etc", "/usr"]
    assert Bind("/home/u/.cargo", "ro") in own and Bind("/home/u/src/main/.git", "ro") in own


def test_a_system_path_below_a_sessions_path_waits_for_it():
    # bound after the private /tmp, or it would be hidden under it
    shared, own = split(read_only=SYSTEM + ["/tmp/toolchain"], system=SYSTEM + ["/tmp/toolchain"])
    assert Bind("/tmp/toolchain", "ro") not in shared
    assert [b.path for b in own].index("/tmp") < [b.path for b in own].index("/tmp/toolchain")


def test_a_worktree_below_a_system_path_comes_after_it():
    shared, own = split(worktree="/usr/src/wt")
    assert Bind("/usr", "ro") in shared and Bind("/usr/src/wt", "rw", WORKTREE_FD) in own


def test_the_session_ids_own_directories_are_bound_ahead_too():
    shared, own = split(ahead=[SCRATCH, "/tmp"])
    assert shared == [Bind("/bin", "ro"), Bind("/etc", "ro"), Bind(SCRATCH, "rw"), Bind("/tmp", "rw", TMP),
                      Bind("/usr", "ro")]
    assert own == [Bind(WT, "rw", WORKTREE_FD)]


def test_a_worktree_under_tmp_is_bound_after_the_private_tmp_made_ahead():
    shared, own = split(worktree="/tmp/u/wt", ahead=[SCRATCH, "/tmp"])
    assert Bind("/tmp", "rw", TMP) in shared and own == [Bind("/tmp/u/wt", "rw", WORKTREE_FD)]


def test_the_two_parts_are_every_bind_once():
    plan = plan_mounts(root="minimal", worktree=WT, worktree_rw=True, private_tmp=TMP, read_write=[SCRATCH],
                       read_only=SYSTEM + ["/tmp/x", "/home/u/.cargo"], over=[WT + "/.git/config"],
                       system=SYSTEM + ["/tmp/x"])
    shared, own = plan.split_binds()
    assert sorted(b.path for b in shared + own) == sorted(b.path for b in plan.binds)
    assert plan.root_part().binds == shared


# --- pool_key -------------------------------------------------------------------


def plan(*, policy: Policy | None = None, network: str = "off", paths: SessionPaths = PATHS, session: str = "s1",
         userns: bool = True, delegation: Delegation = Delegation(note="none"), host_tree: bool = False) -> SessionPlan:
    return plan_session(policy or Policy(), kernel(userns=userns), session=session, paths=paths, network=network,
                        uid=UID, gid=GID, base_env={}, delegation=delegation, host_tree=host_tree)


def test_sessions_of_one_policy_and_network_share_a_key_whatever_their_worktree():
    other = SessionPaths(worktree="/srv/other", scratch=SCRATCH, runtime_dirs=[RUNTIME], code=[CODE],
                         git=GitLayout("linked", readable=["/srv/main/.git"], read_only=["/srv/other/.git"]),
                         read_only=["/home/u/.rustup"])
    assert pool_key(plan()) is not None
    assert pool_key(plan()) == pool_key(plan(paths=other))


def test_rlimits_are_applied_with_the_session_so_they_do_not_change_the_key():
    assert pool_key(plan(policy=Policy(limits=Limits(max_open_files=64)))) == pool_key(plan())


def test_what_the_sandbox_applied_ahead_changes_the_key():
    base = pool_key(plan())
    assert pool_key(plan(network="on")) != base  # its stack, its seccomp
    assert pool_key(plan(policy=Policy(filesystem=Filesystem(read_only=("/usr",))))) != base  # its root
    assert pool_key(plan(policy=Policy(limits=Limits(max_inotify_watches=10)))) != base  # its kernel budgets
    # how it holds the host's root until the session's binds (below its own, or by descriptor)
    assert pool_key(plan(host_tree=True)) != base


def test_landlock_rules_of_paths_the_sessions_binds_cover_wait_for_them():
    """A rule binds to the inode its path leads to: one under a path the
    session binds at adoption (an extra path over a system path, a worktree
    at one) is added then, not with the root; the key says so (a sandbox made
    for the plain kind does not serve it)."""
    base = plan()
    assert "/etc" in base.landlock.ahead and "/tmp" in base.landlock.ahead and "/proc" in base.landlock.ahead
    assert WT not in base.landlock.ahead and SCRATCH not in base.landlock.ahead  # the session's own
    over = SessionPaths(worktree=WT, scratch=SCRATCH, runtime_dirs=[RUNTIME], code=[CODE], read_only=["/"])
    assert plan(paths=over).landlock.ahead == []
    at = SessionPaths(worktree="/etc", scratch=SCRATCH, runtime_dirs=[RUNTIME], code=[CODE])
    assert "/etc" not in plan(paths=at).landlock.ahead and "/usr" in plan(paths=at).landlock.ahead
    assert pool_key(plan(paths=at)) != pool_key(base)
    # Below a session's path is fine: its own bind does not change the inode above it.
    below = SessionPaths(worktree="/usr/src/wt", scratch=SCRATCH, runtime_dirs=[RUNTIME], code=[CODE])
    assert "/usr" in plan(paths=below).landlock.ahead


def test_the_host_root_is_held_by_descriptor_only_where_the_kernel_binds_from_one():
    held = plan(host_tree=True).mounts
    assert held is not None and held.host_by_fd and held.root_part().host_by_fd
    assert plan().mounts is not None and not plan().mounts.host_by_fd  # type: ignore[union-attr]
    assert plan(policy=Policy(filesystem=Filesystem(root="host")), host_tree=True).mounts.host_by_fd is False  # type: ignore[union-attr]


def test_a_cgroup_is_made_for_one_session_id():
    delegated = Delegation(path="/sys/fs/cgroup/u/dispatchd", controllers=("pids",))
    assert pool_key(plan(delegation=delegated, session="a")) != pool_key(plan(delegation=delegated, session="b"))
    assert pool_key(plan(session="a")) == pool_key(plan(session="b"))  # no cgroup: the id is not in it


def test_no_sandbox_is_made_ahead_without_a_root_of_its_own():
    assert pool_key(plan(userns=False)) is None
    assert pool_key(plan(policy=Policy(filesystem=Filesystem(root="host")))) is None


@pytest.mark.parametrize(("network", "userns", "relay", "door"), [
    ("on", True, True, True), ("ports", True, True, True),
    ("on", True, False, False),  # no relay: no door to make
    ("off", True, True, False), ("domains", True, True, False),  # no stack
    ("on", False, True, False),  # degraded: the host's network, no namespace to bind in
])
def test_the_sandbox_makes_the_relays_door_where_a_stack_runs_in_its_own_namespaces(
        network: str, userns: bool, relay: bool, door: bool) -> None:
    got = plan_session(Policy(), kernel(userns=userns), session="s1", paths=PATHS, network=network, uid=UID,
                       gid=GID, base_env={}, dns_door=relay)
    assert got.dns_door is door


def test_a_sandbox_that_made_the_relays_door_serves_only_plans_that_want_it():
    with_door = plan_session(Policy(), kernel(), session="s1", paths=PATHS, network="on", uid=UID, gid=GID,
                             base_env={}, dns_door=True)
    without = plan(network="on")
    assert with_door.dns_door and not without.dns_door
    assert pool_key(with_door) != pool_key(without)
