"""The session's view of the filesystem, in its own mount namespace.

Guarantees, once ``apply_mounts`` has returned (user namespaces only), with
the default ``root = "minimal"`` (as bubblewrap and nsjail build one):
- the session's root is a new tmpfs holding only what the plan binds: the
  system directories and the daemon's code read-only, the worktree (bound from
  the descriptor the daemon checked, never by name) and the session's scratch
  directory read-write, the policy's and the call's extra paths, the git
  directories the worktree needs (``GitLayout``), a private ``/tmp`` (the
  scratch ``tmp``), a fresh ``/dev`` (only the policy's device nodes, ``shm``
  a private tmpfs), a fresh ``/proc`` of the session's pid namespace. The
  host's root is detached (``pivot_root``): everything else — the home
  directory, other users, ``/root``, ``/run``, ``/var``, ``/srv``, ``/mnt``,
  the daemon's socket and state — does not exist: stat, readlink, getxattr,
  inotify and connect() get ENOENT;
- every mount is read-only except the worktree, the scratch directory, the
  private ``/tmp`` and ``/dev/shm`` and the policy's extra read-write paths,
  so chmod, utime and xattr changes elsewhere fail with EROFS;
- the git metadata the user's own git would run (``.git/config``, hooks, a
  linked worktree's pointer files; found by ``dispatchd.daemon.gitguard.layouts``)
  is read-only inside the writable worktree;
- every bind source is opened component by component without following a
  symlink, and bound from that descriptor: a path swapped for a symlink since
  it was planned fails the step, it never binds the symlink's target; a final
  symlink among the system paths (``/bin -> usr/bin``) is reproduced as one;
- nothing propagates back to the host (the whole tree is made private first).

It is built in two stages, so that the first can be done ahead of the
session (``dispatchd.daemon.pool``): ``apply_root`` makes the root with what
every session of the policy shares (system binds, ``/dev``, ``/proc``) and
pivots into it, keeping the host's root below at ``OLD_ROOT``;
``apply_session_mounts`` binds the session's own paths from there (the
worktree proven by inode against the daemon's descriptor), detaches the
host's root and makes the mounts read-only. No code of the session runs
before the second stage has returned.

``root = "host"`` (a policy's choice; the benchmark's baseline) keeps the
previous view: the host's ``/`` read-only with the user's runtime directories
covered, Landlock alone refusing the rest (EACCES rather than ENOENT).

The plan is data (``mountplan``: pure, what the daemon plans with); every
mount is made of the steps of ``mountsteps`` (by descriptor, no symlink
followed); this module puts them together in the session's namespace.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from dispatchd.confine import _sys
from dispatchd.confine.namespaces import limit_reached
from dispatchd.confine.mountplan import PTS, WORKTREE_FD, WORKTREE_STEP, Bind, MountPlan, describe_root, plan_mounts
from dispatchd.confine.mountsteps import (
    bind, bind_over_itself, fd_path, mount, mount_in, mount_point, open_nofollow)
from dispatchd.errors import ConfinementError
from dispatchd.inside import is_within

# The plan's names, handed on: the daemon plans with them, the worker applies.
__all__ = ["OLD_ROOT", "PTS", "WORKTREE_FD", "WORKTREE_STEP", "Bind", "MountPlan", "apply_mounts", "apply_root",
           "apply_session_mounts", "describe_root", "plan_mounts", "probe_host_tree"]

_NEW_ROOT = "/tmp"  # where the new root's tmpfs is mounted while it is built (as bubblewrap does)
OLD_ROOT = "/.host"  # where the host's root waits, below the new one, for the session's own paths


@contextmanager
def _sources(binds: list[Bind], worktree_fd: int, extra: list[str], host: str = "",
             host_fd: int = -1) -> Iterator[dict[str, int]]:
    """Every bind source, opened before anything is mounted over the host's
    paths; ``host`` is where the host's root is seen from here ("": at ``/``,
    or the old root kept under the session's own by ``apply_root``), or
    ``host_fd`` the host's root held by descriptor (``_hold_host``)."""
    fds: dict[str, int] = {}
    try:
        for b in binds:
            if b.source == WORKTREE_FD:
                fds[b.path] = _worktree_here(b.path, worktree_fd, host, host_fd)
                continue
            if b.how == "ro-over":
                continue  # opened in the new root, inside the worktree bound there
            fd = open_nofollow(host + (b.source or b.path), "open bind source", host_fd)
            if fd is not None:
                fds[b.path] = fd
        for path in extra:
            if path == PTS:
                continue  # a devpts of the session's own, never the host's
            fd = open_nofollow(host + path, "open device")
            if fd is not None:
                fds[path] = fd
        yield fds
    finally:
        for fd in fds.values():
            os.close(fd)


