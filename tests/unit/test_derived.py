"""A pack's bitmap or reverse index made or changed since the baseline is
moved aside (``derived.clear``), but a reverse index that is exactly the one
its pack's index gives (``expected_rev``: git's own, byte for byte), and
anything settled before the baseline; ``history.restore`` does it only when
a session could write, and puts a kept one of the user's back."""

from __future__ import annotations

import hashlib
import os
import struct
import time
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import derived, history
from tests.unit.gitrepo import commits_repo, git

pytestmark = pytest.mark.process  # runs git

SETTLE_S = 0.07  # past derived's 50 ms margin


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return commits_repo(tmp_path / "repo")


def _pack(repo: Path) -> Path:
    return repo / ".git" / "objects" / "pack"


def _baseline() -> int:
    time.sleep(SETTLE_S)
    return time.time_ns()


def test_the_reverse_index_is_git_s_own_byte_for_byte(repo: Path) -> None:
    git(repo, "-c", "pack.writeReverseIndex=true", "repack", "-q", "-a", "-d")
    idx = next(_pack(repo).glob("*.idx")).read_bytes()
    assert derived.expected_rev(idx) == next(_pack(repo).glob("*.rev")).read_bytes()


def test_large_offsets_are_read_from_their_own_table() -> None:
    """A version 2 index of two objects, the first at an offset past 2 GiB
    (its 32-bit entry points into the 64-bit table): pack order is 1, 0."""
    names = bytes(20) + b"\x01" + bytes(19)
    fanout = struct.pack(">I", 1) + struct.pack(">I", 2) * 255
    body = (b"\xfftOc" + struct.pack(">I", 2) + fanout + names + bytes(8)
            + struct.pack(">II", 0x80000000, 12) + struct.pack(">Q", 5_000_000_000) + b"P" * 20)
    idx = body + hashlib.sha1(body).digest()
    rev = derived.expected_rev(idx)
    assert rev is not None and rev[12:20] == struct.pack(">II", 1, 0) and rev[20:40] == b"P" * 20
    assert rev[-20:] == hashlib.sha1(rev[:-20]).digest()
    # A large offset past its table, another version, a truncated index: nothing to compare with.
    assert derived.expected_rev(idx.replace(struct.pack(">II", 0x80000000, 12), struct.pack(">II", 0x80000005, 12))) \
        is None
    assert derived.expected_rev(b"\xfftOc" + struct.pack(">I", 3) + idx[8:]) is None
    assert derived.expected_rev(idx[:1100]) is None


def test_made_or_changed_since_the_baseline_goes_aside_settled_stays(repo: Path) -> None:
    git(repo, "-c", "repack.writeBitmaps=true", "-c", "pack.writeReverseIndex=true", "repack", "-q", "-a", "-d")
    user = sorted(p.name for p in _pack(repo).iterdir())
    since = _baseline()
    (repo / "f").write_text("new\n")
    git(repo, "commit", "-qam", "more")
    # A session's repack: a new pack, its own bitmap and git's reverse index.
    git(repo, "-c", "repack.writeBitmaps=true", "-c", "pack.writeReverseIndex=true", "repack", "-q", "-a")
    new = [p.name for p in _pack(repo).iterdir() if p.name not in user]
    (_pack(repo) / "multi-pack-index-1234.rev").write_bytes(b"RIDX")
    (_pack(repo) / "junk.bitmap").symlink_to("/etc/passwd")
    moved, failed = derived.clear(str(repo / ".git" / "objects"), "", since, None)
    assert not failed
    assert len(moved) == 3, moved
    left = sorted(p.name for p in _pack(repo).iterdir())
    assert all(name in left for name in user)  # the user's, untouched
    assert next(n for n in new if n.endswith(".rev")) in left  # git's own: kept
    assert not any(n.endswith(".bitmap") for n in left if n not in user)
    assert "multi-pack-index-1234.rev" not in left and "junk.bitmap" not in left
    assert all(os.path.dirname(m) == str(_pack(repo)) for m in moved)  # renamed beside, never deleted
    assert any(os.path.basename(m).startswith("junk.bitmap") and os.path.islink(m) for m in moved)


