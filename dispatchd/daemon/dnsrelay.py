"""The DNS relay of network ``on`` and ``ports``: in the daemon, one door per session.

Guarantees:
- a session reaches it only through its door: a UDP socket and a TCP
  listener on ``RELAY_ADDRESS`` port 53 of the session's own network
  namespace (its own loopback), made there by a child of the fork server
  (``netstack.open_dns_sockets_in``) and handed to the daemon; the door is
  opened with the session's network stack and closed with it
  (``netstack.Stack.stop``), so a session whose network is ``off`` (or
  ``domains``) has no door: a query there is refused by its own loopback
  (ECONNREFUSED), and no other session, nor any other user, can reach it;
- the session's resolv.conf names ``RELAY_ADDRESS`` (``resolv_conf_text``);
- it forwards only what parses as one DNS query (QR clear, opcode QUERY, one
  question) and only to the host's resolvers, as the host's resolv.conf names
  them (re-read when that file, or the file its symlink leads to, changes);
  the session never chooses where a query goes. A reply is passed back only
  when it comes from the server the query was sent to, answers it (our own
  random ID, the same question) and parses as a reply;
- it is bounded: a query of at most ``MAX_QUERY`` bytes, a reply of at most
  65,535, ``MAX_IN_FLIGHT`` queries at once per session (more are answered
  SERVFAIL at once), ``MAX_PER_WINDOW`` datagrams and connections taken a ``RATE_WINDOW_S``, ``MAX_TCP`` TCP connections per session, each idle at
  most ``TCP_IDLE_S``; an upstream gets ``UPSTREAM_TIMEOUT_S``, the next one
  is tried, and a query no resolver answers is answered SERVFAIL within
  ``QUERY_DEADLINE_S``: the session's resolver library fails at once rather
  than waiting for its own timeouts;
- ``stop`` returns once nothing more is forwarded for that door: the
  sockets are closed, and a query read before but not yet sent is dropped
  (the send upstream happens under the door's lock, after a look at
  ``stopped``, which ``stop`` sets under the same lock);
- ``check`` says whether any of the host's resolvers answers (a query for
  the root's NS records; any reply counts): an open or a switch to ``on`` or
  ``ports`` whose DNS would not answer says so (``SessionInfo.warnings``);
  afterwards a session's status follows its own door's last query
  (``Door.warning``), never another session's.

``network ports``: the door is on the session's loopback, which the
``ports`` rules let through, so DNS through the relay works whatever ports
are listed; DNS straight to a server (port 53 elsewhere) follows the list
like any other UDP or TCP. The relay relays DNS and nothing else, to the
host's resolvers only: what it adds to ``ports`` is name lookups (and what a
query's name can carry).

Four modules, one job each: ``dnswire`` (DNS messages), ``dnshost`` (the
host's resolvers, asking one, the session's resolv.conf), ``dnsdoor`` (one
session's door), and this one (the relay of all sessions: doors made ahead,
the check, the TCP retry).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable

from dispatchd.confine.netstack import Stack
from dispatchd.daemon import dnsdoor
from dispatchd.daemon.dnsdoor import Door
from dispatchd.daemon.dnshost import (
    HOST_RESOLV_CONF, HostResolvers, Server, ask_tcp, ask_udp, resolv_conf_text, session_resolv_binds, why_not)
from dispatchd.daemon.dnswire import RCODE_SERVFAIL, error_reply
from dispatchd.daemon.spawn import SpawnError

# HOST_RESOLV_CONF and session_resolv_binds are the daemon's names for the
# host's file and the binds of the session's; they are handed on from here.
__all__ = ["HOST_RESOLV_CONF", "DnsRelay", "Door", "DoorAhead", "session_resolv_binds"]

log = logging.getLogger("dispatchd.dns")

POOL_THREADS = 16  # for ``check`` (each resolver at once) and doors made ahead; a door's own thread waits for its queries
CHECK_TIMEOUT_S = 1.0
# A check that found no resolver answering stands this long (unless the
# servers change or a query gets through): opens are not each held up by
# CHECK_TIMEOUT_S while the host's resolver is silent.
CHECK_KEEP_S = 5.0
# A check that got an answer stands this long (unless the servers change or
# a query goes unanswered): network-on sessions opened back to back each
# waited for the host's resolver's answer (p50 0.3 ms of the open, up to
# 13 ms), and sent it a query each.
CHECK_ANSWERED_KEEP_S = 1.0


MakeDoor = Callable[[int, int], tuple[socket.socket, socket.socket]]


class DoorAhead:
    """A session's door being made (``DnsRelay.door_ahead``), with copies of
    its namespace descriptors: the session's own may be closed meanwhile (a
    stack that did not start) and are never reused under the request."""

    def __init__(self, relay: DnsRelay, session: str, namespaces: tuple[int, int], make: MakeDoor,
                 made: tuple[socket.socket, socket.socket] | None = None) -> None:
        self.relay, self.session = relay, session
        self.by = "sandbox" if made is not None else "fork_server"  # who made it, for the debug log
        self._made: concurrent.futures.Future[tuple[socket.socket, socket.socket]]
        if made is not None:  # the sandbox made it (SessionPlan.dns_door)
            self._made = concurrent.futures.Future()
            self._made.set_result(made)
            return
        userns, netns = os.dup(namespaces[0]), os.dup(namespaces[1])

        def run() -> tuple[socket.socket, socket.socket]:
            try:
                return make(userns, netns)
            finally:
                os.close(userns)
                os.close(netns)

        try:
            self._made = relay._pool.submit(run)
        except BaseException:
            os.close(userns)
            os.close(netns)
            raise

    def open_with(self, stack: Stack) -> None:
        """Serve the door, closed with ``stack``; the stack's warning follows
        the relay's. Not made: the session opens all the same, and its
        warning says why."""
        started = time.perf_counter()
        try:
            udp, tcp = self._made.result()
        except (SpawnError, OSError) as exc:
            log.warning("event=dns_door_failed session=%s error=%s", self.session, exc)
            why = f"DNS does not answer: the relay's door could not be made in the session's namespace ({exc})"
            stack.warning = lambda: why
            return
        door = self.relay.open_door(self.session, udp, tcp)
        stack.with_it.append(door.stop)
        stack.warning = door.warning  # its own queries' word, else the relay's check
        log.debug("event=dns_door_opened session=%s by=%s waited_ms=%.2f", self.session, self.by,
                  (time.perf_counter() - started) * 1000)

    def discard(self) -> None:
        """The stack did not start: the door's sockets closed once made."""
        def close(made: concurrent.futures.Future[tuple[socket.socket, socket.socket]]) -> None:
            if not made.cancelled() and made.exception() is None:
                for sock in made.result():
                    sock.close()

        self._made.add_done_callback(close)


