"""A session's network: its own namespace in every mode, a user-mode stack for
the way out, and netfilter rules inside for "ports".

Guarantees, in full mode (user namespaces) with a stack available:
- every session has a network namespace of its own, whatever its mode; the
  only way out of it is a user-mode stack the daemon has the fork server
  start outside the sandbox, attached to that namespace (``start_stack``),
  and ends (SIGKILL, waited for) with the session and on every switch to
  "off"; a child of the fork server, it dies with it, so a daemon killed with
  SIGKILL leaves none behind;
- the stack is confined whichever it is: ``pasta`` (Debian's ``passt``)
  isolates itself (namespaces, no filesystem, seccomp); ``slirp4netns``,
  whose own sandbox binds the host's /etc and /run (the user's D-Bus among
  them), is confined by the fork server before its exec
  (``plan_stack_confinement``): Landlock (read and execute of the system's
  programs and libraries, the tun device, nothing else; no signal out, no
  abstract socket out), seccomp (no Unix or netlink socket, no mount, no
  new namespace, no ptrace, no signal), and its own seccomp filter once it
  runs. Either way a stack taken over by a crafted packet holds what a
  network-on session already has (the network, the host's loopback) and
  nothing of the user's files or programs. Which one runs:
  ``dispatchd --network-stack auto|slirp4netns|pasta``; auto takes
  slirp4netns where it can be confined, for its cost (docs/network.md:
  0.3 MiB and ~1 ms of CPU at start, against pasta's 14-20 MiB and 40 ms);
- with the stack ended, its tap device is gone: the namespace has only its
  loopback, so nothing the session still holds (a connected or orphaned
  socket, a ``sendfile`` queue referencing page-cache pages, a UDP socket)
  has a route out. The stack copies every byte out of its tap into its own
  buffers, so a page the session rewrites later was never queued outside;
- "ports" is an nftables table in the session's namespace (``nft_rules``):
  every packet leaving by the tap to a port not listed is rejected, whatever
  made it (TCP, MPTCP subflows, a Fast Open SYN, UDP, DNS included). The
  session cannot touch it: it has no capability, and seccomp refuses setns;
  the rules are applied by a child of the fork server that joins the
  session's namespaces (``apply_rules_in``);
- DNS: while the stack runs, the daemon's relay (daemon/dnsrelay.py) has a
  door on the namespace's loopback (``RELAY_ADDRESS`` port 53, made by
  ``open_dns_sockets_in``, closed with the stack: ``Stack.with_it``), which
  "ports" lets through like all loopback traffic: DNS to the host's
  resolvers only, whatever the ports listed; DNS straight to a server
  follows the list;
- nothing comes in: neither stack forwards a port from the host (pasta:
  ``-t none -u none``; slirp4netns forwards only what its API socket asks,
  and it has none), nor any of the session's loopback to the host's (pasta:
  ``-T none -U none``); the host's loopback is reached at the gateway
  address only.

``plan_network`` is the one place deciding, per mode, which namespace, whether
the stack runs, which rules apply and what Landlock/seccomp must hold; a new
mode (``domains``) adds a branch there.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable

import msgspec

from dispatchd import fdwait
from dispatchd.confine.landlock import LandlockPlan
from dispatchd.confine.seccomp import SeccompPlan
from dispatchd.errors import ConfinementError, DispatchdError
from dispatchd.netmodes import NetworkMode

PASTA = "pasta"
SLIRP4NETNS = "slirp4netns"
STACKS = (SLIRP4NETNS, PASTA)  # what "auto" tries, in order: the lighter first
STACK_CHOICES = ("auto", *STACKS)
# The session's address on its one interface: pasta is told it; slirp4netns
# gives the 100th of its network.
ADDRESSES = {PASTA: "10.0.2.15", SLIRP4NETNS: "10.0.2.100"}
GATEWAY = "10.0.2.2"  # its gateway; both stacks map it to the host's loopback
DNS = "10.0.2.3"  # pasta forwards DNS sent here to the host's first resolver (slirp4netns: disabled)
MTU = 65520  # pasta's default, and slirp4netns's largest (its default is 1500)
# The daemon's DNS relay (daemon/dnsrelay.py), on the session's own loopback,
# while its stack runs: what its resolv.conf names.
RELAY_ADDRESS = "127.0.0.53"
DNS_PORT = 53
READY_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 5.0  # a SIGKILLed stack has exited long before this
TABLE = "dispatchd"


class NetworkPorts(msgspec.Struct, frozen=True):
    """The ports a "ports" session may connect to (TCP, MPTCP, UDP), and bind."""

    connect: list[int]
    bind: list[int] = []


class NetworkPlan(msgspec.Struct, frozen=True):
    mode: NetworkMode
    namespace: bool  # a network namespace of its own
    stack: bool  # the user-mode stack runs, attached to that namespace
    rules: str  # nftables ruleset for that namespace ("" for none)
    landlock_tcp: bool  # Landlock TCP rules hold the mode (no namespace to hold it)
    seccomp_inet: bool  # IPv4/IPv6 sockets may be made
    mechanism: str
    caveats: list[str] = []


def _ports(ports: list[int]) -> str:
    return ", ".join(map(str, ports)) if ports else "none"


def reset_rules() -> str:
    """Our table removed from a session's namespace (one transaction; no
    error when it is not there)."""
    return f"add table inet {TABLE}\ndelete table inet {TABLE}\n"


def nft_rules(mode: NetworkMode, ports: NetworkPorts) -> str:
    """The ruleset for a session's namespace, replacing whatever was there
    (one transaction: add, delete, define)."""
    reset = reset_rules()
    if mode != "ports":
        return reset
    allowed = (f"        meta l4proto {{ tcp, udp }} th dport {{ {', '.join(map(str, ports.connect))} }} accept\n"
               if ports.connect else "")
    # admin-prohibited: a TCP connect (MPTCP, Fast Open) fails at once with
    # EHOSTUNREACH, a datagram with EPERM; a drop would leave connect hanging.
    return reset + (
        f"table inet {TABLE} {{\n"
        "    chain output {\n"
        "        type filter hook output priority 0; policy accept;\n"
        '        oif "lo" accept\n'
        f"{allowed}"
        "        reject with icmpx admin-prohibited\n"
        "    }\n"
        "}\n"
    )


def plan_network(mode: NetworkMode, *, use_userns: bool, stack_missing: str, nft_missing: str, landlock_abi: int,
                 ports: NetworkPorts, stack: str = PASTA) -> NetworkPlan:
    """Pure: how a mode is held. ``stack_missing``/``nft_missing`` are "" when
    available, else why not; ``stack``: the user-mode stack that runs."""
    if not use_userns:
        # Degraded mode: no namespace to give; today's mechanisms.
        if mode == "off":
            return NetworkPlan(mode, namespace=False, stack=False, rules="", landlock_tcp=True, seccomp_inet=False,
                               mechanism="seccomp: no IPv4/IPv6 sockets"
                               + (", Landlock: no TCP bind/connect" if landlock_abi >= 4 else ""))
        return _host_network(mode, ports)
    if mode == "off":
        return NetworkPlan(mode, namespace=True, stack=False, rules="", landlock_tcp=False, seccomp_inet=True,
                           mechanism="network namespace with loopback only")
    if mode == "domains":
        # No stack: the daemon's proxy, reached through a listener the worker
        # makes on the namespace's loopback, is the only way out (dispatchd/domains.py).
        from dispatchd import domains

        return NetworkPlan(mode, namespace=True, stack=False, rules="", landlock_tcp=False, seccomp_inet=True,
                           mechanism=(f"network namespace with loopback only; the daemon's filtering proxy "
                                      f"({domains.PROXY_HOST}:{domains.PROXY_PORT}, HTTP CONNECT and plain HTTP "
                                      "to the listed hosts) is the only way out"),
                           caveats=["network 'domains' checks the host each request names, not what a tunnel "
                                    "carries: a listed name served by a shared CDN can be fronted for other hosts "
                                    "(SNI, ECH), and a listed host that accepts uploads is a way out for data"])
    if stack_missing:
        # Refused, never the host's network instead: a session of full mode
        # has a network namespace of its own in every mode, and the switch to
        # "off" cuts every connection only because of it.
        raise ConfinementError("network", detail=unavailable(mode, stack_missing, nft_missing))
    if mode == "ports" and nft_missing:
        raise ConfinementError("network", detail=unavailable(mode, "", nft_missing))
    via = f"own network namespace, out through {stack} (the host's loopback is {GATEWAY})"
    if mode == "on":
        return NetworkPlan(mode, namespace=True, stack=True, rules="", landlock_tcp=False, seccomp_inet=True,
                           mechanism=via)
    return NetworkPlan(mode, namespace=True, stack=True, rules=nft_rules(mode, ports), landlock_tcp=False,
                       seccomp_inet=True,
                       mechanism=f"{via}; nftables in it: TCP, MPTCP and UDP out only to {_ports(ports.connect)}; "
                                 "listening on any port, reachable from inside the session only; "
                                 f"DNS through the daemon's relay ({RELAY_ADDRESS}, on its loopback) to the host's "
                                 "resolvers, whatever the ports")


def unavailable(mode: NetworkMode, stack_missing: str, nft_missing: str, *, use_userns: bool = True) -> str:
    """Why ``mode`` cannot be held on this machine ("" when it can): what is
    missing, and the command that installs or allows it. Pure."""
    if not use_userns:
        # Degraded mode: the host's network, held by seccomp and Landlock.
        return ("network 'domains' needs a network namespace of its own (user namespaces), and sessions have "
                "none here" if mode == "domains" else "")
    if mode in ("on", "ports") and stack_missing:
        return (f"network {mode!r} needs a user-mode network stack, which cannot run here: "
                f"{stack_missing}; network 'off' and 'domains' work without it")
    if mode == "ports" and nft_missing:
        return f"network 'ports' needs nftables in the session's own network namespace: {nft_missing}"
    return ""


def _host_network(mode: NetworkMode, ports: NetworkPorts) -> NetworkPlan:
    """Degraded mode (no user namespaces): the host's network, as held by seccomp and Landlock."""
    caveats = []
    if mode == "ports":
        caveats.append("network 'ports' restricts TCP only (Landlock): UDP (DNS included) and ICMP reach the "
                       "host's network, and an MPTCP socket or a TCP Fast Open sendto connects to any port")
        return NetworkPlan(mode, namespace=False, stack=False, rules="", landlock_tcp=True, seccomp_inet=True,
                           mechanism=f"host network; Landlock TCP: connect to {_ports(ports.connect)}, "
                                     f"bind {_ports(ports.bind)}", caveats=caveats)
    return NetworkPlan(mode, namespace=False, stack=False, rules="", landlock_tcp=False, seccomp_inet=True,
                       mechanism="host network", caveats=caveats)


