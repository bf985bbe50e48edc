"""The one "is this path inside that one" test (dispatchd.inside)."""

from __future__ import annotations

import pytest

from dispatchd.inside import Tops, is_below, is_within, overlap, worktrees_relate


@pytest.mark.parametrize(("path", "top", "within", "below"), [
    ("/a/b", "/a/b", True, False),
    ("/a/b/c", "/a/b", True, True),
    ("/a/b/c", "/a/b/", True, True),  # a trailing "/" on the top changes nothing
    ("/a/bc", "/a/b", False, False),  # the prefix trap: a component is never matched in part
    ("/a/b.d", "/a/b", False, False),
    ("/a", "/a/b", False, False),
    ("/", "/", True, False),
    ("/x", "/", True, True),  # the root's prefix is "/", not "//"
    ("/a/b/", "/a/b", True, True),  # lexical: the path is not normalised
    (".git/modules/x", ".git/modules", True, True),  # relative paths compare the same way
    (".git/modulesx", ".git/modules", False, False),
])
def test_within_and_below(path: str, top: str, within: bool, below: bool) -> None:
    assert is_within(path, top) is within
    assert is_below(path, top) is below


def test_overlap_is_either_way() -> None:
    assert overlap("/a/b", "/a/b/c") and overlap("/a/b/c", "/a/b") and overlap("/a", "/a")
    assert not overlap("/a/b", "/a/bc") and not overlap("/a/bc", "/a/b")


@pytest.mark.parametrize(("a", "b", "related"), [
    (("/w/a", ""), ("/w/a/b", ""), True),  # one inside the other
    (("/w/a", "/r/.git"), ("/v/b", "/r/.git"), True),  # linked worktrees of one repository
    (("/x", ""), ("/w", "/x/r/.git"), True),  # a worktree holding another's repository
    (("/x/r/.git/y", ""), ("/w", "/x/r/.git"), True),
    (("/x", "/x/.git"), ("/w", "/y/r/.git"), False),  # the twins: siblings, other repositories
    (("/x", ""), ("/w", ""), False),
    (("/x", ""), ("/w", "/xr/.git"), False),  # the prefix trap
])
def test_worktrees_relate_either_way(a: tuple[str, str], b: tuple[str, str], related: bool) -> None:
    assert worktrees_relate(*a, *b) is related and worktrees_relate(*b, *a) is related


def test_tops_holds_below_is_any_is_below() -> None:
    paths = ["/", "/a", "/a/", "/a/b", "/a/b/", "/a/bc", "/a/b/c", "/x", "/x/a/b", ".git", ".git/modules",
             ".git/modules/x", "", "/a//b", "//a"]
    for n in range(len(paths) + 1):
        tops = paths[:n] + paths[n + 1:] if n % 2 else paths[n:]
        found = Tops(tops)
        for path in paths:
            assert found.holds_below(path) is any(is_below(path, t) for t in tops), (path, tops)


def test_outermost_keeps_each_path_not_within_another_shallowest_first() -> None:
    from dispatchd.inside import outermost

    found = ["a/b/c", "b", "a/b", "ab/c", "a/bc", ".git/hooks/x", ".git/hooks", "a/b", "c/d"]
    assert outermost(found) == ["b", ".git/hooks", "a/b", "a/bc", "ab/c", "c/d"]
    assert outermost([]) == []

