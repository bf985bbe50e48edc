"""What all sessions together may hold of the user's inotify and fanotify
budgets (confine/ucounts.py): half of each of the user's limits, read from the
lower of the two sysctls; said in status, or why it is not bounded."""

from __future__ import annotations

from pathlib import Path

from dispatchd.confine import ucounts


def _proc_sys(root: Path, values: dict[str, int]) -> str:
    for rel, value in values.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(f"{value}\n")
    return str(root)


def test_the_users_limits_are_the_lower_of_the_initial_and_the_daemons_namespace(tmp_path: Path) -> None:
    proc_sys = _proc_sys(tmp_path, {"fs/inotify/max_user_instances": 128, "user/max_inotify_instances": 2147483647,
                                    "fs/inotify/max_user_watches": 8192, "user/max_inotify_watches": 1000,
                                    "fs/fanotify/max_user_groups": 128})
    assert ucounts.read_user_limits(proc_sys) == {"max_inotify_instances": 128, "max_inotify_watches": 1000,
                                                  "max_fanotify_groups": 128}  # no marks' sysctl: left out


def test_the_sessions_together_get_half_and_at_least_one() -> None:
    plan = ucounts.plan_shared({"max_inotify_instances": 128, "max_inotify_watches": 8191, "max_fanotify_groups": 1})
    assert plan.maxima == {"max_fanotify_groups": 1, "max_inotify_instances": 64, "max_inotify_watches": 4095}
    assert ucounts.plan_shared({}).maxima == {}


def test_status_says_the_bound_and_a_session_says_it_with_its_share() -> None:
    shared = ucounts.plan_shared({"max_inotify_instances": 128, "max_inotify_watches": 192536,
                                  "max_fanotify_groups": 128, "max_fanotify_marks": 205039})
    words = ucounts.describe_shared(shared)
    assert words == ("all sessions together at most 64 inotify instances, 96,268 inotify watches, "
                     "64 fanotify groups, 102,519 fanotify marks (half of the user's)")
    own = ucounts.plan_ucounts(user_namespace=True, inotify_instances=32, inotify_watches=65536,
                               fanotify_groups=16, fanotify_marks=65536)
    assert ucounts.describe(own, words).startswith(words + "; in its user namespace: inotify 32 instances")
    assert ucounts.describe(own).startswith("in its user namespace: inotify 32 instances")


def _inotify_gaps(**kwargs: object) -> list[str]:
    return [g for g in ucounts.budget_gaps(cgroup_controllers=(), **kwargs) if g.startswith("inotify")]  # type: ignore[arg-type]


def test_what_is_left_open_depends_on_the_sessions_namespace_and_the_shared_one() -> None:
    # Full mode with the shared namespace: nothing of inotify is left open.
    assert _inotify_gaps(user_namespace=True) == []
    # Full mode without it: each session bounded, their sum not, and why.
    [gap] = _inotify_gaps(user_namespace=True, shared_missing="a user namespace for all sessions cannot be made here")
    assert "all sessions together are not bounded" in gap and gap.endswith("cannot be made here")
    # A session without a namespace of its own below the shared one: the sessions' bound, no share of its own.
    [gap] = _inotify_gaps(user_namespace=False)
    assert "no share of its own" in gap and "the user's programs keep the rest" in gap
    # Neither: shared with the user's programs.
    [gap] = _inotify_gaps(user_namespace=False, shared_missing="no user namespaces")
    assert "shared with the user's other programs" in gap
