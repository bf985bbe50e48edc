"""A pack's bitmap or reverse index made or changed since the baseline is
moved aside (``derived.clear``), but a reverse index that is exactly the one
its pack's index gives (``expected_rev``: git's own, byte for byte), and
anything settled before the baseline; ``history.restore`` does it only when
a session could write, and puts a kept one of the user's back."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import time
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import derived, history

pytestmark = pytest.mark.process  # runs git

ENV = {**os.environ, "GIT_AUTHOR_NAME": "u", "GIT_AUTHOR_EMAIL": "u@example.invalid", "GIT_COMMITTER_NAME": "u",
       "GIT_COMMITTER_EMAIL": "u@example.invalid"}
SETTLE_S = 0.07  # past derived's 50 ms margin


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, env=ENV).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    r = tmp_path / "repo"
    r.mkdir()
    git(r, "init", "-q", "-b", "main")
    for n in range(3):
        (r / "f").write_text(f"{n}\n")
        git(r, "add", "f")
        git(r, "commit", "-qm", f"c{n}")
    return r


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
    moved, failed = derived.clear(str(repo / ".git" / "objects"), since)
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
    moved, _ = derived.clear(str(repo / ".git" / "objects"), since)
    assert len(moved) == 1 and not rev.exists()
    # The twin: git's own bytes, written again after the baseline, are kept.
    rev.write_bytes(honest)
    assert derived.clear(str(repo / ".git" / "objects"), since) == ([], [])
    assert rev.read_bytes() == honest


def test_past_the_bound_a_reverse_index_is_not_read(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    git(repo, "-c", "pack.writeReverseIndex=true", "repack", "-q", "-a", "-d")
    since = time.time_ns() - 10**9  # the repack's files are all newer
    monkeypatch.setattr(derived, "MAX_OBJECTS", 2)  # the pack holds 9
    rev = next(_pack(repo).glob("*.rev"))
    honest = rev.read_bytes()
    moved, _ = derived.clear(str(repo / ".git" / "objects"), since)
    assert len(moved) == 1 and os.path.basename(moved[0]).startswith(rev.name)
    monkeypatch.setattr(derived, "MAX_OBJECTS", 9)  # the twin: at the bound, read and kept
    rev.write_bytes(honest)
    assert derived.clear(str(repo / ".git" / "objects"), since) == ([], [])


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
