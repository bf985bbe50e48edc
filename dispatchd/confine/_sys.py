"""Thin ctypes access to the few syscalls Python 3.11 does not wrap.

Every function raises ``OSError`` with the real errno; callers turn that into
a ``ConfinementError`` naming their step.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.prctl.restype = ctypes.c_int
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.unshare.argtypes = [ctypes.c_int]
# Looked up now, at import (in the fork server), like those above: ctypes
# makes a function object at a name's first use and stores it in the
# library's dictionary, which a worker would otherwise do for itself (its
# own copy of those pages) at every start.
for _name in ("setns", "umount2", "capset"):
    getattr(_libc, _name)

if platform.machine() not in ("x86_64", "aarch64"):
    # The syscall numbers below are the asm-generic/x86_64 ones that Landlock
    # shares across architectures; seccomp is compiled by libseccomp per arch.
    raise ImportError(f"dispatchd supports x86_64 and aarch64, not {platform.machine()}")

SYS_pivot_root = 155 if platform.machine() == "x86_64" else 41
SYS_open_tree = 428
SYS_move_mount = 429
SYS_fsopen = 430
SYS_fsconfig = 431
SYS_fsmount = 432
SYS_clone3 = 435
SYS_openat2 = 437
SYS_mount_setattr = 442
SYS_landlock_create_ruleset = 444
SYS_landlock_add_rule = 445
SYS_landlock_restrict_self = 446

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SECCOMP_MODE_FILTER = 2

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_PIDFD = 0x1000
CLONE_PARENT = 0x8000
CLONE_INTO_CGROUP = 0x200000000

MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
AT_RECURSIVE = 0x8000
OPEN_TREE_CLONE = 1
MOUNT_ATTR_RDONLY = 0x1

# The same libc, called with the GIL held: ``clone3`` returns in a copy of
# this process, which must find the interpreter exactly as the parent left it.
_pylibc = ctypes.PyDLL(None, use_errno=True)
_pylibc.syscall.restype = ctypes.c_long
_after_fork_child = ctypes.pythonapi.PyOS_AfterFork_Child  # looked up here, not in each child (as above)


class _CloneArgs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "flags", "pidfd", "child_tid", "parent_tid", "exit_signal", "stack", "stack_size", "tls", "set_tid",
        "set_tid_size", "cgroup")]


def _check(ret: int) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


def syscall(nr: int, *args: object) -> int:
    return _check(_libc.syscall(nr, *args))


def prctl(option: int, a2: int = 0, a3: int = 0, a4: int = 0, a5: int = 0) -> int:
    return _check(_libc.prctl(option, a2, a3, a4, a5))


def clone3(flags: int, exit_signal: int, cgroup_fd: int = -1) -> tuple[int, int]:
    """Fork with ``clone3``: a new process in new namespaces (``flags``), born
    in the cgroup ``cgroup_fd`` when given. Returns ``(0, -1)`` in the child
    and ``(pid, pidfd)`` in the parent.

    As ``os.fork`` does, it runs the interpreter's before/after-fork hooks
    around the system call (locks re-made, ``register_at_fork`` callbacks,
    the random module reseeded in the child), with the GIL held throughout.
    glibc keeps no state a raw clone makes stale that Python uses (it caches
    no pid since 2.25; its thread descriptor's tid is only used for locks,
    consistently in the one thread the child has). Call it only from a
    single-threaded process, as the fork server is.
    """
    pidfd = ctypes.c_int(-1)
    args = _CloneArgs(flags=flags | CLONE_PIDFD | (CLONE_INTO_CGROUP if cgroup_fd >= 0 else 0),
                      pidfd=ctypes.addressof(pidfd), exit_signal=exit_signal, cgroup=max(cgroup_fd, 0))
    ctypes.pythonapi.PyOS_BeforeFork()
    pid = _pylibc.syscall(SYS_clone3, ctypes.byref(args), ctypes.c_size_t(ctypes.sizeof(args)))
    if pid == 0:
        _after_fork_child()
        return 0, -1
    err = ctypes.get_errno()
    ctypes.pythonapi.PyOS_AfterFork_Parent()
    if pid < 0:
        raise OSError(err, os.strerror(err))
    return pid, pidfd.value


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags))


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(fd, nstype))


def fresh_proc_mount() -> int:
    """A new procfs of the caller's pid namespace, read-only, nosuid, nodev,
    noexec (as a session's first /proc is once its root is made read-only),
    as a detached mount (its fd): made while the old ``/proc`` is still
    there, since a user namespace may mount proc only while a full one is
    visible."""
    fs = syscall(SYS_fsopen, b"proc", 1)  # FSOPEN_CLOEXEC
    try:
        # Named "proc", as mount(2) names the first one: mountinfo then reads the
        # same in a woken session as in a fresh one.
        syscall(SYS_fsconfig, fs, 1, b"source", b"proc", 0)  # FSCONFIG_SET_STRING
        syscall(SYS_fsconfig, fs, 6, None, None, 0)  # FSCONFIG_CMD_CREATE
        # FSMOUNT_CLOEXEC; MOUNT_ATTR_RDONLY|NOSUID|NODEV|NOEXEC
        return syscall(SYS_fsmount, fs, 1, MOUNT_ATTR_RDONLY | 0x2 | 0x4 | 0x8)
    finally:
        os.close(fs)


def move_mount(fd: int, target: str) -> None:
    """Attach the detached mount ``fd`` at ``target``."""
    syscall(SYS_move_mount, fd, b"", -100, os.fsencode(target), 4)  # AT_FDCWD, MOVE_MOUNT_F_EMPTY_PATH


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def b(s: str | None) -> bytes | None:
        return None if s is None else os.fsencode(s)

    try:
        _check(_libc.mount(b(source), b(target), b(fstype), flags, b(data)))
    except OSError as exc:
        exc.filename = target
        raise


RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


RESOLVE_NO_MAGICLINKS = 0x02


def _openat2(dir_fd: int, path: str, flags: int, resolve: int) -> int:
    how = _OpenHow(flags, 0, resolve)
    try:
        return syscall(SYS_openat2, ctypes.c_int(dir_fd), os.fsencode(path), ctypes.byref(how),
                       ctypes.c_size_t(ctypes.sizeof(how)))
    except OSError as exc:
        exc.filename = path
        raise


def open_no_symlinks(path: str, dir_fd: int = -100, beneath: bool = False) -> int:
    """``openat2(O_PATH | O_NOFOLLOW, RESOLVE_NO_SYMLINKS)``: one call that
    refuses a symlink anywhere on the way (ELOOP) and returns a final symlink
    itself (Linux 5.6+). ``beneath``: and never above ``dir_fd`` (``..``)."""
    return _openat2(dir_fd, path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC,
                    RESOLVE_NO_SYMLINKS | (RESOLVE_BENEATH if beneath else 0))


def open_beneath(dir_fd: int, path: str, flags: int) -> int:
    """``openat2(flags | O_NOFOLLOW | O_CLOEXEC)`` of ``path`` below the
    directory ``dir_fd``, with RESOLVE_BENEATH, RESOLVE_NO_SYMLINKS and
    RESOLVE_NO_MAGICLINKS: the kernel refuses any symlink on the way (ELOOP)
    and any escape above ``dir_fd`` (EXDEV) in the walk that opens the file.
    Raises the OSError of the errno, ``path`` its filename."""
    return _openat2(dir_fd, path, flags | os.O_NOFOLLOW | os.O_CLOEXEC,
                    RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)


def open_tree_clone(path: str) -> int:
    """``open_tree(OPEN_TREE_CLONE | AT_RECURSIVE)``: a copy of the mount tree
    at ``path``, detached (an anonymous mount namespace of its own), as a
    descriptor; closing its last descriptor unmounts it all (Linux 5.2+)."""
    return syscall(SYS_open_tree, ctypes.c_int(-100), os.fsencode(path),
                   ctypes.c_uint(OPEN_TREE_CLONE | os.O_CLOEXEC | AT_RECURSIVE))


def pivot_root(new_root: str, put_old: str) -> None:
    syscall(SYS_pivot_root, os.fsencode(new_root), os.fsencode(put_old))


def umount2(target: str, flags: int) -> None:
    _check(_libc.umount2(os.fsencode(target), flags))


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def mount_setattr(path: str, *, set_: int = 0, clear: int = 0, recursive: bool = False) -> None:
    """Change mount attributes of ``path``'s mount (and every mount below it
    with ``recursive``) in one call (Linux 5.12+)."""
    attr = _MountAttr(set_, clear, 0, 0)
    flags = AT_RECURSIVE if recursive else 0
    try:
        syscall(SYS_mount_setattr, -100, os.fsencode(path), flags, ctypes.byref(attr), ctypes.sizeof(attr))
    except OSError as exc:
        exc.filename = path
        raise


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def clear_capabilities() -> None:
    """Empty the effective, permitted and inheritable sets (capset v3)."""
    header = _CapHeader(0x20080522, 0)
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), ctypes.byref(data)))


class _SockFprog(ctypes.Structure):
    # Made once at import (in the fork server): a ctypes class made per call
    # cost the open a tenth of a millisecond.
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install_seccomp_program(bpf: bytes) -> None:
    """Install a compiled classic-BPF seccomp program on this thread."""
    if len(bpf) % 8:
        raise OSError(errno.EINVAL, "seccomp program is not a whole number of instructions")
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = _SockFprog(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p))
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0))
