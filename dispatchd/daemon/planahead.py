"""A session's plan made ahead with its sandbox, used only when equal by content.

``plan_session`` is pure: the same inputs give the same plan. The pool's
thread plans the session id S of the sandbox it is about to make as if its
session were the last one opened of that kind (same policy, worktree, git
layout, extra paths, ports, git identity), makes the sandbox with that plan
(it applies only its shared part, ``pool_key``), and keeps the inputs, the
plan and its key with the sandbox. The open that takes the sandbox builds its
inputs as always (the policy re-read, the worktree checked, git inspected,
the identity read) and uses the kept plan only when those inputs are equal
to the kept ones, field by field (``==`` of the structs and dicts, by
content); otherwise it plans then, as without this module.

Guarantees:
- a plan used at open is the plan ``plan_session`` returns for that open's
  inputs (an edited policy, another worktree, a changed git layout or
  identity: planned afresh);
- a plan made ahead goes with one sandbox and serves at most its session;
- nothing here reads the filesystem or runs on the open's path but the
  comparison (a few µs against ~0.5 ms of planning, measured in the daemon).
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from dispatchd.confine.cgroups import Delegation
from dispatchd.confine.netstack import NetworkPorts
from dispatchd.confine.plan import SessionPaths, SessionPlan, encode_plan, plan_session, pool_key
from dispatchd.kernel import KernelFeatures
from dispatchd.netmodes import NetworkMode
from dispatchd.policy import Policy

__all__ = ["PlanInputs", "Planned", "make_plan", "plan_ahead", "plan_for"]


class PlanInputs(NamedTuple):
    """Every argument of ``plan_session``: equal inputs, equal plans."""

    session: str
    policy: Policy
    network: NetworkMode
    paths: SessionPaths
    ports: NetworkPorts
    git_identity: dict[str, str]
    kernel: KernelFeatures
    uid: int
    gid: int
    base_env: dict[str, str]
    delegation: Delegation
    host_tree: bool
    dns_door: bool = False


class Planned(NamedTuple):
    """A plan made ahead: the inputs it was made of, the plan, its pool key."""

    inputs: PlanInputs
    plan: SessionPlan
    key: bytes | None
    encoded: bytes  # encode_plan(plan): the sandbox is made with it (SpawnWorker) and given it at adoption


def make_plan(i: PlanInputs) -> SessionPlan:
    return plan_session(i.policy, i.kernel, session=i.session, paths=i.paths, network=i.network, uid=i.uid,
                        gid=i.gid, base_env=i.base_env, ports=i.ports, delegation=i.delegation,
                        git_identity=i.git_identity, host_tree=i.host_tree, dns_door=i.dns_door)


def plan_ahead(last: PlanInputs, *, session: str, scratch: str, policy: Policy) -> Planned:
    """The plan of session ``session`` (scratch ``scratch``) if it opens as
    ``last`` did, with ``policy`` as it reads now. Raises what
    ``plan_session`` raises."""
    inputs = last._replace(session=session, policy=policy,
                           paths=msgspec.structs.replace(last.paths, scratch=scratch))
    plan = make_plan(inputs)
    return Planned(inputs, plan, pool_key(plan), encode_plan(plan))


def plan_for(inputs: PlanInputs, planned: Planned | None) -> tuple[SessionPlan, bytes | None]:
    """The plan of ``inputs`` and its pool key: ``planned``'s when made of
    equal inputs, else made now."""
    if planned is not None and planned.inputs == inputs:
        return planned.plan, planned.key
    plan = make_plan(inputs)
    return plan, pool_key(plan)
