"""gitguard.history at the sessions' end: a loose object file that git packed
while a session ran (``git gc``, the ``gc --auto`` after a commit) is put
back as a loose copy like any other, but not reported as deleted by the
session (it was reported so, after every ``git gc`` an agent ran). Put
back all the same: a pack index can name objects its pack does not hold,
and a pack can be one git cannot read; a loose copy makes sure nothing is
lost, and git's next ``gc`` removes it. And the object store's reads of a
hostile ``objects`` directory: no symlink followed, no FIFO waited on, no
index read past its bound, no read past its time."""

from __future__ import annotations

import hashlib
import os
import re
import struct
from pathlib import Path

import msgspec
import pytest

from dispatchd.daemon.gitguard import clones, history, keeps, objectstore, packed, reflogs
from dispatchd.tools import native
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


_FANOUT = re.compile(r"[0-9a-f]{2}")  # git's loose object directories, written out here, not taken from the code


def _loose(objects: Path) -> set[str]:
    return {f"{d.name}/{f.name}" for d in objects.iterdir() if _FANOUT.fullmatch(d.name) for f in d.iterdir()}


_NOT_GITS = ("zz", "AB", "0g", "0:", "\u00e9a")


def _with_other_dirs(objects: Path) -> None:
    """Directories of names git reads no object from, each with a file named as an object would be."""
    for name in _NOT_GITS:
        (objects / name).mkdir()
        (objects / name / ("0" * 38)).write_text("not an object git reads")


@pytest.mark.parametrize("helper", ["C", "Python"])
def test_only_git_s_object_directories_are_kept_and_looked_at(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              helper: str) -> None:
    """Directories of other names a session makes in ``objects`` (git reads
    only ``ab``, lowercase, and ``pack``) are neither kept nor stamped: a
    session cannot have the daemon copy what it puts there, nor stat
    thousands of them at every open and close. The twin in the same
    record: git's loose objects are kept, each. By the C look and by the
    Python one."""
    if helper == "Python":
        monkeypatch.setattr(native, "lines", None)
    repo = _repo(tmp_path / "repo")
    objects = repo / ".git" / "objects"
    _with_other_dirs(objects)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    keep = Path(kept.keep)
    assert _loose(objects) and _loose(keep) == _loose(objects)
    others = {d.name for d in keep.iterdir() if not _FANOUT.fullmatch(d.name)}
    assert history._STAMPS in others and others <= {history._STAMPS, "pack", keeps.REPO, clones.OWN_MARK,
                                                    reflogs.COPIES, reflogs.INDEX}  # the reflogs' (reflogs.py)
    assert set(kept.stamps) == {d.name for d in objects.iterdir() if _FANOUT.fullmatch(d.name) or d.name == "pack"}
    assert not set(_NOT_GITS) & set(kept.stamps)


def test_an_older_daemon_s_stamps_of_other_names_are_not_listed_again(tmp_path: Path) -> None:
    """A keep whose stamps an older daemon wrote (naming ``zz`` too): the next
    record neither lists ``zz`` nor keeps what a session put there since.
    The twin: a fan-out directory of those stamps changed since is listed
    again, its new object kept."""
    repo = _repo(tmp_path / "repo")
    objects = repo / ".git" / "objects"
    _with_other_dirs(objects)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    stamps_file = Path(kept.keep) / history._STAMPS
    stamps, stamped_ns = msgspec.json.decode(stamps_file.read_bytes(), type=tuple[dict[str, int], int])
    stamps["zz"] = 1  # as an older daemon recorded it
    stamps_file.write_bytes(msgspec.json.encode((stamps, stamped_ns)))
    (objects / "zz" / ("1" * 38)).write_text("put there since")
    (tmp_path / "new.txt").write_text("a new object\n")
    new = git(repo, "hash-object", "-w", str(tmp_path / "new.txt")).strip()
    again = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    assert not (Path(again.keep) / "zz").exists()
    assert (Path(again.keep) / new[:2] / new[2:]).is_file()


