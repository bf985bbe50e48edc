"""Escapes through the filesystem: reading, writing and changing what lies outside the worktree.

Every attempt runs twice in the same session with the same code: on a path in
the worktree (the control, which must work) and on the path it is after. Where
the user could do it unconfined, the same code outside proves that the refusal
came from the sandbox. Full mode: the session's root holds none of the user's
files (ENOENT), and what it holds is read-only but the worktree and the
scratch directory (EROFS); degraded mode refuses both with EACCES (Landlock
alone). ``test_layers.py`` shows that either layer of full mode holds alone.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import shutil
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import dispatch
from tests.conftest import shell, wait_until
from tests.escape.attempts import (
    EACCES, EBUSY, ENOENT, EPERM, EROFS, EXDEV, SYS, attempt, attempt_outside, background,
)
from tests.escape.conftest import MODES_WITH_LIMIT, Sandbox


def _ok(value: object) -> str:
    return f"OK {value!r}"


def _up(path: Path) -> str:
    """As many ``/..`` as climb from ``path`` to ``/``."""
    return "/.." * (len(path.parts) - 1)


# Ways to read a file: each takes the file and the worktree, plants what it
# needs from outside, and returns the probe's body.
def _absolute(f: Path, wt: Path) -> str:
    return f"result = open({str(f)!r}).read()"


def _dotdot_from_worktree(f: Path, wt: Path) -> str:
    return f"result = open({str(wt) + _up(wt) + str(f)!r}).read()"


def _proc_self_root(f: Path, wt: Path) -> str:
    return f"result = open({'/proc/self/root' + str(f)!r}).read()"


def _proc_self_cwd(f: Path, wt: Path) -> str:
    return f"result = open({'/proc/self/cwd' + _up(wt) + str(f)!r}).read()"


def _symlink_planted_in_worktree(f: Path, wt: Path) -> str:
    link = wt / f"link-to-{f.name}"
    link.symlink_to(f)
    return f"result = open({str(link)!r}).read()"


def _symlink_made_by_the_session(f: Path, wt: Path) -> str:
    return (f"link = f'{wt}/made-{{os.getpid()}}'\n"
            f"os.symlink({str(f)!r}, link)\n"
            f"result = open(link).read()")


def _directory_symlink(f: Path, wt: Path) -> str:
    link = wt / f"dir-of-{f.name}"
    link.symlink_to(f.parent)
    return f"result = open({str(link / f.name)!r}).read()"


def _openat_from_an_o_path_directory(f: Path, wt: Path) -> str:
    # O_PATH opens are not checked by Landlock: the openat below must be.
    return (f"d = os.open({str(f.parent)!r}, os.O_PATH | os.O_DIRECTORY)\n"
            f"result = os.read(os.open({f.name!r}, os.O_RDONLY, dir_fd=d), 4096).decode()")


def _reopen_an_o_path_descriptor(f: Path, wt: Path) -> str:
    return (f"fd = os.open({str(f)!r}, os.O_PATH)\n"
            f"result = open(f'/proc/self/fd/{{fd}}').read()")


READ_ROUTES = [_absolute, _dotdot_from_worktree, _proc_self_root, _proc_self_cwd, _symlink_planted_in_worktree,
               _symlink_made_by_the_session, _directory_symlink, _openat_from_an_o_path_directory,
               _reopen_an_o_path_descriptor]


@pytest.mark.parametrize("route", READ_ROUTES, ids=lambda r: r.__name__.strip("_"))
def test_reading_a_file_in_the_home_directory_is_refused(
    sandbox: Sandbox, session: dispatch.Session, worktree: Path, own_file: Path, home_secret: Path, route: Callable[[Path, Path], str],
) -> None:
    assert attempt(session, route(own_file, worktree)) == _ok(own_file.read_text())
    body = route(home_secret, worktree)
    assert attempt(session, body) == sandbox.unreachable(home_secret)  # full: not in its root
    assert attempt_outside(body) == _ok(home_secret.read_text())


def test_listing_the_home_directory_is_refused(session: dispatch.Session, worktree: Path, own_file: Path) -> None:
    """Full mode: where dispatchd's code lives in the home directory, the root
    holds the way to it, with nothing else, and Landlock (no rule there) still
    refuses listing it; otherwise it is absent. Degraded: Landlock."""
    listing = "result = sorted(os.listdir({path!r}))"
    assert attempt(session, listing.format(path=str(worktree))) == _ok(sorted(os.listdir(worktree)))
    assert attempt(session, listing.format(path=str(Path.home()))) in (EACCES, ENOENT)


def _two_paths(call: str, src: Path, dst: Path) -> str:
    """An attempt's code: ``os.<call>(src, dst)`` (link, rename)."""
    return f"result = os.{call}({str(src)!r}, {str(dst)!r})"


def _full_mode_home_errno(sandbox: Sandbox, session: dispatch.Session) -> str:
    """What full mode answers a rename between the worktree and the home
    directory: the kernel looks at the two directories first, so where the
    root holds the way to the home directory (dispatchd's code there, a
    read-only mount of its own) EXDEV (two mounts), else ENOENT (no home)."""
    return EXDEV if sandbox.create_verdict(session, Path.home()) == EROFS else ENOENT


def test_hard_linking_a_home_file_into_the_worktree_is_refused(
    sandbox: Sandbox, session: dispatch.Session, worktree: Path, own_file: Path, home_secret: Path,
) -> None:
    assert attempt(session, _two_paths("link", own_file, worktree / "own-link")) == "OK None"
    # Full mode: the home file is not in the session's root. Degraded mode:
    # one filesystem, and Landlock refuses a link that would give the file the
    # worktree's rights, with EXDEV (as it does for a refused "refer").
    got = attempt(session, _two_paths("link", home_secret, worktree / "secret-link"))
    assert got == sandbox.expect(full=ENOENT, degraded=EXDEV)
    assert not os.path.lexists(worktree / "secret-link")
    if os.stat(Path.home()).st_dev == os.stat(worktree).st_dev:  # the link is possible at all
        assert attempt_outside(_two_paths("link", home_secret, worktree / "outside-link")) == "OK None"


