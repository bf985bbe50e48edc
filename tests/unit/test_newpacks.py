"""A pack a session writes whose index names the user's objects at other
bytes (git reads packs first: the user's ``git show`` and ``checkout``
would read the session's bytes) is found at the end and moved aside
(``gitguard/newpacks.py``); the twins: a session's honest ``git gc`` and
``git repack``, and a pack of new objects only, are left and not reported."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import history, newpacks
from tests.unit.gitrepo import commits_repo, git
from tests.unit.test_replaced import _fsck, _kept

pytestmark = pytest.mark.process


def _show(repo: Path, rev: str) -> str:
    return subprocess.run(["git", "show", rev], cwd=repo, capture_output=True, text=True, timeout=30).stdout


def _forge(repo: Path, victim: str, other: str, name: str) -> Path:
    """A pack whose index names ``victim`` at ``other``'s bytes: ``other``'s
    pack, its index rewritten to say ``victim`` (the names sorted again, the
    checksums left: git does not check them on a read)."""
    pack_dir = repo / ".git" / "objects" / "pack"
    out = subprocess.run(["git", "pack-objects", "-q", str(pack_dir / "tmp")], cwd=repo, input=other + "\n",
                         capture_output=True, text=True, check=True).stdout.strip()
    idx = pack_dir / f"tmp-{out}.idx"
    data = bytearray(idx.read_bytes())
    start, h = 8 + 256 * 4, len(victim) // 2  # SHA-1 or SHA-256 ids
    assert data[start:start + h] == bytes.fromhex(other)
    data[start:start + h] = bytes.fromhex(victim)
    fan = bytes.fromhex(victim)[0]
    for i in range(256):  # one object: the fan-out counts it from its first byte on
        data[8 + i * 4:12 + i * 4] = (1 if i >= fan else 0).to_bytes(4, "big")
    (pack_dir / f"{name}.idx").write_bytes(bytes(data))
    os.rename(pack_dir / f"tmp-{out}.pack", pack_dir / f"{name}.pack")
    idx.unlink()
    later = time.time() + 100  # the newest pack: git looks in it first (its mtime in whole seconds)
    os.utime(pack_dir / f"{name}.pack", (later, later))
    return pack_dir / f"{name}.pack"


@pytest.mark.parametrize("user_s,name", [("loose", "pack-" + "f" * 40), ("packed", "pack-" + "f" * 40),
                                         ("loose", "evil")])
def test_a_pack_naming_the_user_s_object_at_other_bytes_is_moved_aside(tmp_path: Path, user_s: str,
                                                                      name: str) -> None:
    """Whatever the pack's name: git reads any ``*.idx`` of ``objects/pack``."""
    repo = commits_repo(tmp_path / "repo")
    if user_s == "packed":
        git(repo, "gc", "-q")
    kept, objects = _kept(tmp_path, repo)
    victim = git(repo, "rev-parse", "HEAD:f").strip()
    other = git(repo, "rev-parse", "HEAD~1:f").strip()
    original = _show(repo, victim)
    forged = _forge(repo, victim, other, name)
    assert _show(repo, victim) != original  # the attack works on the user's git
    done, failed = history.restore(kept)
    assert not failed and any("names your objects for other bytes" in why for _, why in done), done
    assert not forged.exists() and not forged.with_suffix(".idx").exists()
    assert _show(repo, victim) == original and _fsck(repo) == 0


def test_a_session_s_gc_repack_and_new_objects_are_verified_and_left(tmp_path: Path) -> None:
    repo = commits_repo(tmp_path / "repo")
    kept, objects = _kept(tmp_path, repo)
    (repo / "new").write_text("new\n")
    git(repo, "add", "new")
    git(repo, "commit", "-qm", "new")
    git(repo, "gc", "-q")
    git(repo, "repack", "-q", "-a", "-d", "--write-bitmap-index")
    packs = sorted(p.name for p in (objects / "pack").iterdir() if p.suffix != ".bitmap")
    done, failed = history.restore(kept)
    assert not failed and not [why for _, why in done if "pack a session made" in why], done
    # Its bitmap (git trusts what one says a commit reaches; not checked) is moved aside: derived.py.
    assert [why for _, why in done if "1 pack bitmaps or reverse indexes" in why], done
    assert sorted(p.name for p in (objects / "pack").iterdir() if ".bitmap" not in p.name) == packs
    assert _fsck(repo) == 0


