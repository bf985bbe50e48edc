"""dispatchd.confine.mounts: plan_mounts and describe_root by equality
(apply_mounts runs in the integration and escape suites, in a real mount
namespace)."""

from __future__ import annotations

import msgspec

from dispatchd.confine.mountplan import WORKTREE_FD, Bind, MountPlan, describe_root, plan_mounts

WT = "/home/u/src/wt"
SCRATCH = "/home/u/.local/state/dispatchd/sessions/s1"
TMP = SCRATCH + "/tmp"
RUNTIME = "/run/user/1000"
SYSTEM = ["/usr", "/bin", "/etc"]
DEVICES = ["/dev/null", "/dev/zero"]


def minimal(**kw: object) -> MountPlan:
    args: dict[str, object] = dict(root="minimal", worktree=WT, worktree_rw=True, private_tmp=TMP,
                                   read_write=[SCRATCH], read_only=SYSTEM, devices=DEVICES, hide=[RUNTIME])
    args.update(kw)
    return plan_mounts(**args)  # type: ignore[arg-type]


def test_a_minimal_root_holds_only_what_is_listed_parents_first():
    assert minimal() == MountPlan(root="minimal", binds=[
        Bind("/bin", "ro"), Bind("/etc", "ro"), Bind(SCRATCH, "rw"), Bind(WT, "rw", WORKTREE_FD),
        Bind("/tmp", "rw", TMP), Bind("/usr", "ro"),
    ], devices=DEVICES, hide=[])


def test_the_worktree_comes_from_the_daemons_descriptor_read_only_when_the_policy_says():
    got = minimal(worktree_rw=False)
    assert Bind(WT, "ro", WORKTREE_FD) in got.binds
    assert got.writable() == [SCRATCH, "/tmp"]


def test_a_worktree_under_tmp_is_bound_after_the_private_tmp():
    wt = "/tmp/pytest-of-u/p0/wt"
    paths = [b.path for b in minimal(worktree=wt).binds]
    assert paths.index("/tmp") < paths.index(wt)


def test_git_paths_go_over_the_worktree_after_it():
    got = minimal(read_write=[WT + "/.git", SCRATCH], over=[WT + "/.git/config", WT + "/.git/hooks"])
    assert [b for b in got.binds if b.path.startswith(WT)] == [
        Bind(WT, "rw", WORKTREE_FD), Bind(WT + "/.git", "rw"), Bind(WT + "/.git/config", "ro-over"),
        Bind(WT + "/.git/hooks", "ro-over"),
    ]


def test_a_read_only_path_inside_another_is_not_bound_twice():
    got = minimal(read_only=["/usr", "/usr/lib/python3.11", "/opt/venv/lib"])
    assert [b.path for b in got.binds if b.how == "ro"] == ["/opt/venv/lib", "/usr"]


def test_a_read_only_path_inside_a_writable_one_is_kept():
    got = minimal(read_only=SYSTEM + [WT + "/vendor"])
    assert Bind(WT + "/vendor", "ro") in got.binds


def test_a_path_listed_twice_keeps_its_first_most_writable_role():
    got = minimal(read_write=[SCRATCH, "/opt/x"], read_only=["/opt/x", WT])
    assert Bind("/opt/x", "rw") in got.binds and Bind("/opt/x", "ro") not in got.binds
    assert [b for b in got.binds if b.path == WT] == [Bind(WT, "rw", WORKTREE_FD)]


def test_a_shared_prefix_is_not_containment():
    got = minimal(read_only=["/usr", "/usrx"])
    assert [b.path for b in got.binds if b.how == "ro"] == ["/usr", "/usrx"]


def test_the_hosts_root_keeps_its_hidden_directories():
    got = minimal(root="host")
    assert (got.root, got.hide) == ("host", [RUNTIME])


def test_a_hidden_directory_holding_a_kept_path_is_not_hidden():
    got = minimal(root="host", worktree=RUNTIME + "/wt", hide=[RUNTIME, "/run/user/10"])
    assert got.hide == ["/run/user/10"]


def test_the_plan_does_not_alias_the_callers_lists():
    devices = ["/dev/null"]
    got = minimal(devices=devices)
    devices.append("/dev/kmsg")
    assert got.devices == ["/dev/null"]


def test_status_shows_every_path_and_how():
    got = msgspec.to_builtins(describe_root(minimal(over=[WT + "/.git/config"]), {SCRATCH: "scratch", "/usr": "system"}))
    assert got == [
        {"path": "/bin", "how": "read-only"},
        {"path": "/etc", "how": "read-only"},
        {"path": SCRATCH, "how": "read-write (scratch)"},
        {"path": WT, "how": "read-write (the worktree, bound from the descriptor the daemon checked)"},
        {"path": WT + "/.git/config", "how": "read-only (inside a writable path)"},
        {"path": "/tmp", "how": "read-write (private: the session's scratch tmp)"},
        {"path": "/usr", "how": "read-only (system)"},
        {"path": "/dev", "how": "fresh, read-only: /dev/null, /dev/zero; fd, stdin, stdout, stderr links"},
        {"path": "/dev/shm", "how": "read-write (private tmpfs)"},
        {"path": "/proc", "how": "fresh procfs of the session's pid namespace"},
    ]


def test_status_of_the_hosts_root_says_so():
    got = msgspec.to_builtins(describe_root(minimal(root="host"), {}))
    assert got[0] == {"path": "/", "how": "the host's root, read-only; Landlock refuses what the rules do not grant"}
    assert got[-1] == {"path": RUNTIME, "how": "covered by an empty tmpfs"}
