"""dispatchd.daemon.worktree.open_worktree: every refusal by its exact message, and success.

Another owner is simulated by passing ``uid=os.getuid() + 1``: the directory
is then not "ours". Each refusal has an accepted twin (``ok``) built the same way.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dispatchd.daemon.worktree import check_read_only_path, open_worktree
from dispatchd.errors import WorktreeError

UID = os.getuid()


def check_worktree(path: str, *, uid: int, home: str, protected: list[str], private: list[str] | None = None) -> str:
    """The resolved worktree path, or ``WorktreeError`` (checks only; the descriptor is closed)."""
    wt = open_worktree(path, uid=uid, home=home, protected=protected, private=private)
    wt.close()
    return wt.path


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


def users_symlink(link: Path, target: str | Path) -> None:
    """A symlink as the user makes one. Run as root, the test's own symlink
    would be root's, which the check trusts (only root could have made it):
    it is given to nobody (65534) instead, as any user's would be."""
    link.symlink_to(target)
    if os.geteuid() == 0:
        os.lchown(link, 65534, 65534)


def not_roots(path: str, link: Path) -> str:
    return (f"worktree {path} goes through a symlink ({link}) that is not root's: a session could have "
            "planted it to aim this one elsewhere; give the directory's real path")


def test_dangling_symlink_is_refused(base: Path):
    link = base / "home" / "dangling"
    users_symlink(link, base / "nowhere")
    assert refusal(str(link), base).message == not_roots(str(link), link)


def test_not_a_directory(base: Path):
    f = base / "home" / "file.txt"
    f.write_text("x")
    assert refusal(str(f), base).message == f"worktree is not a directory: {f}"


def test_a_path_through_a_file_cannot_be_inspected(base: Path):
    f = base / "home" / "file.txt"
    f.write_text("x")
    path = str(f / "sub")
    assert refusal(path, base).message == f"worktree is not a directory: {path}"


def test_root(base: Path):
    assert refusal("/", base).message == "the worktree cannot be / (the whole machine)"


def test_root_spelled_otherwise(base: Path):
    path = str(base) + "/" + "../" * (str(base).count("/") + 1)
    assert refusal(path, base).message == "the worktree cannot be / (the whole machine)"


def test_a_symlink_to_root(base: Path):
    link = base / "home" / "root"
    users_symlink(link, "/")
    assert refusal(str(link), base).message == not_roots(str(link), link)


def test_home_itself(base: Path):
    home = str(base / "home")
    assert refusal(home, base).message == f"the worktree cannot be the home directory itself ({home})"


def test_home_with_a_trailing_slash(base: Path):
    home = str(base / "home")
    assert refusal(home + "/", base).message == f"the worktree cannot be the home directory itself ({home})"


def test_a_symlink_to_home(base: Path):
    link = base / "state" / "to-home"
    users_symlink(link, base / "home")
    assert refusal(str(link), base).message == not_roots(str(link), link)


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
        check_worktree(str(base), uid=UID, home="/nonexistent-home", protected=[str(base / "state")])
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


def test_a_symlink_of_the_users_is_not_followed(base: Path):
    # One a session could have planted, or swapped in, to aim this open at ~/.ssh.
    link = base / "home" / "link"
    users_symlink(link, base / "home" / "wt")
    assert refusal(str(link), base).message == not_roots(str(link), link)
    assert refusal(str(link) + "/sub", base).message == not_roots(str(link) + "/sub", link)


def test_roots_symlinks_are_followed():
    # On Debian /lib is root's symlink to usr/lib: followed, and the path returned is the real one.
    if not os.path.islink("/lib"):
        pytest.skip("no root-owned /lib symlink on this system")
    wt = open_worktree("/lib/..", uid=0, home="/nonexistent", protected=[])
    try:
        assert wt.path == "/usr"
        assert os.path.samestat(os.fstat(wt.fd), os.stat("/usr"))
    finally:
        wt.close()