def test_moving_a_home_file_into_the_worktree_is_refused(
    sandbox: Sandbox, session: dispatch.Session, worktree: Path, own_file: Path, home_secret: Path,
) -> None:
    assert attempt(session, _two_paths("rename", own_file, worktree / "moved-own")) == "OK None"
    out = attempt(session, _two_paths("rename", home_secret, worktree / "moved-secret"))
    assert out == sandbox.expect(full=_full_mode_home_errno(sandbox, session), degraded=EACCES)
    assert home_secret.exists() and not os.path.lexists(worktree / "moved-secret")


def test_moving_a_worktree_file_out_to_the_home_directory_is_refused(
    sandbox: Sandbox, session: dispatch.Session, worktree: Path, own_file: Path,
) -> None:
    assert attempt(session, _two_paths("rename", own_file, worktree / "renamed")) == "OK None"
    target = Path.home() / f"dispatch-escape-moved-{secrets.token_hex(6)}"
    out = attempt(session, _two_paths("rename", worktree / "renamed", target))
    assert out == sandbox.expect(full=_full_mode_home_errno(sandbox, session), degraded=EACCES)
    assert not os.path.lexists(target)


CREATE = {
    "file": ("result = open({path!r}, 'x').write('escape')", "OK 6"),
    "directory": ("result = os.mkdir({path!r})", "OK None"),
    "symlink": ("result = os.symlink('/etc/passwd', {path!r})", "OK None"),
    "fifo": ("result = os.mkfifo({path!r})", "OK None"),
    # socket(AF_UNIX) is refused (seccomp): a stream socketpair's socket, bound to the path.
    "unix socket": ("a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)\nresult = a.bind({path!r})",
                    "OK None"),
}


@pytest.mark.parametrize("kind", CREATE)
def test_creating_anything_in_the_home_directory_is_refused(
    sandbox: Sandbox, session: dispatch.Session, worktree: Path, kind: str,
) -> None:
    code, ok = CREATE[kind]
    name = f"dispatch-escape-created-{secrets.token_hex(6)}"
    if kind == "unix socket":
        # The twin where a session makes its sockets: its own TMPDIR (never the
        # worktree, which another session may reach: test_ipc.py).
        here = "os.chdir(os.environ.get('TMPDIR', '/tmp'))\n"
        assert attempt(session, here + code.format(path=name)) == ok
    else:
        assert attempt(session, code.format(path=name)) == ok  # relative: in the worktree, the command's cwd
        assert os.path.lexists(worktree / name)
    target = Path.home() / name
    assert attempt(session, code.format(path=str(target))) == sandbox.create_verdict(session, Path.home())
    assert not os.path.lexists(target)


# /etc and /usr are root's, so in degraded mode EACCES would come from the
# file modes too; /var/tmp is writable by everyone, so there it is Landlock's.
@pytest.mark.parametrize("directory", ["/etc", "/usr", "/usr/local/bin", "/var/tmp"])
def test_writing_to_system_directories_is_refused(
    sandbox: Sandbox, session: dispatch.Session, worktree: Path, directory: str,
) -> None:
    write = "result = open({path!r}, 'x').write('escape')"
    name = f"dispatch-escape-{secrets.token_hex(6)}"
    assert attempt(session, write.format(path=str(worktree / name))) == "OK 6"
    target = os.path.join(directory, name)
    # Full mode: /var is not in the session's root (ENOENT); the others are read-only binds.
    full = ENOENT if directory == "/var/tmp" else EROFS
    assert attempt(session, write.format(path=target)) == sandbox.expect(full=full, degraded=EACCES)
    assert not os.path.lexists(target)


def test_a_file_written_to_tmp_never_reaches_the_hosts_tmp(sandbox: Sandbox, session: dispatch.Session) -> None:
    """Full mode: /tmp is the session's own, so the write works and lands there.
    Degraded mode: the host's /tmp is simply not granted."""
    target = f"/tmp/dispatch-escape-{secrets.token_hex(6)}"
    out = attempt(session, f"result = open({target!r}, 'x').write('escape')")
    assert out == sandbox.expect(full="OK 6", degraded=EACCES)
    assert not os.path.lexists(target)


MODIFY = {
    "append": "result = open({path!r}, 'a').write('escape')",
    "truncate": "result = os.truncate({path!r}, 0)",
    "unlink": "result = os.unlink({path!r})",
}


@pytest.mark.parametrize("op", MODIFY)
def test_changing_a_home_file_is_refused(
    sandbox: Sandbox, session: dispatch.Session, own_file: Path, home_owned: Path, op: str,
) -> None:
    assert attempt(session, MODIFY[op].format(path=str(own_file))).startswith("OK ")
    before = home_owned.read_text()
    # Full mode: the file is not in the root; a write that would create it
    # (append) or remove it (unlink) fails on the read-only way to it if the
    # root holds one (EROFS), else there is no directory (ENOENT).
    full = sandbox.create_verdict(session, Path.home()) if op in ("append", "unlink") else ENOENT
    assert attempt(session, MODIFY[op].format(path=str(home_owned))) == sandbox.expect(full=full, degraded=EACCES)
    assert home_owned.read_text() == before


def _mode_changed(p: Path, before: os.stat_result) -> bool:
    return stat.S_IMODE(p.stat().st_mode) == 0o600 != stat.S_IMODE(before.st_mode)


def _times_changed(p: Path, before: os.stat_result) -> bool:
    return p.stat().st_mtime_ns == 0 != before.st_mtime_ns


def _xattr_set(p: Path, before: os.stat_result) -> bool:
    return "user.dispatch-escape" in os.listxattr(p)


def _inode_changed(p: Path, before: os.stat_result) -> bool:
    return p.stat().st_ctime_ns != before.st_ctime_ns


