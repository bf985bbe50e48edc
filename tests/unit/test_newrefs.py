"""New remote-tracking refs, notes and stash a session made, taken out at
the end (``gitguard/newrefs.py``): a handful each kept under its own name,
exactly as ever; past ``MAX_KEPT``, one kept a distinct value, the rest
taken out and counted, in one rewrite of ``packed-refs`` and as many
fsynced writes as refs kept, however many the session made."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import newrefs, objectstore, refsback, replacerefs, reftemp
from tests.unit.gitrepo import commits_repo, git

pytestmark = pytest.mark.process

WHY = "made by a session where your git takes it for the upstream's, for notes or for a stash"
STAMP = "20250101T000000"


class Work:
    """What an end wrote: the displaced refs, the fsyncs, the rewrites of ``packed-refs``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.refs: list[str] = []
        self.fsyncs = 0
        self.rewrites = 0
        write_ref, fsync, drop_packed = reftemp.write_ref, os.fsync, replacerefs.drop_packed

        def counted_ref(common: str, name: str, value: str) -> None:
            self.refs.append(name)
            write_ref(common, name, value)

        def counted_fsync(fd: int) -> None:
            self.fsyncs += 1
            fsync(fd)

        def counted_drop(common: str, drop: set[bytes], what: str = "") -> str:
            self.rewrites += 1
            return drop_packed(common, drop, what)
        monkeypatch.setattr(reftemp, "write_ref", counted_ref)
        monkeypatch.setattr(os, "fsync", counted_fsync)
        monkeypatch.setattr(replacerefs, "drop_packed", counted_drop)


def _repo(tmp_path: Path) -> tuple[str, dict[str, str], list[str]]:
    """A repository's git directory, its refs at the baseline, and the ids
    of its three commits, newest first."""
    repo = commits_repo(tmp_path / "repo")
    ids = git(repo, "rev-list", "HEAD").split()
    return str(repo / ".git"), refsback.read_refs(str(repo / ".git")), ids


def _pack(common: str, refs: dict[str, str]) -> None:
    """``refs`` appended to ``packed-refs`` as a session's ``printf`` does (no header: unsorted)."""
    with open(os.path.join(common, "packed-refs"), "a") as f:
        f.writelines(f"{value} {name}\n" for name, value in refs.items())


def _loose(common: str, name: str, value: str) -> None:
    os.makedirs(os.path.dirname(os.path.join(common, name)), exist_ok=True)
    with open(os.path.join(common, name), "w") as f:
        f.write(value + "\n")


def _end(common: str, baseline: dict[str, str]) -> tuple[list[tuple[str, str]], list[str]]:
    now = refsback.read_refs(common)
    store = objectstore.finder(os.path.join(common, "objects"), [])
    return newrefs.clear(common, now, baseline, STAMP, store, {})


def _kept(common: str) -> dict[str, str]:
    return refsback.read_refs(common, (reftemp.DISPLACED,))


def _taken(name: str) -> tuple[str, str]:
    return name, f"{WHY}; taken out (its value kept as {reftemp.DISPLACED}{STAMP}/{name})"