def test_a_reverse_index_out_of_order_or_for_another_pack_goes_aside(repo: Path) -> None:
    git(repo, "-c", "pack.writeReverseIndex=true", "repack", "-q", "-a", "-d")
    rev = next(_pack(repo).glob("*.rev"))
    honest = rev.read_bytes()
    forged = bytearray(honest)
    forged[12:16], forged[16:20] = honest[16:20], honest[12:16]  # two objects' places swapped
    forged[-20:] = hashlib.sha1(bytes(forged[:-20])).digest()  # its own checksum made right
    since = _baseline()
    os.chmod(rev, 0o644)
    rev.write_bytes(bytes(forged))
    moved, _ = derived.clear(str(repo / ".git" / "objects"), "", since, None)
    assert len(moved) == 1 and not rev.exists()
    # The twin: git's own bytes, written again after the baseline, are kept.
    rev.write_bytes(honest)
    assert derived.clear(str(repo / ".git" / "objects"), "", since, None) == ([], [])
    assert rev.read_bytes() == honest


def test_past_the_bound_a_reverse_index_is_not_read(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    git(repo, "-c", "pack.writeReverseIndex=true", "repack", "-q", "-a", "-d")
    since = time.time_ns() - 10**9  # the repack's files are all newer
    monkeypatch.setattr(derived, "MAX_OBJECTS", 2)  # the pack holds 9
    rev = next(_pack(repo).glob("*.rev"))
    honest = rev.read_bytes()
    moved, _ = derived.clear(str(repo / ".git" / "objects"), "", since, None)
    assert len(moved) == 1 and os.path.basename(moved[0]).startswith(rev.name)
    monkeypatch.setattr(derived, "MAX_OBJECTS", 9)  # the twin: at the bound, read and kept
    rev.write_bytes(honest)
    assert derived.clear(str(repo / ".git" / "objects"), "", since, None) == ([], [])


def test_the_restore_moves_a_forged_bitmap_and_puts_the_kept_one_back(repo: Path, tmp_path: Path) -> None:
    """Only when a session could write (``in_place``); the user's bitmap,
    rewritten in place (a session without a mount namespace can: none of its
    packs held, ``held=frozenset()``, so the keep holds copies), comes back
    from the keep."""
    git(repo, "-c", "repack.writeBitmaps=true", "repack", "-q", "-a", "-d")
    bitmap = next(_pack(repo).glob("*.bitmap"))
    original = bitmap.read_bytes()
    time.sleep(SETTLE_S)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), ["refs/heads/main"], held=frozenset())
    time.sleep(SETTLE_S)
    os.chmod(bitmap, 0o644)
    bitmap.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    done, failed = history.restore(kept, in_place=False)
    assert bitmap.read_bytes() != original and not [d for d in done if "bitmaps" in d[1]]  # no session wrote
    done, failed = history.restore(kept, in_place=True)
    assert not failed, failed
    assert any("1 pack bitmaps or reverse indexes made or changed by a session moved aside" in why
               for _, why in done), done
    assert bitmap.read_bytes() == original


def _recorded(repo: Path, tmp_path: Path) -> history.History:
    """The user's pack with its bitmap and reverse index, a keep of copies
    (no pack held: a session without a mount namespace), settled."""
    git(repo, "-c", "repack.writeBitmaps=true", "-c", "pack.writeReverseIndex=true", "repack", "-q", "-a", "-d")
    time.sleep(SETTLE_S)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), ["refs/heads/main"], held=frozenset())
    time.sleep(SETTLE_S)
    return kept


def test_a_reverse_index_matching_a_rewritten_index_is_checked_against_the_kept_one(repo: Path,
                                                                                      tmp_path: Path) -> None:
    """The session rewrites the user's index (two offsets swapped) and writes
    the reverse index that index gives: against the kept index it is wrong,
    and goes aside; the index itself is put back by the restore."""
    kept = _recorded(repo, tmp_path)
    idx, rev = next(_pack(repo).glob("*.idx")), next(_pack(repo).glob("*.rev"))
    original_idx, original_rev = idx.read_bytes(), rev.read_bytes()
    forged = bytearray(original_idx)
    count = struct.unpack_from(">I", forged, 8 + 255 * 4)[0]
    at = 8 + 1024 + 24 * count
    forged[at:at + 4], forged[at + 4:at + 8] = original_idx[at + 4:at + 8], original_idx[at:at + 4]
    os.chmod(idx, 0o644)
    idx.write_bytes(bytes(forged))
    os.chmod(rev, 0o644)
    rev.write_bytes(derived.expected_rev(bytes(forged)) or b"")
    assert rev.read_bytes() != original_rev  # the control: the forged pair agree with each other
    done, failed = history.restore(kept, in_place=True)
    assert not failed, failed
    assert any("1 pack bitmaps or reverse indexes" in why for _, why in done), done
    assert idx.read_bytes() == original_idx and rev.read_bytes() == original_rev


