"""A session's network as the daemon holds it: a request's network checked,
the session's namespace brought to a mode (nftables rules, its user-mode
stack), its "domains" proxy, and all of it let go.

Guarantees:
- a bad request (an unknown mode, a port out of range, ports or domains for
  a mode that has none) is refused before anything changes;
- ``apply_network`` keeps the session's processes: a stack the new mode has
  none of is ended first (killed and reaped before it returns, with what
  it forked; its interface seen gone from the namespace, else
  ``ConfinementError``, and the switch ends the session), the new
  rules are committed before a stack starts; rules nft refuses raise
  ``ConfinementError("network: nftables")``; a mode without a stack
  ("off") leaves the table in place, inert with the loopback alone;
- ``stop_network`` is the way out gone: from its return no byte of the
  session leaves, and the daemon holds none of its namespaces.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import socket
from collections.abc import Callable

import msgspec

from dispatchd import protocol
from dispatchd import domains
from dispatchd.confine import netstack, stacks
from dispatchd.confine.netstack import NetworkPorts
from dispatchd.confine.plan import SessionPlan
from dispatchd.daemon.dnsrelay import Check, DnsRelay
from dispatchd.daemon.pool import Made
from dispatchd.daemon.proxy import Resolver, SessionProxy
from dispatchd.daemon.session import Session
from dispatchd.daemon.spawn import ForkServerClient, NoProcess, SpawnError
from dispatchd.errors import ConfinementError, DispatchdError
from dispatchd.netmodes import NETWORK_MODES, NetworkMode
from dispatchd.policy import Policy

log = logging.getLogger("dispatchd.sessions")


def check_network(network: NetworkMode, ports: list[int] | None, bind_ports: list[int] | None,
                   domain_list: list[str] | None = None) -> tuple[domains.Rule, ...] | None:
    """Refuse a bad request before anything changes; the parsed domains, if given."""
    if network not in NETWORK_MODES:
        raise DispatchdError(f"network must be one of {', '.join(NETWORK_MODES)}, not {network!r}")
    for port in (ports or []) + (bind_ports or []):
        if not 1 <= port <= 65535:
            raise DispatchdError(f"{port} is not a TCP port (1-65535)")
    if network != "ports" and (ports or bind_ports):
        raise DispatchdError(f"ports are only for network 'ports', not {network!r}")
    if domain_list is None:
        return None
    if network != "domains":
        raise DispatchdError(f"domains are only for network 'domains', not {network!r}")
    try:
        return domains.parse_domains(domain_list)
    except domains.BadHost as exc:
        raise DispatchdError(f"domains: {exc}") from None


def ports_of(policy: Policy, ports: list[int] | None = None, bind_ports: list[int] | None = None) -> NetworkPorts:
    """The call's ports, or else the policy's: sorted, each once (what the
    rules and a sandbox made ahead name: the same list, the same pool_key)."""
    net = policy.network
    return NetworkPorts(connect=sorted(set(net.connect_ports if ports is None else ports)),
                        bind=sorted(set(net.bind_ports if bind_ports is None else bind_ports)))


def domains_for(session: Session, rules: tuple[domains.Rule, ...] | None) -> tuple[domains.Rule, ...]:
    """The caller's list, or else the policy's (as ports do)."""
    return domains.parse_domains(session.policy.network.domains) if rules is None else rules


def take_namespaces(plan: SessionPlan, msg: protocol.WorkerReady | protocol.WorkerNamespaces,
                    control: protocol.FrameSocket) -> tuple[int, int] | None:
    """The session's user and network namespaces, as the worker sent them
    with ``WorkerReady`` (first of its fds), when it has its own."""
    if not (plan.namespaces.user and plan.namespaces.net):
        return None
    if isinstance(msg, protocol.WorkerReady) and not msg.namespaces:  # WorkerNamespaces always brings them
        raise ConfinementError("network: namespaces", detail="the worker handed over no namespace descriptors")
    try:
        userns = control.take_fd()
        try:
            return userns, control.take_fd()
        except protocol.ProtocolError:
            os.close(userns)
            raise
    except protocol.ProtocolError as exc:
        raise ConfinementError("network: namespaces", detail=str(exc)) from exc


def take_door(msg: protocol.WorkerReady | protocol.WorkerNamespaces,
              control: protocol.FrameSocket) -> tuple[socket.socket, socket.socket] | None:
    """The DNS relay's door the worker made (``SessionPlan.dns_door``), sent
    right after its namespaces; None when it made none (the fork server
    makes it then, as for a switch)."""
    if not msg.dns_door:
        return None
    socks: list[socket.socket] = []
    try:
        for _ in range(2):
            fd = control.take_fd()
            try:
                socks.append(socket.socket(fileno=fd))
            except OSError:  # not a socket: ours to close
                os.close(fd)
                raise
    except (protocol.ProtocolError, OSError) as exc:
        _close_all(tuple(socks))
        raise ConfinementError("network: DNS relay's door", detail=str(exc)) from exc
    return socks[0], socks[1]


def drop_door(holder: Session | Made) -> None:
    """A door the worker made and no stack served: closed."""
    door, holder.door = holder.door, None
    _close_all(door)


def _close_all(socks: tuple[socket.socket, ...] | None) -> None:
    for sock in socks or ():
        sock.close()


def stop_network(session: Session, reap: Callable[[int, float], None] | None = None) -> None:
    """The session's way out gone: its stack ended, its namespaces let go.
    ``reap``: a session's end, whose processes are killed next: the stack's
    exit is waited for off the reply's path (``afterwards.reap``)."""
    drop_door(session)
    if session.stack is not None:
        session.stack.stop(reap)
        session.stack = None
    if session.ns_fds is not None:
        for fd in session.ns_fds:
            os.close(fd)
        session.ns_fds = None
    session.net = None


