"""The user-mode network stacks a session's way out runs through: which
one this machine has, how it is started, and how it is confined.

Guarantees:
- ``probe_stack`` names the stack sessions get, or says why none can run and
  what installs it: ``dispatchd --network-stack auto|slirp4netns|pasta``;
  auto takes slirp4netns where it is installed, knows the options it is
  started with (0.4.0 and later) and Landlock can confine it, else pasta
  (docs/network.md, "Which stack");
- a stack never runs unconfined: pasta confines itself (namespaces of its
  own, no filesystem, seccomp); slirp4netns, whose own sandbox binds the
  host's /etc and /run (the user's D-Bus among them), is confined by the
  fork server's child before its exec (``plan_stack_confinement``, applied
  by ``confine_stack`` in a fork, or, where the C helper is built, by the
  child of a vfork with the same limits, ruleset and program,
  ``worker/stackstart.py``; a step that fails ends the child, and the open
  fails naming it): Landlock grants reading and executing the system's
  programs and libraries, the stack's own executable and the files it
  loads wherever they are (``elfloads``), and the tun device, nothing else, and scopes
  signals and abstract sockets (ABI 6); seccomp refuses what Landlock does
  not see: every Unix and netlink socket, changes to a file's metadata,
  signals, other processes' limits and priorities, ``listen``, mounts, new
  namespaces, ptrace; its own filter, once it runs, refuses execve, setns
  and unshare too. A stack
  taken over through a crafted packet holds what a network-on session
  already has (the network, the host's loopback at the gateway), and
  nothing of the user's files or programs;
- both are attached to the session's namespaces by descriptor, never by
  pid (``stack_argv``), both configure ``eth0`` with the gateway
  ``GATEWAY`` mapped to the host's loopback, and neither forwards anything
  in.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
from collections.abc import Callable, Mapping, Sequence

import msgspec

from dispatchd.confine import elfloads, landlock
from dispatchd.confine.landlock import LandlockPlan
from dispatchd.confine.seccomp import ArgCheck, SeccompPlan, SeccompRule, plan_seccomp
from dispatchd.errors import ConfinementError
from dispatchd.inside import is_within

log = logging.getLogger("dispatchd.stacks")

PASTA = "pasta"
SLIRP4NETNS = "slirp4netns"
STACKS = (SLIRP4NETNS, PASTA)  # what "auto" tries, in order: the lighter first
STACK_CHOICES = ("auto", *STACKS)
# The session's address on its one interface: pasta is told it; slirp4netns
# gives the 100th of its network.
ADDRESSES = {PASTA: "10.0.2.15", SLIRP4NETNS: "10.0.2.100"}
GATEWAY = "10.0.2.2"  # its gateway; both stacks map it to the host's loopback
DNS = "10.0.2.3"  # pasta forwards DNS sent here to the host's first resolver (slirp4netns: nothing answers)
MTU = 65520  # pasta's default, and slirp4netns's largest (its default is 1500)

TUN = "/dev/net/tun"
# The whole environment a stack is started with.
STACK_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"}


_INSTALL = {
    SLIRP4NETNS: "sudo apt install slirp4netns; Fedora, RHEL: sudo dnf install slirp4netns",
    PASTA: "sudo apt install passt; Fedora, RHEL: sudo dnf install passt",
}


# The long options ``stack_argv`` passes slirp4netns, as its getopt table
# names them. 0.4.0 added the last three (0.3.x refuses --enable-seccomp);
# 0.4.3, 1.0.1, 1.1.12 and 1.2.0 were run with the network suites
# (docs/network.md, "Versions verified"). ``--disable-host-loopback``, for
# a policy that closes the host's loopback, is older (0.3.0): implied.
SLIRP4NETNS_OPTIONS = ("configure", "mtu", "ready-fd", "enable-seccomp", "netns-type", "userns-path")


def slirp4netns_lacks(path: str) -> list[str]:
    """The options of ``SLIRP4NETNS_OPTIONS`` the program at ``path`` does not
    know, read from the file, never run (it runs only confined): each long
    option's name is a string of its own in the executable. Nothing is
    judged of a file that is not an ELF executable (a wrapper script) or
    that this user cannot read: there the stack's own refusal, at the
    first open, names what it lacks."""
    try:
        with open(os.path.realpath(path), "rb") as f:
            data = f.read(64 << 20)
    except OSError:
        return []
    if not data.startswith(b"\x7fELF"):
        return []
    return [name for name in SLIRP4NETNS_OPTIONS if name.encode() + b"\0" not in data]


def probe_stack(choice: str = "auto", tun: str = TUN, *, landlock_abi: int = 0,
                which: Callable[[str], str | None] = shutil.which,
                lacks: Callable[[str], list[str]] = slirp4netns_lacks) -> tuple[str, str]:
    """The stack sessions go out through, and "" ; or "" and why none can run
    here, with the command that fixes it. ``choice``: one of
    ``STACK_CHOICES``; "auto" takes the first of ``STACKS`` that can run
    confined (slirp4netns needs Landlock: ``plan_stack_confinement``; and
    the options it is started with: ``lacks``, given its path, names those
    it does not know). ``tun``: the device both open (another path only for
    the daemon's testing option, which can only make it fail)."""
    names = STACKS if choice == "auto" else (choice,)
    usable = [n for n in names if which(n) is not None]
    if choice == SLIRP4NETNS and usable and landlock_abi < 1:
        return "", (f"{SLIRP4NETNS} runs confined by Landlock, which this kernel does not offer "
                    f"(use --network-stack {PASTA}, which confines itself)")
    usable = [n for n in usable if n != SLIRP4NETNS or landlock_abi >= 1]
    too_old = ""
    if SLIRP4NETNS in usable:
        path = which(SLIRP4NETNS) or SLIRP4NETNS
        missing = lacks(path)
        if missing:
            too_old = (f"{SLIRP4NETNS} ({path}) lacks " + ", ".join("--" + m for m in missing)
                       + ", which dispatchd starts it with (slirp4netns 0.4.0 and later have them: upgrade it")
            if choice == SLIRP4NETNS:
                return "", f"{too_old}, or use --network-stack {PASTA})"
            usable.remove(SLIRP4NETNS)
    if not usable:
        if choice != "auto":
            return "", f"{choice} is not installed (install it: {_INSTALL[choice]})"
        if too_old:
            return "", f"{too_old}), and {PASTA} is not installed (install it: {_INSTALL[PASTA]})"
        if which(SLIRP4NETNS) is not None:  # installed, but nothing here to confine it with
            return "", (f"{SLIRP4NETNS} runs confined by Landlock, which this kernel does not offer, and {PASTA} "
                        f"is not installed (install it: {_INSTALL[PASTA]})")
        return "", (f"neither {SLIRP4NETNS} nor {PASTA} is installed (install one: "
                    + "; or ".join(_INSTALL[n] for n in STACKS) + ")")
    stack = usable[0]
    try:
        os.close(os.open(tun, os.O_RDWR | os.O_CLOEXEC))
    except FileNotFoundError:
        return "", f"{TUN} does not exist (load the tun module: sudo modprobe tun); {stack} needs it"
    except OSError as exc:
        return "", (f"{TUN} cannot be opened by this user ({exc.strerror}; allow it: sudo chmod 0666 {TUN}); "
                    f"{stack} needs it")
    return stack, ""


class Launch(msgspec.Struct, frozen=True):
    """Which stack a daemon's sessions get, the file executed for it (found
    on PATH once, at the daemon's start: the file its Landlock rules name),
    and the fork server's confinement of it (an encoded
    ``StackConfinement``; empty for pasta)."""

    stack: str
    executable: str = ""
    confinement: bytes = b""


def launch_for(stack: str, landlock_abi: int,
               loads: Callable[[str, Mapping[str, str]], tuple[list[str], str]] = elfloads.loaded_files) -> Launch:
    """The daemon's ``Launch`` for ``stack`` (as probed: ``probe_stack``), its
    confinement planned once, for every session. ``loads``: the files the
    program loads to start, and why not all could be found (logged: the
    stack's own start then names what it could not load)."""
    if not stack:
        return Launch(PASTA)  # none can run: no session gets one (plan_network refuses)
    path = os.path.realpath(shutil.which(stack) or stack)
    files: list[str] = []
    if stack != PASTA:  # pasta confines itself, after loading what it needs
        files, why = loads(path, STACK_ENV)
        if why:
            log.warning("event=stack_libraries_unknown stack=%s error=%s", path, why)
    confinement = plan_stack_confinement(stack, landlock_abi=landlock_abi, executable=path, loads=files)
    return Launch(stack, path, msgspec.msgpack.encode(confinement) if confinement is not None else b"")


def stack_argv(stack: str, *, userns_fd: int, netns_fd: int, ready_fd: int, host_loopback: bool = True) -> list[str]:
    """``stack`` attached to a session's namespaces, held by the descriptors
    the fork server's child has (never by pid); it reports ready on
    ``ready_fd`` once the namespace's interface is configured; the gateway
    is the host's loopback unless ``host_loopback`` is False. Pure."""
    userns, netns = f"/proc/self/fd/{userns_fd}", f"/proc/self/fd/{netns_fd}"
    if stack == SLIRP4NETNS:
        # No --enable-sandbox: it binds the host's /etc and /run into its
        # root (the user's D-Bus, agents' sockets); the fork server confines
        # it instead (plan_stack_confinement). Its own seccomp filter,
        # installed once it runs, blocks execve, setns, unshare, mount, ptrace
        # and more. Every option here is in slirp4netns 0.4.0 and later
        # (SLIRP4NETNS_OPTIONS, checked by the probe; 0.4.3 and 1.0.1, which
        # Ubuntu 20.04 and 22.04 ship, were run): not --disable-dns (1.1), so
        # 10.0.2.3 stays its DNS forwarder, which answers nothing: it would
        # read the host's resolv.conf, which Landlock keeps from it. The
        # session's resolver is the daemon's relay (RELAY_ADDRESS).
        return [SLIRP4NETNS, "--configure", f"--mtu={MTU}", "--enable-seccomp",
                *([] if host_loopback else ["--disable-host-loopback"]),  # since slirp4netns 0.3.0
                f"--ready-fd={ready_fd}", "--netns-type=path", f"--userns-path={userns}", netns, "eth0"]
    return [PASTA, "--foreground", "--quiet", "--config-net", "--ipv4-only",
            "--address", ADDRESSES[PASTA], "--netmask", "24", "--gateway", GATEWAY, "--ns-ifname", "eth0",
            "--dns-forward", DNS,
            # Nothing forwarded in, and the session's loopback stays its own.
            "-t", "none", "-u", "none", "-T", "none", "-U", "none",
            *([] if host_loopback else ["--no-map-gw"]),  # the gateway no more the host's loopback
            # pasta writes its pid file once the interface is configured:
            # the readiness pipe as the pid file.
            "--pid", f"/proc/self/fd/{ready_fd}", "--userns", userns, "--netns", netns]


class StackConfinement(msgspec.Struct, frozen=True):
    """What the fork server's child applies before it executes a stack that
    does not confine itself."""

    landlock: LandlockPlan
    seccomp: SeccompPlan
    # Resource limits (soft = hard): what one stack may write to a file (its
    # stderr, a file the daemon reads), and its heap.
    file_size: int = 1 << 20
    data: int = 1 << 30


# Where a program and the libraries it loads live (merged /usr or not).
SYSTEM_READ = ["/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/etc/ld.so.cache"]


def plan_stack_confinement(stack: str, *, landlock_abi: int, executable: str,
                           loads: Sequence[str] = ()) -> StackConfinement | None:
    """How ``stack`` is confined (None: pasta, which confines itself). Pure.

    Landlock: read and execute of the system's programs and libraries, of
    ``executable`` (the stack's resolved path, wherever installed) and of
    each file of ``loads`` outside them (its interpreter and libraries,
    ``elfloads.loaded_files``: one built into /opt or a home directory
    loads them from there; the files alone, never their directories), and the
    tun device, with its ioctls (the interface is made with TUNSETIFF); no
    other file, nothing written; no signal to a process outside, no abstract
    socket outside (ABI 6). seccomp: ``plan_stack_seccomp``. The
    stack's child joins the session's namespaces, which seccomp allows
    (``setns``): it has no descriptor of any other namespace, and Landlock
    keeps /proc, where it would find one, out of its reach."""
    if stack != SLIRP4NETNS:
        return None
    if landlock_abi < 1:  # probe_stack never picks it then: fail closed all the same
        raise ConfinementError("network: confine " + stack, detail="Landlock is not available")
    own = [path for path in dict.fromkeys([executable, *loads])
           if not any(is_within(path, top) for top in SYSTEM_READ)]
    plan = landlock.plan_landlock(abi=landlock_abi, read_only=list(SYSTEM_READ), read_write=[],
                                  devices=[], deny_tcp=False)
    # Its own files, each a rule for that file alone (landlock.PathRule.file_only).
    files = [landlock.PathRule(path, (landlock.READ_FILE | landlock.EXECUTE) & plan.handled_fs, file_only=True)
             for path in own]
    tun = landlock.PathRule(TUN, (landlock.DEVICE | landlock.IOCTL_DEV) & plan.handled_fs)
    # TCP binds handled, none granted (ABI 4): it connects out, and serves
    # nothing on the host's network (listen, without a bind, is seccomp's).
    plan = msgspec.structs.replace(plan, paths=[*plan.paths, *files, tun],
                                   handled_net=landlock.NET_BIND_TCP if landlock_abi >= 4 else 0)
    return StackConfinement(landlock=plan, seccomp=plan_stack_seccomp())


def stack_limits(confinement: StackConfinement) -> list[tuple[int, int]]:
    """The resource limits a confined stack runs under (soft = hard), as
    ``(RLIMIT_*, value)``: ``confine_stack`` and the launch by vfork
    (worker/stackstart.py) set these same ones. Pure."""
    import resource

    return [(resource.RLIMIT_FSIZE, confinement.file_size), (resource.RLIMIT_DATA, confinement.data),
            (resource.RLIMIT_CORE, 0)]


def confine_stack(confinement: StackConfinement, program: bytes) -> None:
    """In the fork server's child, right before the stack's exec: its resource
    limits, Landlock, then seccomp (``program``, compiled from
    ``confinement.seccomp``), each after no_new_privs. Raises
    ``ConfinementError``; the child then exits without running the stack."""
    import resource

    from dispatchd.confine import hygiene, seccomp

    for limit, value in stack_limits(confinement):
        try:
            resource.setrlimit(limit, (value, value))
        except (OSError, ValueError) as exc:
            raise ConfinementError("network: stack limits", getattr(exc, "errno", None), detail=str(exc)) from exc
    hygiene.no_new_privs()
    landlock.apply_landlock(confinement.landlock)
    seccomp.apply_seccomp(program)


# What a stack the fork server confines may not do, beyond what no session may.
_STACK_DENIED = (
    # Signal anyone, or hold a process by a pidfd (Landlock's signal scope
    # needs ABI 6); steer a process's SIGIO to another (F_SETOWN below).
    "kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_send_signal", "pidfd_open",
    "pidfd_getfd",
    # Change a file's metadata: Landlock (to ABI 7) checks none of these,
    # and the user owns the files (a key made readable, a setuid bit).
    # truncate by path: Landlock checks it from ABI 3 only.
    "chmod", "fchmod", "fchmodat", "chown", "fchown", "lchown", "fchownat", "setxattr", "lsetxattr",
    "fsetxattr", "removexattr", "lremovexattr", "fremovexattr", "utime", "utimes", "utimensat", "futimesat",
    "truncate",
    # Watch the user's files, or read their extended attributes.
    "inotify_init", "inotify_init1", "fanotify_init", "getxattr", "lgetxattr", "listxattr", "llistxattr",
    # Change another process's priority, scheduling, memory placement.
    "setpriority", "sched_setscheduler", "sched_setparam", "sched_setattr", "sched_setaffinity",
    "ioprio_set", "migrate_pages", "move_pages",
    # Wait for connections: it forwards nothing in (TCP binds are Landlock's, ABI 4).
    "listen",
)
F_SETOWN, F_SETSIG, F_SETOWN_EX = 8, 10, 15
FIOSETOWN, SIOCSPGRP = 0x8901, 0x8902


@functools.lru_cache(maxsize=1)
def plan_stack_seccomp() -> SeccompPlan:
    """The filter of a stack the fork server confines (slirp4netns); pure.
    A session's, with IPv4/IPv6 sockets (its work), but no Unix socket at
    all (no abstract one, and no named one either: the user's D-Bus,
    ssh-agent and ``systemd --user`` sockets are in the host's filesystem,
    where Landlock does not check a connect), no netlink, none of
    ``_STACK_DENIED``, no resource limit of another process (``prlimit64``
    with a pid), no SIGIO owner. ``setns`` is allowed: the stack's child
    joins the session's namespaces to make the tap device, by descriptors
    it was given (Landlock keeps /proc, where it would find others, out of
    its reach); slirp4netns's own filter refuses it, with ``execve``, before
    the stack reads its first packet."""
    base = plan_seccomp(allow_inet=True, ipc_namespace=False, allow_unix=False, netlink=False, pid_namespace=False)
    rules = [r for r in base.rules if r.syscall != "setns"]
    rules += [SeccompRule(name, errno.EPERM) for name in _STACK_DENIED]
    rules.append(SeccompRule("prlimit64", errno.EPERM, [ArgCheck(0, "ne", 0)]))
    rules += [SeccompRule("fcntl", errno.EPERM, [ArgCheck(1, "eq", cmd)]) for cmd in (F_SETOWN, F_SETSIG, F_SETOWN_EX)]
    rules += [SeccompRule("ioctl", errno.EPERM, [ArgCheck(1, "masked_eq", req, 0xFFFFFFFF)])
              for req in (FIOSETOWN, SIOCSPGRP)]
    return SeccompPlan(rules=rules, allow_inet=True)
