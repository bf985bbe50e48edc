"""gitguard.history at the sessions' end: a loose object file that git packed
while a session ran (``git gc``, the ``gc --auto`` after a commit) is not
put back, once its object is read back out of the pack and hashed to its
id; one deleted outright is, and so is one that a forged pack index names
without holding. Put back, git's own packing was reported as a session
deleting objects, and made loose again what git had just packed: its next
``gc --auto`` packed them again, and the next end put them back again."""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import history, objectstore
from tests.unit.gitrepo import git

pytestmark = pytest.mark.process  # git makes and packs the repositories


def _repo(path: Path, files: int = 12) -> Path:
    path.mkdir()
    git(path, "init", "-q")
    for i in range(files):
        (path / f"f{i}.txt").write_text(f"file {i}\n" * (i + 1))
    git(path, "add", ".")
    git(path, "commit", "-qm", "files")
    return path


def _loose(objects: Path) -> set[str]:
    return {f"{d.name}/{f.name}" for d in objects.iterdir() if len(d.name) == 2 for f in d.iterdir()}


def test_objects_git_packed_meanwhile_are_not_put_back(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    objects = repo / ".git" / "objects"
    before = _loose(objects)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    git(repo, "gc", "-q", "--prune=now")  # as a session's git would: packed, the loose copies removed
    assert _loose(objects) == set()
    done, failed = history.restore(kept)
    assert (done, failed) == ([], [])  # nothing reported as deleted by a session
    assert _loose(objects) == set()  # and nothing made loose again
    git(repo, "fsck", "--strict")
    assert history.packed_meanwhile(str(objects), sorted(before)) == before


def test_objects_deleted_are_put_back(tmp_path: Path) -> None:
    """The twin: the same files removed without a pack holding them."""
    repo = _repo(tmp_path / "repo")
    objects = repo / ".git" / "objects"
    before = _loose(objects)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    for rel in before:
        os.unlink(objects / rel)
    done, failed = history.restore(kept)
    assert failed == []
    assert done == [(str(objects), f"{len(before)} object files deleted by a session put back")]
    assert _loose(objects) == before
    git(repo, "fsck", "--strict")


def test_past_the_budget_the_rest_are_put_back_unread(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    objects = repo / ".git" / "objects"
    before = _loose(objects)
    history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    git(repo, "gc", "-q", "--prune=now")
    assert history.packed_meanwhile(str(objects), sorted(before), budget_s=0.0) == set()
    assert history.packed_meanwhile(str(objects), sorted(before), budget_s=60.0) == before


def _forged_index(pack_dir: Path, names: list[bytes]) -> None:
    """A version 2 pack index naming ``names``, each at the offset of the
    first object of an existing pack (which holds another object): what a
    session would write to make deleted objects look packed."""
    real = next(p for p in pack_dir.iterdir() if p.suffix == ".pack")
    names = sorted(names)
    fanout = [sum(1 for n in names if n[0] <= i) for i in range(256)]
    body = b"\377tOc" + struct.pack(">I", 2) + struct.pack(">256I", *fanout)
    body += b"".join(names) + struct.pack(f">{len(names)}I", *([0] * len(names)))
    body += struct.pack(f">{len(names)}I", *([12] * len(names)))  # just past the pack's 12-byte header
    body += hashlib.sha1(real.read_bytes()).digest()
    body += hashlib.sha1(body).digest()
    forged = pack_dir / "pack-forged"
    (pack_dir / "pack-forged.idx").write_bytes(body)
    forged.with_suffix(".pack").write_bytes(real.read_bytes())


def test_a_forged_pack_index_naming_deleted_objects_does_not_keep_them_from_being_put_back(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    objects = repo / ".git" / "objects"
    git(repo, "gc", "-q")  # a real pack to point into; then new loose objects, kept
    (repo / "new.txt").write_text("new\n")
    git(repo, "add", "new.txt")
    git(repo, "commit", "-qm", "new")
    loose = _loose(objects)
    assert loose
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    for rel in loose:
        os.unlink(objects / rel)
    _forged_index(objects / "pack", [bytes.fromhex(rel.replace("/", "")) for rel in loose])
    assert history.packed_meanwhile(str(objects), sorted(loose)) == set()
    done, failed = history.restore(kept)
    assert failed == [] and done == [(str(objects), f"{len(loose)} object files deleted by a session put back")]
    assert _loose(objects) == loose


def test_the_store_reads_a_packed_object_back_to_its_id(tmp_path: Path) -> None:
    """``Store.packed``: yes for each object git packed (deltas among them:
    the same file grown commit after commit), no for an id no pack holds,
    and no for a malformed id."""
    repo = _repo(tmp_path / "repo", files=1)
    for i in range(6):  # one file grown: git stores later versions as deltas
        (repo / "f0.txt").write_text("".join(f"line {j} of a file grown\n" for j in range(40 * (i + 2))))
        git(repo, "commit", "-qam", f"grow {i}")
    ids = git(repo, "rev-list", "--objects", "--all").split()
    oids = [bytes.fromhex(x) for x in ids if len(x) == 40]
    git(repo, "gc", "-q", "--aggressive", "--prune=now")
    store = objectstore.Store(str(repo / ".git" / "objects"), cache_bytes=1 << 20)
    assert all(store.packed(oid) for oid in oids)
    absent = hashlib.sha1(b"blob 7\0absent\n").digest()
    assert not store.packed(absent)
    assert not store.packed(b"\x01" * 19)