METADATA = {
    "chmod": ("result = os.chmod({path!r}, 0o600)", _mode_changed),
    "utime": ("result = os.utime({path!r}, ns=(0, 0))", _times_changed),
    "setxattr": ("result = os.setxattr({path!r}, 'user.dispatch-escape', b'1')", _xattr_set),
    "chown": ("result = os.chown({path!r}, os.getuid(), os.getgid())", _inode_changed),
}


@pytest.mark.parametrize("sandbox", MODES_WITH_LIMIT, indirect=True)
@pytest.mark.parametrize("op", METADATA)
def test_metadata_of_a_home_file(sandbox: Sandbox, session: dispatch.Session, own_file: Path, home_owned: Path, op: str) -> None:
    """Full mode: ENOENT (not in the session's root). Degraded mode: a KNOWN LIMIT, and it goes through:
    Landlock (ABI <= 7) does not check chmod, chown, utime or xattrs, and
    there is no read-only mount to stop them. The session's status says so."""
    code, changed = METADATA[op]
    assert attempt(session, code.format(path=str(own_file))) == "OK None"
    before = home_owned.stat()
    time.sleep(0.01)  # so that a change of ctime shows
    out = attempt(session, code.format(path=str(home_owned)))
    if sandbox.mode == "full":
        assert out == ENOENT
        assert not changed(home_owned, before)
    else:
        assert out == "OK None"
        assert changed(home_owned, before)
        gaps = session.status()["protections"]["leaves_open"]
        assert any(g.startswith("chmod, chown, utime and xattr changes on files the user owns") for g in gaps), gaps


def test_another_sessions_worktree_and_home_are_out_of_reach(
    sandbox: Sandbox, client: dispatch.Client, session: dispatch.Session, make_worktree: Callable[[str], Path],
) -> None:
    other = make_worktree("other")
    (other / "theirs.txt").write_text("their worktree\n")
    read = "result = open({path!r}).read()"
    with client.open_session(str(other)) as theirs:
        r = shell(theirs, 'echo "their home" > "$HOME/note" && echo "$HOME"')
        their_note = r.metadata["stdout"].strip() + "/note"
        for path, text in ((str(other / "theirs.txt"), "their worktree\n"), (their_note, "their home\n")):
            assert attempt(theirs, read.format(path=path)) == _ok(text)  # the owner reads it
            assert attempt(session, read.format(path=path)) == sandbox.unreachable(path)


def test_the_daemons_own_files_are_out_of_reach(
    sandbox: Sandbox, client: dispatch.Client, session: dispatch.Session, make_worktree: Callable[[str], Path],
) -> None:
    d = sandbox.daemon
    for path, code in ((str(d.log_path), "result = open({path!r}).read(20)"),
                       (os.path.dirname(d.socket), "result = os.listdir({path!r})")):
        assert attempt(session, code.format(path=path)) == sandbox.unreachable(path)
        assert attempt_outside(code.format(path=path)).startswith("OK ")
    # The scratch directories: with another session open, this one sees at
    # most its own (full mode rebuilds the path to it inside its private /tmp).
    sessions = str(d.state / "dispatchd" / "sessions")
    listing = f"result = sorted(os.listdir({sessions!r}))"
    with client.open_session(str(make_worktree("other"))) as other:
        assert attempt(session, listing) == sandbox.expect(full=_ok([session.id]), degraded=EACCES)
        outside = attempt_outside(listing)
        assert outside.startswith("OK "), outside
        # Beside the two sessions', only those of sandboxes made ahead (the pool's).
        seen = set(eval(outside[3:]))  # noqa: S307 (our own probe's repr of a list of str)
        assert {session.id, other.id} <= seen, seen

        def made() -> set[str]:
            return set(re.findall(r"event=pool_made kind=\S+ session=(\w+)", d.log()))

        # A sandbox being made ahead has its directory a moment before its log line.
        assert wait_until(lambda: seen - {session.id, other.id} <= made()), (seen, made())


# The file tools, which check paths themselves before the kernel does.
_VIA_LINK = "path escapes the worktree: '{path}' (through a symlink that points outside it)"
TOOL_ESCAPES = [
    ("read_file", "../{up}{rel}", "path escapes the worktree: '{path}'"),
    ("read_file", "/{rel}", "absolute paths are not allowed: '{path}' (give a path relative to the worktree root)"),
    ("read_file", "link", _VIA_LINK),
    ("read_file", "homedir/{name}", _VIA_LINK),
    ("write_file", "link", _VIA_LINK),
    ("write_file", "homedir/planted", _VIA_LINK),
    ("edit_file", "link", _VIA_LINK),
    ("create_file", "../planted", "path escapes the worktree: '{path}'"),
    ("list_files", "homedir", _VIA_LINK),
    ("search_files", "homedir", _VIA_LINK),
    ("shell_exec", "homedir", _VIA_LINK),
]
# Each tool's arguments, and its control: the same call on a path it may use
# (through an in-worktree symlink where the tool takes a file).
_TOOL_CALLS = {
    "read_file": ({}, {"path": "inner-link"}),
    "write_file": ({"content": "planted"}, {"path": "inner-link"}),
    "edit_file": ({"edits": [{"old_text": "own", "new_text": "mine"}]}, {"path": "inner-link"}),
    "create_file": ({"content": "planted"}, {"path": "created.txt"}),
    "list_files": ({}, {"path": "."}),
    "search_files": ({"query": "own"}, {"path": "."}),
    "shell_exec": ({"command": "cat inner-link"}, {"cwd": "."}),
}


