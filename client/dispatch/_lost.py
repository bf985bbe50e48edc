"""Why a tool call's channel to its sandbox broke, in the daemon's words.

A ``Session`` whose channel breaks during a call attaches again and asks the
daemon. Each channel knows which of the session's sandboxes it reaches
(``Channel.sandbox``: the daemon numbers them, ``SessionInfo.sandbox``), so the
answer is read, never guessed:

- a higher number: the daemon replaced the sandbox, and says why
  (``SessionInfo.replaced``, e.g. "its network was switched");
- the same number, and the new channel is closed at once: the old sandbox
  is gone but the daemon has not seen it end yet: ask again, until
  ``LOST_WAIT_S``; then say just that (and what the sandbox answered the
  last channel, if it refused one), with no cause made up;
- the same number, and the new channel stays open: the sandbox lives on
  (or is stopped) and was not replaced; the cause is not known, and said so;
- an attach refused: the session ended, and the daemon's reason says why.

``cause`` decides from what the attach found (pure: the unit tests drive it);
``hung_up`` and ``refusal`` look at the new channel without reading from it;
``ended`` says whether an attach's failure means the session is over (a
failed call then carries ``metadata["session_ended"]``, and ``close()`` asks
nothing more).
"""

from __future__ import annotations

import select
import socket

from dispatch._transport import Connection
from dispatch.errors import ConnectionLost, DispatchError, RequestFailed
from dispatchd import protocol

__all__ = ["HELD_S", "LOST_WAIT_S", "Channel", "cause", "ended", "hung_up", "refusal"]

# How long a lost call's re-attaches wait for the daemon to see the old
# sandbox end (a worker's end is read from its control channel, then its exit
# status: under load, seconds).
LOST_WAIT_S = 5.0
# How long a new channel to the same sandbox must stay open to count as held:
# a sandbox that is going closes it within milliseconds, one under load later.
HELD_S = 0.5


class Channel(Connection):
    """A channel to a session's tool server, and which of the session's
    sandboxes it reaches (``SessionInfo.sandbox`` at its attach; 0 from a
    daemon that does not number them)."""

    def __init__(self, sock: socket.socket, sandbox: int) -> None:
        super().__init__(sock, protocol.channel_reply_decoder)
        self.sandbox = sandbox


def cause(was: int, now: int, replaced: str, *, hung_up: bool, refused: str = "",
          waited_s: float | None = None) -> str | None:
    """Why a channel to sandbox ``was`` broke, once an attach found sandbox
    ``now`` (``replaced``: why the daemon last replaced it) and a new channel
    that ``hung_up`` at once or was held (``refused``: what the sandbox said
    as it closed it, if anything). None: attach again, the daemon may not
    have seen the old sandbox end yet. ``waited_s``: set once the asking is
    over (``LOST_WAIT_S``), so that a new channel closed at once is said so."""
    if now > was:
        return f"the session's sandbox was replaced ({replaced or 'dispatchd gave no reason'}); " \
               "the call's processes were ended"
    if hung_up:
        if waited_s is None:
            return None
        last = f", the last refused ({refused})" if refused else ""
        return (f"its sandbox stopped answering: the call's channel closed, and each channel attached in the "
                f"{waited_s:g} s since closed at once{last}; dispatchd had not yet seen the sandbox end, and had "
                "not replaced it")
    if now == 0:  # a daemon older than this client: it does not number its sandboxes
        return ("the call's channel closed, and a new channel to the session's sandbox stayed open; this "
                "dispatchd does not say whether it had replaced the sandbox meanwhile (a network switch)")
    return ("the call's channel closed, yet the session's sandbox lives on: dispatchd had not replaced it, and "
            "a new channel to it stayed open; the cause is not known")


def ended(exc: DispatchError, bridge_gone: str | None) -> bool:
    """Whether ``exc``, an attach's failure, says the session is over: the
    daemon refused it as ended or unknown (``unknown_session``, with its
    reason), or the local daemon is gone (its sessions end with it). Not a
    timeout (a daemon hung or overloaded may answer later), nor a bridge to a
    remote daemon gone (``bridge_gone``: the session may live on there)."""
    if isinstance(exc, RequestFailed):
        return exc.code == "unknown_session"
    return isinstance(exc, ConnectionLost) and bridge_gone is None


def hung_up(channel: Connection, wait_s: float) -> bool:
    """Whether the sandbox closed ``channel`` (at once, or within ``wait_s``)."""
    poller = select.poll()
    poller.register(channel._frames.sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(wait_s * 1000))


def refusal(channel: Connection) -> str:
    """What the sandbox said as it closed ``channel`` (its ``ErrorReply``:
    ``too_many_channels``, ``busy``...), "" if nothing. Peeked, not read: a
    call of another thread may be reading the channel."""
    try:
        data = channel._frames.sock.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:
        return ""
    if len(data) < 4:
        return ""
    (length,) = protocol.FRAME_HEADER.unpack_from(data)
    if len(data) < 4 + length:
        return ""
    try:
        msg = protocol.decode(protocol.channel_reply_decoder, data[4:4 + length])
    except protocol.ProtocolError:
        return ""
    return f"{msg.code}: {msg.message}" if isinstance(msg, protocol.ErrorReply) else ""