def switch_in_place(old: NetworkPlan, new: NetworkPlan) -> bool:
    """Can a session go from ``old`` to ``new`` keeping its processes? Only
    when both live in the session's own namespace and neither needs Landlock
    TCP rules (which cannot be lifted from a running process)."""
    # "domains" is set up at the worker's start (the proxy's listener, the
    # proxy variables): to or from it the sandbox is replaced.
    return (old.namespace and new.namespace and not old.landlock_tcp and not new.landlock_tcp
            and "domains" not in (old.mode, new.mode))


# --- probing (daemon start) ----------------------------------------------------


TUN = "/dev/net/tun"


_INSTALL = {
    SLIRP4NETNS: "sudo apt install slirp4netns; Fedora, RHEL: sudo dnf install slirp4netns",
    PASTA: "sudo apt install passt; Fedora, RHEL: sudo dnf install passt",
}


def probe_stack(choice: str = "auto", tun: str = TUN, *, landlock_abi: int = 0,
                which: Callable[[str], str | None] = shutil.which) -> tuple[str, str]:
    """The stack sessions go out through, and "" ; or "" and why none can run
    here, with the command that fixes it. ``choice``: one of
    ``STACK_CHOICES``; "auto" takes the first of ``STACKS`` that can run
    confined (slirp4netns needs Landlock: ``plan_stack_confinement``).
    ``tun``: the device both open (another path only for the daemon's
    testing option, which can only make it fail)."""
    names = STACKS if choice == "auto" else (choice,)
    usable = [n for n in names if which(n) is not None]
    if choice == SLIRP4NETNS and usable and landlock_abi < 1:
        return "", (f"{SLIRP4NETNS} runs confined by Landlock, which this kernel does not offer "
                    f"(use --network-stack {PASTA}, which confines itself)")
    usable = [n for n in usable if n != SLIRP4NETNS or landlock_abi >= 1]
    if not usable:
        if choice != "auto":
            return "", f"{choice} is not installed (install it: {_INSTALL[choice]})"
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