@pytest.mark.parametrize(("tool", "path", "message"), TOOL_ESCAPES)
def test_file_tools_refuse_paths_that_leave_the_worktree(
    session: dispatch.Session, worktree: Path, own_file: Path, home_secret: Path, tool: str, path: str, message: str,
) -> None:
    (worktree / "link").symlink_to(home_secret)
    (worktree / "homedir").symlink_to(home_secret.parent)
    (worktree / "inner-link").symlink_to(own_file)
    path = path.format(up="../" * (len(worktree.parts) - 2), rel=str(home_secret)[1:], name=home_secret.name)
    params, control = _TOOL_CALLS[tool]
    where = "cwd" if tool == "shell_exec" else "path"
    r = session.registry.get(tool).call({**params, **control})
    assert r.is_success, r.error
    r = session.registry.get(tool).call({**params, where: path})
    assert r.is_failure
    assert r.error == message.format(path=path)
    assert home_secret.read_text().startswith("secret ") and not (Path.home() / "planted").exists()


_EXCHANGE = f"""
import ctypes, time
libc = ctypes.CDLL(None, use_errno=True)
end = time.monotonic() + 8
while time.monotonic() < end:  # renameat2(RENAME_EXCHANGE): the directory and the symlink trade places
    libc.syscall({SYS['renameat2']}, -100, b"inside", -100, b"swap", 2)
"""


def test_file_tools_lose_the_race_against_a_swapped_directory(
    session: dispatch.Session, worktree: Path, home_secret: Path,
) -> None:
    """The tools check a path, then open it; a command in the session swaps a
    directory of that path for a symlink to the home directory in between.
    The kernel must refuse what the check let through."""
    (worktree / "inside").mkdir()
    (worktree / "inside" / home_secret.name).write_text("decoy\n")
    (worktree / "swap").symlink_to(home_secret.parent)
    background(session, _EXCHANGE, 10)
    secret = home_secret.read_text()
    planted = f"dispatch-escape-race-{secrets.token_hex(6)}"
    outcomes = []
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        read = session.registry.get("read_file").call({"path": f"inside/{home_secret.name}"})
        write = session.registry.get("write_file").call({"path": f"inside/{planted}", "content": "planted"})
        for r in (read, write):
            text = r.output if r.is_success else r.error
            assert secret.strip() not in text
            outcomes.append(text)
    assert not [p for p in Path.home().iterdir() if planted in p.name]
    # Both sides of the swap were seen: the decoy read, and a refusal.
    assert "0: decoy" in outcomes
    assert any("through a symlink that points outside it" in o for o in outcomes)


_REPLACE_DOT_GIT = """
os.rename(".git", ".git-aside")  # the read-only mounts travel with it
os.mkdir(".git")
for name in ("HEAD", "objects", "refs"):
    os.rename(".git-aside/" + name, ".git/" + name)
result = open(".git/config", "w").write({config!r})
"""


@pytest.mark.parametrize("sandbox", MODES_WITH_LIMIT, indirect=True)
def test_the_users_git_never_runs_what_a_session_wrote(sandbox: Sandbox, client: dispatch.Client, worktree: Path) -> None:
    """The user's own git, outside, runs what .git/config names (core.fsmonitor
    here). Full mode: .git/config and .git/hooks are read-only binds (the
    direct write: EROFS), and .git itself is a mount point of its own, so it
    cannot be moved aside, the read-only binds with it, for a new .git to be
    built in its place (EBUSY); git's own writes to .git work (the control).
    Degraded mode: a KNOWN LIMIT, stated in leaves_open; no mount holds
    anything: the direct write and the replacement both go through, and the
    user's git run while the session is open would run the command; when it
    ends the daemon finds .git/config changed (by content) and moves it
    aside, so the user's git run afterwards runs nothing."""
    subprocess.run(["git", "init", "-q", str(worktree)], check=True, timeout=30)
    marker = f"PLANTED-BY-SESSION-{secrets.token_hex(4)}"
    config = f'[core]\n\trepositoryformatversion = 0\n\tfsmonitor = "echo {marker} >&2; false"\n'
    with client.open_session(str(worktree)) as s:
        assert s.status()["protections"]["git"]["kind"] == "repository"
        assert attempt(s, "result = open('.git/description', 'w').write('mine')") == "OK 4"  # git's own writes work
        direct = attempt(s, f"result = open('.git/config', 'a').write({config!r})")
        replaced = attempt(s, _REPLACE_DOT_GIT.format(config=config))
        gaps = s.status()["protections"]["leaves_open"]
    status = subprocess.run(["git", "-C", str(worktree), "status", "--short"], capture_output=True, text=True, timeout=30)
    ran = marker in status.stderr
    if sandbox.mode == "full":
        assert direct == EROFS
        assert (replaced, ran) == (EBUSY, False), f"the user's git ran the session's command: {status.stderr!r}"
    else:
        assert (direct, replaced, ran) == (f"OK {len(config)}", f"OK {len(config)}", False), status.stderr
        assert len(_quarantined(worktree / ".git", "config")) == 1
        assert any(g.startswith("git metadata (.git/config, hooks, pointer files) is writable") for g in gaps), gaps


_NESTED_REPOSITORY = r"""git init -q sub && \
git -C sub -c user.name=session -c user.email=session@invalid commit -q --allow-empty -m sub && \
printf '[core]\n\trepositoryformatversion = 0\n\tfsmonitor = "echo {marker} >&2; false"\n' > sub/.git/config && \
git update-index --add --cacheinfo "160000,$(git -C sub rev-parse HEAD),sub" && \
git ls-files --stage sub | cut -c1-6"""