def _linked_rev_forged(repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                       ) -> tuple[history.History, Path, bytes]:
    """The keep recorded past its copy budget (it links the pack's files),
    then the pack's reverse index rewritten in place out of order, through
    the link the keep shares: the history, the reverse index, its bytes."""
    from dispatchd.daemon.gitguard import clones
    monkeypatch.setattr(clones, "COPY_BUDGET", 0)
    kept = _recorded(repo, tmp_path)
    rev = next(_pack(repo).glob("*.rev"))
    data = bytearray(rev.read_bytes())
    data[12:16], data[16:20] = data[16:20], data[12:16]
    os.chmod(rev, 0o644)
    with open(rev, "r+b") as f:  # in place: the keep's link sees it
        f.write(bytes(data))
    return kept, rev, bytes(data)


def test_a_reverse_index_the_keep_linked_is_not_put_back_with_the_session_s_bytes(
        repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the copy budget the keep links: a rewrite in place changes the
    kept bytes too. A reverse index out of order is moved aside and the
    keep's link removed: nothing of the session's comes back. (A bitmap
    the keep links is left, like the pack it belongs to: see the module.)"""
    kept, rev, data = _linked_rev_forged(repo, tmp_path, monkeypatch)
    assert (tmp_path / "keep" / "pack" / rev.name).read_bytes() == data  # the control: shared
    done, failed = history.restore(kept, in_place=True)
    assert not failed, failed
    assert not rev.exists() and not (tmp_path / "keep" / "pack" / rev.name).exists()
    assert any("1 pack bitmaps or reverse indexes" in why for _, why in done), done


def test_a_bitmap_the_keep_holds_as_its_link_is_not_looked_at(repo: Path, tmp_path: Path) -> None:
    """Full mode: the session holds the pack's files read-only, the keep
    links them, and the link sets their ctime after the baseline's look:
    the user's bitmap stays, unreported (the twin of the forged ones)."""
    git(repo, "-c", "repack.writeBitmaps=true", "repack", "-q", "-a", "-d")
    time.sleep(SETTLE_S)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), ["refs/heads/main"])  # all held: linked
    bitmap = next(_pack(repo).glob("*.bitmap"))
    assert os.stat(bitmap).st_ctime_ns >= kept.stamped_ns  # the keep's link made it
    done, failed = history.restore(kept, in_place=True)
    assert not failed and not [why for _, why in done if "bitmaps" in why], done
    assert bitmap.exists()


def test_a_restore_run_again_reports_nothing_new(repo: Path, tmp_path: Path) -> None:
    """A daemon killed after its restore runs it again at the next start:
    the user's bitmap, put back as a fresh copy, holds the kept bytes and
    stays; an identical rewrite is not reported either."""
    kept = _recorded(repo, tmp_path)
    bitmap = next(_pack(repo).glob("*.bitmap"))
    data = bitmap.read_bytes()
    os.chmod(bitmap, 0o644)
    bitmap.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    done, _ = history.restore(kept, in_place=True)
    assert any("bitmaps" in why for _, why in done) and bitmap.read_bytes() == data
    for _ in range(2):
        done, failed = history.restore(kept, in_place=True)
        assert not failed and not [why for _, why in done if "bitmaps" in why], done
    os.chmod(bitmap, 0o644)
    bitmap.write_bytes(data)  # rewritten, the same bytes
    done, _ = history.restore(kept, in_place=True)
    assert not [why for _, why in done if "bitmaps" in why], done
    aside = [p for p in _pack(repo).iterdir() if not p.name.endswith((".pack", ".idx", ".bitmap", ".rev"))]
    assert len(aside) == 1  # the forged one, from the first restore; none of the user's since


