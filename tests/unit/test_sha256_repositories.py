"""A SHA-256 repository (``git init --object-format=sha256``) is checked at
the end as a SHA-1 one is: a session's commit and ``git gc`` are kept and
not reported (before, every branch a session moved was put back, as the
reader could not tell a fast-forward, and its new packs and commit-graph
went unverified), while a branch moved elsewhere, a pack naming the user's
objects at other bytes and a forged commit-graph are undone, each beside
its control showing the attack working on the user's git."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import derived, history, objectstore
from tests.unit.gitrepo import commits_repo, git
from tests.unit.test_git_end_attacks import _forge_commit_graph
from tests.unit.test_newpacks import _forge, _show
from tests.unit.test_replaced import _fsck, _kept

pytestmark = pytest.mark.process


def _repo(tmp_path: Path) -> Path:
    repo = commits_repo(tmp_path / "repo", object_format="sha256")
    assert len(git(repo, "rev-parse", "HEAD").strip()) == 64
    return repo


def _count(repo: Path) -> str:
    return git(repo, "rev-list", "--count", "HEAD").strip()


def test_a_session_s_commit_and_gc_are_kept(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    kept, _ = _kept(tmp_path, repo)
    (repo / "g").write_text("the session's\n")
    git(repo, "add", "g")
    git(repo, "commit", "-qm", "the session's commit")
    head = git(repo, "rev-parse", "HEAD").strip()
    git(repo, "gc", "-q")  # a pack, its commit-graph, the loose objects pruned
    assert (repo / ".git" / "objects" / "info" / "commit-graph").is_file()
    done, failed = history.restore(kept)  # the branch (no session's own here) moved forward: said, kept
    assert not failed and [(n, w[:39]) for n, w in done] == [("refs/heads/master", "moved forward while a session ran, kept")]
    assert git(repo, "rev-parse", "HEAD").strip() == head and _count(repo) == "4" and _fsck(repo) == 0


def test_a_branch_moved_to_another_history_is_put_back(tmp_path: Path) -> None:
    """The twin of the fast-forward: the reader tells the two apart."""
    repo = _repo(tmp_path)
    kept, _ = _kept(tmp_path, repo)
    branch = git(repo, "symbolic-ref", "HEAD").strip()
    old = git(repo, "rev-parse", "HEAD").strip()
    git(repo, "checkout", "-q", "--orphan", "other")
    git(repo, "commit", "-qm", "another history")
    git(repo, "update-ref", branch, "HEAD")
    git(repo, "checkout", "-q", branch)
    assert _count(repo) == "1"  # the control: the user's history is gone from the branch
    done, failed = history.restore(kept)
    assert not failed and [name for name, _ in done] == [branch], done
    assert "put back at" in done[0][1] and git(repo, "rev-parse", branch).strip() == old


def test_a_pack_naming_the_user_s_object_at_other_bytes_is_moved_aside(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    kept, _ = _kept(tmp_path, repo)
    victim = git(repo, "rev-parse", "HEAD:f").strip()
    other = git(repo, "rev-parse", "HEAD~1:f").strip()
    original = _show(repo, victim)
    forged = _forge(repo, victim, other, "pack-" + "f" * 64)
    assert _show(repo, victim) != original  # the attack works on the user's git
    done, failed = history.restore(kept)
    assert not failed and any("names your objects for other bytes" in why for _, why in done), done
    assert not forged.exists() and _show(repo, victim) == original and _fsck(repo) == 0


def test_a_forged_commit_graph_is_moved_aside(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    kept, _ = _kept(tmp_path, repo)
    git(repo, "commit-graph", "write", "--reachable")
    _forge_commit_graph(repo)
    assert _count(repo) == "1"  # the control: HEAD has no parents, as the graph says
    done, failed = history.restore(kept)
    assert not failed and _count(repo) == "3"
    assert "disagrees with the object of commit" in done[0][1], done


def test_a_reverse_index_is_computed_as_git_writes_it(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    git(repo, "-c", "pack.writeReverseIndex=true", "repack", "-q", "-a", "-d")
    idx = next((repo / ".git" / "objects" / "pack").glob("*.idx"))
    assert derived.expected_rev(idx.read_bytes()) == idx.with_suffix(".rev").read_bytes()


@pytest.mark.parametrize("object_format,size", [("sha1", 20), ("sha256", 32)])
def test_a_pack_index_s_id_length_is_read_from_its_size(tmp_path: Path, object_format: str, size: int) -> None:
    repo = commits_repo(tmp_path / "repo", object_format=object_format)
    git(repo, "gc", "-q")
    pack_dir = repo / ".git" / "objects" / "pack"
    idx = next(pack_dir.glob("*.idx")).name
    names = objectstore.names_in_index(str(pack_dir), idx, 100)
    assert names is not None and len(names) == 9 and {len(n) for n in names} == {size}
    with (pack_dir / idx).open("rb") as f:
        listed = subprocess.run(["git", "show-index", f"--object-format={object_format}"], stdin=f,
                                capture_output=True, text=True, check=True).stdout
    assert sorted(n.hex() for n in names) == sorted(line.split()[1] for line in listed.splitlines())


def test_an_index_of_neither_size_is_not_read() -> None:
    count = 3
    sha1 = 8 + 256 * 4 + count * 28 + 40
    sha256 = 8 + 256 * 4 + count * 40 + 64
    assert objectstore.index_hash_size(sha1, count) == 20
    assert objectstore.index_hash_size(sha1 + 2 * 8, count) == 20  # large offsets: one per object but the first
    assert objectstore.index_hash_size(sha256, count) == 32
    for size in (sha1 - 1, sha1 + 3 * 8, sha256 - 1, sha256 + 3 * 8):
        with pytest.raises(ValueError, match="does not fit its count"):
            objectstore.index_hash_size(size, count)
