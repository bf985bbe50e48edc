"""The fork server's part in a session's network stack: a child of its own,
confined, then executing the stack.

Guarantees:
- the stack is the fork server's child, with a parent-death signal: it dies
  with the fork server, which dies with the daemon (a daemon killed with
  SIGKILL leaves no stack behind); the fork server is single-threaded, so no
  thread of it can end first and fire the signal early;
- in its session's cgroup where the session has one (joined before
  anything else; a stack that cannot join does not start);
- never unconfined: a stack other than pasta (which confines itself) is
  started only with the daemon's confinement (``stacks.confine_stack``),
  applied before its exec; a step that cannot be applied ends the child,
  which says why on its stderr (the daemon reports it);
- the file executed is the one the daemon's probe found, with nothing of the
  daemon's environment, and only the descriptors it needs;
- started by vfork where the C helper is built (``tools/_confined.c``: the
  same steps, in the same order, as system calls on what is prepared here,
  the Landlock ruleset built whole before the vfork), else by a fork that
  confines itself in Python: the same confinement either way, the vfork
  without a copy of the fork server's memory (about 1.5 ms a stack). A step
  that fails in the vfork's child is answered as an error naming it; in the
  fork's, written to the stack's stderr, which the daemon reports.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal

import msgspec

from dispatchd import protocol
from dispatchd.confine import cgroups, hygiene, landlock, seccomp, sharedprocs, stacks
from dispatchd.errors import ConfinementError
from dispatchd.tools import native


def start_stack(req: protocol.StartStack, frames: protocol.FrameSocket,
                 children: set[int]) -> tuple[protocol.Spawned | protocol.ErrorReply, int]:
    """Start a session's network stack as the fork server's child (``children``
    gets its pid). Returns the reply and a pidfd (-1 on error). The daemon
    waits for its readiness pipe."""
    fds: list[int] = []
    try:
        for _ in range(4):
            fds.append(frames.take_fd())
    except protocol.ProtocolError as exc:
        for fd in fds:
            os.close(fd)
        return protocol.ErrorReply(id=req.id, code="spawn_failed", message=str(exc)), -1
    userns_fd, netns_fd, ready_w, err_fd = fds
    argv = stacks.stack_argv(req.stack, userns_fd=userns_fd, netns_fd=netns_fd, ready_fd=ready_w,
                             host_loopback=req.host_loopback)
    try:
        confinement, program = _stack_confinement(req.stack, req.confinement)
    except Exception as exc:  # undecodable, or libseccomp refused it: no stack unconfined
        for fd in fds:
            os.close(fd)
        return protocol.ErrorReply(id=req.id, code="spawn_failed",
                                   message=f"cannot confine {argv[0]}: {exc}"), -1
    me = os.getpid()
    # The file the daemon's probe found (and its Landlock rules name); else
    # found on PATH, as the probe would.
    path = req.executable or shutil.which(argv[0]) or argv[0]
    pid, why, err = -1, "", None
    if native.lines is not None:
        try:
            pid = _launch_by_vfork(native.lines, req.cgroup, path, argv, confinement, program, fds, me)
        except Exception as exc:  # noqa: BLE001 - answered, whatever it was: nothing was started
            why, err = f"cannot start {argv[0]}: {_launch_error(exc, path)}", getattr(exc, "errno", None)
    else:
        try:
            pid = _launch_by_fork(req.cgroup, path, argv, confinement, program, fds, me)
        except OSError as exc:
            why, err = f"cannot fork for {argv[0]}: {exc}", exc.errno
    if why:
        for fd in fds:
            os.close(fd)
        if err == errno.EAGAIN:  # no process to be had: the daemon may refuse the switch and keep the session
            return protocol.ErrorReply(id=req.id, code="no_process",
                                       message=f"{why}: {sharedprocs.reached(errno.EAGAIN)}"), -1
        return protocol.ErrorReply(id=req.id, code="spawn_failed", message=why), -1
    return _started(req.id, pid, fds, children)


def _launch_by_fork(cgroup: str, path: str, argv: list[str], confinement: stacks.StackConfinement | None,
                    program: bytes, fds: list[int], me: int) -> int:
    """The stack started by a fork that confines itself in Python (no C
    helper): its pid. A step that fails in the child is written on its
    stderr (the fork server's own until its stdio is the stack's), and the
    child exits before its exec. Raises ``OSError`` when it cannot fork."""
    userns_fd, netns_fd, ready_w, err_fd = fds
    pid = os.fork()
    if pid != 0:
        return pid
    try:
        hygiene.die_with_parent(me)
        if cgroup:  # the session's: its limits hold the stack, or it does not start
            cgroups.apply_cgroup(cgroup)
        # As subprocess's restore_signals: an exec keeps what is ignored
        # (Python ignores SIGPIPE and SIGXFSZ, we SIGINT), and pasta
        # refuses to start unless it finds its signals as a new process would.
        for sig in (signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.dup2(err_fd, 2)
        keep = {0, 1, 2, userns_fd, netns_fd, ready_w}
        for fd in (userns_fd, netns_fd, ready_w):
            os.set_inheritable(fd, True)
        low = 3
        for fd in sorted(keep | {1 << 20}):
            if fd >= low:
                os.closerange(low, fd)
                low = fd + 1
        if confinement is not None:
            stacks.confine_stack(confinement, program)
        # Nothing of the daemon's environment (a token the user
        # exported where the daemon was started): neither stack reads one.
        os.execve(path, argv, stacks.STACK_ENV)
    except BaseException as exc:  # confinement or exec failed: say why on its stderr
        os.write(2, f"cannot start {argv[0]}: {exc}\n".encode())
    finally:
        os._exit(127)


def _started(rid: int, pid: int, fds: list[int],
             children: set[int]) -> tuple[protocol.Spawned | protocol.ErrorReply, int]:
    """The reply for a stack started, either way (its descriptors closed here)."""
    try:
        children.add(pid)
        pidfd = os.pidfd_open(pid)
    except OSError as exc:  # cannot be: our child, not reaped
        return protocol.ErrorReply(id=rid, code="spawn_failed", message=f"cannot hold the stack's process: {exc}"), -1
    finally:
        for fd in fds:
            os.close(fd)
    return protocol.Spawned(id=rid, pid=pid), pidfd


def _launch_by_vfork(lines: native.Lines, cgroup: str, path: str, argv: list[str],
                     confinement: stacks.StackConfinement | None, program: bytes, fds: list[int], me: int) -> int:
    """The stack started by vfork (``tools/_confined.c``), confined as the
    fork path confines it: its pid. Raises ``OSError`` (its filename the
    step that failed) or ``ConfinementError`` (its cgroup, its ruleset)."""
    userns_fd, netns_fd, ready_w, err_fd = fds
    held: list[int] = []
    try:
        null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        held.append(null)
        cgroup_fd = -1
        if cgroup:  # the session's: its limits hold the stack, or it does not start
            try:
                cgroup_fd = os.open(f"{cgroup}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
            except OSError as exc:  # as cgroups.apply_cgroup says it in the fork's child
                raise ConfinementError("cgroup", exc.errno, f"{cgroup}/cgroup.procs") from exc
            held.append(cgroup_fd)
        ruleset, limits = -1, []
        if confinement is not None:
            ruleset = landlock.build_ruleset(confinement.landlock)
            held.append(ruleset)
            limits = stacks.stack_limits(confinement)
        return lines.spawn_confined(
            os.fsencode(path), [os.fsencode(a) for a in argv],
            [os.fsencode(f"{k}={v}") for k, v in stacks.STACK_ENV.items()],
            null, null, err_fd, [userns_fd, netns_fd, ready_w], cgroup_fd, limits, ruleset, program, me)
    finally:
        for fd in held:
            os.close(fd)


def _launch_error(exc: Exception, path: str) -> str:
    """What failed, in words, as the fork's child says it: the step and the
    system's reason (the C helper's OSError names the step it failed at)."""
    if isinstance(exc, OSError) and isinstance(exc.filename, str):
        exc = ConfinementError(exc.filename, exc.errno, path if exc.filename == "exec" else "")
    return str(exc)


_stack_programs: dict[bytes, tuple[stacks.StackConfinement, bytes]] = {}


def _stack_confinement(stack: str, encoded: bytes) -> tuple[stacks.StackConfinement | None, bytes]:
    """The confinement a StartStack asks for, decoded, with its seccomp
    program compiled (once per distinct confinement: a daemon asks the same
    one for every session)."""
    if not encoded:
        if stack != stacks.PASTA:  # only pasta confines itself: never one started bare
            raise ValueError(f"{stack} needs the daemon's confinement, and none was sent")
        return None, b""
    if encoded not in _stack_programs:
        confinement = msgspec.msgpack.decode(encoded, type=stacks.StackConfinement)
        _stack_programs[encoded] = (confinement, seccomp.compile_seccomp(confinement.seccomp))
    return _stack_programs[encoded]