def test_a_nested_repository_never_runs_in_the_users_git(sandbox: Sandbox, client: dispatch.Client, worktree: Path) -> None:
    """Neither .git/config nor .git/hooks is touched: the session makes a
    repository inside the worktree whose own config names a command
    (core.fsmonitor), and records it in the index as a gitlink (a submodule)
    with git itself; .git/index is writable, as the session's git needs (the
    control: the session's update-index goes through). The user's own git
    status would look into every populated submodule with that submodule's own
    config. When the session ends the daemon reads the index, finds the new
    submodule and moves its .git aside: the command never runs. Both modes."""
    subprocess.run(["git", "init", "-q", str(worktree)], check=True, timeout=30)
    marker = f"PLANTED-BY-SESSION-{secrets.token_hex(4)}"
    with client.open_session(str(worktree)) as s:
        r = shell(s, _NESTED_REPOSITORY.format(marker=marker))
        assert (r.metadata["exit_code"], r.metadata["stdout"]) == (0, "160000\n"), r.metadata["stderr"]
    status = subprocess.run(["git", "-C", str(worktree), "status", "--short"], capture_output=True, text=True, timeout=30)
    assert marker not in status.stderr, f"the user's git ran the session's command: {status.stderr!r}"
    assert not (worktree / "sub" / ".git").exists()
    assert [p.name.startswith(".git.quarantined-by-dispatchd-") for p in (worktree / "sub").iterdir()
            if p.name.startswith(".git")] == [True]


def test_a_nested_repository_hidden_behind_an_unsearchable_directory_never_runs_in_the_users_git(
    sandbox: Sandbox, client: dispatch.Client, worktree: Path,
) -> None:
    """The same nested repository, in a/sub, and then ``chmod 000 a``: the
    daemon (the user's uid) cannot look into ``a`` when the session ends, nor
    can the user's git, until the user makes ``a`` searchable again and git
    would run the command. What cannot be checked is not handed on: the index
    that records the submodule is moved aside (a ``git reset`` away), the
    nested repository stays, untracked, and the user's git runs nothing in it
    (the control: the session's update-index goes through). Both modes."""
    subprocess.run(["git", "init", "-q", str(worktree)], check=True, timeout=30)
    marker = f"PLANTED-BY-SESSION-{secrets.token_hex(4)}"
    try:
        with client.open_session(str(worktree)) as s:
            r = shell(s, "mkdir a && " + _NESTED_REPOSITORY.replace("sub", "a/sub").format(marker=marker)
                      + " && chmod 000 a")
            assert (r.metadata["exit_code"], r.metadata["stdout"]) == (0, "160000\n"), r.metadata["stderr"]
    finally:
        (worktree / "a").chmod(0o755)  # what the user would do next
    status = subprocess.run(["git", "-C", str(worktree), "status", "--short"], capture_output=True, text=True, timeout=30)
    assert marker not in status.stderr, f"the user's git ran the session's command: {status.stderr!r}"
    assert "?? a/" in status.stdout.splitlines()  # an untracked directory, no submodule
    assert [p.name.startswith("index.quarantined-by-dispatchd-") for p in (worktree / ".git").iterdir()
            if p.name.startswith("index")] == [True]
    # The nested repository is disarmed too (its config moved aside: a new
    # repository in the worktree), and nothing is lost
    aside = [p for p in (worktree / "a" / "sub" / ".git").iterdir() if p.name.startswith("config.quarantined-by-dispatchd-")]
    assert len(aside) == 1 and aside[0].read_text().count(marker) == 1
    with client.open_session(str(worktree)) as s:  # and the worktree opens again
        assert shell(s, "true").is_success


def _git(cwd: Path, *args: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="u", GIT_AUTHOR_EMAIL="u@invalid", GIT_COMMITTER_NAME="u",
               GIT_COMMITTER_EMAIL="u@invalid")
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, env=env,
                          timeout=30).stdout


@pytest.mark.parametrize("sandbox", MODES_WITH_LIMIT, indirect=True)
def test_no_git_directory_of_the_repository_runs_what_a_session_wrote(
    sandbox: Sandbox, client: dispatch.Client, worktree: Path, tmp_path: Path,
) -> None:
    """Beyond .git/config and .git/hooks: a submodule whose name has a slash
    (its git directory in .git/modules/libs/sub), a submodule kept in place
    (emb/.git), another linked worktree's entry, and a repository with no
    hooks directory at all. Full mode: each is read-only (EROFS), and a
    commondir planted in a submodule's git directory, which no mount can stop,
    is moved aside when the session ends; the user's git status and commit
    then run nothing of the session's. Degraded mode: a KNOWN LIMIT, the
    writes go through (leaves_open says git metadata is writable)."""
    _superproject(worktree, tmp_path, "libs/sub")
    _git(worktree, "worktree", "add", "-q", str(tmp_path / "other"), "-b", "other")
    for hooks in (worktree / ".git" / "hooks", worktree / "emb" / ".git" / "hooks"):
        subprocess.run(["rm", "-rf", str(hooks)], check=True)
    marker = f"PLANTED-BY-SESSION-{secrets.token_hex(4)}"
    fsmonitor = f'[core]\n\tfsmonitor = "echo {marker} >&2; false"\n'
    hook = f"#!/bin/sh\necho {marker} >&2\n"
    with client.open_session(str(worktree)) as s:
        # The control: git itself works in the superproject.
        assert shell(s, "git -c user.name=s -c user.email=s@invalid commit -q --allow-empty -m in && echo ok"
                     ).output == "ok\n"
        got = {
            "module config": attempt(s, f"result = open('.git/modules/libs/sub/config', 'a').write({fsmonitor!r})"),
            "embedded config": attempt(s, f"result = open('emb/.git/config', 'a').write({fsmonitor!r})"),
            "new hook": attempt(s, f"result = open('.git/hooks/pre-commit', 'w').write({hook!r})"),
            "other worktree": attempt(s, "result = open('.git/worktrees/other/commondir', 'w').write('../x')"),
        }
        planted = attempt(s, "result = open('.git/modules/libs/sub/commondir', 'w').write('../../../../../evil')")
    if sandbox.mode == "degraded":
        # The limit while the session runs; once it ends, what changed is
        # moved aside (each changed submodule's git directory whole, the
        # hook and the other worktree's commondir alone).
        assert set(got.values()) == {f"OK {len(fsmonitor)}", f"OK {len(hook)}", "OK 4"}, got
        status = subprocess.run(["git", "-C", str(worktree), "status"], capture_output=True, text=True, timeout=30)
        assert marker not in status.stderr, status.stderr
        assert [len(_quarantined(d, n)) for d, n in ((worktree / ".git" / "modules" / "libs", "sub"),
                (worktree / "emb", ".git"), (worktree / ".git" / "hooks", "pre-commit"),
                (worktree / ".git" / "worktrees" / "other", "commondir"))] == [1, 1, 1, 1]
        return
    assert got == {k: EROFS for k in got}, got
    assert planted == "OK 19"
    assert not (worktree / ".git" / "modules" / "libs" / "sub" / "commondir").exists()  # moved aside
    status = subprocess.run(["git", "-C", str(worktree), "status"], capture_output=True, text=True, timeout=30)
    (worktree / "f").write_text("f")
    _git(worktree, "add", "f")
    commit = subprocess.run(["git", "-C", str(worktree), "-c", "user.name=u", "-c", "user.email=u@invalid",
                             "commit", "-qm", "f"], capture_output=True, text=True, timeout=30)
    assert marker not in status.stderr + commit.stderr, status.stderr + commit.stderr
    assert commit.returncode == 0 and status.returncode == 0


