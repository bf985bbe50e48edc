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
    start = 8 + 256 * 4
    assert data[start:start + 20] == bytes.fromhex(other)
    data[start:start + 20] = bytes.fromhex(victim)
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
    packs = sorted(p.name for p in (objects / "pack").iterdir())
    done, failed = history.restore(kept)
    assert not failed and not [why for _, why in done if "pack a session made" in why], done
    assert sorted(p.name for p in (objects / "pack").iterdir()) == packs and _fsck(repo) == 0


def test_past_the_budget_a_pack_is_reported_not_verified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = commits_repo(tmp_path / "repo")
    kept, objects = _kept(tmp_path, repo)
    git(repo, "gc", "-q")
    monkeypatch.setattr(newpacks, "MAX_OBJECTS", 2)
    done, failed = history.restore(kept)
    assert not failed and any("not verified (it names" in why and "git fsck checks it" in why for _, why in done)
    assert _fsck(repo) == 0
    monkeypatch.setattr(newpacks, "MAX_OBJECTS", 200_000)
    monkeypatch.setattr(newpacks, "BUDGET_S", 0.0)
    time.sleep(0.01)
    done, failed = newpacks.check(str(objects), kept.keep)
    assert not failed and any("past the 0 s read at one end" in why for _, why in done), done