def _worktree_here(path: str, worktree_fd: int, host: str = "", host_fd: int = -1) -> int:
    """The worktree in this mount namespace, proven to be the directory the
    daemon checked. The daemon's descriptor names a mount of the namespace it
    was opened in, which the kernel will not bind into this one (EINVAL); so
    the path is walked again here (below ``host``, where the host's root is
    seen), without following a symlink, and must lead to the same inode, or
    the session is refused: a swap since the check can make an open fail,
    never give it another directory."""
    want = os.fstat(worktree_fd)
    try:
        fd = (_sys.open_no_symlinks(path.lstrip("/"), host_fd, beneath=True) if host_fd >= 0
              else _sys.open_no_symlinks(host + path))
    except OSError:
        fd = None  # gone, or a symlink on the way: not what was checked
    if fd is not None:
        got = os.fstat(fd)
        if (got.st_dev, got.st_ino) == (want.st_dev, want.st_ino) and stat.S_ISDIR(got.st_mode):
            return fd
        os.close(fd)
    raise ConfinementError(WORKTREE_STEP, path=path, detail="it was moved or replaced since the daemon checked it")


def _pivot_into(root_fd: int) -> None:
    """Make the new root ``/``, the host's kept beneath it at ``OLD_ROOT``
    until ``_detach_host`` (``pivot_root`` walks every thread on the machine:
    done with the root, possibly ahead of the session)."""
    try:
        os.mkdir(OLD_ROOT.lstrip("/"), 0o700, dir_fd=root_fd)
        os.fchdir(root_fd)
        _sys.pivot_root(".", OLD_ROOT.lstrip("/"))
        os.chdir("/")
    except OSError as exc:
        raise ConfinementError("mounts: pivot_root", exc.errno, _NEW_ROOT) from exc


def _detach_host(host_fd: int = -1) -> None:
    """The host's root gone from the session's namespace for good (lazily
    unmounted: nothing of it is reachable from here on), and its mount point
    removed from the session's root. Held by descriptor (``_hold_host``): that
    descriptor closed, which is all there is left of it."""
    if host_fd >= 0:
        os.close(host_fd)
        return
    try:
        _sys.umount2(OLD_ROOT, _sys.MNT_DETACH)
        os.rmdir(OLD_ROOT)
    except OSError as exc:
        raise ConfinementError("mounts: detach the host's root", exc.errno, OLD_ROOT) from exc


def _hold_host() -> int:
    """The host's root as this mount namespace has it (a copy made at
    ``clone3``), as a detached tree of its own held by one descriptor
    (``open_tree(OPEN_TREE_CLONE | AT_RECURSIVE)``): the session's own paths
    are bound from it later (the kernel binds from a detached tree cloned from
    the caller's own namespace since 6.15), so the host's root below the new
    one can be unmounted with the root, possibly ahead of the session, and not
    at its open: a lazy unmount waits for an RCU grace period (0.2 ms at the
    median, up to 3 ms on a loaded machine); closing the tree's descriptor
    does not (0.05 ms: measured in a user namespace, 60 of each).

    Why a waiting sandbox may hold it, and why a session can never reach it:
    - it reaches nothing ``OLD_ROOT`` did not: the same copy of the host's
      mounts, with the same locks and permissions (the user's own, mapped),
      and it is held by the same process, before any session code runs;
    - it is a descriptor of this process only: opened after the inherited
      descriptors were closed (``hygiene.close_inherited_fds``), close-on-exec,
      in no list handed to the daemon (``WorkerNamespaces`` carries only the
      namespaces and the DNS relay's door) and in none a command inherits; nothing is exec'd while
      the sandbox waits, and nothing but the daemon's ``AdoptSession`` is
      read;
    - ``apply_session_mounts`` closes it right after the session's binds
      (``_detach_host``), where ``OLD_ROOT`` was unmounted: before the
      rlimits, the capabilities, Landlock and seccomp, so before any code of
      the session's runs. The binds made from it are copies attached to the
      session's namespace, and every descriptor opened below it (the bind
      sources) is closed before it (``_sources``): once it is closed the
      detached tree has no reference left and is unmounted whole;
    - the sandbox is pid 1 of its pid namespace and not dumpable from the
      start (``confine_shared``): no process of the user's can take the
      descriptor from it (``pidfd_getfd`` and ``/proc/PID/fd`` need ptrace
      access), and after adoption seccomp refuses ``open_tree``,
      ``move_mount`` and ``mount`` to the session anyway.
    ``tests/escape/test_pool.py`` checks a session's view: no descriptor of
    pid 1 beyond a fresh sandbox's, nothing of the host's root mounted."""
    try:
        return _sys.open_tree_clone("/")
    except OSError as exc:
        # ENOSPC: the clone's anonymous mount namespace counts against user.max_mnt_namespaces.
        raise ConfinementError("mounts: hold the host's root", exc.errno, "/",
                               limit_reached(exc.errno, ("mount",))) from exc