def _superproject(worktree: Path, tmp_path: Path, sub: str = "sub") -> None:
    """``sub``, a submodule with its git directory in .git/modules/<sub>, and
    ``emb``, one kept in place (emb/.git), committed."""
    lib = tmp_path / "lib"
    _git(tmp_path, "init", "-q", str(lib))
    _git(lib, "commit", "-q", "--allow-empty", "-m", "lib")
    _git(worktree, "init", "-q")
    _git(worktree, "-c", "protocol.file.allow=always", "submodule", "add", "-q", str(lib), sub)
    (worktree / "emb").mkdir()
    _git(worktree / "emb", "init", "-q")
    _git(worktree / "emb", "commit", "-q", "--allow-empty", "-m", "emb")
    _git(worktree, "update-index", "--add", "--cacheinfo",
         f"160000,{_git(worktree / 'emb', 'rev-parse', 'HEAD').strip()},emb")
    _git(worktree, "commit", "-q", "-m", "submodules")


def _planted(tmp_path: Path) -> tuple[Path, str]:
    """A file the user's git would create, outside the worktree, if it ran
    the session's command; and a config naming that command."""
    marker = tmp_path / f"ran-{secrets.token_hex(4)}"
    return marker, f'[core]\n\trepositoryformatversion = 0\n\tfsmonitor = "touch {marker}; false"\n'


def _users_git_status(worktree: Path) -> subprocess.CompletedProcess[str]:
    """The user's own git, outside, after the session: status recurses into
    every populated submodule and runs its core.fsmonitor."""
    return subprocess.run(["git", "-C", str(worktree), "status", "--short"], capture_output=True, text=True,
                          timeout=60)


def _quarantined(where: Path, name: str) -> list[str]:
    return sorted(p.name for p in where.iterdir() if p.name.startswith(f"{name}.quarantined-by-dispatchd-"))


_REBUILD_MODULE = """
import os
os.rename({renamed!r}, {renamed!r} + "-aside")  # within its parent: one mount, so EBUSY, not EXDEV
os.makedirs(".git/modules/sub", exist_ok=True)
aside = {renamed!r} + ("-aside" if {renamed!r}.endswith("sub") else "-aside/sub")
for name in ("HEAD", "objects", "refs", "index"):
    os.rename(aside + "/" + name, ".git/modules/sub/" + name)
result = open(".git/modules/sub/config", "w").write({config!r})
"""


@pytest.mark.parametrize("renamed", [".git/modules/sub", ".git/modules"])
def test_a_rebuilt_submodule_git_directory_never_runs_in_the_users_git(
    sandbox: Sandbox, client: dispatch.Client, worktree: Path, tmp_path: Path, renamed: str,
) -> None:
    """A delayed escape: the session renames a submodule's git directory (or the
    whole .git/modules) away, its read-only binds with it, and rebuilds it
    with the old HEAD, objects, refs and index and a config naming a command;
    the submodule's gitfile is untouched. Full mode: each is a mount point of
    its own (EBUSY). Degraded mode: the rebuild goes through, and when the
    session ends the daemon finds a git directory whose config differs from
    the one it recorded at open and moves it aside. Either way the user's
    `git status` runs nothing (the marker file is absent). The allowed twin:
    test_work_in_submodules_leaves_the_users_git_as_it_was."""
    _superproject(worktree, tmp_path)
    marker, config = _planted(tmp_path)
    with client.open_session(str(worktree)) as s:
        got = attempt(s, _REBUILD_MODULE.format(renamed=renamed, config=config))
    status = _users_git_status(worktree)
    assert not marker.exists(), f"the user's git ran the session's command: {status.stderr!r}"
    modules = worktree / ".git" / "modules"
    if sandbox.mode == "full":
        assert got == EBUSY
        assert _quarantined(modules, "sub") == [] and status.returncode == 0, status.stderr
    else:
        assert got == f"OK {len(config)}"
        assert len(_quarantined(modules, "sub")) == 1 and not (modules / "sub").exists()
        assert "not a git repository" in status.stderr  # loud: the user's git says where it stopped


def test_a_rebuilt_git_directory_is_moved_aside_at_a_network_switch(
    sandbox: Sandbox, client: dispatch.Client, worktree: Path, tmp_path: Path,
) -> None:
    """The same rebuild of .git/modules, then a network switch: the new
    worker would have found the protected paths gone. The check runs at the
    switch (every process of the session is gone then): the rebuilt git
    directory is moved aside before the new worker starts, and the session
    goes on."""
    _superproject(worktree, tmp_path)
    marker, config = _planted(tmp_path)
    modules = worktree / ".git" / "modules"
    with client.open_session(str(worktree)) as s:
        got = attempt(s, _REBUILD_MODULE.format(renamed=".git/modules", config=config))
        s.set_network(False)
        after_switch = _quarantined(modules, "sub")
        assert shell(s, "true").is_success
    status = _users_git_status(worktree)
    assert not marker.exists(), f"the user's git ran the session's command: {status.stderr!r}"
    assert (got, len(after_switch)) == sandbox.expect(full=(EBUSY, 0), degraded=(f"OK {len(config)}", 1))