def tell_denied(session: Session, host: str, port: int, allow: str) -> None:
    """The proxy refused ``host:port``: tell the tool server, whose calls in
    flight carry it (an asleep one has none)."""
    with session.send_lock:
        if session.control is not None and session.nap is None:
            try:
                session.control.send(protocol.NetworkDenied(host=host, port=port, allow=allow))
            except OSError:
                pass  # the sandbox is going: no call to tell


def namespaces(session: Session | Made) -> tuple[int, int]:
    if session.ns_fds is None:
        raise ConfinementError("network: namespaces", detail="the session has no network namespace of its own")
    return session.ns_fds


class NetworkUnchanged(ConfinementError):
    """A switch refused before it changed anything that stays: no process to
    start the stack with (the sessions' shared bound, or the user's limit),
    its rules, if any, put back. The session goes on as it was."""


class SessionNetworks:
    """What sets a session's network up needs of the daemon: its fork server
    (nft and the stacks run from there), its DNS relay, and the proxies' resolver."""

    def __init__(self, fork_server: ForkServerClient, dns: DnsRelay | None, resolver: Resolver,
                 launch: stacks.Launch) -> None:
        self.fork_server, self.dns, self.resolver = fork_server, dns, resolver
        self.launch = launch  # which stack, and how the fork server confines it

    def _start(self, fds: list[int], cgroup: str, host_loopback: bool) -> tuple[int, int]:
        return self.fork_server.start_stack(fds, stack=self.launch.stack, executable=self.launch.executable,
                                            confinement=self.launch.confinement, cgroup=cgroup,
                                            host_loopback=host_loopback)

    def apply(self, session: Session | Made, new: netstack.NetworkPlan | None) -> None:
        """Bring the session's namespace to ``new``, keeping its processes: the
        stack ended first when the new mode has none (killed and reaped before
        this returns), the rules committed before a stack starts; with no
        stack, the table stays (on record in ``session.net``)."""
        old, session.net = session.net, new
        if new is None or not new.namespace:
            return
        if not new.stack and session.stack is not None:
            self._stop_stack(session)
        held = old.rules if old is not None else ""  # what the namespace holds of ours
        if not new.stack and session.stack is None and held:
            # Off: the stack has ended and its way out is known gone
            # (``_stop_stack``), leaving the namespace its loopback alone,
            # which each table of ours lets in and out (pasta's translation
            # needs an eth0). The table stays, on record: no commit (no
            # process needed), and a switch back to the same mode commits
            # nothing either.
            session.net = msgspec.structs.replace(new, rules=held)
            return
        if new.rules != held:
            try:
                self.fork_server.net_rules(netstack.to_commit(new.rules, held), *namespaces(session))
            except NoProcess as exc:  # nft's transaction is whole or nothing: nothing changed
                if old is not None and (session.stack is not None) == old.stack:
                    session.net = old
                    raise NetworkUnchanged("network: nftables", detail=f"{exc}; the session's network is "
                                                                     "unchanged") from exc
                raise ConfinementError("network: nftables", detail=str(exc)) from exc
            except SpawnError as exc:
                raise ConfinementError("network: nftables", detail=str(exc)) from exc
        if new.stack and session.stack is None:
            # The DNS relay's door is made while the stack starts (daemon/dnsrelay.py).
            made, session.door = session.door, None  # made by the worker: no child of the fork server's
            door = None
            try:
                if self.dns:
                    door = self.dns.door_ahead(session.id, namespaces(session), self.fork_server.dns_sockets, made)
            finally:
                if door is None:  # no relay, or refused: the worker's door goes
                    _close_all(made)
            try:
                # In the session's cgroup, where it has one: its limits
                # (pids.max, memory.max, cpu.weight) hold the stack too.
                cgroup = session.cgroup
                session.stack = netstack.start_stack(
                    *namespaces(session), launch=lambda fds: self._start(fds, cgroup, new.host_loopback),
                    name=self.launch.stack)
            except BaseException as exc:
                if door is not None:
                    door.discard()
                if isinstance(exc, ConfinementError) and (isinstance(exc.__cause__, NoProcess)
                                                           or exc.errno == errno.EAGAIN):
                    self._undo(session, old, new, exc)
                raise
            log.debug("event=stack_started session=%s pid=%s", session.id, session.stack.pid)
            if door is not None:
                door.open_with(session.stack)

    def _undo(self, session: Session | Made, old: netstack.NetworkPlan | None, new: netstack.NetworkPlan,
              exc: ConfinementError) -> None:
        """A stack that could not start for want of a process (the fork
        server's refusal, or the stack's own fork refused): the rules
        ``new`` committed put back and the session's plan ``old`` again, then
        ``NetworkUnchanged``. Rules that cannot be put back leave ``exc`` to
        end the session, as any half-made switch does."""
        if not isinstance(exc.__cause__, NoProcess):
            # The stack ran and exited, refused a fork of its own: what it
            # may have forked ended and its way out known gone, as a stop's
            # (``_stop_stack``), before the session is said to be as it was.
            try:
                self.fork_server.net_closed(*namespaces(session))
            except SpawnError:
                return
        if old is None or new.rules == old.rules:
            pass
        else:
            try:
                self.fork_server.net_rules(old.rules or netstack.reset_rules(), *namespaces(session))
            except SpawnError:
                return
        session.net = old
        raise NetworkUnchanged(exc.step, exc.errno, exc.path,
                               detail=f"{exc.__cause__ or exc.why}; the session's network is unchanged") from exc

    def _stop_stack(self, session: Session | Made) -> None:
        """The stack ended, and the way out known to be gone: a stack can fork
        (slirp4netns must, at its start: docs/network.md, "A stack that
        forks"), and a process it forked holds its tap device as well as it
        did. The fork server ends whatever it left behind, then looks in the
        session's namespace: an interface still up there, or a look that
        could not be made, fails the switch, which ends the session
        (``Switching._switch_failed``), never a session said to be off with
        a way out."""
        stack, session.stack = session.stack, None
        if stack is None:
            return
        stack.stop()
        try:
            self.fork_server.net_closed(*namespaces(session))
        except SpawnError as exc:
            log.error("event=stack_outlived session=%s stack=%s pid=%s error=%s", session.id, stack.name,
                      stack.pid, exc)
            raise ConfinementError("network: stop " + stack.name,
                                   detail=f"its way out is not gone ({exc}); the session was ended") from exc

    def begin_dns_check(self, plan: SessionPlan) -> Check | None:
        """``check_dns``'s queries, sent as soon as an open has its plan (one
        with a stack, and so the relay's door): the resolvers answer while
        the sandbox is made ready, off the open's path."""
        return self.dns.begin_check() if self.dns is not None and plan.net is not None and plan.net.stack else None

    def check_dns(self, session: Session, begun: Check | None = None) -> None:
        """An open or a switch with the relay: ask the host's resolvers now
        (or read the answers to ``begun``), so that the reply's ``warnings``
        say whether names will resolve."""
        if self.dns is not None and session.stack is not None and session.stack.with_it:
            (begun or self.dns.begin_check()).result(session.id)

    def start_proxy(self, session: Session, plan: SessionPlan, msg: protocol.WorkerReady,
                    control: protocol.FrameSocket) -> None:
        """Serve the listener a "domains" worker made in its namespace; in any
        other mode the session's proxy (if it had one) refuses everything."""
        if plan.proxy_port and not msg.proxy_listener:
            raise ConfinementError("network: proxy listener", detail="the worker handed over no listener")
        if msg.proxy_listener:
            try:
                listener = socket.socket(fileno=control.take_fd())
            except protocol.ProtocolError as exc:
                raise ConfinementError("network: proxy listener", detail=str(exc)) from exc
            if session.proxy is None:
                session.proxy = SessionProxy(session.id, self.resolver)
                session.proxy.on_deny = functools.partial(tell_denied, session)
            session.proxy.configure(plan.network, session.domains)
            session.proxy.serve(listener)
        elif session.proxy is not None:
            session.proxy.configure(plan.network, session.domains)
