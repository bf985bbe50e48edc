"""A session's network switched: in place where the old and the new mode
are both held in the session's own namespace (its processes kept), else by
replacing its sandbox (every process of the session ended).

Guarantees:
- a bad request, or a setting that cannot be enforced, is refused before
  anything changes; the session stays as it was (``ready`` or ``asleep``);
- a switch holds the session's lock from ``switching`` to its end: a close
  asked meanwhile waits for it, then closes; a switch asked of a session
  closing or closed is refused (``lifecycle.decide``);
- a switch that fails half way (a stack that did not start, rules nft
  refused, a new sandbox that did not start) ends the session
  (``switch_failed``), its worktree checked as at every end, rather than
  leave it running under a setting nobody asked for;
- a sandbox replaced is wound down (``Ending._wind_down``) before the new
  one starts: nothing started under the old setting keeps its connections;
  the session's ``sandbox`` number goes up by one, its reason
  ``REPLACED_NETWORK``, before any attach can reach the new one.
"""

from __future__ import annotations

import logging

import msgspec

from dispatchd import domains, protocol
from dispatchd.confine import netstack
from dispatchd.daemon.lifecycle import Action, Event, Op, State
from dispatchd.daemon.opening import Opening
from dispatchd.daemon.session import Session, count_session_processes, has_user_namespace
from dispatchd.daemon.sessionnet import NetworkUnchanged, check_network, domains_for, ports_of
from dispatchd.errors import ConfinementError
from dispatchd.netmodes import NetworkMode

log = logging.getLogger("dispatchd.sessions")


class Switching(Opening):
    def set_network(self, sid: str, network: NetworkMode, ports: list[int] | None = None,
                    bind_ports: list[int] | None = None, domain_list: list[str] | None = None) -> Session:
        """Between off, on and ports in the session's own namespace: in place,
        its processes kept (``_switch_in_place``). Otherwise by replacing the
        sandbox: every process of the session is ended, so nothing started under
        the old setting keeps its connections. From "domains" to "domains" (a
        new list) the sandbox stays: the proxy closes the connections the new
        list does not allow before this returns."""
        rules = check_network(network, ports, bind_ports, domain_list)
        session = self.get(sid)
        self._admit(session, Op.SWITCH)  # closing: refused now, not once its close is over
        with session.lock:
            if self._admit(session, Op.SWITCH).action is not Action.GO:
                raise AssertionError(f"session {sid}: {session.state.value} seen under its lock")
            session.move(Event.SWITCH)
            try:
                ended = self._switch(session, network, ports, bind_ports, rules)
            finally:
                if session.state is State.SWITCHING:  # done, or refused before anything changed
                    session.move(Event.SWITCHED_ASLEEP if session.nap is not None else Event.SWITCHED)
        if ended is not None:
            log.info("event=session_network session=%s network=%s ended=%s", sid, network, ended)
        return session

    def _switch(self, session: Session, network: NetworkMode, ports: list[int] | None,
                bind_ports: list[int] | None, rules: tuple[domains.Rule, ...] | None) -> int | None:
        """The switch itself, under the session's lock: how many processes
        replacing the sandbox ended, or None when it was switched in place."""
        sid = session.id
        if network == "domains" and session.network == "domains" and session.proxy is not None:
            session.domains = domains_for(session, rules)
            cut = session.proxy.configure("domains", session.domains)
            session.note = (f"network domains: the list was changed in place (no process ended); {cut} "
                            "connection(s) to hosts no longer listed were closed")
            log.info("event=session_network session=%s network=domains in_place=1 cut=%s", sid, cut)
            return None
        old_ports, old_domains = session.ports, session.domains
        session.ports = ports_of(session.policy, ports, bind_ports)
        session.domains = domains_for(session, rules)
        try:
            self._plan(session, network)  # what cannot be enforced is refused before anything ends
        except ConfinementError:
            session.ports, session.domains = old_ports, old_domains
            raise
        try:
            note = self._switch_in_place(session, network)
        except NetworkUnchanged:
            session.ports, session.domains = old_ports, old_domains
            raise
        except BaseException:
            # Half switched (a stack that did not start, rules nft refused).
            self._switch_failed(session, network, wound_down=False)
            raise
        if note is not None:
            session.note = note
            log.info("event=session_network session=%s network=%s in_place=1", sid, network)
            return None
        ended = count_session_processes(session)
        self._wind_down(session)
        try:
            self._start_worker(session, network)
            # Before the lock is let go: an attach waiting for it (a client
            # whose call the old sandbox took with it) learns why.
            session.sandbox = (session.sandbox[0] + 1, protocol.REPLACED_NETWORK)
            session.note = (f"network {network}: the sandbox was replaced ({self._why_replaced(session)}); "
                            f"{ended} process(es) the session had started were ended")
        except BaseException as exc:
            # The new setting cannot be enforced (or starting failed).
            if isinstance(exc, ConfinementError):
                session.ports, session.domains = old_ports, old_domains
            self._switch_failed(session, network, wound_down=True)
            raise
        return ended

    def _switch_failed(self, session: Session, network: NetworkMode, *, wound_down: bool) -> None:
        """End the session rather than leave it running under a setting nobody
        asked for; what it planted in git is moved aside, as at every end."""
        session.move(Event.SWITCH_FAILED)
        self._ended.record(session.id, f"its network could not be switched to {network}")
        try:
            # A replacement that failed after its worker or stack was
            # recorded (its watch's thread, its environment not sent) has a
            # new sandbox to end too, its way out with it.
            if not wound_down or session.worker is not None or session.stack is not None:
                self._wind_down(session)
        finally:
            self._discard(session)
            session.move(Event.DISCARDED)

    def _switch_in_place(self, session: Session, network: NetworkMode) -> str | None:
        """Switch without replacing the sandbox when the old and the new mode
        are both held in the session's own namespace; the reply's note, or None
        when the sandbox must be replaced (see ``netstack.switch_in_place``)."""
        old = session.net
        plan = self._plan(session, network)
        if old is None or plan.net is None or not netstack.switch_in_place(old, plan.net) \
                or (session.worker is None and session.nap is None):
            return None
        self.networks.apply(session, plan.net)
        self.networks.check_dns(session)
        if session.proxy is not None:
            session.proxy.configure(network, session.domains)  # refuses all outside "domains"
        absent = session.protections.absent_paths if session.protections else None
        made_ahead = bool(session.protections and session.protections.made_ahead)
        session.protections = msgspec.structs.replace(plan.protections, absent_paths=absent or [], made_ahead=made_ahead)
        session.network = network
        kept = count_session_processes(session)
        if network == "off":
            cut = (f"its way out ({self.networks.launch.stack}) was stopped: every connection outside the session "
                   "is cut; servers inside still serve the session's own clients")
        elif network == "ports":
            cut = ("nftables in its namespace now lets out only TCP, MPTCP and UDP to ports "
                   f"{', '.join(map(str, session.ports.connect)) or 'none'}: connections to any other are cut")
        else:
            cut = f"out through {self.networks.launch.stack}, any port"
        return f"network {network}: switched in place, {kept} process(es) of the session kept; {cut}"

    def _why_replaced(self, session: Session) -> str:
        if not has_user_namespace(session):
            return "no user namespaces: the network is held by seccomp and Landlock, fixed at the start"
        # In full mode every network is held in the session's own namespace:
        # only "domains" is set up at the worker's start.
        return "to or from 'domains': its proxy's listener and variables are set up when the sandbox starts"
