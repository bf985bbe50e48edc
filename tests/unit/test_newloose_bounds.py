"""``newloose.check`` (the last end's look at loose files a session made at
the ids of the user's packed objects) within bounds: each inode inflated
once, a file's header before the rest, all of it within ``BUDGET_S``;
honest loose copies kept as before."""

from __future__ import annotations

import os
import subprocess
import zlib
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import newloose, objectstore, replaced

pytestmark = pytest.mark.process

BOMB = zlib.compress(b"\0" * (64 * 1024 * 1024 + 16), 9)  # 64 KiB, inflating past the bound


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def _packed(tmp_path: Path, files: int = 40) -> tuple[Path, list[str], dict[str, bytes]]:
    """A repository whose objects are all packed; its objects directory,
    their ids, and each one's loose file as git wrote it (kept aside)."""
    repo = tmp_path / "repo"
    repo.mkdir(parents=True)
    _git(repo, "init", "-q")
    for i in range(files):
        (repo / f"f{i}").write_text(f"{i}\n" * (i + 1))
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=u", "-c", "user.email=u@example.invalid", "commit", "-qm", "init")
    objects = repo / ".git" / "objects"
    oids = sorted(o for o in _git(repo, "rev-list", "--objects", "--all").split() if len(o) == 40)
    loose = {oid: (objects / oid[:2] / oid[2:]).read_bytes() for oid in oids}
    _git(repo, "repack", "-a", "-d", "-q")
    _git(repo, "prune-packed")
    assert not any((objects / oid[:2] / oid[2:]).exists() for oid in oids)
    return objects, oids, loose


def _names(oids: list[str]) -> list[str]:
    return [f"{oid[:2]}/{oid[2:]}" for oid in oids]


def _place(objects: Path, oid: str) -> Path:
    (objects / oid[:2]).mkdir(exist_ok=True)
    return objects / oid[:2] / oid[2:]


def _moved(objects: Path, oid: str) -> tuple[str, str]:
    path = str(objects / oid[:2] / oid[2:])
    return (path, "a loose file a session made at the id of one of your packed objects, holding something else "
                  f"(git fsck: hash-path mismatch); moved aside to {oid[2:]}{{aside}}")


def _said(done: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``done`` with each moved-aside name's tail (after the name) as ``{aside}``."""
    out = []
    for path, why in done:
        head, _, moved = why.rpartition(" moved aside to ")
        name = os.path.basename(path)
        assert moved.startswith(name) and len(moved) > len(name) and os.path.lexists(os.path.join(
            os.path.dirname(path), moved))
        out.append((path, f"{head} moved aside to {name}{{aside}}"))
    return out


def test_one_bomb_hard_linked_at_every_packed_id_is_inflated_once_to_its_header(tmp_path: Path) -> None:
    """Before: each link inflated to 64 MiB (257 of them: 54.5 s; at
    ``MAX_FILES``, hours). Now the inode is decided once, after the 28
    bytes a header may take: every link moved aside, as before."""
    objects, oids, _ = _packed(tmp_path)
    bomb = tmp_path / "bomb"
    bomb.write_bytes(BOMB)
    for oid in oids:
        os.link(bomb, _place(objects, oid))
    look = replaced.Inflating(600)
    done, failed = newloose.check(str(objects), str(objects), [], _names(oids), look)
    assert (_said(done), failed) == ([_moved(objects, oid) for oid in oids], [])
    assert (look.files, look.bytes) == (1, 28)
    assert os.stat(bomb).st_nlink == 1 + len(oids)  # moved aside, never deleted


def test_honest_loose_copies_stay_each_inflated_whole_once(tmp_path: Path) -> None:
    """The twin: git's own loose files put back at their ids (as ``git gc``
    loosens unreachable objects) are each inflated whole, once, and stay;
    one of them hard-linked at another id too is inflated once, stays at
    its own id and is moved aside at the other."""
    objects, oids, loose = _packed(tmp_path)
    for oid in oids:
        _place(objects, oid).write_bytes(loose[oid])
    look = replaced.Inflating(600)
    assert newloose.check(str(objects), str(objects), [], _names(oids), look) == ([], [])
    assert (look.files, look.bytes) == (len(oids), sum(len(zlib.decompress(loose[oid])) for oid in oids))

    objects, oids, loose = _packed(tmp_path / "again")
    own, other = oids[0], oids[1]
    _place(objects, own).write_bytes(loose[own])
    os.link(_place(objects, own), _place(objects, other))
    look = replaced.Inflating(600)
    done, failed = newloose.check(str(objects), str(objects), [], _names([own, other]), look)
    assert (_said(done), failed) == ([_moved(objects, other)], [])
    assert (look.files, look.bytes) == (1, len(zlib.decompress(loose[own])))
    assert _place(objects, own).read_bytes() == loose[own]


class _Stops(replaced.Inflating):
    """A deadline that passes once ``after`` files were begun (inside the
    next one's inflation): a clock that does not depend on the machine."""

    def __init__(self, after: int) -> None:
        super().__init__(600)
        self.after = after

    def in_time(self) -> None:
        if self.files > self.after:
            raise objectstore.OutOfTime("out of time")


def _distinct_forgeries(objects: Path, oids: list[str]) -> None:
    for i, oid in enumerate(oids):
        _place(objects, oid).write_bytes(zlib.compress(b"blob %d\0forged %d" % (len(b"forged %d" % i), i)))


def test_past_the_shared_deadline_the_rest_is_reported_and_left(tmp_path: Path) -> None:
    """Forged files, each an inode of its own: the deadline passes inside
    the third (after two decided): those two moved aside, the third and
    the rest counted, said and left where they are, as newpacks leaves a
    pack it could not verify in time."""
    objects, oids, _ = _packed(tmp_path)
    _distinct_forgeries(objects, oids)
    look = _Stops(after=2)
    done, failed = newloose.check(str(objects), str(objects), [], _names(oids), look)
    assert _said(done) == [_moved(objects, oid) for oid in oids[:2]]
    assert failed == [f"{objects}: {len(oids) - 2} new loose files at ids of your packed objects not looked at, "
                      f"past the 10 s read at one end: left where they are (git fsck checks them)"]
    assert all(_place(objects, oid).exists() for oid in oids[2:])
    assert look.files == 3

    # Its twins: a deadline passed before the first, nothing inflated; within it, every one moved.
    objects, oids, _ = _packed(tmp_path / "late")
    _distinct_forgeries(objects, oids)
    look = replaced.Inflating(-1)
    done, failed = newloose.check(str(objects), str(objects), [], _names(oids), look)
    assert (done, look.files) == ([], 0)
    assert failed == [f"{objects}: {len(oids)} new loose files at ids of your packed objects not looked at, "
                      f"past the 10 s read at one end: left where they are (git fsck checks them)"]
    look = replaced.Inflating(600)
    done, failed = newloose.check(str(objects), str(objects), [], _names(oids), look)
    assert (_said(done), failed) == ([_moved(objects, oid) for oid in oids], [])
    assert look.files == len(oids)


def test_the_check_s_own_deadline_is_its_budget() -> None:
    assert newloose.BUDGET_S == 10.0
