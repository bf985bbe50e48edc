"""dispatchd.daemon.gitguard.hookslinks: the symbolic links on the way to a
hooks path in the worktree, recorded at the baseline (``on_the_way``, pure
on a tree made here) and made again at the end where a session changed
them, with the store's own check (real repositories made by git), each
beside its twin."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import msgspec
import pytest

from dispatchd.daemon.gitguard import baselines, fs, hookslinks, layouts, parts, redirects, snapshots
from tests.unit.gitrepo import empty_repo, git

ASIDE = "git configuration, hooks or state changed or new"
HOOK = "#!/bin/sh\n# the user's pre-commit\n"


def _said(target: str) -> str:
    return (f"yours, a link to {target} on the way to the hooks path (core.hooksPath), as it was before the session "
            "changed it, put back")


# --- on_the_way: pure, on a tree made here ----------------------------------------------------


def test_each_link_on_the_way_is_recorded_where_it_is_met(tmp_path: Path) -> None:
    w = tmp_path / "w"
    (w / "vendor" / "tools" / "hooks").mkdir(parents=True)
    (w / "tools").symlink_to("vendor/tools")
    (w / ".githooks").symlink_to("tools/hooks")
    assert hookslinks.on_the_way(str(w), str(w / ".githooks")) == {".githooks": "tools/hooks",
                                                                    "tools": "vendor/tools"}


def test_the_twin_a_plain_hooks_directory_has_no_link(tmp_path: Path) -> None:
    w = tmp_path / "w"
    (w / "tools" / "hooks").mkdir(parents=True)
    assert hookslinks.on_the_way(str(w), str(w / "tools" / "hooks")) == {}
    assert hookslinks.on_the_way(str(w), str(w / "not-there" / "hooks")) == {}


def test_a_link_leading_out_is_recorded_and_what_lies_outside_is_not(tmp_path: Path) -> None:
    w, out = tmp_path / "w", tmp_path / "out"
    (out / "hooks").mkdir(parents=True)
    (tmp_path / "hop").symlink_to("out")  # outside the worktree: not the session's to write
    w.mkdir()
    (w / ".githooks").symlink_to("../hop/hooks")
    assert hookslinks.on_the_way(str(w), str(w / ".githooks")) == {".githooks": "../hop/hooks"}


def test_a_loop_of_links_ends_the_walk(tmp_path: Path) -> None:
    w = tmp_path / "w"
    w.mkdir()
    (w / "a").symlink_to("b")
    (w / "b").symlink_to("a")
    assert hookslinks.on_the_way(str(w), str(w / "a" / "hooks")) == {"a": "b", "b": "a"}


# --- the end's check, through the store (git makes the repositories) ---------------------------


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """``core.hooksPath = .githooks``, ``.githooks -> tools/hooks``: the layout a repository tracks."""
    r = empty_repo(tmp_path / "repo", "empty")
    (r / "tools" / "hooks").mkdir(parents=True)
    (r / "tools" / "hooks" / "pre-commit").write_text(HOOK)
    (r / "tools" / "hooks" / "pre-commit").chmod(0o755)
    (r / ".githooks").symlink_to("tools/hooks")
    git(r, "config", "core.hooksPath", ".githooks")
    return r


def _join(store: baselines.Baselines, sid: str, root: Path) -> None:
    layout = layouts.inspect_git(str(root), uid=os.getuid())
    snap = snapshots.take(str(root), layout, keep=True)  # the open's look
    store.join(sid, str(root), layout, snap, redirects.redirects_present(layout, str(root)), ("vscode-like",),
               reach=(str(root), *layout.writable))


def _aside(path: Path) -> list[Path]:
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(path.name + fs.QUARANTINED))


@pytest.mark.process
def test_the_baseline_records_the_link_and_an_older_record_has_none(repo: Path) -> None:
    snap = snapshots.take(str(repo), layouts.inspect_git(str(repo), uid=os.getuid()), keep=True)
    assert snap.links == {".githooks": "tools/hooks"}
    assert ".githooks/pre-commit" not in snap.included and "tools/hooks/pre-commit" in snap.included
    assert snapshots.take(str(repo), layouts.inspect_git(str(repo), uid=os.getuid())).links == {}  # an end's look
    old = msgspec.json.encode(snap).replace(b'"links":{".githooks":"tools/hooks"}', b'"x":0')
    assert msgspec.json.decode(old, type=snapshots.GitSnapshot).links == {}  # judged as before: not at all


@pytest.mark.process
def test_a_link_replaced_by_an_empty_directory_is_put_back_and_said(repo: Path, tmp_path: Path) -> None:
    """The user's hooks were all still there, unchanged, and the end said
    nothing; their git looked in the empty directory and ran none of them."""
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "s", repo)
    (repo / ".githooks").unlink()
    (repo / ".githooks").mkdir()
    found = store.leave("s")
    [aside] = _aside(repo / ".githooks")
    assert {(p.path, p.why) for p in found} == {(str(aside), ASIDE), (str(repo / ".githooks"), _said("tools/hooks"))}
    assert os.readlink(repo / ".githooks") == "tools/hooks" and aside.is_dir() and list(aside.iterdir()) == []
    assert (repo / ".githooks" / "pre-commit").read_text() == HOOK and store.tainted == {}
    assert git(repo, "rev-parse", "--git-path", "hooks").strip() == ".githooks"


@pytest.mark.process
def test_a_link_to_hooks_outside_the_worktree_replaced_by_a_directory_is_put_back(tmp_path: Path) -> None:
    """``.githooks -> ../shared-hooks``: the hooks are not the session's to
    write, but the link is, and with it which hooks the user's git runs."""
    r = empty_repo(tmp_path / "repo", "empty")
    (tmp_path / "shared-hooks").mkdir()
    (tmp_path / "shared-hooks" / "pre-commit").write_text(HOOK)
    (r / ".githooks").symlink_to("../shared-hooks")
    git(r, "config", "core.hooksPath", ".githooks")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "s", r)
    (r / ".githooks").unlink()
    (r / ".githooks").mkdir()
    found = store.leave("s")
    [aside] = _aside(r / ".githooks")
    assert {(p.path, p.why) for p in found} == {(str(aside), ASIDE), (str(r / ".githooks"), _said("../shared-hooks"))}
    assert (r / ".githooks" / "pre-commit").read_text() == HOOK