def test_past_the_bound_of_names_the_check_fails_and_renames_nothing(repo: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from dispatchd.daemon.gitguard import packlinks
    since = _baseline()
    for n in range(5):
        (_pack(repo) / f"junk{n}.bitmap").write_text("")
    monkeypatch.setattr(packlinks, "MAX_FILES", 4)
    moved, failed = derived.clear(str(repo / ".git" / "objects"), "", since, None)
    assert moved == [] and failed and "more than 4 pack bitmaps and reverse indexes" in failed[0]
    assert len(list(_pack(repo).glob("junk*.bitmap"))) == 5
    monkeypatch.setattr(packlinks, "MAX_FILES", 5)  # the twin: at the bound, looked at
    moved, failed = derived.clear(str(repo / ".git" / "objects"), "", since, None)
    assert len(moved) == 5 and not failed


def test_past_the_read_budget_a_reverse_index_goes_aside_unread(repo: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    git(repo, "-c", "pack.writeReverseIndex=true", "repack", "-q", "-a", "-d")
    since = time.time_ns() - 10**9
    monkeypatch.setattr(derived, "READ_BUDGET", 100)  # the index alone is larger
    assert len(derived.clear(str(repo / ".git" / "objects"), "", since, None)[0]) == 1


def test_a_name_new_since_the_baseline_is_never_taken_for_the_user_s(repo: Path, tmp_path: Path) -> None:
    """A checkpoint keeps what the session made (``keep_more``): a forged
    bitmap of the session's own pack, copied into the keep, holds the same
    bytes as the keep's file; its name was not there at the baseline, so it
    still goes aside (the twin: the user's own name, the same bytes, stays)."""
    kept = _recorded(repo, tmp_path)
    (repo / "f").write_text("new\n")
    git(repo, "commit", "-qam", "more")
    git(repo, "-c", "repack.writeBitmaps=true", "repack", "-q", "-a")
    new = next(p for p in _pack(repo).glob("*.bitmap") if p.name not in (kept.pack_links or {}))
    (tmp_path / "keep" / "pack" / new.name).write_bytes(new.read_bytes())  # as keep_more would
    done, failed = history.restore(kept, in_place=True)
    assert not failed and any("1 pack bitmaps or reverse indexes" in why for _, why in done), done
    assert not new.exists() and len(list(_pack(repo).glob("*.bitmap"))) == 1  # the user's


def test_the_read_budget_is_one_for_the_whole_end(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two packs' reverse indexes, the budget enough for one index and its
    reverse index: the first is read and kept, the second goes aside unread."""
    git(repo, "-c", "pack.writeReverseIndex=true", "repack", "-q", "-a", "-d")
    (repo / "f").write_text("new\n")
    git(repo, "commit", "-qam", "more")
    git(repo, "-c", "pack.writeReverseIndex=true", "repack", "-q")
    revs = sorted(_pack(repo).glob("*.rev"))
    assert len(revs) == 2
    one = max((r.with_suffix(".idx").stat().st_size + r.stat().st_size for r in revs))
    monkeypatch.setattr(derived, "READ_BUDGET", one + 8)
    moved, failed = derived.clear(str(repo / ".git" / "objects"), "", time.time_ns() - 10**9, None)
    assert len(moved) == 1 and not failed
    monkeypatch.setattr(derived, "READ_BUDGET", 2 * one + 8)  # the twin: enough for both
    (moved_back := Path(moved[0])).rename(_pack(repo) / os.path.basename(moved[0]).split(".quarantined")[0])
    assert not moved_back.exists()
    assert derived.clear(str(repo / ".git" / "objects"), "", time.time_ns() - 10**9, None) == ([], [])


def test_without_a_keep_the_end_still_moves_a_forged_bitmap(repo: Path, tmp_path: Path) -> None:
    """A record that could not keep the object files (its note says why)
    still has its time: a bitmap made since goes aside all the same."""
    import msgspec
    kept = msgspec.structs.replace(_recorded(repo, tmp_path), keep="")
    (repo / "f").write_text("new\n")
    git(repo, "commit", "-qam", "more")
    git(repo, "-c", "repack.writeBitmaps=true", "repack", "-q", "-a")
    done, _ = history.restore(kept, in_place=True)
    assert any("1 pack bitmaps or reverse indexes" in why for _, why in done), done


def _checkpoint(repo: Path, tmp_path: Path) -> None:
    """What a checkpoint keeps: every object file the keep lacks (``keep_more``)."""
    ofd = os.open(repo / ".git" / "objects", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        history.keep_more(ofd, str(tmp_path / "keep"), str(repo / ".git"), [1 << 30])
    finally:
        os.close(ofd)


def test_a_checkpointed_bitmap_the_session_deleted_is_not_put_back(repo: Path, tmp_path: Path) -> None:
    """The session's pack and its bitmap, kept by a checkpoint, then deleted
    by the session: the pack is put back (it may hold the session's work),
    its bitmap is not (git would take it at its word)."""
    kept = _recorded(repo, tmp_path)
    user = {p.name for p in _pack(repo).iterdir()}
    (repo / "f").write_text("new\n")
    git(repo, "commit", "-qam", "more")
    git(repo, "-c", "repack.writeBitmaps=true", "repack", "-q", "-a")
    _checkpoint(repo, tmp_path)
    new = [p for p in _pack(repo).iterdir() if p.name not in user]
    assert any(p.suffix == ".bitmap" for p in new) and all((tmp_path / "keep" / "pack" / p.name).exists() for p in new)
    for p in new:
        p.unlink()
    done, failed = history.restore(kept, in_place=True)
    assert not failed, failed
    back = {p.name for p in _pack(repo).iterdir()} - user
    assert back and not [n for n in back if n.endswith(derived.DERIVED)], back  # the pack and index only
    assert git(repo, "fsck", "--no-progress") == ""


def test_the_user_s_reverse_index_the_keep_links_stays_when_it_cannot_be_read(
        repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Full mode: the keep links the user's reverse index (its ctime is the
    link's); past ``MAX_OBJECTS`` it is not read, and is left, unreported,
    at every end (the twin: within the bound it is read, and holds)."""
    git(repo, "-c", "pack.writeReverseIndex=true", "repack", "-q", "-a", "-d")
    time.sleep(SETTLE_S)
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), ["refs/heads/main"])  # all held: linked
    for bound in (2, derived.MAX_OBJECTS):
        monkeypatch.setattr(derived, "MAX_OBJECTS", bound)
        done, failed = history.restore(kept, in_place=True)
        assert not failed and not [why for _, why in done if "bitmaps" in why], done
        assert len(list(_pack(repo).glob("*.rev"))) == 1


def test_a_daemon_killed_while_it_moves_a_forged_reverse_index_does_not_bring_it_back(
        repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The keep's link to the session's bytes goes before the move: a daemon
    killed between the two (the move stands for it) leaves nothing the next
    start's restore would put back (the control: the link is gone at once)."""
    from dispatchd.daemon.gitguard import fs
    kept, rev, _ = _linked_rev_forged(repo, tmp_path, monkeypatch)

    def killed(dir_fd: int, name: str) -> str:
        raise KeyboardInterrupt  # the daemon's end, half way
    monkeypatch.setattr(fs, "move_aside_at", killed)
    with pytest.raises(KeyboardInterrupt):
        history.restore(kept, in_place=True)
    assert not (tmp_path / "keep" / "pack" / rev.name).exists()
    monkeypatch.undo()
    done, failed = history.restore(kept, in_place=True)  # the next start's
    assert not failed and not rev.exists(), (done, failed)


def test_a_pack_directory_that_cannot_be_resolved_holds_none(tmp_path: Path) -> None:
    """A chain of symbolic links too deep to follow where a pack directory
    was (a session's): no pack taken for held, so the keep copies them all,
    instead of an error on every join (the twin: a plain one names its own)."""
    from dispatchd.daemon.gitguard import packlinks
    common = tmp_path / "repo" / ".git"
    (common / "objects" / "pack").mkdir(parents=True)
    name = "pack-" + "1" * 40 + ".pack"
    assert packlinks.held_names([str(common / "objects" / "pack" / name)], str(common)) == {name}
    target = tmp_path / "end"
    target.mkdir()
    for i in range(1200):
        (tmp_path / f"l{i}").symlink_to(target)
        target = tmp_path / f"l{i}"
    os.rmdir(common / "objects" / "pack")
    (common / "objects" / "pack").symlink_to(target)
    assert packlinks.held_names([str(common / "objects" / "pack" / name)], str(common)) == frozenset()
