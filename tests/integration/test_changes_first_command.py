"""A session's first command says what it changed in every directory of the
worktree, those the watch's first build did not list (no subdirectory:
dispatchd/tools/changes.py) as much as the others; in both modes."""

from __future__ import annotations

import os
from pathlib import Path

import dispatch
from tests.conftest import shell


def _worktree(tmp_path: Path) -> Path:
    wt = tmp_path / "wt"
    for d in ("pkg/sub/leaf", "docs", "empty", ".git"):
        (wt / d).mkdir(parents=True)
    for rel in ("pkg/a.py", "pkg/sub/b.py", "pkg/sub/leaf/c.py", "docs/d.md"):
        (wt / rel).write_text("x\n")
    return Path(os.path.realpath(wt))


def test_the_first_command_lists_changes_in_leaves_and_below(tmp_path: Path,
                                                             mode_client: tuple[str, dispatch.Client]) -> None:
    _, client = mode_client
    wt = _worktree(tmp_path)
    with client.open_session(str(wt)) as s:
        r = shell(s, "echo y >> pkg/sub/leaf/c.py && echo z > docs/new.md && mkdir empty/made && "
                     "echo w > empty/made/f && rm pkg/a.py")
        assert r.is_success, r.error
        assert sorted(r.metadata["changed"]) == ["docs/new.md", "empty/made", "empty/made/f", "pkg/a.py",
                                                 "pkg/sub/leaf/c.py"]
        assert "changed_unknown" not in r.metadata
        # The directory the first command made is watched from then on.
        later = shell(s, "echo v > empty/made/g")
        assert later.metadata["changed"] == ["empty/made/g"]


def test_a_first_command_that_only_reads_changed_nothing(tmp_path: Path,
                                                         mode_client: tuple[str, dispatch.Client]) -> None:
    _, client = mode_client
    wt = _worktree(tmp_path)
    with client.open_session(str(wt)) as s:
        r = shell(s, "cat pkg/sub/leaf/c.py docs/d.md && ls -R > /dev/null")
        assert r.is_success, r.error
        assert r.metadata["changed"] == [] and "changed_unknown" not in r.metadata
