"""``subtree.plan_kill``: which processes the fork server ends, from a fake tree."""

from __future__ import annotations

import pytest

from dispatchd.worker import subtree
from dispatchd.worker.subtree import plan_kill

ROOT = 100


def test_every_live_descendant_of_a_child_not_spared_is_killed_deepest_first() -> None:
    # 200: a session's first process (spared), with its own processes;
    # 300: a stopped stack's child, with a chain below it.
    children = {ROOT: [200, 300], 200: [201], 300: [301, 310], 301: [302], 302: [303]}
    pairs = plan_kill(ROOT, {200}, children, set())
    planned = [pid for pid, _ in pairs]
    assert sorted(planned) == [300, 301, 302, 303, 310]
    parent = {child: pid for pid, kids in children.items() for child in kids}
    assert all(p == parent[pid] for pid, p in pairs)
    assert all(planned.index(pid) < planned.index(parent[pid]) for pid in planned if parent[pid] != ROOT)
    assert planned[:2] == [303, 302] and planned[-1] == 300


def test_nothing_is_planned_when_only_spared_children_are_there() -> None:
    children = {ROOT: [200, 210], 200: [201, 202], 210: [211]}
    assert plan_kill(ROOT, {200, 210}, children, set()) == []
    # The allowed twin: the same tree with 210 no longer spared (its stack stopped).
    assert plan_kill(ROOT, {200}, children, set()) == [(211, 210), (210, ROOT)]


def test_a_zombie_is_not_killed_but_what_is_below_a_live_one_is() -> None:
    children = {ROOT: [300, 400], 300: [301], 301: [302], 400: []}
    assert plan_kill(ROOT, set(), children, {400, 302}) == [(301, 300), (300, ROOT)]


def test_a_pid_listed_twice_or_the_root_listed_below_is_planned_once() -> None:
    # Read while the tree changed: 302 moved from 301 to the root, and a
    # stale listing names the root below a child.
    children = {ROOT: [300, 302], 300: [301, ROOT], 301: [302]}
    planned = [pid for pid, _ in plan_kill(ROOT, set(), children, set())]
    assert sorted(planned) == [300, 301, 302] and planned.index(301) < planned.index(300)


def test_a_chain_is_confirmed_with_one_read_a_link_whatever_its_depth(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every link of a chain of 2,000 below the root is confirmed with one
    read of its parent (each kill read the whole chain again before: 2
    million reads, 53 s, while every open waited for the fork server)."""
    chain = list(range(1000, 3000))
    children = {ROOT: [chain[0]], **{a: [b] for a, b in zip(chain, chain[1:])}}
    parent = {b: a for a, kids in children.items() for b in kids}
    reads: list[int] = []

    def read(pid: int) -> int | None:
        reads.append(pid)
        return parent.get(pid)
    monkeypatch.setattr(subtree, "_parent", read)
    plan = plan_kill(ROOT, set(), children, set())
    assert subtree._confirmed(ROOT, set(), plan) == set(plan)
    assert len(reads) == len(chain)


def test_a_link_whose_parent_changed_is_not_confirmed_nor_what_is_below_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The twin: 301's pid now names a process under another parent (reused,
    or moved): neither it nor the links planned below it are signalled;
    a child of the root that is spared never is."""
    children = {ROOT: [200, 300], 200: [201], 300: [301], 301: [302]}
    now = {200: ROOT, 201: 200, 300: ROOT, 301: 999, 302: 301}
    monkeypatch.setattr(subtree, "_parent", lambda pid: now.get(pid))
    plan = plan_kill(ROOT, {200}, children, set())
    assert subtree._confirmed(ROOT, {200}, plan) == {(300, ROOT)}