class Check:
    """A check of the host's resolvers under way (``DnsRelay.begin_check``)."""

    def __init__(self, relay: DnsRelay, servers: list[Server],
                 asked: dict[concurrent.futures.Future[object], Server]) -> None:
        self._relay, self._servers, self._asked = relay, servers, asked
        self._started = time.perf_counter()

    def result(self, session: str = "") -> str:
        """The first reply counts; none (every resolver failed, or none
        answered in ``CHECK_TIMEOUT_S``) notes the problem. ``warning()`` after."""
        relay = self._relay
        if self._asked:  # else a check's word of less than CHECK_KEEP_S (or CHECK_ANSWERED_KEEP_S) ago stands
            errors = []
            for fut in concurrent.futures.as_completed(self._asked):
                try:
                    fut.result()
                except (OSError, TimeoutError) as exc:
                    errors.append(why_not(self._asked[fut], exc))
                    continue
                errors = []
                break
            relay.note("; ".join(errors), self._servers)
        warning = relay.warning()
        log.debug("event=dns_checked session=%s ms=%.2f answers=%d", session,
                  (time.perf_counter() - self._started) * 1000, not warning)
        return warning


class DnsRelay:
    """The relay of every session: the host's resolvers and their last known
    state (``problem``, ``warning``, ``check``); each session's door serves
    its own queries (``Door``)."""

    def __init__(self, resolv_conf: str = HOST_RESOLV_CONF, *, ports: bool = False) -> None:
        self.resolvers = HostResolvers(resolv_conf, ports=ports)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=POOL_THREADS, thread_name_prefix="dns")
        self._lock = threading.Lock()
        self._problem = ""  # why no resolver answered the last query or check; "" once one did
        # When a check last had its word, of which servers, and whether one answered.
        self._checked: tuple[float, list[Server], bool] | None = None

    def session_file(self, state_dir: str) -> str:
        """The resolv.conf sessions bind (in the daemon's state directory);
        its real path. Made whole (a temporary file of this daemon's, renamed)
        when there is none; one there already is rewritten in place, as it is
        when the host's search list changes: a bind holds the inode, and
        another daemon on the state directory may have bound it into its
        sessions (replaced, they would read the old one for good; their
        texts are the same, the host's)."""
        path = os.path.join(os.path.realpath(state_dir), "dns-resolv.conf")
        self.resolvers.servers()  # read the host's file
        text = resolv_conf_text(self.resolvers.kept)
        _remove_stale_temporaries(path)
        if not _rewrite_in_place(path, text):
            tmp = f"{path}.{secrets.token_hex(4)}.tmp"  # two daemons starting at once write one each
            try:
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(text)
                os.chmod(tmp, 0o644)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise

        def rewrite(kept: list[str]) -> bool:
            try:
                if not _rewrite_in_place(path, resolv_conf_text(kept)):
                    raise FileNotFoundError(errno.ENOENT, "gone")
            except OSError as exc:
                log.warning("event=dns_resolv_conf_rewrite_failed path=%s error=%s", path, exc.strerror)
                return False
            return True

        self.resolvers.on_change = rewrite
        return path

    def door_ahead(self, session: str, namespaces: tuple[int, int], make: MakeDoor,
                   made: tuple[socket.socket, socket.socket] | None = None) -> DoorAhead:
        """Have ``make`` (the fork server's ``dns_sockets``) make a session's
        door in its ``namespaces`` on a thread of the relay's, while the
        caller starts its stack (the fork server is free again once pasta is
        launched, and pasta takes ~90 ms to report ready); or serve ``made``,
        the door its sandbox made itself (``SessionPlan.dns_door``)."""
        return DoorAhead(self, session, namespaces, make, made)

    def open_door(self, session: str, udp: socket.socket, tcp: socket.socket) -> Door:
        return Door(self, session, udp, tcp)

    def problem(self) -> str:
        """"" when the last check got a reply; else what went wrong."""
        with self._lock:
            return self._problem

    def note(self, problem: str, servers: list[Server]) -> None:
        """A check's word, the relay's: ``problem`` ("" once a resolver
        answered), which stands for a while (``begin_check``). A session's
        queries have their own (``Door.note``)."""
        with self._lock:
            changed = problem != self._problem
            self._problem = problem
            self._checked = (time.monotonic(), servers, not problem)
        if changed:
            if problem:
                log.warning("event=dns_unanswered why=%s", problem)
            else:
                log.info("event=dns_answers")

    def queried(self, problem: str) -> None:
        """A session's query had its word: the check kept no longer stands,
        and the next open asks for itself. The relay's own word (what opens
        say) is left as it is: one session's lookups say nothing of another's."""
        with self._lock:
            self._checked = None

    def warning(self, problem: str | None = None) -> str:
        """The text a session's status carries while DNS does not answer:
        of ``problem`` (a door's word), else of the relay's last check."""
        if problem is None:
            problem = self.problem()
        return (f"DNS does not answer: no resolver of the host's answers ({problem}); names will not resolve "
                f"in this session (lookups fail at once) until one does") if problem else ""

    def check(self, session: str = "") -> str:
        """Ask every resolver of the host's, at once, for the root's NS
        records; any reply counts. Returns ``warning()`` after. A problem
        found less than ``CHECK_KEEP_S`` ago, or an answer had less than
        ``CHECK_ANSWERED_KEEP_S`` ago, with the same servers and no query's
        word since, stands."""
        return self.begin_check().result(session)

    def begin_check(self) -> Check:
        """``check``, its queries sent now and its answer read by
        ``Check.result``: an open sends them before its sandbox is in hand,
        so the resolvers answer while it is made ready. A check whose result
        is never read changes nothing (the relay's problem is noted by
        ``result`` alone)."""
        servers = self.resolvers.servers()
        with self._lock:
            kept = self._checked
        if kept is not None and kept[1] == servers and \
                time.monotonic() - kept[0] < (CHECK_ANSWERED_KEEP_S if kept[2] else CHECK_KEEP_S):
            return Check(self, servers, {})
        query = struct.pack("!HHHHHH", 0, 0x0100, 1, 0, 0, 0) + b"\x00" + struct.pack("!HH", 2, 1)
        deadline = time.monotonic() + CHECK_TIMEOUT_S
        return Check(self, servers, {self._pool.submit(ask_udp, s, query, deadline): s for s in servers})

    def resolve_tcp(self, door: Door, query: bytes) -> bytes | None:
        """The reply to a query a session sent over TCP (the retry of a
        truncated reply; rare, so a thread of its own waits): the first
        resolver's that answers, over TCP, else SERVFAIL; None when the door
        closed meanwhile (nothing is sent after ``Door.stop``). UDP queries
        are the door's own loop's (``Door._launch``)."""
        # The door's own timeouts, read from its module at each query: one
        # setting for the UDP and the TCP path alike.
        deadline = time.monotonic() + dnsdoor.QUERY_DEADLINE_S
        errors = []
        for server in self.resolvers.servers():
            until = min(deadline, time.monotonic() + dnsdoor.UPSTREAM_TIMEOUT_S)
            try:
                reply = ask_tcp(server, query, until, door.send_if_open)
            except (OSError, TimeoutError) as exc:
                errors.append(why_not(server, exc))
                continue
            if reply is None:
                return None  # the door closed: nothing sent
            door.note("")
            return reply
        door.note("; ".join(errors))
        with door.lock:
            door.failed += 1
        return error_reply(query, RCODE_SERVFAIL)

    def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _rewrite_in_place(path: str, text: str) -> bool:
    """``text`` written over the file at ``path`` (its inode kept); False
    when there is none. The same text over the same bytes reads the same
    to a session reading it meanwhile."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        data = text.encode()
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)
    return True


STALE_TMP_S = 60.0  # a temporary file this old was left by a daemon killed between its write and rename


def _remove_stale_temporaries(path: str) -> None:
    """``PATH.HEX.tmp`` files a daemon killed half way left (another one's,
    being written now, is a few microseconds old: kept)."""
    directory, name = os.path.split(path)
    try:
        names = os.listdir(directory)
    except OSError:
        return
    now = time.time()
    for found in names:
        if found.startswith(name + ".") and found.endswith(".tmp"):
            with contextlib.suppress(OSError):
                if now - os.lstat(os.path.join(directory, found)).st_mtime > STALE_TMP_S:
                    os.unlink(os.path.join(directory, found))
