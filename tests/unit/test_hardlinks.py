"""dispatchd.daemon.gitguard.hardlinks: another hard link of a file of the
user's, in a directory a later linked worktree's session may write, refuses
that session's open, and each end makes the file one of its own, only
with the bytes the end's look saw (real repositories made by git, linked
as a session could)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import arealinks, fs, hardlinks, keptfiles, layouts, parts, runnables, snapshots
from tests.unit.gitrepo import empty_repo, git

pytestmark = pytest.mark.process  # starts git

HOOK = "#!/bin/sh\nexec ./check-before-commit\n"
SPLIT = ("had 1 other hard link(s), a way to write it from where a session could; made a file of its own "
         "(the other names keep the old one)")
WRITTEN = "had 1 other hard link(s), a way to write it from where a session could, and was written through one " \
          "since the end's look"


def _take(repo: Path, keep: bool = False) -> snapshots.GitSnapshot:
    return snapshots.take(str(repo), layouts.inspect_git(str(repo), uid=os.getuid()), keep=keep)


def _detach(repo: Path, now: snapshots.GitSnapshot,
            kept: list[keptfiles.Kept] | None = None) -> tuple[list[tuple[str, str]], list[str]]:
    return hardlinks.detach(str(repo), now.gitdirs, now.by_file, now.included, kept or [], hardlinks.Copied())


def _hooks(repo: Path, where: str, size: int = 0) -> Path:
    """``core.hooksPath = where``, its pre-commit (mode 0750, ``HOOK`` and
    ``size`` more bytes) and pre-push; returns the directory."""
    hooks = repo / where
    hooks.mkdir()
    for name in ("pre-commit", "pre-push"):
        (hooks / name).write_text(HOOK + "#" * size if name == "pre-commit" else HOOK)
        (hooks / name).chmod(0o750)
    git(repo, "config", "core.hooksPath", where)
    return hooks


@pytest.mark.parametrize("size", [1024, 300 * 1024, 5 * 1024 * 1024])
@pytest.mark.parametrize("where", [".git/myhooks", ".githooks"])
def test_a_hard_link_of_a_hooks_path_hook_is_made_a_file_of_its_own(repo: Path, where: str, size: int) -> None:
    """A session hard-linked a hook of the hooks path into ``.git/logs``, its
    bytes unchanged: a later session of a linked worktree, granted ``logs``
    writable, wrote the hook through the link. The end makes it a file of
    its own, the same bytes and mode, the link keeping the old inode,
    whatever its size: a hook over ``keptfiles.MAX_FILE`` (256 KiB, a
    compiled one) was read by nothing and kept its link, said nowhere; it
    is streamed through its descriptor now. The twin: a hook of one name is
    left as it is, nothing said."""
    hooks = _hooks(repo, where, size)
    link = repo / ".git" / "logs" / "hk"
    os.link(hooks / "pre-commit", link)
    alone = os.stat(hooks / "pre-push").st_ino
    now = _take(repo)
    assert _detach(repo, now) == ([(str(hooks / "pre-commit"), SPLIT)], [])
    assert os.stat(hooks / "pre-commit").st_nlink == 1 and os.stat(link).st_nlink == 1
    assert (hooks / "pre-commit").read_text() == HOOK + "#" * size
    assert os.stat(hooks / "pre-commit").st_mode & 0o777 == 0o750
    link.write_text("#!/bin/sh\necho planted\n")
    assert (hooks / "pre-commit").read_text() == HOOK + "#" * size
    assert os.stat(hooks / "pre-push").st_ino == alone  # the twin
    assert _detach(repo, now) == ([], [])


def test_a_split_past_the_bytes_copied_at_one_end_fails_the_check_saying_so(
        repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copies of one part's end are bounded (``MAX_SPLIT``): past it the
    file keeps its link, and the check fails, saying which and why, never
    a silent skip. The twin: within it, the same file is made one of its own."""
    hooks = _hooks(repo, ".githooks", 3 << 19)  # 1.5 MiB
    os.link(hooks / "pre-commit", repo / ".git" / "logs" / "hk")
    now = _take(repo)
    monkeypatch.setattr(hardlinks, "MAX_SPLIT", 1 << 20)
    assert _detach(repo, now) == ([], [
        f"{hooks / 'pre-commit'}: had 1 other hard link(s), a way to write it from where a session could; not "
        "made a file of its own: past the 1 MiB copied at one end"])
    assert os.stat(hooks / "pre-commit").st_nlink == 2
    assert sorted(os.listdir(hooks)) == ["pre-commit", "pre-push"]  # nothing of ours left beside
    monkeypatch.setattr(hardlinks, "MAX_SPLIT", 2 << 20)
    assert _detach(repo, now) == ([(str(hooks / "pre-commit"), SPLIT)], [])


