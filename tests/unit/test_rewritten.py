"""A kept loose object a session rewrote *in place* (``chmod u+w``, then a
write: the inode and its directory's ctime stay) is found by its own ctime
and put back from the keep, whose loose objects are files of their own
(``gitguard/clones.py``, ``replaced.find_rewritten``). Each twin shows what
is left: the untouched objects, a mode changed and set back, the session's
own new objects. And the packs a session could rewrite so are bound
read-only in its mount namespace (``layouts.held_packs``)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from dispatchd import statemodes
from dispatchd.daemon.gitguard import clones, history, layouts, replaced
from tests.unit.gitrepo import commits_repo, git
from tests.unit.test_replaced import _fsck, _kept, _loose

pytestmark = pytest.mark.process


def _rewrite_in_place(path: Path, data: bytes) -> None:
    """What a session can do to a file it owns: make it writable, write into it."""
    ino = path.stat().st_ino
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate()
    os.chmod(path, 0o444)
    assert path.stat().st_ino == ino


def test_the_keep_holds_loose_objects_as_files_of_their_own(tmp_path: Path) -> None:
    repo = commits_repo(tmp_path / "repo")
    kept, objects = _kept(tmp_path, repo)
    for rel in _loose(objects):
        mine, theirs = (Path(kept.keep) / rel).stat(), (objects / rel).stat()
        assert mine.st_ino != theirs.st_ino and mine.st_nlink == 1 and theirs.st_nlink == 1
        assert (Path(kept.keep) / rel).read_bytes() == (objects / rel).read_bytes()
    assert (Path(kept.keep) / clones.OWN_MARK).exists()


def test_a_loose_object_rewritten_in_place_is_found_and_put_back(tmp_path: Path) -> None:
    repo = commits_repo(tmp_path / "repo")
    kept, objects = _kept(tmp_path, repo)
    victim, other = _loose(objects)[:2]
    original = (objects / victim).read_bytes()
    _rewrite_in_place(objects / victim, b"garbage")
    assert _fsck(repo) != 0  # the attack works on the user's git
    # Its directory's ctime did not change: the look at replaced files alone misses it.
    assert replaced.find(str(objects), kept.keep, history._changed(kept.stamps, kept.stamped_ns,
                                                                   history._stamps(str(objects))),
                         kept.stamped_ns) == []
    assert replaced.find_rewritten(str(objects), kept.keep, kept.stamped_ns, set()) == ([victim], [], "")
    done, failed = history.restore(kept)
    assert not failed and any("1 object files a session replaced put back" in why for _, why in done), done
    assert (objects / victim).read_bytes() == original and _fsck(repo) == 0
    aside = [p for p in (objects / victim).parent.iterdir() if p.name.startswith(Path(victim).name + ".")]
    assert len(aside) == 1 and aside[0].read_bytes() == b"garbage"
    # Put back as a copy: the repository's file and the keep do not share an inode again.
    assert (objects / victim).stat().st_ino != (Path(kept.keep) / victim).stat().st_ino
    assert (objects / other).read_bytes() == (Path(kept.keep) / other).read_bytes()


def test_a_mode_changed_and_the_session_s_own_objects_are_left(tmp_path: Path) -> None:
    """The twin: a ctime that changed over the same bytes (a chmod and back),
    and the objects a session's commit wrote (not kept), are not taken."""
    repo = commits_repo(tmp_path / "repo")
    kept, objects = _kept(tmp_path, repo)
    first = _loose(objects)[0]
    os.chmod(objects / first, 0o644)
    os.chmod(objects / first, 0o444)
    (repo / "new").write_text("new\n")
    git(repo, "add", "new")
    git(repo, "commit", "-qm", "new")
    assert replaced.find_rewritten(str(objects), kept.keep, kept.stamped_ns, set()) == ([], [], "")
    done, failed = history.restore(kept)
    assert not failed and not [why for _, why in done if "replaced" in why], done


def test_the_look_is_bounded_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = commits_repo(tmp_path / "repo")
    kept, objects = _kept(tmp_path, repo)
    monkeypatch.setattr(replaced, "_MAX_LOOSE", 1)
    found, lost, cut = replaced.find_rewritten(str(objects), kept.keep, kept.stamped_ns, set())
    assert found == lost == [] and cut == "more than 1 kept object files; not all looked at"


def test_a_keep_directory_made_unreadable_is_set_back_and_looked_at(tmp_path: Path) -> None:
    """A fan-out directory of the keep a session made 000: set back, and its
    files looked at (it once cut the look short, and every later open was refused)."""
    repo = commits_repo(tmp_path / "repo")
    kept, objects = _kept(tmp_path, repo)
    fanout = sorted(p for p in Path(kept.keep).iterdir() if len(p.name) == 2)
    for d in fanout:
        os.chmod(d, 0)
    assert replaced.find_rewritten(str(objects), kept.keep, kept.stamped_ns, set()) == ([], [], "")
    assert all(stat.S_IMODE(d.stat().st_mode) == 0o700 for d in fanout)


