"""Where dispatchd keeps its socket and its state; both commands resolve it alike.

The socket path is, in order: ``--socket PATH``, ``$DISPATCH_SOCKET``,
``$XDG_RUNTIME_DIR/dispatchd/dispatchd.sock``, and, when ``XDG_RUNTIME_DIR``
is unset, ``$XDG_STATE_HOME/dispatchd/run/dispatchd.sock``
(``~/.local/state/dispatchd/run/``): a directory inside the user's own home,
which another local user cannot create first. (It was ``/tmp/dispatchd-$UID``,
which anyone can create first, listen in and read every call sent to it.)

Both sides check the socket's directory by descriptor before they use it
(``open_socket_dir``): a directory, not a symlink, owned by the user, not
writable by group or others; the daemon creates it 0700. They then bind or
connect through ``/proc/self/fd/N/NAME``, so the directory checked is the one
used, whatever is renamed meanwhile, and a long path is no problem. The client
also checks the peer (``peer_problem``): a daemon of another uid is refused
before a byte is sent.

Session scratch directories (each session's private TMPDIR and HOME) live in
``$XDG_STATE_HOME/dispatchd/sessions`` (``~/.local/state/...``), on disk, so a
session cannot fill the user's RAM-backed runtime directory.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping


def default_socket_path(env: Mapping[str, str] | None = None, uid: int | None = None) -> str:
    env = os.environ if env is None else env
    uid = os.getuid() if uid is None else uid
    if env.get("DISPATCH_SOCKET"):
        return env["DISPATCH_SOCKET"]
    # XDG paths must be absolute (the spec says to ignore others): a relative
    # one would put the socket wherever the command happens to run.
    if os.path.isabs(env.get("XDG_RUNTIME_DIR", "")):
        return os.path.join(env["XDG_RUNTIME_DIR"], "dispatchd", "dispatchd.sock")
    return os.path.join(state_dir(env), "run", "dispatchd.sock")


def resolve_socket_path(explicit: str | None, env: Mapping[str, str] | None = None) -> str:
    return os.path.abspath(explicit) if explicit else default_socket_path(env)


def state_dir(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    base = env.get("XDG_STATE_HOME", "")
    if not os.path.isabs(base):
        home = env.get("HOME", "")
        base = os.path.join(home if os.path.isabs(home) else os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "dispatchd")


class UnsafeDirectory(Exception):
    pass


def what_to_do() -> str:
    """The advice after a refused socket or state directory: a place that works."""
    env = {k: v for k, v in os.environ.items() if k != "DISPATCH_SOCKET"}
    return ("dispatchd keeps its socket in a private directory of its own (mode 0700, yours): name a socket "
            f"in a directory you own or may create, e.g. --socket {default_socket_path(env)}")


def socket_dir_problem(st: os.stat_result, uid: int) -> str | None:
    """Why a directory (its ``lstat``) cannot hold our socket, or None. Pure."""
    if stat.S_ISLNK(st.st_mode):
        return "it is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != uid:
        return f"it belongs to uid {st.st_uid}, not to you (uid {uid})"
    if st.st_mode & 0o022:
        who = {0o020: "group", 0o002: "others", 0o022: "group and others"}[st.st_mode & 0o022]
        return f"it is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def peer_problem(peer_uid: int, peer_pid: int, uid: int) -> str | None:
    """Why the process serving a socket is not our daemon, or None. Pure."""
    if peer_uid != uid:
        return f"it is served by uid {peer_uid} (pid {peer_pid}), not by you (uid {uid})"
    return None


def open_socket_dir(directory: str) -> int:
    """An ``O_PATH`` descriptor of ``directory`` once it passed
    ``socket_dir_problem``; the caller closes it. Raises ``FileNotFoundError``
    when it does not exist and ``UnsafeDirectory`` (naming the path, the
    problem and what to do) when it is not fit."""
    try:
        fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except NotADirectoryError:
        st = os.lstat(directory)  # a symlink, or a file: say which
        if not stat.S_ISLNK(st.st_mode):
            raise
        fd = None
    if fd is None:
        problem = socket_dir_problem(os.lstat(directory), os.getuid())
    else:
        problem = socket_dir_problem(os.fstat(fd), os.getuid())
    if problem is not None:
        if fd is not None:
            os.close(fd)
        raise UnsafeDirectory(
            f"refusing the socket directory {directory}: {problem}, so another user could put a socket there; "
            f"use a directory of your own (mode 0700): remove or fix {directory}, or choose another path "
            "with --socket or $DISPATCH_SOCKET")
    assert fd is not None  # socket_dir_problem names a symlink as a problem
    return fd


def unsearchable(path: str) -> str:
    """The first directory on ``path``'s way that this user cannot search,
    in words ("" when none: the refusal is elsewhere): a chmod that took
    its search right away (a degraded session's, say) keeps everyone out."""
    path = os.path.abspath(path)
    parts = path.split(os.sep)[1:-1]
    for i in range(len(parts) + 1):
        directory = os.sep + os.path.join(*parts[:i]) if i else os.sep
        try:
            st = os.lstat(directory)
        except OSError:
            return ""
        if stat.S_ISDIR(st.st_mode) and not os.access(directory, os.X_OK):
            return (f"the directory {directory} cannot be searched (mode {stat.S_IMODE(st.st_mode):04o}); "
                    f"if it is yours, set its mode back (chmod 700 {directory})")
    return ""


def via_fd(fd: int, name: str) -> str:
    """The path of ``name`` inside the directory open as ``fd``, for bind and
    connect: it names exactly the directory that was checked."""
    return f"/proc/self/fd/{fd}/{name}"


def ensure_private_dir(path: str) -> None:
    """Create ``path`` (mode 0700) or check an existing one is ours and private.
    Refusals end with what to do instead (``what_to_do``)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise UnsafeDirectory(f"cannot create {path}: {exc.strerror}; {what_to_do()}") from exc
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{path} is not a directory (a symlink?); {what_to_do()}")
    if st.st_uid != os.getuid():
        raise UnsafeDirectory(f"{path} belongs to uid {st.st_uid}, not to us ({os.getuid()}); {what_to_do()}")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