def test_the_bytes_a_session_wrote_after_the_look_are_never_made_the_user_s(repo: Path) -> None:
    """A session of a linked worktree, granted ``logs`` before the link was
    made, still runs: it writes the hook through the link after the end's
    look (which saw the user's bytes, so nothing was put back) and before
    the split reads it. Made a file of its own, the session's bytes were the
    user's hook, said only as a split, and no end looked at it again. Now a
    copy whose digest is not the look's is dropped: the user's kept bytes
    are written back (the session's kept aside), or, none kept, the hook is
    moved aside; said either way. The twin: unchanged since the look, the
    user's bytes are made a file of their own."""
    hooks = _hooks(repo, ".git/myhooks")
    link = repo / ".git" / "logs" / "hk"
    os.link(hooks / "pre-commit", link)
    before = _take(repo, keep=True)
    now = _take(repo)
    link.write_text("#!/bin/sh\ntouch PWNED\n")  # the running session, after the look
    done, failed = _detach(repo, now, before.kept)
    assert failed == [] and (hooks / "pre-commit").read_text() == HOOK
    aside = [p for p, why in done if why == "git configuration, hooks or state changed or new"]
    assert [(p, why) for p, why in done if p not in aside] == [
        (str(hooks / "pre-commit"), f"{WRITTEN}: yours, as it was before, put back")]
    assert len(aside) == 1 and Path(aside[0]).read_text() == "#!/bin/sh\ntouch PWNED\n"
    assert os.stat(hooks / "pre-commit").st_nlink == 1 and os.stat(hooks / "pre-commit").st_mode & 0o777 == 0o750
    # None kept (a hook over the bound, or a part joined while the session ran): moved aside.
    os.link(hooks / "pre-push", repo / ".git" / "logs" / "hk2")
    now = _take(repo)
    (repo / ".git" / "logs" / "hk2").write_text("#!/bin/sh\ntouch PWNED\n")
    done, failed = _detach(repo, now)
    assert failed == [] and not (hooks / "pre-push").exists()
    [(moved, why)] = done
    assert moved.startswith(str(hooks / "pre-push") + fs.QUARANTINED)
    assert why == f"{WRITTEN}: moved aside (no copy of yours was kept to put back)"
    # The twin.
    os.link(hooks / "pre-commit", repo / ".git" / "logs" / "hk3")
    assert _detach(repo, _take(repo), before.kept) == ([(str(hooks / "pre-commit"), SPLIT)], [])
    assert (hooks / "pre-commit").read_text() == HOOK


@pytest.mark.parametrize("name", [".envrc", ".vscode/tasks.json"])
def test_any_file_the_tree_walk_records_with_another_link_is_made_a_file_of_its_own(repo: Path, name: str) -> None:
    """A session on an outer worktree linked a file the user's tools run in
    the clone it holds (its ignored ``.envrc``, direnv's) into the clone's
    ``.git/logs``; a later session of the clone's linked worktree wrote it
    through ``logs``, and no end looked at it: the split covered only what
    git runs or reads. Now every file the tree walk records is split. The
    twins: the clone's config and hook (``detach_tree`` did those), and a
    file of one name, left as it is."""
    inner = empty_repo(repo / "inner", "inner")
    target = inner / name
    target.parent.mkdir(exist_ok=True)
    target.write_text("export A=1\n")
    (inner / ".git" / "myhooks").mkdir()
    (inner / ".git" / "myhooks" / "pre-commit").write_text(HOOK)
    (inner / ".git" / "hooks" / "pre-push").write_text(HOOK)
    git(inner, "config", "core.hooksPath", ".git/myhooks")
    for link, of in (("logs-x", target), ("logs-hk", inner / ".git" / "myhooks" / "pre-commit"),
                     ("logs-cfg", inner / ".git" / "config")):
        os.link(of, inner / ".git" / link)
    alone = os.stat(inner / ".git" / "hooks" / "pre-push").st_ino
    now = runnables.take(str(repo), skip_root_git=True)
    parts.nested_targets(str(repo), "", now.entries)
    done, failed = hardlinks.detach_tree(str(repo), now.entries, [], hardlinks.Copied())
    assert failed == [] and sorted(done) == sorted((str(p), SPLIT) for p in (
        target, inner / ".git" / "config", inner / ".git" / "myhooks" / "pre-commit"))
    for path in (target, inner / ".git" / "config", inner / ".git" / "myhooks" / "pre-commit"):
        assert os.stat(path).st_nlink == 1, path
    (inner / ".git" / "logs-x").write_text("touch PWNED\n")
    assert target.read_text() == "export A=1\n"
    assert os.stat(inner / ".git" / "hooks" / "pre-push").st_ino == alone  # the twin


def _linked(repo: Path, tmp_path: Path) -> Path:
    linked = tmp_path / "linked"
    git(repo, "worktree", "add", "-q", str(linked), "-b", "side")
    return linked


NOT_GRANTED = "has another hard link (a name elsewhere for the same file, which a write through would change); " \
              "not granted"
SPLIT_NEXT = " (the next end of a session on the main worktree makes this name a file of its own)"
BY_HAND = " (yours? `cp -p NAME NAME.new && mv NAME.new NAME` makes it a file of its own)"
OBJECT = "objects/ab/" + "c" * 38