def probe_nft() -> str:
    try:
        ctypes.CDLL("libnftables.so.1")
    except OSError:
        return ("libnftables is not installed (install it: sudo apt install nftables; Fedora, RHEL: "
                "sudo dnf install nftables)")
    return ""


# --- applying (daemon and fork server) -------------------------------------------


class Stack:
    """A running stack for one session: a child of the fork server (it dies
    with it, and so with the daemon), held by the daemon through a pidfd."""

    def __init__(self, pid: int, pidfd: int, name: str = PASTA) -> None:
        self.pid = pid
        self.pidfd = pidfd
        self.name = name  # which stack (STACKS)
        # What goes with the stack (the DNS relay's door): stopped first.
        self.with_it: list[Callable[[], None]] = []
        # What the session's status warns of while it runs ("" for nothing):
        # the DNS relay's (daemon/dnsrelay.py), set by the daemon.
        self.warning: Callable[[], str] = lambda: ""
        self.stopping = False  # ended on purpose: its exit is no failure (daemon/helpers.py)

    def exited(self) -> bool:
        """Whether it has exited on its own (not by ``stop``)."""
        pidfd = self.pidfd
        # The flag is read after the poll: a stop meanwhile (its descriptor
        # closed, the number reused) is seen as a stop, never as an exit.
        return pidfd >= 0 and fdwait.readable(pidfd, 0) and not self.stopping

    def stop(self, reap: Callable[[int, float], None] | None = None) -> None:
        """Exited on return: nothing of it moves a byte any more, and its tap
        device (the namespace's way out) is gone with its descriptors. The fork
        server reaps it.

        With ``reap`` (a session's end, whose processes are killed next and
        waited for): SIGKILL is sent, and its exit, with the tap device's
        removal, is waited for by ``reap(pidfd, timeout_s)``, which closes the
        pidfd (daemon/afterwards.py). A killed stack runs none of its own code
        again: it copies no byte more, exited or not."""
        self.stopping = True
        while self.with_it:
            self.with_it.pop()()
        if self.pidfd < 0:
            return
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        pidfd, self.pidfd = self.pidfd, -1
        if reap is not None:
            reap(pidfd, STOP_TIMEOUT_S)
            return
        fdwait.readable(pidfd, STOP_TIMEOUT_S)  # readable once it has exited
        os.close(pidfd)


