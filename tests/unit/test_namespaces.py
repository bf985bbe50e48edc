"""The namespace flags the fork server's clone3 asks for, from the plan."""

import errno

from dispatchd.confine import _sys
from dispatchd.confine.namespaces import NamespacePlan, clone_flags, limit_reached, plan_kinds, plan_namespaces
from dispatchd.errors import ConfinementError


def test_full_mode_network_off_asks_for_every_namespace():
    plan = plan_namespaces(use_userns=True, network_off=True, uid=1000, gid=1000)
    assert clone_flags(plan) == (_sys.CLONE_NEWUSER | _sys.CLONE_NEWNS | _sys.CLONE_NEWIPC | _sys.CLONE_NEWPID
                                 | _sys.CLONE_NEWNET)


def test_full_mode_on_the_hosts_network_keeps_it():
    plan = plan_namespaces(use_userns=True, network_off=False, uid=1000, gid=1000, own_network=False)
    assert clone_flags(plan) == _sys.CLONE_NEWUSER | _sys.CLONE_NEWNS | _sys.CLONE_NEWIPC | _sys.CLONE_NEWPID


def test_without_user_namespaces_it_is_a_plain_fork():
    plan = plan_namespaces(use_userns=False, network_off=True, uid=1000, gid=1000)
    assert clone_flags(plan) == 0


def test_enospc_from_a_call_making_namespaces_names_the_limits_it_counts_against() -> None:
    """ENOSPC from clone3, unshare or open_tree means a count of the user's
    namespaces is at its limit, which the error's own words ("No space left
    on device") do not say: the message names the sysctls of the kinds the
    call makes. The twin: any other error keeps its own words (no detail)."""
    full = NamespacePlan(user=True, mount=True, pid=True, net=True, uid=1000, gid=1000)
    said = limit_reached(errno.ENOSPC, plan_kinds(full))
    assert said.startswith("ENOSPC: a limit on namespaces is reached: user.max_user_namespaces, "
                           "user.max_mnt_namespaces, user.max_pid_namespaces, user.max_net_namespaces, "
                           "user.max_ipc_namespaces (sysctl, in this user namespace or one above it")
    offline = NamespacePlan(user=True, mount=True, pid=True, net=False, uid=1000, gid=1000)
    assert "max_net_namespaces" not in limit_reached(errno.ENOSPC, plan_kinds(offline))
    assert limit_reached(errno.ENOSPC, ("mount",)).startswith(
        "ENOSPC: a limit on namespaces is reached: user.max_mnt_namespaces (sysctl")
    assert limit_reached(errno.EPERM, plan_kinds(full)) == ""
    error = ConfinementError("namespaces: clone3", errno.ENOSPC, detail=limit_reached(errno.ENOSPC, ("user",)))
    assert str(error).startswith("cannot apply namespaces: clone3: ENOSPC: a limit on namespaces is reached: "
                                 "user.max_user_namespaces (sysctl")
    assert str(ConfinementError("namespaces: clone3", errno.EPERM)) == \
        "cannot apply namespaces: clone3: EPERM: Operation not permitted"
