"""The namespace flags the fork server's clone3 asks for, from the plan."""

from dispatchd.confine import _sys
from dispatchd.confine.namespaces import clone_flags, plan_namespaces


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
