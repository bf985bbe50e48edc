"""What a session can leave in ``.git`` to defeat the end's restore, each
beside the user's git showing the attack working (the control) and the
restore undoing it (dispatchd/daemon/gitguard/shown.py and the modules it
runs). The repositories are real; the session's deeds are done with git
and the shell as a session would."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import hangs, history
from tests.unit.gitrepo import commits_repo, git

pytestmark = pytest.mark.process


def _run(repo: Path, *args: str, seconds: int = 10) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["timeout", str(seconds), "git", *args], cwd=repo, capture_output=True, timeout=60)


def _show(repo: Path) -> bytes:
    return _run(repo, "show", "HEAD:f").stdout


def _start(tmp_path: Path) -> tuple[Path, history.History]:
    repo = commits_repo(tmp_path / "repo")
    return repo, history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])


def _evil_loose(blob: str) -> bytes:
    return zlib.compress(b"blob 5\0evil\n")  # under the user's blob's name: git does not check on read


def test_a_symlinked_fanout_directory_is_moved_aside_and_the_objects_put_back(tmp_path: Path) -> None:
    repo, kept = _start(tmp_path)
    blob = git(repo, "rev-parse", "HEAD:f").strip()
    objects = repo / ".git" / "objects"
    copy = tmp_path / "x"
    shutil.copytree(objects / blob[:2], copy)  # new inodes: the keep's hard links are not touched
    os.chmod(copy / blob[2:], 0o644)
    (copy / blob[2:]).write_bytes(_evil_loose(blob))
    shutil.rmtree(objects / blob[:2])
    (objects / blob[:2]).symlink_to(copy)
    assert _show(repo) == b"evil\n"  # the control
    done, failed = history.restore(kept)
    assert not failed and _show(repo) == b"2\n" and not (objects / blob[:2]).is_symlink()


def test_a_symlinked_pack_directory_is_moved_aside(tmp_path: Path) -> None:
    repo, kept = _start(tmp_path)
    git(repo, "gc", "-q")
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    objects = repo / ".git" / "objects"
    shutil.copytree(objects / "pack", tmp_path / "p")
    shutil.rmtree(objects / "pack")
    for p in (tmp_path / "p").iterdir():
        os.chmod(p, 0o644)
        if p.suffix == ".pack":
            p.write_bytes(p.read_bytes()[:40])
    (objects / "pack").symlink_to(tmp_path / "p")
    assert _show(repo) != b"2\n"  # the control: unreadable
    done, failed = history.restore(kept)
    assert not failed and _show(repo) == b"2\n"


@pytest.mark.parametrize("rel", ["refs/heads/zz", "objects/info/commit-graph", "objects/pack/multi-pack-index"])
def test_a_symlink_to_a_fifo_where_git_reads_is_moved_aside(tmp_path: Path, rel: str) -> None:
    repo, kept = _start(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    path = repo / ".git" / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(fifo)
    assert _run(repo, "log", "--all", seconds=1).returncode == 124  # the control: git hangs
    done, failed = history.restore(kept)
    assert not failed and not os.path.lexists(path) and _run(repo, "log", "--all").returncode == 0


def test_long_names_are_moved_aside_too(tmp_path: Path) -> None:
    repo, kept = _start(tmp_path)
    blob = git(repo, "rev-parse", "HEAD:f").strip()
    evil = git(repo, "hash-object", "-w", "--stdin", stdin="evil\n").strip()
    top = repo / ".git" / "refs" / "replace"
    top.mkdir()
    (top / (blob + "x" * 200)).write_text(evil + "\n")
    os.mkfifo(repo / ".git" / "refs" / "heads" / ("y" * 240))
    assert _show(repo) == b"evil\n"
    done, failed = history.restore(kept)
    assert not failed and _show(repo) == b"2\n" and _run(repo, "log", "--all").returncode == 0


def test_read_only_directories_do_not_keep_what_the_end_takes_out(tmp_path: Path) -> None:
    """``chmod 555`` on ``.git``, ``refs`` and ``objects/info`` after the
    plants, ``refs/tags`` removed: each step still runs."""
    repo, kept = _start(tmp_path)
    blob = git(repo, "rev-parse", "HEAD:f").strip()
    evil = git(repo, "hash-object", "-w", "--stdin", stdin="evil\n").strip()
    git(repo, "replace", blob, evil)
    git(repo, "pack-refs", "--all")
    common = repo / ".git"
    (common / "shallow").write_text(git(repo, "rev-parse", "HEAD"))
    (common / "refs" / "tags").rmdir()
    for d in ("refs", "objects/info", ""):
        os.chmod(common / d, 0o555)
    assert _show(repo) == b"evil\n" and _run(repo, "rev-list", "--count", "HEAD").stdout == b"1\n"
    done, failed = history.restore(kept)
    assert not failed, failed
    assert _show(repo) == b"2\n" and _run(repo, "rev-list", "--count", "HEAD").stdout == b"3\n"


def test_an_unsearchable_objects_info_does_not_hide_a_planted_alternates(tmp_path: Path) -> None:
    repo, kept = _start(tmp_path)
    info = repo / ".git" / "objects" / "info"
    info.mkdir(exist_ok=True)
    (info / "alternates").write_text(str(tmp_path / "elsewhere") + "\n")
    os.chmod(info, 0)
    done, failed = history.restore(kept)
    assert not failed and not (info / "alternates").exists()
    assert any("gone, the session's moved aside" in why for _, why in done), done


def _forge_commit_graph(repo: Path) -> None:
    """HEAD given no parents in the commit-graph (git trusts it)."""
    path = repo / ".git" / "objects" / "info" / "commit-graph"
    b = bytearray(path.read_bytes())
    chunks = {struct.unpack(">4sQ", b[8 + 12 * i: 20 + 12 * i])[0]: struct.unpack(">4sQ", b[8 + 12 * i: 20 + 12 * i])[1]
              for i in range(b[6])}
    head = bytes.fromhex(git(repo, "rev-parse", "HEAD").strip())
    h = len(head)  # SHA-1 or SHA-256
    n = struct.unpack(">I", b[chunks[b"OIDF"] + 255 * 4: chunks[b"OIDF"] + 256 * 4])[0]
    idx = [bytes(b[chunks[b"OIDL"] + h * i: chunks[b"OIDL"] + h * i + h]) for i in range(n)].index(head)
    c = chunks[b"CDAT"] + (h + 16) * idx
    b[c + h:c + h + 4] = struct.pack(">I", 0x70000000)
    os.chmod(path, 0o644)
    path.write_bytes(bytes(b))


def test_a_commit_graph_a_session_wrote_is_moved_aside_and_the_user_s_stays(tmp_path: Path) -> None:
    repo = commits_repo(tmp_path / "repo")
    git(repo, "commit-graph", "write", "--reachable")
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    assert history.restore(kept) == ([], [])  # the twin: the user's, unchanged, stays
    _forge_commit_graph(repo)
    assert _run(repo, "rev-list", "--count", "HEAD").stdout == b"1\n"  # the control
    done, failed = history.restore(kept)
    assert not failed and _run(repo, "rev-list", "--count", "HEAD").stdout == b"3\n"
    assert "disagrees with the object of commit" in done[0][1] and "git builds it again" in done[0][1]


def test_a_commit_graph_git_wrote_in_a_session_is_kept(tmp_path: Path) -> None:
    """The twin of the forged graph: a session's commit and ``git gc`` write
    an honest one, which agrees with every commit's object."""
    repo = commits_repo(tmp_path / "repo")
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    (repo / "g").write_text("g\n")
    git(repo, "add", "g")
    git(repo, "commit", "-qm", "g")
    git(repo, "gc", "-q")
    graph = repo / ".git" / "objects" / "info" / "commit-graph"
    assert graph.is_file()
    done, failed = history.restore(kept)
    assert not failed and graph.is_file() and not [d for d in done if "commit-graph" in d[0]], done