class Launch(msgspec.Struct, frozen=True):
    """Which stack a daemon's sessions get, and the fork server's confinement
    of it (an encoded ``StackConfinement``; empty for pasta)."""

    stack: str
    confinement: bytes = b""


def launch_for(stack: str, landlock_abi: int) -> Launch:
    """The daemon's ``Launch`` for ``stack`` (as probed: ``probe_stack``), its
    confinement planned once, for every session."""
    if not stack:
        return Launch(PASTA)  # none can run: no session gets one (plan_network refuses)
    path = os.path.realpath(shutil.which(stack) or stack)
    confinement = plan_stack_confinement(stack, landlock_abi=landlock_abi, executable=path)
    return Launch(stack, msgspec.msgpack.encode(confinement) if confinement is not None else b"")


def start_stack(userns_fd: int, netns_fd: int, launch: Callable[[list[int]], tuple[int, int]],
                name: str = PASTA) -> Stack:
    """Start the stack attached to a session's namespaces (held by fd, never by
    pid) and return once the namespace's interface is configured.

    ``launch(fds)`` has the fork server start it (``ForkServerClient.start_stack``)
    with the user and network namespaces, the readiness pipe's write end and
    its stderr file, and returns ``(pid, pidfd)``; it raises ``OSError``, or a
    ``DispatchdError`` saying why, when the fork server cannot. ``name``: the
    stack's, for the errors."""
    # Both stacks write to the readiness pipe once the namespace's interface
    # is configured (pasta: its pid file; slirp4netns: its --ready-fd).
    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    err = tempfile.TemporaryFile()
    try:
        pid, pidfd = launch([userns_fd, netns_fd, ready_w, err.fileno()])
    except OSError as exc:
        os.close(ready_r)
        err.close()
        raise ConfinementError("network: start " + name, exc.errno, name) from exc
    except DispatchdError as exc:
        os.close(ready_r)
        err.close()
        raise ConfinementError("network: start " + name, detail=str(exc)) from exc
    finally:
        os.close(ready_w)
    stack = Stack(pid, pidfd, name)
    try:
        ready = fdwait.readable(ready_r, READY_TIMEOUT_S)
        if not ready or not os.read(ready_r, 16):
            stack.stop()
            err.seek(0)
            lines = err.read().decode(errors="replace").strip().splitlines()
            raise ConfinementError("network: start " + name, detail=(lines[-1] if lines else
                                   ("it did not report ready in time" if not ready else "it exited")))
    finally:
        os.close(ready_r)
        err.close()
    return stack


