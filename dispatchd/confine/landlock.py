"""Landlock: which paths a session may read, write or execute, and its scopes.

Guarantees, once ``apply_landlock`` has returned:
- every filesystem access right the kernel's ABI knows is *handled*: a path is
  reachable only beneath a rule, with only that rule's rights;
- system paths are read+execute only; the worktree, the session's scratch
  directory and the policy's extra paths are read-write; a Unix socket can
  be made (``bind``, a rename or link of one) only in the session's own
  scratch, ``/tmp`` and ``/dev/shm``, which no other session can reach: one
  in the worktree or a shared path would let a session running beside it
  connect, and be handed descriptors (a file open for writing that outlives
  its giver's end and check, a TCP socket for a session with the network
  off); device files get
  read+write on the file itself; everything else (the rest of the home
  directory, other worktrees, the daemon's files) is denied with EACCES;
- where the ABI has scopes (6+), the session cannot connect to abstract Unix
  sockets or signal processes created outside its domain;
- where the ABI has TCP rules (4+) and the plan handles them, every TCP bind
  and connect is denied but to the plan's ports: none for "network off"
  without a network namespace, the listed ones for "network ports".

A rule that cannot be added, or a ruleset the kernel enforces only partly,
fails the step: we never run a session on a weaker ruleset than planned.

Landlock binds the calling thread and its future children only, so this runs
while the worker has exactly one thread. With a root of the session's own,
the rules of the paths whose inodes there do not depend on the session (the
system paths, ``/proc``, ``/dev``'s, the private ``/tmp``) are added with the
root (``start_ruleset``), possibly ahead of the session; the rest, and the
restriction itself, at ``apply_landlock``: one ruleset, the same rules, as a
sandbox made at open.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat

import msgspec

from dispatchd.confine import _sys
from dispatchd.errors import ConfinementError
from dispatchd.fds import close_held

# Filesystem rights, by the ABI that introduced them.
EXECUTE = 1 << 0
WRITE_FILE = 1 << 1
READ_FILE = 1 << 2
READ_DIR = 1 << 3
REMOVE_DIR = 1 << 4
REMOVE_FILE = 1 << 5
MAKE_CHAR = 1 << 6
MAKE_DIR = 1 << 7
MAKE_REG = 1 << 8
MAKE_SOCK = 1 << 9
MAKE_FIFO = 1 << 10
MAKE_BLOCK = 1 << 11
MAKE_SYM = 1 << 12
REFER = 1 << 13  # ABI 2
TRUNCATE = 1 << 14  # ABI 3
IOCTL_DEV = 1 << 15  # ABI 5

NET_BIND_TCP = 1 << 0  # ABI 4
NET_CONNECT_TCP = 1 << 1

SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1

_FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1, 5: (1 << 16) - 1}
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV

READ_ONLY = EXECUTE | READ_FILE | READ_DIR
# Everything but creating device nodes, which an unprivileged user cannot do
# anyway: refusing it here keeps a future capability slip from mattering.
READ_WRITE = ((1 << 16) - 1) & ~(MAKE_CHAR | MAKE_BLOCK)
# Paths another session may reach too (the worktree, the policy's read_write
# paths): read-write, but no Unix socket made there (the module says why).
SHARED = READ_WRITE & ~MAKE_SOCK
DEVICE = READ_FILE | WRITE_FILE
# The session's own pseudo-terminals (a devpts of its own, full mode only):
# a terminal needs its ioctls (TCGETS, TIOCGPTN...); TIOCSTI stays refused by seccomp.
TERMINALS = READ_FILE | WRITE_FILE | READ_DIR | IOCTL_DEV
PTS = "/dev/pts"


def fs_rights_for_abi(abi: int) -> int:
    return _FS_BY_ABI.get(abi, _FS_BY_ABI[5]) if abi >= 1 else 0


class PathRule(msgspec.Struct, frozen=True, array_like=True):
    path: str
    access: int
    # A rule for one file: at apply, the path must be that regular file, not
    # followed if a symlink (else the step fails): a file the plan named
    # that became a directory, or a symlink to one, would grant what is
    # below it.
    file_only: bool = False


class LandlockPlan(msgspec.Struct, frozen=True):
    abi: int
    handled_fs: int
    handled_net: int
    scoped: int
    paths: list[PathRule]
    tcp_ports: list[tuple[int, int]] = []  # (port, access) allowed when net is handled
    # Paths whose rules are added with the root, possibly ahead of the session
    # (``start_ruleset``): their inodes in the session's root do not depend on
    # the session (plan_session decides; they join the pool key).
    ahead: list[str] = []

    def ahead_part(self) -> LandlockPlan:
        """What ``start_ruleset`` applies: the ruleset's handled rights and
        scopes, and the rules of the ``ahead`` paths."""
        ahead = set(self.ahead)
        return LandlockPlan(abi=self.abi, handled_fs=self.handled_fs, handled_net=self.handled_net,
                            scoped=self.scoped, paths=[r for r in self.paths if r.path in ahead],
                            ahead=list(self.ahead))


def plan_landlock(
    *,
    abi: int,
    read_only: list[str],
    read_write: list[str],
    devices: list[str],
    deny_tcp: bool,
    connect_ports: list[int] | None = None,
    bind_ports: list[int] | None = None,
    shared: list[str] | None = None,
) -> LandlockPlan:
    """The ruleset for one session; pure, so tests compare it by equality.

    ``read_write``: the session's own paths; ``shared``: read-write paths
    another session may reach as well (``SHARED``: no Unix socket made).

    ``deny_tcp`` handles TCP: every bind and connect is denied except to the
    listed ports (none: all TCP denied). It needs ABI 4; the caller checks."""
    handled = fs_rights_for_abi(abi)
    rules = [PathRule(p, READ_ONLY & handled) for p in read_only]
    rules += [PathRule(p, READ_WRITE & handled) for p in read_write]
    rules += [PathRule(p, SHARED & handled) for p in shared or []]
    rules += [PathRule(p, (TERMINALS if p == PTS else DEVICE) & handled) for p in devices]
    handled_net = (NET_BIND_TCP | NET_CONNECT_TCP) if (deny_tcp and abi >= 4) else 0
    scoped = (SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL) if abi >= 6 else 0
    ports: dict[int, int] = {}
    if handled_net:
        for port in connect_ports or []:
            ports[port] = ports.get(port, 0) | NET_CONNECT_TCP
        for port in bind_ports or []:
            ports[port] = ports.get(port, 0) | NET_BIND_TCP
    return LandlockPlan(abi=abi, handled_fs=handled, handled_net=handled_net, scoped=scoped, paths=rules,
                        tcp_ports=sorted(ports.items()))


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # the kernel's struct is __attribute__((packed))
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _NetPortAttr(ctypes.Structure):
    _fields_ = [("allowed_access", ctypes.c_uint64), ("port", ctypes.c_uint64)]


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 when Landlock is absent or disabled."""
    try:
        return _sys.syscall(_sys.SYS_landlock_create_ruleset, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    except OSError:
        return 0


class Ruleset:
    """A ruleset begun by ``start_ruleset``: its descriptor and the ahead
    paths it skipped. Restricts nothing until ``apply_landlock`` (which closes
    it); ``close`` lets it go unused."""

    def __init__(self, fd: int, skipped: list[str]) -> None:
        self.fd = fd
        self.skipped = skipped

    def close(self) -> None:
        self.fd = close_held(self.fd)


def _create_ruleset(plan: LandlockPlan) -> int:
    attr = _RulesetAttr(plan.handled_fs, plan.handled_net, plan.scoped)
    # Older ABIs reject the larger struct; pass only the fields they know.
    size = 8 if plan.abi < 4 else (16 if plan.abi < 6 else 24)
    try:
        return _sys.syscall(_sys.SYS_landlock_create_ruleset, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    except OSError as exc:
        raise ConfinementError("landlock: create ruleset", exc.errno) from exc


def start_ruleset(plan: LandlockPlan) -> Ruleset:
    """The ruleset created and the rules of ``plan.ahead`` added: what a
    sandbox made ahead does with its root, before it knows its session (the
    rules bind to inodes, which for these paths are the same then and at
    adoption). Nothing is restricted yet: ``apply_landlock`` adds the rest and
    restricts. The ruleset's descriptor is the caller's until then; no code
    of the session runs while it is open."""
    fd = _create_ruleset(plan)
    try:
        return Ruleset(fd, _add_path_rules(fd, [r for r in plan.paths if r.path in set(plan.ahead)], {}))
    except BaseException:
        os.close(fd)
        raise


def apply_landlock(plan: LandlockPlan, held: dict[str, int] | None = None, begun: Ruleset | None = None,
                   kept: list[int] | None = None) -> list[str]:
    """Enforce the plan on the calling thread. Returns the planned paths that do
    not exist on this machine (skipped: nothing there to grant). ``held`` maps
    a planned path to a descriptor to grant instead of opening the path: the
    worktree, as the daemon checked it (a rule binds to the inode). ``begun``:
    ``start_ruleset``'s for this plan, whose ahead rules are in it already
    (closed here, whatever happens). ``kept``: a copy of the complete ruleset
    is appended to it, for the daemon to confine the session's next tool
    server with (``restrict_with``: a session that sleeps)."""
    held = held or {}
    if begun is not None:
        ruleset, begun.fd = begun.fd, -1
        skipped = list(begun.skipped)
        ahead = set(plan.ahead)
        rules = [r for r in plan.paths if r.path not in ahead]
    else:
        ruleset, skipped, rules = _create_ruleset(plan), [], plan.paths
    try:
        skipped += _add_path_rules(ruleset, rules, held)
        _add_port_rules(ruleset, plan)
        if kept is not None:
            kept.append(os.dup(ruleset))  # complete: nothing is added to it after this
        try:
            _sys.syscall(_sys.SYS_landlock_restrict_self, ruleset, 0)
        except OSError as exc:
            detail = "no_new_privs must be set first" if exc.errno == errno.EPERM else ""
            raise ConfinementError("landlock: restrict self", exc.errno, detail=detail) from exc
    finally:
        os.close(ruleset)
    return skipped


def build_ruleset(plan: LandlockPlan) -> int:
    """The plan's complete ruleset, restricting nothing yet: its descriptor
    (close-on-exec), for a child to restrict itself with before its exec
    (``restrict_with``; the stack's launch, tools/_confined.c). Paths absent
    here are skipped, as ``apply_landlock`` skips them."""
    ruleset = _create_ruleset(plan)
    try:
        _add_path_rules(ruleset, plan.paths, {})
        _add_port_rules(ruleset, plan)
    except BaseException:
        os.close(ruleset)
        raise
    return ruleset


def _add_port_rules(ruleset: int, plan: LandlockPlan) -> None:
    for port, access in plan.tcp_ports:
        net = _NetPortAttr(access, port)
        try:
            _sys.syscall(_sys.SYS_landlock_add_rule, ruleset, 2, ctypes.byref(net), 0)
        except OSError as exc:
            raise ConfinementError("landlock: add port rule", exc.errno, f"port {port}") from exc


def restrict_with(ruleset: int) -> None:
    """Enforce a complete ruleset made before (``apply_landlock``'s ``kept``)
    on the calling thread: the same rules, bound to the same inodes when they
    were added, with no path looked up again."""
    try:
        _sys.syscall(_sys.SYS_landlock_restrict_self, ruleset, 0)
    except OSError as exc:
        detail = "no_new_privs must be set first" if exc.errno == errno.EPERM else ""
        raise ConfinementError("landlock: restrict self", exc.errno, detail=detail) from exc


def grant_again(ruleset: int, plan: LandlockPlan, below: str, root_fd: int) -> None:
    """Add the plan's rules for ``below`` and what is under it to a kept
    ruleset (``restrict_with``): for a mount made again since the ruleset
    was (a woken session's fresh /proc), whose new inodes the old rules do
    not name. ``below`` itself is granted by ``root_fd``, the new mount's
    root (a rule on the directory it is mounted on would not do: Landlock's
    walk skips the mount point it goes up through); what is under it is
    looked up now. Only for paths nothing of the session has touched. Each
    call names a new inode: the ruleset grows by one rule a wake."""
    _add_path_rules(ruleset, [r for r in plan.paths if r.path == below or r.path.startswith(below.rstrip("/") + "/")],
                    {below: root_fd})


def _add_path_rules(ruleset: int, rules: list[PathRule], held: dict[str, int]) -> list[str]:
    """Each rule added to ``ruleset``; returns the paths absent here (skipped)."""
    skipped: list[str] = []
    for rule in rules:
        try:
            flags = os.O_PATH | os.O_CLOEXEC | (os.O_NOFOLLOW if rule.file_only else 0)
            fd = os.dup(held[rule.path]) if rule.path in held else os.open(rule.path, flags)
        except FileNotFoundError:
            skipped.append(rule.path)
            continue
        except OSError as exc:
            raise ConfinementError("landlock: open rule path", exc.errno, rule.path) from exc
        try:
            access = rule.access
            mode = os.fstat(fd).st_mode
            if rule.file_only and not stat.S_ISREG(mode):
                raise ConfinementError("landlock: file rule", detail=f"{rule.path} is no longer a regular file "
                                                                     "(a symlink or a directory now)")
            if not stat.S_ISDIR(mode):
                access &= FILE_RIGHTS  # directory rights on a file are EINVAL
            beneath = _PathBeneathAttr(access, fd)
            _sys.syscall(_sys.SYS_landlock_add_rule, ruleset, 1, ctypes.byref(beneath), 0)
        except OSError as exc:
            raise ConfinementError("landlock: add path rule", exc.errno, rule.path) from exc
        finally:
            os.close(fd)
    return skipped


def open_exact(paths: list[str]) -> dict[str, int]:
    """Each of ``paths`` (absolute, resolved by the daemon) that exists,
    opened with no symlink anywhere on the way (``openat2``
    RESOLVE_NO_SYMLINKS from ``/``), for ``apply_landlock``'s ``held``: a
    rule opened by name followed a symlink a session on another worktree
    swapped in after the daemon's look (a linked worktree's ``logs`` made a
    link to the user's home: that directory was granted writable). One that
    is a symlink now, or lies behind one, refuses the session (fail closed)."""
    held: dict[str, int] = {}
    root = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for path in paths:
            try:
                held[path] = _sys.open_beneath(root, path.lstrip("/"), os.O_PATH | os.O_DIRECTORY)
            except FileNotFoundError:
                continue  # absent: its rule is skipped, as one opened by name would be
            except OSError as exc:
                for fd in held.values():
                    os.close(fd)
                raise ConfinementError("landlock: git directory", exc.errno,
                                       f"{path} (a symlink now, or behind one, where the daemon found a "
                                       "directory)") from exc
    finally:
        os.close(root)
    return held


def scope_signals_below() -> None:
    """A nested Landlock domain that restricts nothing but signals: processes
    started from here on cannot signal the ones above (the session init),
    which can still signal, and kill, them. Needs ABI 6.

    Every ruleset handles the REFER right implicitly (denied unless granted:
    renames across directories fail with EXDEV), so this one handles it
    explicitly and grants it on ``/``: the outer domain alone decides."""
    attr = _RulesetAttr(REFER, 0, SCOPE_SIGNAL)
    try:
        ruleset = _sys.syscall(_sys.SYS_landlock_create_ruleset, ctypes.byref(attr), ctypes.c_size_t(24),
                               ctypes.c_uint32(0))
    except OSError as exc:
        raise ConfinementError("landlock: nested signal scope", exc.errno) from exc
    try:
        root = os.open("/", os.O_PATH | os.O_CLOEXEC)
        try:
            _sys.syscall(_sys.SYS_landlock_add_rule, ruleset, 1, ctypes.byref(_PathBeneathAttr(REFER, root)), 0)
        finally:
            os.close(root)
        _sys.syscall(_sys.SYS_landlock_restrict_self, ruleset, 0)
    except OSError as exc:
        raise ConfinementError("landlock: nested signal scope", exc.errno) from exc
    finally:
        os.close(ruleset)
