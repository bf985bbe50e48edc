"""The processes all sessions of a daemon may run together
(confine/sharedprocs.py): half of the lowest limit a task meets, read from
the rlimit, the kernel's sysctls and the daemon's cgroups; said in status,
and what is left open when it cannot hold."""

from __future__ import annotations

import errno
import os
import resource
from pathlib import Path

import pytest

from dispatchd.confine import sharedprocs, ucounts


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_every_limit_on_the_way_up_is_read_and_unlimited_ones_are_left_out(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        assert sharedprocs.read_limits(str(tmp_path)) == {}  # root is held to none of them: no bound claimed
        return
    _tree(tmp_path / "proc", {"sys/kernel/threads-max": "192726\n", "sys/kernel/pid_max": "32768\n",
                              "self/cgroup": "0::/user.slice/user-1000.slice/user@1000.service/app.slice/d.service\n"})
    cg = tmp_path / "cg"
    _tree(cg, {"user.slice/user-1000.slice/user@1000.service/app.slice/d.service/pids.max": "max\n",
               "user.slice/user-1000.slice/user@1000.service/pids.max": "4915\n",
               "user.slice/user-1000.slice/pids.max": "12000\n"})  # the root has none
    found = sharedprocs.read_limits(str(tmp_path / "proc"), str(cg))
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    expected = {"kernel.threads-max": 192726, "kernel.pid_max": 32768,
                "pids.max of the cgroup /user.slice/user-1000.slice/user@1000.service": 4915,
                "pids.max of the cgroup /user.slice/user-1000.slice": 12000}
    if soft != resource.RLIM_INFINITY:
        expected["the user's RLIMIT_NPROC"] = soft
    assert found == expected


def test_a_process_in_no_cgroup_v2_reads_only_the_kernels_limits(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        return  # root: none read (above)
    _tree(tmp_path / "proc", {"sys/kernel/pid_max": "4194304\n", "self/cgroup": "1:name=systemd:/\n"})
    found = sharedprocs.read_limits(str(tmp_path / "proc"), str(tmp_path / "cg"))
    assert found.get("kernel.pid_max") == 4194304 and not any(k.startswith("pids.max") for k in found)


def test_the_sessions_together_get_half_of_the_lowest_and_at_least_one() -> None:
    assert sharedprocs.plan({"the user's RLIMIT_NPROC": 96363, "kernel.pid_max": 32768}) == (16384, "kernel.pid_max")
    assert sharedprocs.plan({"kernel.pid_max": 1}) == (1, "kernel.pid_max")
    assert sharedprocs.plan({}) == (0, "")


def test_status_says_the_process_bound_after_the_users_budgets() -> None:
    shared = ucounts.plan_shared({"max_inotify_instances": 128},
                                 {"the user's RLIMIT_NPROC": 96363, "kernel.pid_max": 32768})
    assert (shared.processes, shared.processes_of) == (16384, "kernel.pid_max 32,768")
    assert ucounts.describe_shared(shared) == (
        "all sessions together at most 64 inotify instances (half of the user's); 16,384 processes and threads "
        "(half of the lowest limit they meet, kernel.pid_max 32,768)")
    # No process limit found (every one unlimited): nothing said of processes, none applied.
    assert ucounts.plan_shared({"max_inotify_instances": 128}).processes == 0
    assert "processes" not in ucounts.describe_shared(ucounts.plan_shared({"max_inotify_instances": 128}))


def test_when_the_sum_is_not_bounded_the_processes_are_left_open_too() -> None:
    def gaps(**kwargs: object) -> list[str]:
        return [g for g in ucounts.budget_gaps(cgroup_controllers=(), **kwargs)  # type: ignore[arg-type]
                if g.startswith("processes")]
    assert gaps(user_namespace=True) == [] and gaps(user_namespace=False) == []
    [gap] = gaps(user_namespace=True, max_processes=512, shared_missing="no user namespaces")
    assert gap.startswith("processes: each session runs at most 512, but all sessions together are not bounded")
    assert gap.endswith(": no user namespaces")


def test_eagain_at_a_sessions_start_is_said_in_words_other_errors_are_not() -> None:
    words = sharedprocs.reached(errno.EAGAIN)
    assert words.startswith("EAGAIN: the processes all sessions of this daemon may run together (")
    assert "close sessions or end their commands" in words
    assert sharedprocs.reached(errno.ENOSPC) == "" and sharedprocs.reached(None) == ""


def test_a_command_refused_for_want_of_a_process_says_what_to_do_and_other_errors_do_not() -> None:
    from dispatchd.tools.base import not_started

    eagain = not_started("/bin/bash", OSError(errno.EAGAIN, os.strerror(errno.EAGAIN)))
    assert eagain.startswith("could not start /bin/bash: Resource temporarily unavailable: the session's processes, "
                             "or all sessions' together, are at their limit")
    assert not_started("/bin/bash", OSError(errno.ENOENT, os.strerror(errno.ENOENT))) == (
        "could not start /bin/bash: No such file or directory")


def test_commands_keep_the_tool_server_a_reserve_below_all_sessions_bound_too() -> None:
    from dispatchd.tools import proctree

    # The session's own budget, the tool server's limit: commands get 64 fewer.
    assert proctree._command_limit(1024, 1024) == 960
    # All sessions' bound below the session's budget (the limit it was capped
    # at): a quarter of that bound kept, not none (before: 50 - 64 < 0, no reserve).
    assert proctree._command_limit(50, 1024) == 38
    assert proctree._command_limit(603, 1024) == 539


@pytest.mark.process
def test_the_fork_server_lowers_its_hard_limit_too_so_nothing_below_raises_it_back() -> None:
    import subprocess
    import sys

    code = ("import resource; from dispatchd.confine import sharedprocs; sharedprocs.apply(300); "
            "print(*resource.getrlimit(resource.RLIMIT_NPROC))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    soft, hard = (int(x) for x in out.stdout.split())
    assert soft <= 300 and hard == 300, out.stdout


def test_a_cgroup_v1_pids_hierarchy_is_read_too(tmp_path: Path) -> None:
    """A hybrid machine (v1 controllers, an empty v2 tree) or a v1-only one."""
    if os.geteuid() == 0:
        return  # root: none read (above)
    _tree(tmp_path / "proc", {"self/cgroup": "12:pids:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n"})
    _tree(tmp_path / "cg", {"pids/docker/abc/pids.max": "400\n", "pids/docker/pids.max": "max\n"})
    found = sharedprocs.read_limits(str(tmp_path / "proc"), str(tmp_path / "cg"))
    assert found["pids.max of the cgroup /docker/abc (cgroup v1)"] == 400
    assert sharedprocs.plan(found)[0] == 200
