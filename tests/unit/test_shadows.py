"""What a session put in front of the user's short names, moved aside at
the end (``gitguard/shadows.py``): the names moved, exactly, and a check
whose cost grows with the number of names found, not with its square."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import fs, shadows


def _common(tmp_path: Path, refs: list[str]) -> Path:
    """A git directory holding ``refs`` in its ``packed-refs`` (no process:
    the check reads files alone)."""
    common = tmp_path / "repo.git"
    (common / "refs" / "heads").mkdir(parents=True)
    (common / "refs" / "tags").mkdir()
    (common / "HEAD").write_text("ref: refs/heads/main\n")
    lines = ["# pack-refs with: peeled fully-peeled sorted"] + sorted(f"{'1' * 40} {r}" for r in refs)
    (common / "packed-refs").write_text("\n".join(lines) + "\n")
    return common


def _plant(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("2" * 40 + "\n")


def test_the_names_in_front_are_moved_aside_and_the_user_s_own_left(tmp_path: Path) -> None:
    """The usual case: a few names, each moved aside once; one inside a
    directory moved whole is not moved again; the one the user had at the
    baseline stays."""
    refs = ["refs/heads/main", "refs/heads/feature/x", "refs/tags/v1", "refs/tags/v2"]
    common = _common(tmp_path, refs)
    _plant(common / "v2")  # the user's own, at the baseline
    (common / "worktrees" / "w0").mkdir(parents=True)
    baseline = shadows.present(str(common), refs)
    assert baseline == ["loose:v2"]
    for rel in ("v1", "refs/v1", "feature/x", "worktrees/w0/v1"):
        _plant(common / rel)
    done, failed = shadows.clear(str(common), refs, baseline)
    assert failed == []
    assert [path for path, _ in done] == [str(common / rel) for rel in ("feature", "refs/v1", "v1", "worktrees/w0/v1")]
    assert all("in front of one of your branches or tags (git resolves its short name there first); moved aside to "
               in why for _, why in done)
    assert sorted(os.listdir(common / "worktrees" / "w0")) == [os.path.basename(done[3][1].rsplit(" ", 1)[1])]
    assert (common / "v2").is_file() and not (common / "v1").exists() and not (common / "feature").exists()
    assert shadows.present(str(common), refs) == baseline  # nothing in front is left but the user's
    assert shadows.clear(str(common), refs, baseline) == ([], [])


@pytest.mark.parametrize("nested", [False, True])
def test_many_names_in_front_are_cleared_in_linear_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        nested: bool) -> None:
    """40,000 directories a session made in front of short names, each with
    a name inside it: each directory moved once, the names inside skipped.
    Comparing each name with every one moved before it was up to 1.6 * 10^9
    prefix tests here (minutes; under a second now); the moves are stood in
    for (the file system's cost is not what is measured), and the bound is
    generous."""
    count = 40_000
    names = [f"d{i}" for i in range(count)]
    found = sorted([f"loose:{n}" for n in names] + ([f"loose:{n}/x" for n in names] if nested else []))
    monkeypatch.setattr(shadows, "present", lambda common, refs: found)
    moves: list[str] = []

    def move_aside(path: str) -> str:
        moves.append(path)
        return path + ".aside"
    monkeypatch.setattr(fs, "move_aside", move_aside)
    common = str(tmp_path)
    began = time.monotonic()
    done, failed = shadows.clear(common, [], [])
    took = time.monotonic() - began
    assert failed == []
    assert sorted(moves) == sorted(os.path.join(common, n) for n in names)  # each once, none inside one moved
    assert [path for path, _ in done] == moves
    assert took < 10, f"{took:.1f} s to clear {count} names"
