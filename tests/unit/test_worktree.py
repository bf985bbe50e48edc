"""dispatchd.daemon.worktree.check_worktree: every refusal by its exact message, and success.

Another owner is simulated by passing ``uid=os.getuid() + 1``: the directory
is then not "ours". Each refusal has an accepted twin (``ok``) built the same way.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dispatchd.daemon.worktree import check_worktree
from dispatchd.errors import WorktreeError

UID = os.getuid()


@pytest.fixture
def base(tmp_path: Path) -> Path:
    # realpath: the tmp directory itself may sit behind a symlink.
    base = Path(os.path.realpath(tmp_path))
    (base / "home").mkdir()
    (base / "home" / "wt").mkdir()
    (base / "state").mkdir()
    (base / "run").mkdir()
    return base


def check(path: str, base: Path, *, uid: int = UID, protected: list[str] | None = None) -> str:
    home = str(base / "home")
    if protected is None:
        protected = [str(base / "state"), str(base / "run")]
    return check_worktree(path, uid=uid, home=home, protected=protected, private=[str(base / "state")])


def refusal(path: str, base: Path, **kwargs: object) -> WorktreeError:
    with pytest.raises(WorktreeError) as info:
        check(path, base, **kwargs)  # type: ignore[arg-type]
    assert info.value.path == path
    assert info.value.code == "bad_worktree"
    return info.value


def test_ok(base: Path):
    assert check(str(base / "home" / "wt"), base) == str(base / "home" / "wt")


def test_empty_path(base: Path):
    assert refusal("", base).message == "no worktree given"


@pytest.mark.parametrize("path", ["wt", "./wt", "home/wt", "~/wt", "../wt"])
def test_relative_path(base: Path, path: str):
    assert refusal(path, base).message == f"the worktree must be an absolute path: {path!r}"


def test_missing(base: Path):
    path = str(base / "home" / "missing")
    assert refusal(path, base).message == f"worktree does not exist: {path}"


def test_dangling_symlink_is_missing(base: Path):
    link = base / "home" / "dangling"
    link.symlink_to(base / "nowhere")
    assert refusal(str(link), base).message == f"worktree does not exist: {link}"


def test_not_a_directory(base: Path):
    f = base / "home" / "file.txt"
    f.write_text("x")
    assert refusal(str(f), base).message == f"worktree is not a directory: {f}"


def test_a_path_through_a_file_cannot_be_inspected(base: Path):
    f = base / "home" / "file.txt"
    f.write_text("x")
    path = str(f / "sub")
    assert refusal(path, base).message == f"cannot inspect worktree {path}: Not a directory"


def test_root(base: Path):
    assert refusal("/", base).message == "the worktree cannot be / (the whole machine)"


def test_root_spelled_otherwise(base: Path):
    path = str(base) + "/" + "../" * (str(base).count("/") + 1)
    assert refusal(path, base).message == "the worktree cannot be / (the whole machine)"


def test_a_symlink_to_root(base: Path):
    link = base / "home" / "root"
    link.symlink_to("/")
    assert refusal(str(link), base).message == "the worktree cannot be / (the whole machine)"


def test_home_itself(base: Path):
    home = str(base / "home")
    assert refusal(home, base).message == f"the worktree cannot be the home directory itself ({home})"


def test_home_with_a_trailing_slash(base: Path):
    home = str(base / "home")
    assert refusal(home + "/", base).message == f"the worktree cannot be the home directory itself ({home})"


def test_a_symlink_to_home(base: Path):
    link = base / "state" / "to-home"
    link.symlink_to(base / "home")
    assert refusal(str(link), base).message == f"the worktree cannot be the home directory itself ({base / 'home'})"


def test_home_given_through_a_symlink(base: Path):
    link = base / "home-link"
    link.symlink_to(base / "home")
    with pytest.raises(WorktreeError) as info:
        check_worktree(str(base / "home"), uid=UID, home=str(link), protected=[])
    assert info.value.message == f"the worktree cannot be the home directory itself ({link})"


def test_other_owner(base: Path):
    wt = str(base / "home" / "wt")
    other = UID + 1
    assert refusal(wt, base, uid=other).message == f"worktree {wt} belongs to uid {UID}, not to you (uid {other})"


def test_contains_a_protected_path(base: Path):
    sock = base / "home" / "wt" / "run" / "dispatchd.sock"
    sock.parent.mkdir()
    wt = str(base / "home" / "wt")
    err = refusal(wt, base, protected=[str(sock)])
    assert err.message == f"worktree {wt} contains dispatchd's own files ({sock})"


def test_is_a_protected_path(base: Path):
    state = str(base / "state")
    assert refusal(state, base).message == f"worktree {state} contains dispatchd's own files ({state})"


def test_a_parent_of_the_state_directory(base: Path):
    with pytest.raises(WorktreeError) as info:
        check_worktree(str(base), uid=UID, home=str(base / "home"), protected=[str(base / "state")])
    assert info.value.message == f"worktree {base} contains dispatchd's own files ({base / 'state'})"


def test_protected_path_reached_through_a_symlink(base: Path):
    # The protected path is compared resolved: a symlink to it inside the
    # worktree does not hide that the worktree holds it.
    real = base / "home" / "wt" / "state"
    real.mkdir()
    link = base / "state-link"
    link.symlink_to(real)
    wt = str(base / "home" / "wt")
    assert refusal(wt, base, protected=[str(link)]).message == f"worktree {wt} contains dispatchd's own files ({link})"


def test_a_sibling_with_a_shared_prefix_is_not_protected(base: Path):
    (base / "state2").mkdir()
    assert check(str(base / "state2"), base) == str(base / "state2")


@pytest.mark.parametrize("inside", ["sessions", "sessions/other"])
def test_inside_the_state_directory(base: Path, inside: str):
    # The module refuses a worktree holding the daemon's state because "a
    # session there could reach ... the other sessions' scratch directories".
    # STATE/sessions holds every session's scratch (HOME, TMPDIR) as much as
    # STATE does, so a worktree inside a protected path must be refused too.
    wt = base / "state" / inside
    wt.mkdir(parents=True)
    err = refusal(str(wt), base)
    assert err.message == f"worktree {wt} is inside dispatchd's own files ({base / 'state'})"


def test_inside_the_socket_directory_is_allowed(base: Path):
    # The socket's directory only must not be *inside* a worktree (a session
    # would see it); a worktree below it reaches nothing (no Unix sockets).
    wt = base / "run" / "wt"
    wt.mkdir(parents=True)
    assert check(str(wt), base) == str(wt)


def test_symlinked_worktree_resolves(base: Path):
    link = base / "home" / "link"
    link.symlink_to(base / "home" / "wt")
    assert check(str(link), base) == str(base / "home" / "wt")


def test_unnormalised_path_resolves(base: Path):
    path = str(base / "home" / "wt") + "/./../wt/"
    assert check(path, base) == str(base / "home" / "wt")


def test_worktree_may_hold_unrelated_directories(base: Path):
    (base / "home" / "wt" / "sub").mkdir()
    assert check(str(base / "home" / "wt"), base, protected=[str(base / "state"), str(base / "run")]) == str(
        base / "home" / "wt")