def test_junk_at_the_top_does_not_hide_a_fifo_in_refs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo, kept = _start(tmp_path)
    monkeypatch.setattr(hangs, "_MAX_ENTRIES", 40)
    for n in range(50):
        (repo / ".git" / f"junk{n}").write_text("")
    os.mkfifo(repo / ".git" / "refs" / "heads" / "zz")
    done, failed = history.restore(kept)
    assert _run(repo, "log", "--all").returncode == 0
    assert failed == [f"{repo / '.git'}: more than 40 entries; the rest was not looked at for FIFOs"]


def test_a_step_that_raises_is_reported_and_the_next_still_runs(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    repo, kept = _start(tmp_path)
    blob = git(repo, "rev-parse", "HEAD:f").strip()
    git(repo, "replace", blob, git(repo, "hash-object", "-w", "--stdin", stdin="evil\n").strip())

    def broken(*args: object) -> None:
        raise RuntimeError("a bug")
    monkeypatch.setattr(hangs, "sweep", broken)
    done, failed = history.restore(kept)
    assert failed == [f"{repo / '.git'}: the check of hangs failed: RuntimeError: a bug"]
    assert _show(repo) == b"2\n"  # the replacement step ran all the same


def _graph(repo: Path) -> tuple[Path, bytearray, dict[bytes, int], int]:
    """The commit-graph, its bytes, its chunks, and HEAD's entry."""
    path = repo / ".git" / "objects" / "info" / "commit-graph"
    b = bytearray(path.read_bytes())
    chunks = {}
    for i in range(b[6] + 1):
        cid, off = struct.unpack_from(">4sQ", b, 8 + 12 * i)
        chunks[cid] = off
    head = bytes.fromhex(git(repo, "rev-parse", "HEAD").strip())
    n = struct.unpack_from(">I", b, chunks[b"OIDF"] + 255 * 4)[0]
    entry = [bytes(b[chunks[b"OIDL"] + 20 * k: chunks[b"OIDL"] + 20 * k + 20]) for k in range(n)].index(head)
    return path, b, chunks, entry


def _written(path: Path, b: bytearray) -> None:
    os.chmod(path, 0o644)
    path.write_bytes(bytes(b))


def _graphed(tmp_path: Path) -> tuple[Path, history.History]:
    repo = commits_repo(tmp_path / "repo")
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    git(repo, "commit-graph", "write", "--reachable")  # the session's
    return repo, kept


def _count(repo: Path) -> bytes:
    return _run(repo, "rev-list", "--count", "HEAD").stdout


def test_a_graph_read_as_git_reads_it_first_parent_none(tmp_path: Path) -> None:
    """git stops at a first parent "none", whatever the second says."""
    repo, kept = _graphed(tmp_path)
    path, b, chunks, entry = _graph(repo)
    at = chunks[b"CDAT"] + 36 * entry + 20
    p1, _ = struct.unpack_from(">II", b, at)
    struct.pack_into(">II", b, at, 0x70000000, p1)
    _written(path, b)
    assert _count(repo) == b"1\n"  # the control
    done, failed = history.restore(kept)
    assert not failed and _count(repo) == b"3\n" and "disagrees" in done[0][1]


def test_a_graph_s_generation_data_is_checked(tmp_path: Path) -> None:
    repo, kept = _graphed(tmp_path)
    path, b, chunks, entry = _graph(repo)
    gda = chunks.get(b"GDA2", chunks.get(b"GDAT"))
    at = chunks[b"CDAT"] + 36 * entry + 28
    if gda is not None:
        struct.pack_into(">I", b, gda + 4 * entry, 0)  # HEAD's corrected date: its own date
    struct.pack_into(">Q", b, at, (1 << 34) | (struct.unpack_from(">Q", b, at)[0] & ((1 << 34) - 1)))  # level 1
    _written(path, b)
    done, failed = history.restore(kept)
    assert not failed and any("is not what its parents give" in why for _, why in done), done


def _incremental_midx(repo: Path, layer: bytes) -> Path:
    """Git 2.47's incremental multi-pack index, as a newer git than this
    machine's writes it: a chain file naming its layers, each a ``.midx``
    that maps object ids to packs and offsets (read without the packs' ``.idx``)."""
    d = repo / ".git" / "objects" / "pack" / "multi-pack-index.d"
    d.mkdir(exist_ok=True)
    name = "a" * 40
    (d / f"multi-pack-index-{name}.midx").write_bytes(b"MIDX\1\1" + layer)
    (d / "multi-pack-index-chain").write_text(name + "\n")
    return d


def test_an_incremental_multi_pack_index_a_session_planted_is_moved_aside(tmp_path: Path) -> None:
    repo, kept = _start(tmp_path)
    d = _incremental_midx(repo, b"the session's offsets")
    done, failed = history.restore(kept)
    assert not failed and not d.exists(), done
    why = [w for p, w in done if p == str(d)]
    assert why and why[0].startswith("written by a session") and "git builds it again" in why[0]
    assert _show(repo) == b"2\n"


def test_the_user_s_incremental_multi_pack_index_stays_unless_a_session_rewrites_it(tmp_path: Path) -> None:
    repo = commits_repo(tmp_path / "repo")
    d = _incremental_midx(repo, b"the user's offsets")
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    assert history.restore(kept) == ([], [])  # the twin: the user's, unchanged, stays
    layer = d / f"multi-pack-index-{'a' * 40}.midx"
    os.chmod(layer, 0o644)
    with open(layer, "r+b") as f:  # rewritten in place: the same inode and size
        f.write(b"MIDX\1\1the session's")
    done, failed = history.restore(kept)
    assert not failed and not d.exists() and [p for p, _ in done] == [str(d)], done


def test_changed_path_filters_and_a_split_graph_are_moved_aside(tmp_path: Path) -> None:
    repo = commits_repo(tmp_path / "repo")
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    git(repo, "commit-graph", "write", "--reachable", "--changed-paths")
    done, failed = history.restore(kept)
    assert not failed and "changed-path filters" in done[0][1]
    git(repo, "commit-graph", "write", "--reachable", "--split")
    done, failed = history.restore(kept)
    info = repo / ".git" / "objects" / "info"
    assert not failed and not (info / "commit-graphs").exists() and _count(repo) == b"3\n", done


def test_a_graph_that_cannot_be_parsed_and_a_shallow_beside_it_both_go(tmp_path: Path) -> None:
    repo, kept = _start(tmp_path)
    info = repo / ".git" / "objects" / "info"
    info.mkdir(exist_ok=True)
    (info / "commit-graph").write_bytes(b"CGPH\x01\x01\x00\x00" + struct.pack(">4sQ", b"\0\0\0\0", 20) + b"\0" * 20)
    (repo / ".git" / "shallow").write_text(git(repo, "rev-parse", "HEAD"))
    done, failed = history.restore(kept)
    assert not failed and not (info / "commit-graph").exists() and _count(repo) == b"3\n", (done, failed)


def test_a_loose_object_with_a_size_of_thousands_of_digits_stops_nothing(tmp_path: Path) -> None:
    repo, kept = _start(tmp_path)
    blob = git(repo, "rev-parse", "HEAD:f").strip()
    path = repo / ".git" / "objects" / blob[:2] / blob[2:]
    (path.parent / "n").write_bytes(zlib.compress(b"blob " + b"1" * 5000 + b"\0"))
    os.rename(path.parent / "n", path)
    git(repo, "update-ref", "refs/heads/master", "HEAD~2")
    done, failed = history.restore(kept)
    assert not failed and _show(repo) == b"2\n" and _count(repo) == b"3\n"


def test_a_fifo_in_a_directory_the_session_made_unlistable_is_found(tmp_path: Path) -> None:
    repo, kept = _start(tmp_path)
    hidden = repo / ".git" / "refs" / "heads" / "h"
    hidden.mkdir()
    os.mkfifo(hidden / "b")
    os.chmod(hidden, 0o311)
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/h/b\n")  # git opens it by name, listed or not
    assert _run(repo, "log", seconds=1).returncode == 124  # the control
    done, failed = history.restore(kept)
    assert not failed and _run(repo, "log").returncode != 124 and not os.path.lexists(hidden / "b")


def test_a_symlinked_split_graph_directory_is_moved_aside_and_nothing_outside_changes(tmp_path: Path) -> None:
    repo, kept = _start(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "commit-graph-chain").write_text("x\n")
    os.chmod(outside, 0o755)
    (repo / ".git" / "objects" / "info" / "commit-graphs").symlink_to(outside)
    done, failed = history.restore(kept)
    assert not failed and sorted(os.listdir(outside)) == ["commit-graph-chain"]
    assert oct(outside.stat().st_mode & 0o777) == "0o755"
    assert not (repo / ".git" / "objects" / "info" / "commit-graphs").is_symlink()


def test_a_shared_clone_s_fast_forward_through_its_alternate_is_kept(tmp_path: Path) -> None:
    """The user's merge, during a session, of history their shared clone
    borrows from its source: the fast-forward is told through the alternates
    the user had (a branch of theirs was rewound when the look could not read
    the borrowed commits)."""
    src = commits_repo(tmp_path / "src")
    git(src, "checkout", "-qb", "feature")
    (src / "g").write_text("g\n")
    git(src, "add", "g")
    git(src, "commit", "-qm", "feature")
    git(src, "checkout", "-q", "master")
    repo = tmp_path / "repo"
    git(tmp_path, "clone", "-q", "--shared", str(src), str(repo))
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    (repo / "f").write_text("three\n")
    git(repo, "commit", "-qam", "three")
    git(repo, "merge", "-q", "--no-ff", "-m", "merge", "origin/feature")  # the user's, meanwhile
    before = git(repo, "rev-parse", "HEAD")
    done, failed = history.restore(kept)
    assert not failed and all(why.startswith("moved forward while a session ran, kept") for _, why in done), done
    assert git(repo, "rev-parse", "HEAD") == before


def test_a_session_s_gc_over_a_multi_pack_index_is_not_reported_as_deleted_objects(tmp_path: Path) -> None:
    """The twin of a deletion: git's own repack drops the multi-pack index
    and its bitmap, which are put back (as every kept file is) unreported."""
    repo = commits_repo(tmp_path / "repo")
    git(repo, "repack", "-q", "-a", "-d", "--write-midx", "--write-bitmap-index")
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    (repo / "g").write_text("g\n")
    git(repo, "add", "g")
    git(repo, "commit", "-qm", "g")
    git(repo, "gc", "-q")
    done, failed = history.restore(kept)
    assert not failed and not [d for d in done if "deleted by a session" in d[1]], done
    assert _run(repo, "fsck", "--no-progress").returncode == 0