@pytest.mark.process
def test_a_plant_in_the_directory_that_replaced_the_link_goes_aside_with_it(repo: Path, tmp_path: Path) -> None:
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "s", repo)
    (repo / ".githooks").unlink()
    (repo / ".githooks").mkdir()
    (repo / ".githooks" / "pre-commit").write_text("#!/bin/sh\ntouch PLANTED\n")
    found = store.leave("s")
    [aside] = _aside(repo / ".githooks")
    assert {(p.path, p.why) for p in found} == {(str(aside), ASIDE), (str(repo / ".githooks"), _said("tools/hooks"))}
    assert (aside / "pre-commit").read_text() == "#!/bin/sh\ntouch PLANTED\n"  # whole, with it: never deleted
    assert (repo / ".githooks" / "pre-commit").read_text() == HOOK


@pytest.mark.process
def test_a_link_led_elsewhere_is_put_back_and_the_other_directory_s_hook_moved_aside(repo: Path,
                                                                                    tmp_path: Path) -> None:
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "s", repo)
    (repo / "mine").mkdir()
    (repo / "mine" / "pre-commit").write_text("#!/bin/sh\ntouch PLANTED\n")
    (repo / ".githooks").unlink()
    (repo / ".githooks").symlink_to("mine")
    found = store.leave("s")
    [link_aside] = _aside(repo / ".githooks")
    [plant_aside] = _aside(repo / "mine" / "pre-commit")
    assert {(p.path, p.why) for p in found} == {
        (str(link_aside), ASIDE), (str(repo / ".githooks"), _said("tools/hooks")),
        (str(plant_aside), ASIDE)}
    assert os.readlink(link_aside) == "mine" and os.readlink(repo / ".githooks") == "tools/hooks"
    assert not (repo / "mine" / "pre-commit").exists()


@pytest.mark.process
def test_the_twin_a_link_left_alone_is_left_and_nothing_said(repo: Path, tmp_path: Path) -> None:
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "s", repo)
    ino = os.lstat(repo / ".githooks").st_ino
    (repo / "f").write_text("x\n")  # the session's work
    assert store.leave("s") == []
    assert os.lstat(repo / ".githooks").st_ino == ino and sorted(os.listdir(repo)) == [".git", ".githooks", "f",
                                                                                        "tools"]


@pytest.mark.process
def test_a_link_that_cannot_be_made_again_fails_the_check_and_says_why(repo: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "s", repo)
    (repo / ".githooks").unlink()
    (repo / ".githooks").mkdir()

    def refused(*args: object, **kwargs: object) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    monkeypatch.setattr(os, "symlink", refused)
    [said] = [p for p in store.leave("s") if p.why.startswith(parts.NOT_WHOLE)]
    failure = (f"{repo / '.githooks'}: the link to the hooks path changed by a session, yours cannot be put back "
               "(Permission denied)")
    assert said.path == str(repo) and said.why.startswith(f"{parts.NOT_WHOLE}: {failure}. ")
    assert store.tainted == {str(repo): failure}
    assert not os.path.lexists(repo / ".githooks")  # what stood there aside: git runs none of it


def test_a_part_joined_while_sessions_run_records_only_the_links_none_of_them_could_write(tmp_path: Path) -> None:
    snap = snapshots.GitSnapshot(links={".githooks": "tools/hooks"})
    root = str(tmp_path / "w")
    assert parts.keep_outside(snap, root, [root]).links == {}  # a session could have made it: not the user's
    assert parts.keep_outside(snap, root, None).links == {}  # not known: none
    assert parts.keep_outside(snap, root, [str(tmp_path / "other")]).links == {".githooks": "tools/hooks"}  # twin