def stack_argv(stack: str, *, userns_fd: int, netns_fd: int, ready_fd: int) -> list[str]:
    """``stack`` attached to a session's namespaces, held by the descriptors
    the fork server's child has (never by pid); it reports ready on
    ``ready_fd`` once the namespace's interface is configured. Pure."""
    userns, netns = f"/proc/self/fd/{userns_fd}", f"/proc/self/fd/{netns_fd}"
    if stack == SLIRP4NETNS:
        # No --enable-sandbox: it binds the host's /etc and /run into its
        # root (the user's D-Bus, agents' sockets); the fork server confines
        # it instead (plan_stack_confinement). --disable-dns: the session's
        # resolver is the daemon's relay; 10.0.2.3 would read the host's
        # resolv.conf, which it cannot. Its own seccomp filter, installed once
        # it runs, blocks execve, setns, unshare, mount, ptrace and more.
        return [SLIRP4NETNS, "--configure", f"--mtu={MTU}", "--disable-dns", "--enable-seccomp",
                f"--ready-fd={ready_fd}", "--netns-type=path", f"--userns-path={userns}", netns, "eth0"]
    return [PASTA, "--foreground", "--quiet", "--config-net", "--ipv4-only",
            "--address", ADDRESSES[PASTA], "--netmask", "24", "--gateway", GATEWAY, "--ns-ifname", "eth0",
            "--dns-forward", DNS,
            # Nothing forwarded in, and the session's loopback stays its own.
            "-t", "none", "-u", "none", "-T", "none", "-U", "none",
            # pasta writes its pid file once the interface is configured:
            # the readiness pipe as the pid file.
            "--pid", f"/proc/self/fd/{ready_fd}", "--userns", userns, "--netns", netns]


class StackConfinement(msgspec.Struct, frozen=True):
    """What the fork server's child applies before it executes a stack that
    does not confine itself."""

    landlock: LandlockPlan
    seccomp: SeccompPlan


# Where a program and the libraries it loads live (merged /usr or not).
SYSTEM_READ = ["/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/etc/ld.so.cache"]


