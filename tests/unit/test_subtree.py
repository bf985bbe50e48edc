"""``subtree.plan_kill``: which processes the fork server ends, from a fake tree."""

from __future__ import annotations

from dispatchd.worker.subtree import plan_kill

ROOT = 100


def test_every_live_descendant_of_a_child_not_spared_is_killed_deepest_first() -> None:
    # 200: a session's first process (spared), with its own processes;
    # 300: a stopped stack's child, with a chain below it.
    children = {ROOT: [200, 300], 200: [201], 300: [301, 310], 301: [302], 302: [303]}
    planned = plan_kill(ROOT, {200}, children, set())
    assert sorted(planned) == [300, 301, 302, 303, 310]
    parent = {child: pid for pid, kids in children.items() for child in kids}
    assert all(planned.index(pid) < planned.index(parent[pid]) for pid in planned if parent[pid] != ROOT)
    assert planned[:2] == [303, 302] and planned[-1] == 300


def test_nothing_is_planned_when_only_spared_children_are_there() -> None:
    children = {ROOT: [200, 210], 200: [201, 202], 210: [211]}
    assert plan_kill(ROOT, {200, 210}, children, set()) == []
    # The allowed twin: the same tree with 210 no longer spared (its stack stopped).
    assert plan_kill(ROOT, {200}, children, set()) == [211, 210]


def test_a_zombie_is_not_killed_but_what_is_below_a_live_one_is() -> None:
    children = {ROOT: [300, 400], 300: [301], 301: [302], 400: []}
    assert plan_kill(ROOT, set(), children, {400, 302}) == [301, 300]


def test_a_pid_listed_twice_or_the_root_listed_below_is_planned_once() -> None:
    # Read while the tree changed: 302 moved from 301 to the root, and a
    # stale listing names the root below a child.
    children = {ROOT: [300, 302], 300: [301, ROOT], 301: [302]}
    planned = plan_kill(ROOT, set(), children, set())
    assert sorted(planned) == [300, 301, 302] and planned.index(301) < planned.index(300)