def test_a_few_new_refs_are_each_kept_under_their_own_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The usual case: packed and loose, two of one value, each kept as
    ``refs/dispatchd/displaced/TIME/NAME`` and named in the report."""
    common, baseline, ids = _repo(tmp_path)
    _pack(common, {"refs/remotes/o/a": ids[0], "refs/remotes/o/b": ids[0]})
    _loose(common, "refs/notes/commits", ids[1])
    _loose(common, "refs/stash", ids[2])
    work = Work(monkeypatch)
    done, failed = _end(common, baseline)
    names = ["refs/notes/commits", "refs/remotes/o/a", "refs/remotes/o/b", "refs/stash"]
    assert failed == [] and done == [_taken(name) for name in names]
    assert _kept(common) == {f"{reftemp.DISPLACED}{STAMP}/{name}": value
                             for name, value in zip(names, [ids[1], ids[0], ids[0], ids[2]])}
    assert refsback.read_refs(common) == baseline | _kept(common)  # the new ones gone, nothing else moved
    assert work.refs == [f"{reftemp.DISPLACED}{STAMP}/{name}" for name in names]
    assert work.rewrites == 1 and work.fsyncs == len(names) + 2  # a ref each; the records kept beside, packed-refs


def test_past_the_bound_one_ref_a_value_is_kept_and_the_rest_counted(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound shrunk to 4: 30 new packed refs and 2 loose ones naming 3
    commits keep 3 refs, the first of each value; all 32 are taken out."""
    monkeypatch.setattr(newrefs, "MAX_KEPT", 4)
    common, baseline, ids = _repo(tmp_path)
    made = {f"refs/remotes/o/r{i:02d}": ids[i % 3] for i in range(30)}
    _pack(common, made)
    for name in ("refs/remotes/o/r30", "refs/remotes/o/r31"):
        made[name] = ids[0]
        _loose(common, name, ids[0])
    work = Work(monkeypatch)
    done, failed = _end(common, baseline)
    first = ["refs/remotes/o/r00", "refs/remotes/o/r01", "refs/remotes/o/r02"]
    rest = sorted(set(made) - set(first))
    assert failed == [] and done == [_taken(name) for name in first] + [(rest[0], (
        f"{WHY}; 29 such refs taken out without their values kept (refs/remotes/o/r03, refs/remotes/o/r04, "
        f"refs/remotes/o/r05, ...): past the 4 an end keeps, one a value; 29 of them held a value kept under another "
        f"name"))]
    assert _kept(common) == {f"{reftemp.DISPLACED}{STAMP}/{name}": made[name] for name in first}
    assert refsback.read_refs(common) == baseline | _kept(common)
    assert not os.path.lexists(os.path.join(common, "refs/remotes/o/r31"))
    assert work.refs == [f"{reftemp.DISPLACED}{STAMP}/{name}" for name in first]
    assert work.rewrites == 1 and work.fsyncs == 3 + 2


def test_past_the_bound_at_most_max_kept_values_are_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound shrunk to 4: 10 new refs of 10 commits keep the first 4."""
    monkeypatch.setattr(newrefs, "MAX_KEPT", 4)
    common, baseline, ids = _repo(tmp_path)
    tree = git(Path(common), "rev-parse", f"{ids[0]}^{{tree}}").strip()
    commits = [git(Path(common), "commit-tree", tree, "-p", ids[0], "-m", str(i), stdin="").strip() for i in range(10)]
    made = {f"refs/notes/n{i}": commit for i, commit in enumerate(commits)}
    _pack(common, made)
    work = Work(monkeypatch)
    done, failed = _end(common, baseline)
    first = [f"refs/notes/n{i}" for i in range(4)]
    assert failed == [] and done == [_taken(name) for name in first] + [("refs/notes/n4", (
        f"{WHY}; 6 such refs taken out without their values kept (refs/notes/n4, refs/notes/n5, refs/notes/n6, ...): "
        f"past the 4 an end keeps, one a value; 0 of them held a value kept under another name"))]
    assert _kept(common) == {f"{reftemp.DISPLACED}{STAMP}/{name}": made[name] for name in first}
    assert refsback.read_refs(common) == baseline | _kept(common)
    assert work.rewrites == 1 and len(work.refs) == 4


def test_thousands_of_new_packed_refs_cost_one_rewrite_and_one_kept_ref(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """At the real bound: 3,000 packed lines at HEAD's id (a session's
    ``printf`` loop) were 3,000 fsynced refs of ours, left in the user's
    repository; now one ref keeps the commit, and one rewrite takes them out."""
    common, baseline, ids = _repo(tmp_path)
    n = 3000
    assert n > newrefs.MAX_KEPT
    _pack(common, {f"refs/remotes/o/r{i:06d}": ids[0] for i in range(n)})
    work = Work(monkeypatch)
    done, failed = _end(common, baseline)
    assert failed == [] and len(done) == 2 and done[0] == _taken("refs/remotes/o/r000000")
    assert done[1][1].startswith(f"{WHY}; {n - 1} such refs taken out without their values kept")
    assert done[1][1].endswith(f"{n - 1} of them held a value kept under another name")
    assert _kept(common) == {f"{reftemp.DISPLACED}{STAMP}/refs/remotes/o/r000000": ids[0]}
    assert refsback.read_refs(common) == baseline | _kept(common)
    assert work.rewrites == 1 and work.fsyncs == 1 + 2
