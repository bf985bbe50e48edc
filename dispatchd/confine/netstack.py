"""A session's network: its own namespace in every mode, a user-mode stack for
the way out, and netfilter rules inside for "ports".

Guarantees, in full mode (user namespaces) with a stack available:
- every session has a network namespace of its own, whatever its mode; the
  only way out of it is a user-mode stack the daemon has the fork server
  start outside the sandbox, attached to that namespace (``start_stack``),
  and ends (SIGKILL, waited for) with the session and on every switch to
  "off"; a child of the fork server, it dies with it, so a daemon killed with
  SIGKILL leaves none behind; at a switch to "off", what it forked is ended
  too, and the namespace looked into (``links_up_in``) before the switch
  returns (daemon/sessionnet.py);
- the stack is confined whichever it is (confine/stacks.py: which one runs,
  and how each is confined);
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
  address only. What a stack hands in for a flow the session began (both
  take, for each UDP flow, a socket on every address of the host and pass
  on whatever reaches it, from any sender) is dropped in the namespace
  unless it is a reply of the flow's own peer: ``nft_rules``' input chain,
  in every mode where a stack runs, committed before the stack starts.
  Under pasta, which binds the host's port of the session's source port
  number, the session's UDP source ports are moved into the host's
  ephemeral range, so a session cannot pick which port of the host it holds.

``plan_network`` is the one place deciding, per mode, which namespace, whether
the stack runs, which rules apply and what Landlock/seccomp must hold; a new
mode (``domains``) adds a branch there.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import socket
import tempfile
from collections.abc import Callable

import msgspec

from dispatchd import fdwait
from dispatchd.confine.stacks import GATEWAY, PASTA
from dispatchd.errors import ConfinementError, DispatchdError
from dispatchd.netmodes import NetworkMode

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
    host_loopback: bool = True  # the stack maps the gateway to the host's loopback


def _ports(ports: list[int]) -> str:
    return ", ".join(map(str, ports)) if ports else "none"


def reset_rules() -> str:
    """Our table removed from a session's namespace (one transaction; no
    error when it is not there)."""
    return f"add table inet {TABLE}\ndelete table inet {TABLE}\n"


# Where a session's UDP source ports go under pasta: Linux's default
# ephemeral range (ip_local_port_range), where the host's own programs pick
# theirs and servers seldom listen.
UDP_SOURCE_PORTS = "32768-60999"
# The modes whose namespace has a stack, and so the input chain.
STACK_MODES: tuple[NetworkMode, ...] = ("on", "ports")


def to_commit(rules: str, held: str) -> str:
    """What is committed to bring a namespace holding ``held`` (the rules
    committed there last; "" for no table of ours) to ``rules``
    (``nft_rules``): without the removal that leads them (``reset_rules``)
    where there is no table to remove. A removal makes the committing
    process wait, at its exit, for an RCU grace period (its netlink
    socket's release flushes nf_tables' destroy work): 8-18 ms of each
    commit into a fresh namespace, measured. Pure."""
    reset = reset_rules()
    return rules.removeprefix(reset) if not held and rules != reset else rules


def nft_rules(mode: NetworkMode, ports: NetworkPorts, stack: str = "") -> str:
    """The ruleset for a session's namespace, replacing whatever was there
    (one transaction: add, delete, define). Pure.

    In every mode where a stack runs (``STACK_MODES``), an input chain: the
    loopback, and the packets conntrack ties to a flow the session began
    (its exact addresses and ports, and the ICMP errors about it); nothing
    else. A stack hands in what any sender sends to the host socket it
    opened for a flow, as from the gateway (the host's loopback) or the
    sender's own address, with the sender's port: not the flow's, so
    dropped. "ports" adds its output chain; under pasta (``stack``), which
    binds the host's port of the same number as the session's UDP source
    port, those are moved into ``UDP_SOURCE_PORTS`` at random."""
    reset = reset_rules()
    if mode not in STACK_MODES:
        return reset
    chains = [
        "    chain input {\n"
        "        type filter hook input priority 0; policy drop;\n"
        '        iif "lo" accept\n'
        "        ct state established,related accept\n"
        "    }\n",
        # Loopback is let in whatever its state: tracking it would buy nothing,
        # and let a session hold an entry a datagram (up to nf_conntrack_max).
        "    chain untracked_out {\n"
        "        type filter hook output priority raw; policy accept;\n"
        '        oif "lo" notrack\n'
        "    }\n",
        "    chain untracked_in {\n"
        "        type filter hook prerouting priority raw; policy accept;\n"
        '        iif "lo" notrack\n'
        "    }\n"]
    if mode == "ports":
        allowed = (f"        meta l4proto {{ tcp, udp }} th dport {{ {', '.join(map(str, ports.connect))} }} accept\n"
                   if ports.connect else "")
        # admin-prohibited: a TCP connect (MPTCP, Fast Open) fails at once with
        # EHOSTUNREACH, a datagram with EPERM; a drop would leave connect hanging.
        chains.append(
            "    chain output {\n"
            "        type filter hook output priority 0; policy accept;\n"
            '        oif "lo" accept\n'
            f"{allowed}"
            "        reject with icmpx admin-prohibited\n"
            "    }\n")
    if stack == PASTA:
        # By name: the stack makes eth0 after the rules are committed.
        chains.append(
            "    chain postrouting {\n"
            "        type nat hook postrouting priority 100; policy accept;\n"
            f'        oifname "eth0" meta l4proto udp masquerade to :{UDP_SOURCE_PORTS} random\n'
            "    }\n")
    return reset + f"table inet {TABLE} {{\n" + "".join(chains) + "}\n"


def plan_network(mode: NetworkMode, *, use_userns: bool, stack_missing: str, nft_missing: str, landlock_abi: int,
                 ports: NetworkPorts, stack: str, host_loopback: bool = True) -> NetworkPlan:
    """Pure: how a mode is held. ``stack_missing``/``nft_missing`` are "" when
    available, else why not; ``stack``: the user-mode stack that runs;
    ``host_loopback``: the policy's (False: the gateway is not the host's
    loopback, and a mode that cannot hold that is refused)."""
    if not use_userns:
        # Degraded mode: no namespace to give; today's mechanisms.
        if mode in ("on", "ports") and not host_loopback:
            raise ConfinementError("network", detail=f"network {mode!r} without user namespaces is the host's "
                                   "network, its loopback included; the policy closes the host's loopback "
                                   "([network] host_loopback = false)")
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
    via = f"own network namespace, out through {stack} " + \
        (f"(the host's loopback is {GATEWAY})" if host_loopback else "(the host's loopback closed)")
    inbound = "in only the replies to what the session sent" + \
        ("; its UDP source ports moved into the host's ephemeral range" if stack == PASTA else "")
    if mode == "on":
        if nft_missing:
            # Still the internet, as asked: what the stack hands in is said open, never held.
            return NetworkPlan(mode, namespace=True, stack=True, rules="", landlock_tcp=False, seccomp_inet=True,
                               mechanism=via, host_loopback=host_loopback,
                               caveats=["network 'on' without nftables in the session's namespace: whatever any "
                                        "sender sends to a port the stack holds on the host for the session's UDP "
                                        "flows comes in" + (", and the session picks that port (pasta binds the "
                                                            "number of its source port)" if stack == PASTA else "")
                                        + f" ({nft_missing})"])
        return NetworkPlan(mode, namespace=True, stack=True, rules=nft_rules(mode, ports, stack), landlock_tcp=False,
                           seccomp_inet=True, mechanism=f"{via}; nftables in it: {inbound}",
                           host_loopback=host_loopback)
    return NetworkPlan(mode, namespace=True, stack=True, rules=nft_rules(mode, ports, stack), landlock_tcp=False,
                       seccomp_inet=True, host_loopback=host_loopback,
                       mechanism=f"{via}; nftables in it: TCP, MPTCP and UDP out only to {_ports(ports.connect)}, "
                                 f"{inbound}; listening on any port, reachable from inside the session only; "
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

    def __init__(self, pid: int, pidfd: int, name: str) -> None:
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


def start_stack(userns_fd: int, netns_fd: int, launch: Callable[[list[int]], tuple[int, int]],
                name: str) -> Stack:
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
            said = err.read().decode(errors="replace")
            lines = said.strip().splitlines()
            # A stack that exited because it could not fork or start a
            # thread (slirp4netns forks at its start) says so only in words:
            # the sessions' process bound or the user's limit, told as
            # EAGAIN, as the fork server's own refusal is, so that the switch
            # is undone (once its way out is known gone: sessionnet._undo).
            # One that did not report in time is no such case.
            raise ConfinementError("network: start " + name,
                                   errno.EAGAIN if ready and os.strerror(errno.EAGAIN) in said else 0,
                                   detail=(lines[-1] if lines else
                                           ("it did not report ready in time" if not ready else "it exited")))
    finally:
        os.close(ready_r)
        err.close()
    return stack


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
    lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
    lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    ctx = lib.nft_ctx_new(0)
    lib.nft_ctx_buffer_output(ctx)
    lib.nft_ctx_buffer_error(ctx)
    if lib.nft_run_cmd_from_buffer(ctx, rules.encode()) != 0:
        return "nft: " + (lib.nft_ctx_get_error_buffer(ctx) or b"failed").decode(errors="replace").strip()
    # Read back: its return code is libnftables' word alone, and a session
    # said to be in "ports" with no table in its namespace would be open.
    listed = lib.nft_run_cmd_from_buffer(ctx, f"list table inet {TABLE}".encode()) == 0
    return rules_hold(rules, (lib.nft_ctx_get_output_buffer(ctx) or b"").decode(errors="replace") if listed else None)


def rules_hold(rules: str, listed: str | None) -> str:
    """Pure: whether ``listed`` (our table as nft lists it, None when there
    is none) is what committing ``rules`` (``nft_rules``) leaves: "" or
    what is wrong. Where the rules define the table, each of its chains'
    hooks and what holds each (``_HOLDING``) must be there."""
    if f"table inet {TABLE} {{" not in rules:  # the table removed (``reset_rules``)
        return "" if listed is None else f"nft: the table inet {TABLE} is still there after its removal"
    if listed is None:
        return f"nft: the rules were committed, but the table inet {TABLE} is not there"
    for needed in _HOLDING:
        if needed in rules and needed not in listed:
            return f"nft: the rules were committed, but the table inet {TABLE} has no {needed!r}"
    return ""


# What must be listed of each chain ``nft_rules`` defines, as nft lists it:
# its hook and policy, and what holds it (the output's final reject, the
# input's one way in); the source ports' translation.
_HOLDING = ("hook input", "policy drop", "ct state established,related accept", 'oif "lo" notrack',
            'iif "lo" notrack', "hook output",
            "reject with icmpx admin-prohibited", "hook postrouting", f"masquerade to :{UDP_SOURCE_PORTS} random")


def links_up_in(userns_fd: int, netns_fd: int) -> str:
    """In a fresh single-threaded child (of the fork server), as
    ``apply_rules_in``: join the session's namespaces and name the interfaces
    up there but its loopback (``netns.links_up``). Returns "" when there is
    none, else what is up, or why it could not be looked at: both mean the
    way out is not known to be gone."""
    from dispatchd.confine import _sys, netns

    try:
        _sys.setns(userns_fd, _sys.CLONE_NEWUSER)
        _sys.setns(netns_fd, _sys.CLONE_NEWNET)
        up = netns.links_up()
    except OSError as exc:
        return f"its network namespace could not be looked at: {exc.strerror}"
    return f"{', '.join(up)} still up" if up else ""


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
    return open_dns_door()


def open_dns_door() -> tuple[int, int]:
    """The DNS relay's door on this process's network namespace's loopback
    (``open_dns_sockets_in``'s, once there): a sandbox that still holds its
    namespace's capabilities, before any code of its session runs, makes it
    itself (``SessionPlan.dns_door``). Raises ``OSError``."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        udp.bind((RELAY_ADDRESS, DNS_PORT))
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind((RELAY_ADDRESS, DNS_PORT))
        tcp.listen(16)
    except BaseException:
        udp.close()
        tcp.close()
        raise
    return udp.detach(), tcp.detach()
