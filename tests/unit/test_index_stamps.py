"""An index the daemon cannot parse is compared by its bytes: read again at
a session's end only if its inode, size or ctime changed since the open's
look, and hashed, one walk's indexes together, up to a bound (a session's
thousands of sparse 4 GiB indexes were each hashed, for hours)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import digests, gitdirs, layouts, snapshots
from tests.unit.gitrepo import git

pytestmark = pytest.mark.process  # git makes the repository


def _repo(path: Path) -> Path:
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    (path / ".git" / "index").write_bytes(b"not an index git wrote" * 1000)  # the user's, unparsable
    time.sleep(gitdirs._SETTLE_NS / 1e9 * 2)  # written well before the look
    return path


def _take(repo: Path, before: snapshots.GitSnapshot | None = None) -> snapshots.GitSnapshot:
    return snapshots.take(str(repo), layouts.inspect_git(str(repo), uid=os.getuid()), before=before)


def _hashes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    real = digests.hash_fd

    def counted(fd: int, limit: int, budget: digests.Budget | None = None) -> str | None:
        sizes.append(os.fstat(fd).st_size)
        return real(fd, limit, budget)

    monkeypatch.setattr(gitdirs, "hash_fd", counted)
    return sizes


def test_an_unparsable_index_unchanged_since_the_look_is_not_read_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = _repo(tmp_path / "r")
    before = _take(repo)
    assert before.indexes[".git/index"].startswith("an index that cannot be parsed:")
    hashed = _hashes(monkeypatch)
    now = _take(repo, before)
    assert hashed == [] and now.indexes == before.indexes and snapshots.changes(before, now) == []
    # The twins: the same bytes written again (a new ctime) are read again and
    # still equal; other bytes differ.
    (repo / ".git" / "index").write_bytes((repo / ".git" / "index").read_bytes())
    again = _take(repo, before)
    assert hashed == [22000] and again.indexes == before.indexes
    (repo / ".git" / "index").write_bytes(b"a session's" * 2000)
    other = _take(repo, before)
    assert other.indexes != before.indexes and snapshots.changes(before, other) == [".git/index"]


def test_an_index_changed_just_before_the_look_is_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = _repo(tmp_path / "r")
    index = repo / ".git" / "index"
    index.write_bytes(b"not an index git wrote" * 1000)
    # The look 10 ms after that write, within the clock's tick, however loaded the machine.
    with monkeypatch.context() as m:
        m.setattr(gitdirs.time, "time_ns", lambda: os.stat(index).st_ctime_ns + 10_000_000)
        before = _take(repo)
    hashed = _hashes(monkeypatch)
    now = _take(repo, before)
    assert hashed == [22000] and now.indexes == before.indexes


def test_the_unparsable_indexes_of_one_look_are_hashed_up_to_a_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gitdirs, "_MAX_HASHED_INDEXES", 50_000)
    files = []
    for i in range(5):
        f = tmp_path / f"index{i}"
        f.write_bytes(bytes([i]) * 20_000)
        files.append(f)
    budget = digests.Budget(gitdirs._MAX_HASHED_INDEXES)
    found = [gitdirs._index_content(str(f), None, budget)[0] for f in files]
    # Two fit in 50,000 bytes; the rest are never equal (they go aside at an end).
    assert [v.startswith("an index that cannot be parsed:") for v in found] == [True, True, False, False, False]
    # The twin: within the bound, each is compared by its bytes, alike for alike.
    roomy = digests.Budget(10**9)
    assert [gitdirs._index_content(str(f), None, roomy)[0] for f in files] == \
        [gitdirs._index_content(str(f), None, digests.Budget(10**9))[0] for f in files]
    assert len({gitdirs._index_content(str(f), None, roomy)[0] for f in files}) == 5
