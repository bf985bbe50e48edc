"""dispatchd.daemon.gitguard.taints: a worktree a check could not finish on
is refused; one refused by a check beside live sessions of its domain is
lifted once the domain's last end passes, never otherwise. Pure (``Taints``),
then through the store with real repositories: two sessions of one
worktree, the first's end unable to put the user's hooks back while the
second takes back the write permission the end lends the hooks directory
(stood in for by a lend that does nothing), each beside its twin; a daemon
that dies in between (its domain's lock let go) and the next start's check."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import baselines, fs, layouts, parts, redirects, snapshots, taints
from tests.unit.gitrepo import empty_repo, git

W = "/home/u/repo"
FINAL = "until a restart's check passes"
LAST_END = "until the check at the end of the last session still open on it passes, or a restart's"


# --- pure ----------------------------------------------------------------------------------------


def test_a_refusal_beside_live_sessions_is_lifted_by_the_last_end_s_pass() -> None:
    t = taints.Taints()
    t.fail([W, W + "-linked"], "x: Permission denied", final=False)
    assert t.why == {W: "x: Permission denied", W + "-linked": "x: Permission denied"}
    assert t.until(W) == LAST_END
    assert t.refusal(W + "/src") == (f"{W}/src: a session left files here that dispatchd could not move aside (x: "
                                     f"Permission denied); look at them (your own tools would run them); sessions on "
                                     f"it are refused {LAST_END}")
    said = t.lift([W, W + "-linked"], 5.0)
    assert [(p.path, p.why, p.time) for p in said] == [(W, taints.LIFTED, 5.0), (W + "-linked", taints.LIFTED, 5.0)]
    assert t.why == {} and t.refusal(W) == ""
    assert t.take_lifted() == [W, W + "-linked"] and t.take_lifted() == []  # once


def test_the_twin_a_refusal_of_a_last_end_waits_for_a_restart() -> None:
    t = taints.Taints()
    t.fail([W], "x: Permission denied", final=False)
    t.fail([W], "y: the repository's git directory is gone", final=True)  # the last end failed too: its reason
    assert t.lift([W]) == [] and t.why == {W: "y: the repository's git directory is gone"}
    assert t.until(W) == FINAL and t.refusal(W).endswith(f"sessions on it are refused {FINAL}")
    assert t.take_lifted() == []


def test_a_refusal_until_a_restart_is_not_lifted_by_a_later_domain_s_pass() -> None:
    """One a start's check left (a dead daemon's record), then a check beside
    live sessions failing on the same worktree: a pass of that domain lifts
    none of it."""
    t = taints.Taints()
    t.fail([W], "from a start", final=True)
    t.fail([W], "beside live sessions", final=False)
    assert t.lift([W]) == [] and t.why == {W: "from a start"} and t.until(W) == FINAL


def test_a_pass_lifts_only_its_own_domain_s_roots_and_the_refusal_is_exact_or_overlapping() -> None:
    t = taints.Taints()
    t.fail([W], "mine", final=False)
    t.fail(["/home/u/other"], "another's", final=False)
    assert [p.path for p in t.lift([W])] == [W] and t.why == {"/home/u/other": "another's"}
    assert t.refusal("/home/u/other/sub", inside=False) == "" and t.refusal("/home/u/other/sub")
    assert t.refusal("/home/u/else") == ""  # the twin: unrelated


def test_a_root_lifted_then_refused_again_keeps_its_other_daemons_entry() -> None:
    t = taints.Taints()
    t.fail([W], "first", final=False)
    t.lift([W])
    t.fail([W], "again", final=True)
    assert t.take_lifted() == []


# --- through the store ---------------------------------------------------------------------------


HOOK = "#!/bin/sh\n# the user's {}\n"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    r = empty_repo(tmp_path / "repo", "empty")
    (r / ".githooks").mkdir()
    for name in ("pre-commit", "pre-push"):
        (r / ".githooks" / name).write_text(HOOK.format(name))
        (r / ".githooks" / name).chmod(0o755)
    git(r, "config", "core.hooksPath", ".githooks")
    return r


def _join(store: baselines.Baselines, sid: str, root: Path) -> None:
    layout = layouts.inspect_git(str(root), uid=os.getuid())
    store.join(sid, str(root), layout, snapshots.take(str(root), layout, keep=True),
               redirects.redirects_present(layout, str(root)), ("vscode-like",), reach=(str(root), *layout.writable))


def _plant_and_hold(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the live session does: rewrites the hooks, and takes back at once
    the write permission an end lends their directory (``chmod 555`` in a loop)."""
    for name in ("pre-commit", "pre-push"):
        with open(repo / ".githooks" / name, "a") as f:
            f.write("touch PLANTED\n")
    (repo / ".githooks").chmod(0o555)
    monkeypatch.setattr(fs, "lend", lambda fd: 0o555)


def _two_sessions_one_holding(repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> baselines.Baselines:
    """Sessions "a" and "b" on ``repo``, "b" planting and holding the hooks
    directory (``_plant_and_hold``): "a"'s end cannot put them back."""
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "a", repo)
    _join(store, "b", repo)
    _plant_and_hold(repo, monkeypatch)
    return store