def _build_dev(root_fd: int, devices: list[str], fds: dict[str, int]) -> None:
    # A directory of the new root's own tmpfs (read-only once built; one mount
    # fewer than a tmpfs of its own), holding only the policy's device nodes.
    for path in devices:
        if path in fds:  # bound from the host: an unprivileged user cannot mknod
            bind(fds[path], root_fd, path)
    dev = mount_point(root_fd, "/dev", "dir")
    assert dev is not None
    try:
        for name, link in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                           ("stderr", "/proc/self/fd/2")):
            os.symlink(link, name, dir_fd=dev)
        if PTS in devices:
            # Pseudo-terminals of the session's own: a new devpts instance
            # (its ptys are not the host's, and the host keeps its reserve).
            mount_in(dev, "pts", "devpts", "devpts", _sys.MS_NOSUID | _sys.MS_NOEXEC,
                     "newinstance,ptmxmode=0666,mode=0620")
            os.symlink("pts/ptmx", "ptmx", dir_fd=dev)
        mount_in(dev, "shm", "private /dev/shm", "tmpfs", _sys.MS_NOSUID | _sys.MS_NODEV, "size=64m,mode=1777")
    finally:
        os.close(dev)


def _build_root(plan: MountPlan) -> int:
    """The session's own root with what every session of the policy shares:
    the system binds, ``/dev``, ``/proc``; then ``/`` is it, and the host's root
    waits for the session's own paths: below at ``OLD_ROOT``, or (``host_by_fd``)
    as a detached tree whose descriptor is returned (else -1)."""
    shared, _ = plan.split_binds()
    # Before the new root covers the host's /tmp: a worktree there is bound from the host's.
    host_fd = _hold_host() if plan.host_by_fd else -1
    try:
        _build_root_over(plan, shared)
        if host_fd >= 0:
            _detach_host()  # the lazy unmount's wait now, with the root (ahead of the session)
    except BaseException:
        if host_fd >= 0:
            os.close(host_fd)
        raise
    return host_fd