@pytest.mark.parametrize("into", ["logs/hk", "refs/hk", "logs/refs/heads/deep/hk", "worktrees/linked/hk",
                                  "objects/hk", "objects/ab/hk", "objects/pack/tmp_pack_hk", "objects/zz/deep/hk",
                                  "objects/info/hk", "objects/pack/pack-" + "a" * 40 + ".pack/hk"])
def test_a_linked_open_refuses_while_any_file_in_logs_refs_or_objects_has_another_link(repo: Path, tmp_path: Path,
                                                                                       into: str) -> None:
    """Git never hard-links a file of ``logs``, ``refs`` or a linked
    worktree's own git directory, nor one in ``objects`` of a name not of
    git's (``arealinks.SHAPES``): one there with another name (a code file
    of the main worktree's, any size, which no end looks at) is a way for
    the linked session, granted those writable, to write that file. The
    twin: the same file linked at an object's name (``git clone --local``
    links every file there; those are not stat'ed at an open) refuses
    nothing, nor does one of one name."""
    linked = _linked(repo, tmp_path)
    code = repo / "main.c"
    code.write_bytes(b"int main(void) { return 0; }\n" + b"/" * (300 * 1024))
    name = repo / ".git" / into
    name.parent.mkdir(parents=True, exist_ok=True)
    os.link(code, name)
    layout = layouts.inspect_git(str(linked), uid=os.getuid())
    assert layout.kind == "refused" and layout.writable == []
    assert layout.note == f"{name} {NOT_GRANTED}{SPLIT_NEXT}"
    name.unlink()
    (repo / ".git" / OBJECT).parent.mkdir(exist_ok=True)
    os.link(code, repo / ".git" / OBJECT)
    assert layouts.inspect_git(str(linked), uid=os.getuid()).kind == "linked"  # the twin


def test_a_linked_open_refuses_past_the_files_it_looks_through(repo: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The look through ``logs``, ``refs`` and ``objects`` is bounded
    (``MAX_SCANNED``, 200,000 entries stat'ed, 2.6 us each): past it the
    open is refused, said, naming the directory listed then, not granted
    unlooked. The twin: within it, granted."""
    linked = _linked(repo, tmp_path)
    for i in range(30):
        git(repo, "branch", f"b{i}")
    monkeypatch.setattr(arealinks, "MAX_SCANNED", 20)
    layout = layouts.inspect_git(str(linked), uid=os.getuid())
    heads = repo / ".git" / "refs" / "heads"
    assert layout.kind == "refused" and layout.note == (
        f"{repo / '.git'}: more than 20 files in its refs, logs and objects to look at for hard links, "
        f"{len(os.listdir(heads))} of them in {heads} (`git pack-refs --all` packs the refs; a reflog or a file git "
        "does not use can be removed); not granted")
    monkeypatch.setattr(arealinks, "MAX_SCANNED", 200)
    assert layouts.inspect_git(str(linked), uid=os.getuid()).kind == "linked"


def test_a_linked_open_refuses_a_directory_of_logs_it_cannot_look_through(repo: Path, tmp_path: Path) -> None:
    """A directory of ``logs`` the daemon cannot list (a session's ``chmod
    000``, degraded mode) may hide a link: the linked session can give it
    its mode back and write through it. The open is refused, said. The
    twin: listable again, granted."""
    linked = _linked(repo, tmp_path)
    hidden = repo / ".git" / "logs" / "refs"
    hidden.chmod(0)
    try:
        layout = layouts.inspect_git(str(linked), uid=os.getuid())
    finally:
        hidden.chmod(0o755)
    assert layout.kind == "refused" and layout.note == (
        f"{hidden} cannot be looked through for hard links (Permission denied); not granted")
    assert layouts.inspect_git(str(linked), uid=os.getuid()).kind == "linked"


@pytest.mark.parametrize("linked_file", [".git/hooks.inc", ".githooks/pre-commit"])
def test_a_linked_open_refuses_while_a_file_its_config_names_has_another_link(repo: Path, tmp_path: Path,
                                                                               linked_file: str) -> None:
    """An included file inside the common directory, and a hook of a hooks
    path beside the code in the main worktree, are files git reads or runs:
    another name of one, wherever it is (``objects`` here, which the open
    does not stat at an object's name), refuses the linked open, as
    ``config`` does.
    The twin: the second name gone, granted."""
    (repo / ".githooks").mkdir()
    (repo / ".githooks" / "pre-commit").write_text(HOOK)
    (repo / ".git" / "hooks.inc").write_text("[core]\n\thooksPath = .githooks\n")
    git(repo, "config", "include.path", "hooks.inc")
    linked = _linked(repo, tmp_path)
    (repo / ".git" / OBJECT).parent.mkdir(exist_ok=True)
    os.link(repo / linked_file, repo / ".git" / OBJECT)
    layout = layouts.inspect_git(str(linked), uid=os.getuid())
    assert layout.kind == "refused" and layout.note == f"{repo / linked_file} {NOT_GRANTED}{BY_HAND}"
    (repo / ".git" / OBJECT).unlink()
    assert layouts.inspect_git(str(linked), uid=os.getuid()).kind == "linked"