def test_a_checkpoint_s_keep_leaves_other_names_out(tmp_path: Path) -> None:
    """``keep_more`` (a checkpoint's) keeps and lists git's object files only;
    the twin: a loose object is kept and listed."""
    repo = _repo(tmp_path / "repo")
    objects = repo / ".git" / "objects"
    _with_other_dirs(objects)
    fd = os.open(objects, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        present = history.keep_more(fd, str(tmp_path / "keep"), str(tmp_path / "repo" / ".git"), [1 << 30])
    finally:
        os.close(fd)
    assert present == _loose(objects) | {f"pack/{p.name}" for p in (objects / "pack").iterdir()}
    assert {p.name for p in (tmp_path / "keep").iterdir() if not _FANOUT.fullmatch(p.name)} <= {"pack", keeps.REPO}


def test_objects_git_packed_meanwhile_are_put_back_unreported(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo")
    objects = repo / ".git" / "objects"
    before = _loose(objects)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    git(repo, "gc", "-q", "--prune=now")  # as a session's git would: packed, the loose copies removed
    assert _loose(objects) == set()
    assert packed.packed_meanwhile(str(objects), sorted(before)) == before
    done, failed = history.restore(kept)
    assert (done, failed) == ([], [])  # nothing reported as deleted by a session
    assert _loose(objects) == before  # loose copies beside the pack
    git(repo, "fsck", "--strict")
    git(repo, "prune-packed")  # what git's next gc does with them
    assert _loose(objects) == set()


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


def test_a_forged_pack_index_loses_nothing(tmp_path: Path) -> None:
    """A session deletes loose objects and writes an index naming them
    beside a pack that does not hold them: they are put back all the same
    (the report leaves them out: the index says git packed them), and the
    forged pack is moved aside (newpacks.py: its objects do not hash to the
    ids it names)."""
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
    assert packed.packed_meanwhile(str(objects), sorted(loose)) == loose
    done, failed = history.restore(kept)
    assert failed == [] and _loose(objects) == loose
    assert not (objects / "pack" / "pack-forged.idx").exists() and not (objects / "pack" / "pack-forged.pack").exists()
    assert any("names your objects for other bytes" in why for _, why in done), done
    git(repo, "fsck", "--strict")


def test_the_indexes_name_what_git_packed_and_nothing_else(tmp_path: Path) -> None:
    repo = _repo(tmp_path / "repo", files=3)
    oids = [bytes.fromhex(x) for x in git(repo, "rev-list", "--objects", "--all").split() if len(x) == 40]
    objects = repo / ".git" / "objects"
    assert objectstore.indexed(str(objects), oids) == set()  # all loose: no pack yet
    git(repo, "gc", "-q")
    absent = hashlib.sha1(b"blob 7\0absent\n").digest()
    assert objectstore.indexed(str(objects), [*oids, absent, b"short"]) == set(oids)


def _fifo_instead_of(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def test_a_fifo_or_a_symlink_for_an_index_is_not_read(tmp_path: Path) -> None:
    """A FIFO planted for a pack index hung the read for good; a symlink to
    /dev/zero read until memory ran out. Neither is read now (the twin:
    the real index, above, is)."""
    repo = _repo(tmp_path / "repo", files=3)
    git(repo, "gc", "-q")
    oids = [bytes.fromhex(x) for x in git(repo, "rev-list", "--objects", "--all").split() if len(x) == 40]
    pack_dir = repo / ".git" / "objects" / "pack"
    idx = next(p for p in pack_dir.iterdir() if p.suffix == ".idx")
    saved = idx.read_bytes()
    _fifo_instead_of(idx)
    assert objectstore.indexed(str(repo / ".git" / "objects"), oids) == set()  # returned: not waiting on the FIFO
    idx.unlink()
    idx.symlink_to("/dev/zero")
    assert objectstore.indexed(str(repo / ".git" / "objects"), oids) == set()
    idx.unlink()
    idx.write_bytes(saved[:8 + 256 * 4 + 20])  # shorter than its count says
    assert objectstore.indexed(str(repo / ".git" / "objects"), oids) == set()
    idx.write_bytes(saved)
    assert objectstore.indexed(str(repo / ".git" / "objects"), oids) == set(oids)


def test_a_fifo_for_a_loose_object_and_a_spent_budget_answer_not_known(tmp_path: Path) -> None:
    """``is_ancestor`` reads commits: a FIFO where a loose commit should be
    is "not known" at once (it hung), and so is any read past the store's
    deadline; the twin, the real objects, answers."""
    repo = _repo(tmp_path / "repo", files=1)
    first = git(repo, "rev-parse", "HEAD").strip()
    (repo / "g.txt").write_text("g\n")
    git(repo, "add", "g.txt")
    git(repo, "commit", "-qm", "g")
    head = git(repo, "rev-parse", "HEAD").strip()
    objects = repo / ".git" / "objects"
    assert objectstore.is_ancestor(str(objects), first, head) is True
    store = objectstore.Store(str(objects), deadline=0.0)
    with pytest.raises(objectstore.OutOfTime):
        store.read(bytes.fromhex(head))
    _fifo_instead_of(objects / head[:2] / head[2:])
    assert objectstore.is_ancestor(str(objects), first, head) is None


def _packs(objects: Path) -> set[str]:
    return {p.name for p in (objects / "pack").iterdir()}


def test_a_pack_git_repacked_meanwhile_is_put_back_unreported(tmp_path: Path) -> None:
    """A repository already packed (as a clone is): ``git gc`` writes a new
    pack and removes the old one. The old pack's files are put back (git's
    next gc removes them) and, every object of theirs being in the new pack's
    index, not reported as deleted by the session."""
    repo = _repo(tmp_path / "repo")
    objects = repo / ".git" / "objects"
    git(repo, "gc", "-q")
    (repo / "more.txt").write_text("more\n")
    git(repo, "add", "more.txt")
    git(repo, "commit", "-qm", "more")
    old = _packs(objects)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    git(repo, "gc", "-q", "--prune=now")
    assert not old & _packs(objects)  # the old pack is gone, another holds everything
    done, failed = history.restore(kept)
    assert (done, failed) == ([], [])
    assert old <= _packs(objects)  # put back beside the new one
    git(repo, "fsck", "--strict")


def test_a_pack_deleted_is_put_back_and_reported(tmp_path: Path) -> None:
    """The twin: the pack's files removed with no pack holding its objects."""
    repo = _repo(tmp_path / "repo")
    objects = repo / ".git" / "objects"
    git(repo, "gc", "-q")
    old = _packs(objects)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    for name in old:
        os.unlink(objects / "pack" / name)
    done, failed = history.restore(kept)
    assert failed == [] and done == [(str(objects), f"{len(old)} object files deleted by a session put back")]
    assert _packs(objects) == old
    git(repo, "fsck", "--strict")


def test_many_ids_are_looked_up_as_a_set_with_the_same_answer(tmp_path: Path) -> None:
    """Past ``_LOOKUPS`` ids (an old pack's), each index is read as a set
    (a search each took ~10 us: 0.1 s for 100,000, 5 s for half a million);
    the answer is the search's."""
    repo = tmp_path / "repo"
    git(tmp_path, "init", "-q", str(repo))
    blobs = "".join(f"blob\nmark :{i + 1}\ndata {len(f'b{i}')}\nb{i}\n" for i in range(objectstore._LOOKUPS + 100))
    git(repo, "fast-import", "--quiet", stdin=blobs)
    objects = repo / ".git" / "objects"
    idx = next(p.name for p in (objects / "pack").iterdir() if p.suffix == ".idx")
    names = objectstore.names_in_index(str(objects / "pack"), idx, 10**6)
    assert names is not None and len(names) == objectstore._LOOKUPS + 100
    absent = [hashlib.sha1(b"absent %d" % i).digest() for i in range(50)]
    many = objectstore.indexed(str(objects), [*names, *absent])
    few = set().union(*(objectstore.indexed(str(objects), names[i:i + 1000]) for i in range(0, len(names), 1000)))
    assert many == few == set(names)
    assert objectstore.names_in_index(str(objects / "pack"), idx, 10) is None  # more than the limit: not read


def test_the_indexes_read_from_one_directory_are_bounded_in_all(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Each index was bounded, not their sum: a session could plant a
    thousand large (sparse) ones for the daemon to read into memory. Past
    the bound, the rest are left out, as if absent (the twin: within it,
    both packs are read)."""
    repo = _repo(tmp_path / "repo", files=2)
    git(repo, "gc", "-q")
    (repo / "again.txt").write_text("again\n")
    git(repo, "add", "again.txt")
    git(repo, "commit", "-qm", "again")
    git(repo, "repack", "-q")  # a second pack beside the first
    objects = repo / ".git" / "objects"
    idxs = sorted(p for p in (objects / "pack").iterdir() if p.suffix == ".idx")
    assert len(idxs) == 2
    oids = [bytes.fromhex(x) for x in git(repo, "rev-list", "--objects", "--all").split() if len(x) == 40]
    both = objectstore.indexed(str(objects), oids)
    assert both == set(oids)
    monkeypatch.setattr(objectstore, "_MAX_INDEX", idxs[0].stat().st_size + 100)
    first_only = objectstore.indexed(str(objects), oids)
    assert first_only and first_only < both