def test_a_keep_directory_that_cannot_be_set_back_is_named_as_such(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Not the user's (the heal refuses another uid's file: here the uid is
    told otherwise), it is said to be a keep directory that cannot be read."""
    repo = commits_repo(tmp_path / "repo")
    kept, objects = _kept(tmp_path, repo)
    first = sorted(p for p in Path(kept.keep).iterdir() if len(p.name) == 2)[0]
    os.chmod(first, 0)
    try:
        if os.access(first, os.R_OK):
            pytest.skip("this user reads any directory")
        monkeypatch.setattr(statemodes.os, "getuid", lambda: 1 << 30)
        found, lost, cut = replaced.find_rewritten(str(objects), kept.keep, kept.stamped_ns, set())
        monkeypatch.undo()
        assert (found, lost) == ([], [])
        assert cut == (f"{first}: a directory of dispatchd's keep of this repository's objects cannot be read "
                       f"(Permission denied), even after setting its mode back; make it readable again "
                       f"(chmod 700 {first}), then open the session again")
        assert stat.S_IMODE(first.stat().st_mode) == 0  # the twin, above, sets it back
    finally:
        os.chmod(first, 0o700)


def test_an_older_keep_s_hard_links_become_copies_once(tmp_path: Path) -> None:
    """A keep an older daemon made hard-linked the loose objects: the next
    record makes them copies of their own and marks the keep; the twin, a
    keep already marked, is not walked again (a link planted there stays)."""
    repo = commits_repo(tmp_path / "repo")
    kept, objects = _kept(tmp_path, repo)
    keep = Path(kept.keep)
    rel = _loose(objects)[0]
    (keep / rel).unlink()
    os.link(objects / rel, keep / rel)
    (keep / clones.OWN_MARK).unlink()
    history.record(str(repo / ".git"), str(keep), own=[])
    assert (keep / rel).stat().st_ino != (objects / rel).stat().st_ino and (keep / clones.OWN_MARK).exists()
    assert not [n for d in keep.iterdir() if d.is_dir() for n in os.listdir(d) if n.startswith("tmp")]
    (keep / rel).unlink()
    os.link(objects / rel, keep / rel)
    history.record(str(repo / ".git"), str(keep), own=[])
    assert (keep / rel).stat().st_ino == (objects / rel).stat().st_ino


def test_past_the_copy_budget_a_loose_object_is_linked(tmp_path: Path) -> None:
    src = tmp_path / "object"
    src.write_bytes(b"x" * 100)
    budget = [50]
    clones.clone(str(src), str(tmp_path / "linked"), budget, own=True)
    assert (tmp_path / "linked").stat().st_ino == src.stat().st_ino and budget == [50]
    budget = [150]
    clones.clone(str(src), str(tmp_path / "copied"), budget, own=True)
    assert (tmp_path / "copied").stat().st_ino != src.stat().st_ino and budget == [50]


def test_the_packs_are_held_read_only_and_only_they(tmp_path: Path) -> None:
    repo = commits_repo(tmp_path / "repo")
    git(repo, "gc", "-q")
    pack = repo / ".git" / "objects" / "pack"
    (pack / "pack-planted.idx").symlink_to(repo / "f")  # a symlink: not the repository's
    (pack / "notapack.pack").write_text("x")
    (pack / "pack-x.keep").write_text("")
    layout = layouts.inspect_git(str(repo), uid=os.getuid())
    held = sorted(os.path.basename(p) for p in layout.read_only if p.startswith(str(pack)))
    assert held and all(n.startswith("pack-") and n.endswith((".pack", ".idx", ".rev", ".bitmap")) for n in held)
    assert "pack-planted.idx" not in held and "pack-x.keep" not in held and layout.note == ""
    assert set(held) >= {p.name for p in pack.iterdir()
                         if p.suffix in (".pack", ".idx") and p.name.startswith("pack-") and not p.is_symlink()}


def test_past_the_bound_the_packs_left_writable_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = commits_repo(tmp_path / "repo")
    git(repo, "gc", "-q")
    monkeypatch.setattr(layouts, "MAX_HELD_PACK_FILES", 1)
    layout = layouts.inspect_git(str(repo), uid=os.getuid())
    assert len([p for p in layout.read_only if "/objects/pack/" in p]) == 1
    assert layout.note.startswith("1 pack files past the first 1 are not held read-only"), layout.note


def _packed(tmp_path: Path) -> Path:
    repo = commits_repo(tmp_path / "repo")
    git(repo, "gc", "-q")
    return repo


def _pack_files(repo: Path) -> list[Path]:
    return sorted(p for p in (repo / ".git" / "objects" / "pack").iterdir() if p.suffix in (".pack", ".idx"))


def test_a_pack_given_a_second_name_is_made_the_repository_s_own_again(tmp_path: Path) -> None:
    """A pack a session made, or one it does not hold, can be hard-linked
    under a name of the session's, and rewritten through it in a later
    session, which no bind by path holds. At the end it is copied to a new
    inode under its own name and the keep follows it; the other name keeps
    the old inode. The twin: a pack with as many names as at the baseline (a
    ``git clone --local`` shares its source's inodes) is left."""
    repo = _packed(tmp_path)
    shared = tmp_path / "source-link"
    first, second = _pack_files(repo)
    os.link(second, shared)  # the user's own second name, at the baseline (a local clone's source)
    kept, objects = _kept(tmp_path, repo)
    assert kept.pack_links is not None and kept.pack_links[second.name] == 3  # the repository, the keep, the clone
    other = tmp_path / "session-name"
    os.link(first, other)  # the session's
    before = first.stat().st_ino
    done, failed = history.restore(kept)
    assert not failed and any("1 pack files with more names than at the baseline (hard links made meanwhile) given an inode of their own" in why for _, why in done), done
    assert first.stat().st_ino != before and other.stat().st_ino == before and first.read_bytes() == other.read_bytes()
    assert (Path(kept.keep) / "pack" / first.name).stat().st_ino == first.stat().st_ino  # the keep follows
    assert second.stat().st_nlink == 3 and shared.stat().st_ino == second.stat().st_ino  # the twin: left
    assert _fsck(repo) == 0


def test_packs_not_held_are_kept_as_copies_and_held_ones_linked(tmp_path: Path) -> None:
    """A pack the session does not hold read-only (past the bound, degraded
    mode) is kept as a copy of its own, so one rewritten in place is put
    back; the held ones stay hard links (the twin: cheap, and unwritable in
    the session). A link kept before, not held now, becomes a copy."""
    repo = _packed(tmp_path)
    first, second = _pack_files(repo)
    time.sleep(0.06)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[], held=frozenset({second.name}))
    keep = Path(kept.keep) / "pack"
    assert (keep / first.name).stat().st_ino != first.stat().st_ino
    assert (keep / second.name).stat().st_ino == second.stat().st_ino
    history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[], held=frozenset())
    assert (keep / second.name).stat().st_ino != second.stat().st_ino  # converted
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[], held=frozenset())
    time.sleep(0.06)
    original = first.read_bytes()
    data = bytearray(original)
    data[40] ^= 0xFF
    _rewrite_in_place(first, bytes(data))
    assert _fsck(repo) != 0
    done, failed = history.restore(kept)
    assert not failed and first.read_bytes() == original and _fsck(repo) == 0, (done, failed)


