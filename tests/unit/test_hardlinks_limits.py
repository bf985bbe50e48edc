"""What the ends' look for hard links in ``objects`` leaves open, pinned
(docs/git-protection.md, "Left open"): a new name made elsewhere for an
object the repository already had is not seen, as the fan-out directory's
ctime does not move; a name made into the directory is."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.unit.gitrepo import git, one_file_repo
from tests.unit.test_hardlinks_users import AREA, baseline, end

pytestmark = pytest.mark.process  # starts git


def _settled_repo(tmp_path: Path) -> tuple[Path, Path]:
    """A repository of one file, and its blob's loose object file."""
    repo = one_file_repo(tmp_path / "repo", "app.py")
    blob = git(repo, "hash-object", "app.py").strip()
    time.sleep(0.1)  # the fan-out directories' ctimes well before the baseline
    return repo, repo / ".git" / "objects" / blob[:2] / blob[2:]


@pytest.mark.known_limit
def test_an_object_the_repository_had_linked_out_to_a_new_name_is_not_split_known_limit(tmp_path: Path) -> None:
    """``ln .git/objects/ab/<38 hex> tool.sh`` by a session on the main
    worktree: the end leaves both names one inode, so a later linked
    session could write ``tool.sh`` through the object's name."""
    repo, obj = _settled_repo(tmp_path)
    part = baseline(repo)
    os.link(obj, repo / "tool.sh")
    assert end(part) == ([], [])
    assert os.stat(repo / "tool.sh").st_ino == os.stat(obj).st_ino


def test_a_name_linked_into_a_fan_out_directory_is_split(tmp_path: Path) -> None:
    """The twin: a name added into the fan-out directory moves its ctime;
    the end stats its object-named files and splits the one linked since."""
    repo, obj = _settled_repo(tmp_path)
    part = baseline(repo)
    planted = obj.parent / ("f" * 38)
    os.link(repo / "app.py", planted)
    done, failed = end(part)
    assert failed == [] and (str(planted), AREA.format(1)) in done
    assert os.stat(planted).st_nlink == 1