def test_past_the_bounds_a_pack_is_reported_and_left_with_the_session_s_objects(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pack the end cannot verify within its bounds (the user's objects it
    names, the time) is reported, and left: a session's honest gc pruned its
    own new objects into it, and moving it aside lost them (``fatal: bad
    object HEAD``). The user's objects are all there besides (put back loose
    from the keep), and git fsck passes."""
    repo = commits_repo(tmp_path / "repo")
    kept, objects = _kept(tmp_path, repo)
    (repo / "session.txt").write_text("the session's\n")
    git(repo, "add", "session.txt")
    git(repo, "commit", "-qm", "the session's commit")
    head = git(repo, "rev-parse", "HEAD").strip()
    git(repo, "gc", "-q", "--prune=now")
    monkeypatch.setattr(newpacks, "MAX_OBJECTS", 2)
    done, failed = history.restore(kept)
    assert not failed and any("was not verified (it names 9 of your objects, past the 2 read at one end): git "
                              "fsck checks it" in why for _, why in done), done
    assert [p for p in (objects / "pack").iterdir() if p.name.endswith(".idx")]
    assert git(repo, "cat-file", "-t", head).strip() == "commit" and _fsck(repo) == 0
    monkeypatch.setattr(newpacks, "MAX_OBJECTS", 2_000_000)
    monkeypatch.setattr(newpacks, "BUDGET_S", 0.0)
    time.sleep(0.01)
    done, failed = newpacks.check(str(objects), kept.keep)
    assert not failed and any("was not verified (past the 0 s read at one end)" in why for _, why in done), done


def test_an_object_past_the_reader_s_bound_is_hashed_as_it_streams(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A blob larger than objectstore's bound (64 MiB; lowered here) in a
    session's honest repack: hashed as it streams, not taken for forged;
    the twin, the same blob's id over other bytes of that size, is."""
    from dispatchd.daemon.gitguard import objectstore
    repo = commits_repo(tmp_path / "repo")
    (repo / "big").write_bytes(os.urandom(300_000))
    git(repo, "add", "big")
    git(repo, "commit", "-qm", "big")
    kept, objects = _kept(tmp_path, repo)
    monkeypatch.setattr(objectstore, "_MAX_OBJECT", 100_000)
    git(repo, "repack", "-q", "-a", "-d")
    done, failed = history.restore(kept)
    assert not failed and not [why for _, why in done if "pack a session made" in why], done
    victim = git(repo, "rev-parse", "HEAD:big").strip()
    other = (repo / "other")
    other.write_bytes(os.urandom(300_000))
    other_id = git(repo, "hash-object", "-w", "other").strip()
    _forge(repo, victim, other_id, "pack-" + "b" * 40)
    done, failed = newpacks.check(str(objects), kept.keep)
    assert any("names your objects for other bytes" in why for _, why in done), done
def _entry(kind: int, size: int) -> bytes:
    c, size, out = (kind << 4) | (size & 15), size >> 4, bytearray()
    while size:
        out.append(c | 0x80)
        c, size = size & 0x7F, size >> 7
    return bytes(out + bytes([c]))


def _pack(stem: Path, entries: list[tuple[bytes, bytes]]) -> None:
    """A pack and its version 2 index, by hand: (id named, raw entry) each."""
    import hashlib
    import struct
    import zlib
    body = bytearray(b"PACK" + struct.pack(">II", 2, len(entries)))
    rows = []
    for oid, raw in entries:
        rows.append((oid, len(body), zlib.crc32(raw)))
        body += raw
    body += hashlib.sha1(body).digest()
    stem.with_suffix(".pack").write_bytes(bytes(body))
    rows.sort()
    idx = bytearray(b"\377tOc" + struct.pack(">I", 2))
    for i in range(256):
        idx += struct.pack(">I", sum(1 for oid, _, _ in rows if oid[0] <= i))
    idx += b"".join(o for o, _, _ in rows) + b"".join(struct.pack(">I", c) for _, _, c in rows)
    idx += b"".join(struct.pack(">I", off) for _, off, _ in rows) + body[-20:]
    stem.with_suffix(".idx").write_bytes(bytes(idx + hashlib.sha1(idx).digest()))


def test_a_delta_s_base_is_read_from_the_same_pack_as_git_reads_it(tmp_path: Path) -> None:
    """The user's blob stored as a delta on a base named by id, that base in
    the same pack holding the session's bytes; a loose object at the base's
    id holds the user's. Git takes a delta's base from the same pack only:
    it reads the session's bytes (the control); a reader taking the base
    from anywhere else would hash the user's and pass the pack. Moved aside."""
    import zlib
    repo = commits_repo(tmp_path / "repo")
    kept, objects = _kept(tmp_path, repo)
    victim = git(repo, "rev-parse", "HEAD:f").strip()
    original = _show(repo, victim)
    forged = b"X" * len(original.encode())
    base = bytes.fromhex("ab" * 20)
    n = len(forged)
    delta = bytes([n, n, 0x90, n])  # sizes, then copy n bytes from offset 0 (n < 128)
    _pack(objects / "pack" / ("pack-" + "d" * 40), [
        (base, _entry(3, n) + zlib.compress(forged)),
        (bytes.fromhex(victim), _entry(7, len(delta)) + base + zlib.compress(delta))])
    later = time.time() + 100
    os.utime(objects / "pack" / ("pack-" + "d" * 40 + ".pack"), (later, later))
    (objects / "ab").mkdir(exist_ok=True)
    body = b"blob %d\0" % n + original.encode()
    (objects / "ab" / ("ab" * 19)).write_bytes(zlib.compress(body))
    assert _show(repo, victim) == forged.decode()  # the attack works on the user's git
    done, failed = history.restore(kept)
    assert not failed and any("names your objects for other bytes" in why for _, why in done), done
    assert _show(repo, victim) == original


def test_objects_the_user_borrows_through_alternates_are_verified(tmp_path: Path) -> None:
    """A ``git clone --shared`` holds none of its history: its objects are
    the source's, through ``objects/info/alternates``. A pack naming one of
    those for other bytes is read first by git (local packs before the
    alternates'): verified against the alternates the user had, and moved
    aside."""
    source = commits_repo(tmp_path / "source")
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", "--shared", str(source), str(clone))
    time.sleep(0.06)
    kept = history.record(str(clone / ".git"), str(tmp_path / "keep"), own=[])
    time.sleep(0.06)
    victim = git(clone, "rev-parse", "HEAD:f").strip()
    other = git(clone, "rev-parse", "HEAD~1:f").strip()
    original = _show(clone, victim)
    _forge(clone, victim, other, "pack-" + "c" * 40)
    assert _show(clone, victim) != original  # the attack works on the user's git
    done, failed = history.restore(kept)
    assert not failed and any("names your objects for other bytes" in why for _, why in done), done
    assert _show(clone, victim) == original