def test_a_loose_object_the_keep_shares_past_its_budget_is_reported_when_broken(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the copy budget a loose object is hard-linked: rewritten in
    place, nothing can be put back, and the end says so (a failure of the
    check) rather than nothing. The twin: one only chmodded is not."""
    monkeypatch.setattr(clones, "COPY_BUDGET", 0)
    repo = commits_repo(tmp_path / "repo")
    kept, objects = _kept(tmp_path, repo)
    victim, other = _loose(objects)[:2]
    assert (Path(kept.keep) / victim).stat().st_ino == (objects / victim).stat().st_ino
    time.sleep(0.06)
    _rewrite_in_place(objects / victim, b"garbage")
    os.chmod(objects / other, 0o644)
    done, failed = history.restore(kept)
    assert [f for f in failed if "rewritten in place by a session, and the keep shares its inode" in f] == [
        f"{objects / victim}: rewritten in place by a session, and the keep shares its inode (kept past the copy "
        "budget): it cannot be put back (git fsck names it)"], failed
    assert len(failed) == 1


def test_an_object_directory_made_unsearchable_is_lent_and_looked_into(tmp_path: Path) -> None:
    repo = commits_repo(tmp_path / "repo")
    kept, objects = _kept(tmp_path, repo)
    victim = _loose(objects)[0]
    original = (objects / victim).read_bytes()
    _rewrite_in_place(objects / victim, b"garbage")
    os.chmod((objects / victim).parent, 0)
    done, failed = history.restore(kept)
    assert not failed and (objects / victim).read_bytes() == original and _fsck(repo) == 0, (done, failed)


def test_another_object_at_a_kept_name_is_put_back_whatever_its_hash_says(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """"The same object compressed again" is decided by inflating both, not
    by hashing the new file (hashlib's SHA-1 would take a collision twin):
    with the hash standing in as always right, another object is still put
    back; the twin, a recompression of the kept one, is left."""
    import zlib
    monkeypatch.setattr(replaced, "_valid_loose", lambda *args: True)
    repo = commits_repo(tmp_path / "repo")
    kept, objects = _kept(tmp_path, repo)
    first, second, third = _loose(objects)[:3]
    _rewrite_in_place(objects / first, (objects / third).read_bytes())
    _rewrite_in_place(objects / second, zlib.compress(zlib.decompress((objects / second).read_bytes()), 1))
    found, lost, cut = replaced.find_rewritten(str(objects), kept.keep, kept.stamped_ns, set())
    assert (found, lost, cut) == ([first], [], "")


def test_only_git_s_pack_names_are_held_and_the_oldest_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session's junk named like a pack but not as git names one
    (``pack-!1.idx``) takes no place in the bound; past it, the newest are
    the ones left out (a ctime no session can set back)."""
    repo = _packed(tmp_path)
    pack = repo / ".git" / "objects" / "pack"
    oldest = sorted(_pack_files(repo), key=lambda p: p.stat().st_ctime_ns)[0]
    for n in range(5):
        (pack / f"pack-!{n}.idx").write_text("junk")
    time.sleep(0.02)
    newer = pack / ("pack-" + "0" * 40 + ".idx")
    newer.write_text("newer")  # a git name, sorting first by name: last by age
    monkeypatch.setattr(layouts, "MAX_HELD_PACK_FILES", 1)
    layout = layouts.inspect_git(str(repo), uid=os.getuid())
    held = [p for p in layout.read_only if "/objects/pack/" in p]
    assert held == [str(oldest)], held


def test_packs_given_names_are_copied_once_an_inode_within_one_budget(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """One inode under two pack names of the repository and a name of the
    session's: copied once, both names on the copy; the next pack past the
    budget (one for the whole end, not one a file: a sparse file under many
    names filled the disk) is reported, not copied."""
    from dispatchd.daemon.gitguard import packlinks
    repo = _packed(tmp_path)
    kept, objects = _kept(tmp_path, repo)
    pack_dir = objects / "pack"
    first = _pack_files(repo)[0]
    twin = pack_dir / ("pack-" + "a" * 40 + ".pack")
    os.link(first, twin)
    os.link(first, tmp_path / "session-name")
    budget = first.stat().st_size
    done, failed = packlinks.unshare(str(objects), kept.keep, kept.pack_links or {},
                                     lambda src, dst, left: clones.clone(src, dst, left, never_link=True), budget)
    assert sorted(done) == sorted([first.name, twin.name]) and not failed
    assert first.stat().st_ino == twin.stat().st_ino != (tmp_path / "session-name").stat().st_ino
    second = _pack_files(repo)[1]
    os.link(second, tmp_path / "other-name")
    done, failed = packlinks.unshare(str(objects), kept.keep, kept.pack_links or {},
                                     lambda src, dst, left: clones.clone(src, dst, left, never_link=True), 0)
    assert done == [] and f"{second}: more names than at the baseline, and it cannot be given an inode of its own " \
        "(over the copy budget)" in failed, failed
    (pack_dir / f"tmp-unshared-{first.name}.part").write_text("a killed daemon's")
    packlinks.unshare(str(objects), kept.keep, {n: 99 for n in kept.pack_links or {}}, lambda *a: None, 0)
    assert not (pack_dir / f"tmp-unshared-{first.name}.part").exists()  # swept
    monkeypatch.setattr(packlinks, "MAX_FILES", 2)
    assert packlinks.unshare(str(objects), kept.keep, {}, lambda *a: None, 0) == (
        [], [f"{pack_dir}: more than 2 pack files; those given another name not looked for"])


def test_a_keep_linked_to_an_inode_no_longer_the_repository_s_is_linked_again(tmp_path: Path) -> None:
    """A daemon killed between making the repository's pack an inode of its
    own and moving the keep's link: the keep shares the session's name's
    inode. The next end links it to the repository's file again."""
    from dispatchd.daemon.gitguard import packlinks
    repo = _packed(tmp_path)
    kept, objects = _kept(tmp_path, repo)
    first = _pack_files(repo)[0]
    keep_file = Path(kept.keep) / "pack" / first.name
    assert keep_file.stat().st_ino == first.stat().st_ino
    os.link(first, tmp_path / "session-name")
    copy = first.parent / "copy"
    clones.clone(str(first), str(copy), [1 << 30], never_link=True)
    os.replace(copy, first)  # the repository's file made its own; the keep not moved (killed here)
    assert keep_file.stat().st_ino == (tmp_path / "session-name").stat().st_ino
    packlinks.unshare(str(objects), kept.keep, kept.pack_links or {}, lambda *a: None, 0)
    assert keep_file.stat().st_ino == first.stat().st_ino