def _build_root_over(plan: MountPlan, shared: list[Bind]) -> None:
    with _sources(shared, -1, plan.devices) as fds:
        # The sources are held: the new root may now cover the host's /tmp.
        mount("new root", "tmpfs", _NEW_ROOT, "tmpfs", _sys.MS_NOSUID | _sys.MS_NODEV, "size=1m,mode=0755")
        root_fd = os.open(_NEW_ROOT, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for b in shared:
                if b.path in fds:
                    bind(fds[b.path], root_fd, b.path)
            _build_dev(root_fd, plan.devices, fds)
            proc = mount_point(root_fd, "/proc", "dir")
            assert proc is not None
            try:
                # Before the host's root goes: the kernel lets a user namespace
                # mount proc only while a full proc is visible in it.
                mount("proc", "proc", fd_path(proc), "proc", _sys.MS_NOSUID | _sys.MS_NODEV | _sys.MS_NOEXEC)
            finally:
                os.close(proc)
            _pivot_into(root_fd)
        finally:
            os.close(root_fd)


def _bind_session_paths(plan: MountPlan, worktree_fd: int, host_fd: int) -> None:
    """The session's own paths into its root, taken from the host's root kept
    at ``OLD_ROOT`` or held by ``host_fd`` (the worktree proven by inode
    against the daemon's descriptor). The host's root is detached next
    (``_detach_host``)."""
    _, own = plan.split_binds()
    with _sources(own, worktree_fd, [], host="" if host_fd >= 0 else OLD_ROOT, host_fd=host_fd) as fds:
        root_fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for b in own:  # parents first: a worktree under /tmp lands in the private /tmp
                if b.how == "ro-over":
                    bind_over_itself(root_fd, b.path)
                elif b.path in fds:
                    bind(fds[b.path], root_fd, b.path)
        finally:
            os.close(root_fd)


def _apply_host(plan: MountPlan, worktree_fd: int) -> None:
    """The host's root, read-only, as the release before (``root = "host"``)."""
    tmp = next(b for b in plan.binds if b.path == "/tmp")
    kept = [b for b in plan.binds if b.how != "ro-over" and b.path != "/tmp" and (b.how == "rw" or is_within(b.path, "/tmp")
                                                                                 or b.source == WORKTREE_FD)]
    with _sources([tmp, *kept], worktree_fd, []) as fds:
        root_fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            mount("private /tmp", fd_path(fds["/tmp"]), "/tmp", None, _sys.MS_BIND)
            for b in kept:
                if b.path in fds:
                    bind(fds[b.path], root_fd, b.path)
            for b in plan.binds:
                if b.how == "ro-over":
                    bind_over_itself(root_fd, b.path)
        finally:
            os.close(root_fd)
    for path in plan.hide:
        if os.path.isdir(path):
            mount("hide", "tmpfs", path, "tmpfs", _sys.MS_NOSUID | _sys.MS_NODEV | _sys.MS_NOEXEC, "size=4k,mode=0555")
    if os.path.isdir("/dev/shm"):
        mount("private /dev/shm", "tmpfs", "/dev/shm", "tmpfs", _sys.MS_NOSUID | _sys.MS_NODEV, "size=64m,mode=1777")
    mount("proc", "proc", "/proc", "proc", _sys.MS_NOSUID | _sys.MS_NODEV | _sys.MS_NOEXEC)


def apply_root(plan: MountPlan) -> int:
    """The part of the view every session of the policy shares. With a root
    of the session's own: the new root with its system binds, ``/dev`` and
    ``/proc``, pivoted into, the host's root still reachable below
    ``OLD_ROOT``, or (``host_by_fd``) by the descriptor returned (else -1):
    no session code runs before ``apply_session_mounts``, which closes it."""
    mount("make private", None, "/", None, _sys.MS_REC | _sys.MS_PRIVATE)
    if plan.root == "minimal":
        return _build_root(plan)
    return -1


def apply_session_mounts(plan: MountPlan, worktree_fd: int, mark: Callable[[str], None] = lambda _: None,
                         host_fd: int = -1) -> None:
    """The rest, after ``apply_root`` (at once, or when a sandbox made ahead
    is given its session): the session's own paths, the host's root
    detached (``host_fd``, what ``apply_root`` returned, closed), every mount
    read-only but the writable ones. ``mark(step)`` is called after each step
    (the worker's timings)."""
    if plan.root == "minimal":
        try:
            _bind_session_paths(plan, worktree_fd, host_fd)
        except BaseException:
            if host_fd >= 0:
                os.close(host_fd)  # the worker exits; nothing of the host's is left open meanwhile
            raise
        mark("session_binds")
        _detach_host(host_fd)
        mark("detach_host")
    else:
        _apply_host(plan, worktree_fd)
    # Everything read-only in one call (mount_setattr, AT_RECURSIVE), then the
    # few writable mounts made writable again: they are our own bind mounts,
    # so no flag of theirs is locked by the parent namespace. Not recursive:
    # the git binds inside the worktree stay read-only.
    try:
        _sys.mount_setattr("/", set_=_sys.MOUNT_ATTR_RDONLY, recursive=True)
    except OSError as exc:
        raise ConfinementError("mounts: read-only /", exc.errno, "/") from exc
    pts = [PTS] if plan.root == "minimal" and PTS in plan.devices else []  # a terminal's mode changes
    for path in ["/tmp", "/dev/shm", *pts, *plan.writable()]:
        if os.path.isdir(path):
            try:
                _sys.mount_setattr(path, clear=_sys.MOUNT_ATTR_RDONLY)
            except OSError as exc:
                raise ConfinementError("mounts: writable path", exc.errno, path) from exc


def apply_mounts(plan: MountPlan, worktree_fd: int) -> None:
    """The whole view at once: ``apply_root`` then ``apply_session_mounts``."""
    apply_session_mounts(plan, worktree_fd, host_fd=apply_root(plan))


def probe_host_tree() -> str:
    """"" when this kernel lets a user namespace bind a path of a detached
    copy of its own mount tree (``_hold_host``; Linux 6.15+), else why not.
    Forks a throw-away child that tries it on a tmpfs of its own: call it
    before any thread exists."""
    uid, gid = os.getuid(), os.getgid()
    pid = os.fork()
    if pid == 0:
        try:
            _sys.unshare(_sys.CLONE_NEWUSER | _sys.CLONE_NEWNS)
            for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                               ("/proc/self/gid_map", f"{gid} {gid} 1")):
                with open(path, "w") as f:
                    f.write(text)
            _sys.mount(None, "/", None, _sys.MS_REC | _sys.MS_PRIVATE)
            tree = _sys.open_tree_clone("/")
            _sys.mount("tmpfs", "/tmp", "tmpfs", _sys.MS_NOSUID | _sys.MS_NODEV, "size=4k")
            os.mkdir("/tmp/p")
            src = _sys.open_no_symlinks("proc", tree, beneath=True)
            _sys.mount(fd_path(src), "/tmp/p", None, _sys.MS_BIND)
            os._exit(0)
        except OSError as exc:
            os._exit(min(exc.errno or 1, 250))
        except BaseException:
            os._exit(251)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        return ""
    why = os.strerror(code) if 0 < code < 251 else "the probe failed"
    return f"binding from a detached copy of the mount tree: {why} (before Linux 6.15); the host's root is kept below"
