"""dispatchd.daemon.planahead: a plan made ahead is used only when its inputs
equal the open's by content; every difference plans afresh, and the plan used
is always the one plan_session gives for the open's inputs."""

from __future__ import annotations

import msgspec
import pytest

from dispatchd.confine.cgroups import Delegation
from dispatchd.confine.netstack import NetworkPorts
from dispatchd.confine.plan import GitLayout, SessionPaths, decode_plan, encode_plan, plan_session, pool_key
from dispatchd.daemon.planahead import PlanInputs, plan_ahead, plan_for
from dispatchd.policy import parse_policy

from .test_plan import kernel

POLICY = parse_policy("p", "[limits]\nmax_processes = 100\n")
LAST = PlanInputs(
    session="aaaaaaaaaaaa", policy=POLICY, network="off",
    paths=SessionPaths(worktree="/home/u/wt", scratch="/state/sessions/aaaaaaaaaaaa", runtime_dirs=["/run/user/1"],
                       code=["/opt/dispatchd"], read_only=["/srv/data"]),
    ports=NetworkPorts(connect=[], bind=[]), git_identity={"GIT_AUTHOR_NAME": "U"}, kernel=kernel(), uid=1000,
    gid=1000, base_env={"PATH": "/usr/bin"}, delegation=Delegation(note="not looked for"), host_tree=True)
SID, SCRATCH = "bbbbbbbbbbbb", "/state/sessions/bbbbbbbbbbbb"


def fresh(i: PlanInputs):
    return plan_session(i.policy, i.kernel, session=i.session, paths=i.paths, network=i.network, uid=i.uid,
                        gid=i.gid, base_env=i.base_env, ports=i.ports, delegation=i.delegation,
                        git_identity=i.git_identity, host_tree=i.host_tree)


def the_open(**changes) -> PlanInputs:
    """The inputs of the open that takes the sandbox made for SID: built anew, as the daemon does."""
    paths = SessionPaths(worktree="/home/u/wt", scratch=SCRATCH, runtime_dirs=["/run/user/1"],
                         code=["/opt/dispatchd"], read_only=["/srv/data"])
    i = LAST._replace(session=SID, paths=paths, policy=parse_policy("p", "[limits]\nmax_processes = 100\n"),
                      git_identity={"GIT_AUTHOR_NAME": "U"}, ports=NetworkPorts(connect=[], bind=[]))
    return i._replace(**changes)


def test_an_open_alike_the_last_gets_the_plan_made_ahead_equal_to_a_fresh_one():
    planned = plan_ahead(LAST, session=SID, scratch=SCRATCH, policy=POLICY)
    inputs = the_open()
    plan, key = plan_for(inputs, planned)
    assert plan is planned.plan and key == planned.key
    assert plan == fresh(inputs) and key == pool_key(fresh(inputs))
    assert plan.session == SID and plan.paths.scratch == SCRATCH


@pytest.mark.parametrize("changes", [
    {"policy": parse_policy("p", "[limits]\nmax_processes = 200\n")},  # the policy edited since
    {"paths": SessionPaths(worktree="/home/u/other", scratch=SCRATCH, runtime_dirs=["/run/user/1"],
                           code=["/opt/dispatchd"], read_only=["/srv/data"])},
    {"paths": SessionPaths(worktree="/home/u/wt", scratch=SCRATCH, runtime_dirs=["/run/user/1"],
                           code=["/opt/dispatchd"], read_only=["/srv/data"],
                           git=GitLayout("linked", readable=["/home/u/main/.git"]))},
    {"paths": SessionPaths(worktree="/home/u/wt", scratch=SCRATCH, runtime_dirs=["/run/user/1"],
                           code=["/opt/dispatchd"], read_only=[])},
    {"git_identity": {"GIT_AUTHOR_NAME": "V"}},
    {"ports": NetworkPorts(connect=[443], bind=[]), "network": "ports"},
    {"network": "on"},
])
def test_any_difference_plans_afresh(changes):
    planned = plan_ahead(LAST, session=SID, scratch=SCRATCH, policy=POLICY)
    inputs = the_open(**changes)
    plan, key = plan_for(inputs, planned)
    assert plan is not planned.plan
    assert plan == fresh(inputs) and key == pool_key(plan)
    assert plan != planned.plan


def test_the_policy_edited_since_is_what_the_plan_says():
    planned = plan_ahead(LAST, session=SID, scratch=SCRATCH, policy=POLICY)
    edited = parse_policy("p", "[limits]\nmax_processes = 200\n")
    plan, _ = plan_for(the_open(policy=edited), planned)
    assert plan.limits.max_processes == 200 and planned.plan.limits.max_processes == 100


def test_no_plan_made_ahead_plans_now():
    inputs = the_open()
    plan, key = plan_for(inputs, None)
    assert plan == fresh(inputs) and key == pool_key(plan)


def test_the_plan_made_ahead_is_for_the_sandbox_s_session_not_the_last():
    planned = plan_ahead(LAST, session=SID, scratch=SCRATCH, policy=POLICY)
    assert planned.inputs.session == SID and planned.inputs.paths.scratch == SCRATCH
    assert msgspec.structs.replace(planned.inputs.paths, scratch=LAST.paths.scratch) == LAST.paths


def test_the_bytes_a_sandbox_is_made_with_are_the_plan_s_encoding():
    planned = plan_ahead(LAST, session=SID, scratch=SCRATCH, policy=POLICY)
    assert planned.encoded == encode_plan(planned.plan)
    assert decode_plan(planned.encoded) == planned.plan