def plan_stack_confinement(stack: str, *, landlock_abi: int, executable: str) -> StackConfinement | None:
    """How ``stack`` is confined (None: pasta, which confines itself). Pure.

    Landlock: read and execute of the system's programs and libraries and of
    ``executable`` (the stack's resolved path, wherever installed), and the
    tun device, with its ioctls (the interface is made with TUNSETIFF); no
    other file, nothing written; no signal to a process outside, no abstract
    socket outside (ABI 6). seccomp: ``seccomp.plan_stack_seccomp``. The
    stack's child joins the session's namespaces, which seccomp allows
    (``setns``): it has no descriptor of any other namespace, and Landlock
    keeps /proc, where it would find one, out of its reach."""
    if stack != SLIRP4NETNS:
        return None
    from dispatchd.confine import landlock, seccomp

    plan = landlock.plan_landlock(abi=landlock_abi, read_only=[*SYSTEM_READ, executable], read_write=[],
                                  devices=[], deny_tcp=False)
    tun = landlock.PathRule(TUN, (landlock.DEVICE | landlock.IOCTL_DEV) & plan.handled_fs)
    plan = msgspec.structs.replace(plan, paths=[*plan.paths, tun])
    return StackConfinement(landlock=plan, seccomp=seccomp.plan_stack_seccomp())


def confine_stack(confinement: StackConfinement, program: bytes) -> None:
    """In the fork server's child, right before the stack's exec: Landlock,
    then seccomp (``program``, compiled from ``confinement.seccomp``), each
    after no_new_privs. Raises ``ConfinementError``; the child then exits
    without running the stack."""
    from dispatchd.confine import hygiene, landlock, seccomp

    hygiene.no_new_privs()
    landlock.apply_landlock(confinement.landlock)
    seccomp.apply_seccomp(program)


def apply_rules_in(userns_fd: int, netns_fd: int, rules: str) -> str:
    """In a fresh single-threaded child (of the fork server): join the
    session's namespaces, where the owner of the user namespace holds every
    capability, and commit ``rules`` through libnftables. Returns "" or the
    error. Never call in a process that goes on living: it stays in there."""
    from dispatchd.confine import _sys

    try:
        _sys.setns(userns_fd, _sys.CLONE_NEWUSER)
        _sys.setns(netns_fd, _sys.CLONE_NEWNET)
    except OSError as exc:
        return f"setns: {exc.strerror}"
    try:
        lib = ctypes.CDLL("libnftables.so.1")
    except OSError as exc:
        return f"libnftables: {exc}"
    lib.nft_ctx_new.restype = ctypes.c_void_p
    lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
    lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    ctx = lib.nft_ctx_new(0)
    lib.nft_ctx_buffer_output(ctx)
    lib.nft_ctx_buffer_error(ctx)
    if lib.nft_run_cmd_from_buffer(ctx, rules.encode()) != 0:
        return "nft: " + (lib.nft_ctx_get_error_buffer(ctx) or b"failed").decode(errors="replace").strip()
    return ""


def open_dns_sockets_in(userns_fd: int, netns_fd: int) -> tuple[int, int]:
    """In a fresh single-threaded child (of the fork server), as
    ``apply_rules_in``: join the session's namespaces and make the DNS relay's
    door there, a UDP socket and a TCP listener on ``RELAY_ADDRESS`` port 53
    of its loopback (a port below 1024: the owner of the user namespace may
    bind it, the session, with no capability, may not). Returns their fds
    (close-on-exec), for the daemon to serve. Raises ``OSError``."""
    from dispatchd.confine import _sys

    _sys.setns(userns_fd, _sys.CLONE_NEWUSER)
    _sys.setns(netns_fd, _sys.CLONE_NEWNET)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    udp.bind((RELAY_ADDRESS, DNS_PORT))
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind((RELAY_ADDRESS, DNS_PORT))
    tcp.listen(16)
    return udp.detach(), tcp.detach()