@pytest.mark.parametrize("name", [".ssh", ".gnupg", ".aws", ".config", ".config/gh", ".local/share/keyrings"])
def test_credential_directories_are_refused(base: Path, name: str):
    cred = base / "home" / name
    cred.mkdir(parents=True)
    home_cred = str(base / "home" / name.split("/")[0]) if name.startswith(".config/") else str(cred)
    assert refusal(str(cred), base).message == f"worktree {cred} is or holds your credentials ({home_cred}): refused"


def test_a_directory_holding_credentials_is_refused(base: Path):
    (base / "home" / "proj").mkdir()
    (base / "home" / ".ssh").mkdir()
    # Not the home directory itself, but a directory above it.
    assert refusal(str(base), base).message.startswith(f"worktree {base} is or holds your credentials")
    assert check(str(base / "home" / "proj"), base) == str(base / "home" / "proj")  # a sibling: fine


def test_the_descriptor_is_the_checked_directory(base: Path):
    wt = open_worktree(str(base / "home" / "wt"), uid=UID, home=str(base / "home"), protected=[])
    try:
        os.rename(base / "home" / "wt", base / "home" / "moved")
        (base / "home" / "wt").symlink_to(base / "home" / ".ssh-like")
        assert os.path.samestat(os.fstat(wt.fd), os.stat(base / "home" / "moved"))
    finally:
        wt.close()


@pytest.mark.parametrize("path", ["/usr/lib", "/opt"])
def test_extra_read_only_paths_that_are_fine(base: Path, path: str):
    assert check_read_only_path(path, home=str(base / "home"), protected=[str(base / "state")], where="x") == \
        os.path.realpath(path)


@pytest.mark.parametrize(("rel", "why"), [
    ("home", "would show the whole home directory (or more): refused"),
    ("", "would show the whole home directory (or more): refused"),
    ("home/.ssh", "is or holds your credentials"),
    ("home/.config/gh", "is or holds your credentials"),
    ("state", "is or holds dispatchd's own files"),
    ("state/sessions", "is or holds dispatchd's own files"),
])
def test_extra_read_only_paths_that_are_refused(base: Path, rel: str, why: str):
    path = base / rel
    path.mkdir(parents=True, exist_ok=True)
    with pytest.raises(WorktreeError) as info:
        check_read_only_path(str(path), home=str(base / "home"), protected=[str(base / "state")], where="read_only")
    assert info.value.code == "bad_worktree"
    assert info.value.message.startswith(f"read_only: {path} ") and why in info.value.message


def test_unnormalised_path_resolves(base: Path):
    path = str(base / "home" / "wt") + "/./../wt/"
    assert check(path, base) == str(base / "home" / "wt")


def test_worktree_may_hold_unrelated_directories(base: Path):
    (base / "home" / "wt" / "sub").mkdir()
    assert check(str(base / "home" / "wt"), base, protected=[str(base / "state"), str(base / "run")]) == str(
        base / "home" / "wt")


def test_an_extra_read_only_path_through_a_symlink_of_the_users_is_refused(base: Path):
    # A session could have aimed it at a secret, as for a worktree.
    (base / "home" / "tools").mkdir()
    link = base / "home" / "cargo-link"
    users_symlink(link, base / "home" / "tools")
    with pytest.raises(WorktreeError) as info:
        check_read_only_path(str(link), home=str(base / "home"), protected=[], where="read_only")
    assert info.value.message == (f"read_only: path {link} goes through a symlink ({link}) that is not root's: a "
                                  "session could have planted it to aim this one elsewhere; give the directory's "
                                  "real path")
    assert check_read_only_path(str(base / "home" / "tools"), home=str(base / "home"), protected=[],
                                where="read_only") == str(base / "home" / "tools")


def test_an_extra_read_only_file_is_fine(base: Path):
    tool = base / "home" / "tool.bin"
    tool.write_text("x")
    assert check_read_only_path(str(tool), home=str(base / "home"), protected=[], where="x") == str(tool)