def _let_go(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """That session's processes are gone: nothing takes the permission back."""
    monkeypatch.undo()
    (repo / ".githooks").chmod(0o755)


def _failed(found: list[parts.Protected]) -> list[parts.Protected]:
    return [p for p in found if p.why.startswith(parts.NOT_WHOLE)]


def _hooks_are_the_user_s(repo: Path) -> bool:
    return all((repo / ".githooks" / n).read_text() == HOOK.format(n) for n in ("pre-commit", "pre-push"))


@pytest.mark.process
def test_a_non_final_end_that_cannot_put_back_refuses_until_the_last_end_passes(
        repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _two_sessions_one_holding(repo, tmp_path, monkeypatch)
    [said] = _failed(store.leave("a"))  # beside b, still live
    hook = repo / ".githooks" / "pre-commit"
    assert said.path == str(repo) and said.why.startswith(
        f"{parts.NOT_WHOLE}: {hook}: changed by a session, yours cannot be put back (Permission denied)")
    assert said.why.endswith(f"dispatchd refuses sessions on it {LAST_END}")
    with pytest.raises(baselines.WorktreeError, match=f"could not move aside .*sessions on it are refused {LAST_END}$"):
        _join(store, "c", repo)
    _let_go(repo, monkeypatch)
    found = store.leave("b")  # the last end: no process of the domain left
    assert _failed(found) == [] and _hooks_are_the_user_s(repo)
    assert [p.why for p in found if p.path == str(repo)] == [taints.LIFTED]
    assert store.tainted == {} and store.taints.take_lifted() == [str(repo)]
    assert os.listdir(tmp_path / "state" / "baselines") == []
    _join(store, "c", repo)  # opens again
    assert store.leave("c") == []


@pytest.mark.process
def test_the_twin_a_last_end_that_cannot_put_back_either_keeps_the_refusal_with_its_reason(
        repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _two_sessions_one_holding(repo, tmp_path, monkeypatch)
    store.leave("a")
    [said] = _failed(store.leave("b"))  # still held: the last end fails too
    assert said.why.endswith(f"dispatchd refuses sessions on it {FINAL}")
    assert "yours cannot be put back (Permission denied)" in store.tainted[str(repo)]
    assert store.taints.until(str(repo)) == FINAL and store.taints.take_lifted() == []
    with pytest.raises(baselines.WorktreeError, match=f"sessions on it are refused {FINAL}$"):
        _join(store, "c", repo)
    assert len([n for n in os.listdir(tmp_path / "state" / "baselines") if n.endswith(".json")]) == 1
    _let_go(repo, monkeypatch)
    fresh = baselines.Baselines(str(tmp_path / "state"))  # a restart: its check puts them back, and passes
    fresh.recover()
    assert fresh.tainted == {} and _hooks_are_the_user_s(repo)


@pytest.mark.process
def test_a_daemon_killed_between_the_two_ends_leaves_the_record_and_the_next_start_puts_back(
        repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal is in memory, and goes with the daemon; the record, still
    naming the live session, is on disk: the next start runs the last end's
    check on it, which puts the user's hooks back and passes."""
    store = _two_sessions_one_holding(repo, tmp_path, monkeypatch)
    assert _failed(store.leave("a")) and str(repo) in store.tainted
    _let_go(repo, monkeypatch)  # b's processes die with its daemon
    for domain in list(store._domains.values()):
        os.close(domain.lock_fd)  # the daemon's death lets its lock go
    fresh = baselines.Baselines(str(tmp_path / "state"))
    found = fresh.recover()
    assert fresh.tainted == {} and _hooks_are_the_user_s(repo)
    assert {p.why for p in found if p.path == str(repo / ".githooks" / "pre-commit")} == {
        "yours, as it was before the session changed it, put back"}
    assert os.listdir(tmp_path / "state" / "baselines") == []


@pytest.mark.process
def test_the_twin_killed_and_still_held_the_start_s_check_refuses_until_the_next_restart(
        repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _two_sessions_one_holding(repo, tmp_path, monkeypatch)
    store.leave("a")
    for domain in list(store._domains.values()):
        os.close(domain.lock_fd)
    fresh = baselines.Baselines(str(tmp_path / "state"))
    fresh.recover()  # the hooks directory still cannot be written
    assert "yours cannot be put back (Permission denied)" in fresh.tainted[str(repo)]
    assert fresh.taints.until(str(repo)) == FINAL
    _let_go(repo, monkeypatch)


@pytest.mark.process
def test_the_twin_with_nothing_held_the_first_end_puts_back_and_refuses_nothing(
        repo: Path, tmp_path: Path) -> None:
    store = baselines.Baselines(str(tmp_path / "state"))
    _join(store, "a", repo)
    _join(store, "b", repo)
    for name in ("pre-commit", "pre-push"):
        with open(repo / ".githooks" / name, "a") as f:
            f.write("touch PLANTED\n")
    found = store.leave("a")
    assert _failed(found) == [] and _hooks_are_the_user_s(repo) and store.tainted == {}
    assert store.leave("b") == [] and store.taints.take_lifted() == []
