"""A commit-graph is checked against the objects git reads, once they are
the user's again (``viewfiles.restore_stamped``, ``objectstore.Store.read``:
packs first, as git looks). A session that planted a commit of its own
where the check looked first (a loose file at a packed commit's id, which
git never reads; or a loose commit replaced, which the end then puts back)
and wrote a graph agreeing with it had ``git log -p`` and ``git diff``
show the user a tree of its choosing after an end that reported nothing."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import history
from tests.unit.gitrepo import commits_repo, git

pytestmark = pytest.mark.process


def _diff(repo: Path) -> str:
    """What the user sees HEAD~1 change."""
    return subprocess.run(["git", "diff", "HEAD~2", "HEAD~1"], cwd=repo, capture_output=True, text=True,
                          timeout=30).stdout


def _graph(repo: Path, trees: dict[str, str]) -> bytes:
    """A version 1 SHA-1 commit-graph of every commit of HEAD, each with its
    tree, or the one ``trees`` gives it, its parents, level and date."""
    info = {}
    for c in git(repo, "rev-list", "HEAD").split():
        header = git(repo, "cat-file", "commit", c).split("\n\n", 1)[0].split("\n")
        parents = [line[7:] for line in header if line.startswith("parent ")]
        date = int(next(line for line in header if line.startswith("committer ")).rsplit(" ", 2)[-2])
        info[c] = (trees.get(c, header[0][5:]), parents, date)
    ids = sorted(info, key=bytes.fromhex)
    at = {c: i for i, c in enumerate(ids)}
    level: dict[str, int] = {}
    for c in reversed(git(repo, "rev-list", "--topo-order", "HEAD").split()):  # parents first
        level[c] = 1 + max((level[p] for p in info[c][1]), default=0)
    fanout = b"".join(struct.pack(">I", sum(1 for c in ids if int(c[:2], 16) <= i)) for i in range(256))
    cdat = b""
    for c in ids:
        tree, parents, date = info[c]
        p1 = at[parents[0]] if parents else 0x70000000
        p2 = at[parents[1]] if len(parents) > 1 else 0x70000000
        cdat += bytes.fromhex(tree) + struct.pack(">IIQ", p1, p2, (level[c] << 34) | date)
    chunks = [(b"OIDF", fanout), (b"OIDL", b"".join(bytes.fromhex(c) for c in ids)), (b"CDAT", cdat)]
    out = b"CGPH" + bytes([1, 1, len(chunks), 0])
    offset = len(out) + 12 * (len(chunks) + 1)
    for cid, data in chunks:
        out += cid + struct.pack(">Q", offset)
        offset += len(data)
    out += b"\0\0\0\0" + struct.pack(">Q", offset) + b"".join(data for _, data in chunks)
    return out + hashlib.sha1(out).digest()


def _forge(repo: Path) -> str:
    """HEAD~1 given a tree of the session's: a commit object saying so,
    loose at HEAD~1's own id, and a graph agreeing with it. The id."""
    target = git(repo, "rev-parse", "HEAD~1").strip()
    blob = git(repo, "hash-object", "-w", "--stdin", stdin="EVIL\n").strip()
    tree = git(repo, "mktree", stdin=f"100644 blob {blob}\tf\n").strip()
    lines = git(repo, "cat-file", "commit", target).split("\n")
    body = "\n".join([f"tree {tree}"] + lines[1:]).encode()
    path = repo / ".git" / "objects" / target[:2] / target[2:]
    path.parent.mkdir(exist_ok=True)
    planted = path.parent / "planted"
    planted.write_bytes(zlib.compress(b"commit %d\0" % len(body) + body))
    os.replace(planted, path)
    _write_graph(repo, _graph(repo, {target: tree}))
    return target


def _write_graph(repo: Path, data: bytes) -> Path:
    """Over git's own (read-only, as git writes it), renamed into place."""
    graph = repo / ".git" / "objects" / "info" / "commit-graph"
    graph.parent.mkdir(exist_ok=True)
    (graph.parent / "new-graph").write_bytes(data)
    os.replace(graph.parent / "new-graph", graph)
    return graph


@pytest.mark.parametrize("objects", ["packed", "loose"])
def test_a_graph_agreeing_with_a_planted_commit_is_moved_aside(tmp_path: Path, objects: str) -> None:
    """Packed: git reads the pack, never the loose file the session put at
    the commit's id. Loose: the session's file replaces the user's, and the
    end puts the user's back; the graph is checked after that."""
    repo = commits_repo(tmp_path / "repo")
    if objects == "packed":
        git(repo, "gc", "-q")
    real = _diff(repo)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    _forge(repo)
    assert "+EVIL" in _diff(repo)  # the control: the user's git shows the session's tree
    done, failed = history.restore(kept)
    assert not failed and any("commit-graph" in path and "disagrees with the object of commit" in why
                              for path, why in done), done
    assert _diff(repo) == real
    assert subprocess.run(["git", "fsck", "--no-progress"], cwd=repo, capture_output=True).returncode == 0
    # Packed: the planted loose file, which git fsck names, moved aside too (newloose.py).
    assert any("hash-path mismatch" in why for _, why in done) == (objects == "packed"), done


def test_an_honest_loose_copy_of_a_packed_object_stays(tmp_path: Path) -> None:
    """The twin of the planted file: a loose file holding the very object
    its name says (as ``git gc`` loosens unreachable ones) is left."""
    repo = commits_repo(tmp_path / "repo")
    git(repo, "gc", "-q")
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    target = git(repo, "rev-parse", "HEAD~1").strip()
    body = git(repo, "cat-file", "commit", target).encode()
    path = repo / ".git" / "objects" / target[:2] / target[2:]
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(zlib.compress(b"commit %d\0" % len(body) + body))
    assert history.restore(kept) == ([], []) and path.is_file()


def test_the_same_graph_of_the_user_s_own_trees_is_kept(tmp_path: Path) -> None:
    """The twin: the builder's graph with no tree changed agrees, and stays."""
    repo = commits_repo(tmp_path / "repo")
    git(repo, "gc", "-q")
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    graph = _write_graph(repo, _graph(repo, {}))
    done, failed = history.restore(kept)
    assert (done, failed) == ([], []) and graph.is_file()