_TAKE_MODULES_AWAY = """
import os
os.rename(".git/modules", ".git/modules-gone")
result = "moved"
"""
_REBUILD_IN_A_SECOND_SESSION = """
import os
os.makedirs(".git/modules/sub")
for name in ("HEAD", "objects", "refs", "index"):
    os.rename(".git/modules-gone/sub/" + name, ".git/modules/sub/" + name)
open(".git/modules/sub/config", "w").write({config!r})
result = open("sub/.git", "w").write("gitdir: ../.git/modules/sub\\n")
"""


def test_a_git_directory_taken_away_in_one_session_and_rebuilt_in_the_next_never_runs(
    sandbox: Sandbox, client: dispatch.Client, worktree: Path, tmp_path: Path,
) -> None:
    """Across two sessions: the first moves .git/modules away, so that the
    second finds nothing to hold read-only, and the second rebuilds it with
    the command and points the gitfile back at it. Full mode: the first
    rename fails (EBUSY). Degraded: both go through; each session's end
    check compares with what it recorded at its own open: the first moves
    aside the gitfile that now leads nowhere, the second the new git
    directory and the new gitfile. The user's git runs nothing."""
    _superproject(worktree, tmp_path)
    marker, config = _planted(tmp_path)
    with client.open_session(str(worktree)) as s:
        first = attempt(s, _TAKE_MODULES_AWAY)
    with client.open_session(str(worktree)) as s:
        second = attempt(s, _REBUILD_IN_A_SECOND_SESSION.format(config=config))
    status = _users_git_status(worktree)
    assert not marker.exists(), f"the user's git ran the session's command: {status.stderr!r}"
    if sandbox.mode == "full":
        assert first == EBUSY and second.startswith("FileExistsError"), second
        assert status.returncode == 0, status.stderr
    else:
        assert (first, second) == ("OK 'moved'", "OK 28")
        assert len(_quarantined(worktree / ".git" / "modules", "sub")) == 1
        assert not (worktree / "sub" / ".git").exists()


def test_an_in_place_submodule_rebuilt_under_a_renamed_parent_never_runs(
    sandbox: Sandbox, client: dispatch.Client, worktree: Path, tmp_path: Path,
) -> None:
    """Past every mount point: emb/.git is one, but emb itself, a directory
    of the worktree, must stay renamable (git mv). The session renames emb,
    rebuilds emb/.git from a copy with a config naming the command, and the
    superproject's index still records emb. The end check compares content,
    not names or inodes: the rebuilt emb/.git is moved aside. Both modes."""
    _superproject(worktree, tmp_path)
    marker, config = _planted(tmp_path)
    with client.open_session(str(worktree)) as s:
        r = shell(s, "mv emb emb-aside && mkdir emb && cp -a emb-aside/.git emb/.git && "
                     f"printf %s {shlex.quote(config)} > emb/.git/config && echo rebuilt")
        assert r.output == "rebuilt\n", r.metadata["stderr"]
    status = _users_git_status(worktree)
    assert not marker.exists(), f"the user's git ran the session's command: {status.stderr!r}"
    assert len(_quarantined(worktree / "emb", ".git")) == 1 and not (worktree / "emb" / ".git").exists()


_NESTED_IN_SUBMODULE = r"""git init -q sub/inner && \
git -C sub/inner -c user.name=session -c user.email=session@invalid commit -q --allow-empty -m inner && \
printf %s {config} > sub/inner/.git/config && \
git -C sub update-index --add --cacheinfo "160000,$(git -C sub/inner rev-parse HEAD),inner" && echo planted"""


def test_a_submodule_of_a_submodule_never_runs_in_the_users_git(
    sandbox: Sandbox, client: dispatch.Client, worktree: Path, tmp_path: Path,
) -> None:
    """Both modes (was a known limit): a session makes a repository inside
    an existing submodule and records it in that submodule's own index
    (writable: the session's git needs it; the control: the update-index goes
    through). The end check reads the index of every git directory,
    recursively, finds the new git directory and moves it aside: the user's
    `git status`, recursing into submodules, runs nothing."""
    _superproject(worktree, tmp_path)
    marker, config = _planted(tmp_path)
    with client.open_session(str(worktree)) as s:
        r = shell(s, _NESTED_IN_SUBMODULE.format(config=shlex.quote(config)))
        assert r.output == "planted\n", r.metadata["stderr"]
    status = _users_git_status(worktree)
    assert not marker.exists(), f"the user's git ran the session's command: {status.stderr!r}"
    assert len(_quarantined(worktree / "sub" / "inner", ".git")) == 1
    assert status.returncode == 0, status.stderr


_WORK_IN_SUBMODULES = """set -e
export GIT_AUTHOR_NAME=s GIT_AUTHOR_EMAIL=s@invalid GIT_COMMITTER_NAME=s GIT_COMMITTER_EMAIL=s@invalid
echo x > sub/f && git -C sub add f && git -C sub commit -qm in-sub
echo y > emb/f && git -C emb add f && git -C emb commit -qm in-emb
git -C sub checkout -q "$(git ls-tree HEAD sub | cut -d' ' -f3 | cut -f1)"  # what `git submodule update` checks out
git -C sub checkout -q -
git add sub emb && git commit -qm bump
git status --short -- sub emb
echo done"""


def test_work_in_submodules_leaves_the_users_git_as_it_was(
    sandbox: Sandbox, client: dispatch.Client, worktree: Path, tmp_path: Path,
) -> None:
    """The allowed twin of the tests above: commits in both submodules, the
    checkout `git submodule update` makes (the command itself rewrites the
    submodule's config, read-only in full mode: run it outside), the
    superproject's gitlinks bumped, a network switch in between: nothing
    git reads for configuration changes, nothing is moved aside, and the
    user's git works with the session's commits."""
    _superproject(worktree, tmp_path)
    before = _users_git_status(worktree).stdout
    with client.open_session(str(worktree)) as s:
        s.set_network(False)
        r = shell(s, _WORK_IN_SUBMODULES)
        assert r.metadata["stdout"] == "done\n", r.metadata["stderr"]
    status = _users_git_status(worktree)
    assert status.returncode == 0 and status.stdout == before, status.stderr + status.stdout
    assert _git(worktree, "log", "--format=%s", "-1") == "bump\n"
    found = subprocess.run(["find", str(worktree), "-name", "*quarantined-by-dispatchd-*"], capture_output=True,
                           text=True, check=True).stdout
    assert found == ""


_REDIRECT_GIT = r"""mkdir evilc && ln -s ../.git/objects evilc/objects && ln -s ../.git/refs evilc/refs && \
cp .git/HEAD evilc/HEAD && \
printf '[core]\n\trepositoryformatversion = 0\n\tfsmonitor = "echo {marker} >&2; false"\n' > evilc/config && \
echo ../evilc > .git/commondir && echo planted"""


@pytest.mark.known_limit
def test_a_redirect_planted_in_git_works_until_the_session_ends_known_limit(
    sandbox: Sandbox, client: dispatch.Client, worktree: Path,
) -> None:
    """A KNOWN LIMIT, both modes: ``.git/commondir`` does not exist in a
    plain repository, and git must be able to create files in ``.git`` (its
    lock files, renamed over index, HEAD, packed-refs), so no mount and no
    Landlock rule can stop a session from creating it. While the session is
    open, the user's own git run outside reads the configuration it points to
    (here ``core.fsmonitor``, which runs a command). When the session ends the
    daemon moves it aside: from then on the user's git runs nothing of it.
    Do not run git in a worktree outside while an agent's session is open on
    it (a shell prompt or an editor that runs git does)."""
    subprocess.run(["git", "init", "-q", str(worktree)], check=True, timeout=30)
    marker = f"PLANTED-BY-SESSION-{secrets.token_hex(4)}"
    with client.open_session(str(worktree)) as s:
        assert shell(s, _REDIRECT_GIT.format(marker=marker)).output == "planted\n"
        during = subprocess.run(["git", "-C", str(worktree), "status"], capture_output=True, text=True, timeout=30)
    after = subprocess.run(["git", "-C", str(worktree), "status"], capture_output=True, text=True, timeout=30)
    assert marker in during.stderr  # the limit
    assert marker not in after.stderr and after.returncode == 0, after.stderr
    assert not (worktree / ".git" / "commondir").exists()


# What Landlock does not govern: a path's metadata, its link target, its
# extended attributes, watching it, and connecting to a socket there. Full
# mode: the session's root holds none of the user's files, so each gets
# ENOENT; the twin is the same probe on a worktree file. Degraded mode: a
# KNOWN LIMIT, stated in leaves_open (only connect() is refused, by seccomp).
SIGHT = {
    "stat": ("result = os.stat({path!r}).st_size > 0", "OK True"),
    "readlink": ("result = os.readlink({link!r}) == {path!r}", "OK True"),
    "getxattr": ("result = os.getxattr({path!r}, 'user.dispatch')", "OK b'secret'"),
    "inotify": ("fd = libc.inotify_init1(os.O_CLOEXEC)\n"
                "w = libc.inotify_add_watch(fd, {parent!r}.encode(), 0xfff)\n"
                "if w < 0:\n    raise OSError(ctypes.get_errno(), 'inotify_add_watch')\n"
                "result = w > 0", "OK True"),
    "connect": ("s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\nresult = s.connect({sock!r})", "OK None"),
}


def _metadata_targets(directory: Path, tag: str) -> dict[str, str]:
    """A file with an xattr, a symlink to it, and a listening socket, in ``directory``."""
    f = directory / f"meta-{tag}-{secrets.token_hex(4)}"
    f.write_text("content\n")
    try:
        os.setxattr(f, "user.dispatch", b"secret")
    except OSError:
        pass  # a filesystem without user xattrs: the probe then says so on both sides
    link = directory / f"{f.name}.link"
    link.symlink_to(f)
    return {"path": str(f), "link": str(link), "parent": str(directory), "sock": str(directory / f"{f.name}.sock")}


@pytest.mark.parametrize("sandbox", MODES_WITH_LIMIT, indirect=True)
@pytest.mark.parametrize("probe", SIGHT)
def test_the_metadata_of_the_users_files_is_out_of_sight(
    sandbox: Sandbox, session: dispatch.Session, worktree: Path, probe: str,
) -> None:
    import socket as socket_module

    code, ok = SIGHT[probe]
    home_dir = Path.home() / f"dispatch-escape-meta-{secrets.token_hex(4)}"
    home_dir.mkdir()
    listeners = []
    try:
        targets = {"worktree": _metadata_targets(worktree, "own"), "home": _metadata_targets(home_dir, "home")}
        for t in targets.values():
            s = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
            s.bind(t["sock"])
            s.listen(4)
            listeners.append(s)
        home = code.format(**targets["home"])
        assert attempt_outside(home) == ok  # the user can
        own = attempt(session, code.format(**targets["worktree"]))
        got = attempt(session, home)
        gaps = session.status()["protections"]["leaves_open"]
        if sandbox.mode == "full":
            assert (own, got) == (ok, ENOENT)
        elif probe == "connect":
            assert (own, got) == (EPERM, EPERM)  # no socket(AF_UNIX) without a root of its own
        else:
            assert (own, got) == (ok, ok)  # the limit
            assert any(g.startswith("metadata of files outside the worktree") for g in gaps), gaps
    finally:
        for s in listeners:
            s.close()
        shutil.rmtree(home_dir)
