"""A session's life, as data: its states, the events that move it, and what
each request may do in each state. Pure: no I/O, no daemon import.

    opening ──opened──▶ ready ──slept──▶ asleep
       │                 │ ▲ ◀──woken──── │
    open_failed     switch│ │switched      │switch
       │                 ▼ │              ▼
       │              switching ◀──────────┘   (switched_asleep: in place, asleep again)
       │                 │ switch_failed
       ▼                 ▼
    closed ◀─discarded─ closing ◀── ready: worker_died, sleep_failed
                                 ◀── ready|asleep: close, memory, orphaned, idle,
                                     wake_failed, ended, daemon_stop

Guarantees:
- every change of a session's state goes through ``move(state, event)``:
  an event not allowed in the state raises ``IllegalTransition``, naming the
  state it was in, the state the event leads to, and the event; nothing is
  changed then;
- every request on a session (close, switch, wake, sleep, attach, and the
  watch that sees its worker's channel close) is decided by ``decide(state,
  op)``: go, wait (another operation holds the session: take its lock and
  ask again), nothing to do, or refused with the sentence to give the caller.
  A second close is nothing to do; a switch, a wake or an attach on a
  session closing or closed is refused; a sleep is refused unless ready;
- ``closing`` and ``closed`` are final: no event leads out of ``closed``,
  and out of ``closing`` only to ``closed``.

The manager (``sessions.py``) changes a session's state only under that
session's lock, and holds the lock for the whole of the action the change
stands for (an open, a switch, a sleep's hand-over, a wake, a close), so a
request that holds the lock sees ``ready``, ``asleep`` or ``closed`` only;
``opening``, ``switching`` and ``closing`` are what a request that has not
taken the lock yet sees (``decide`` answers it at once: refused, or wait).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass


class State(enum.Enum):
    OPENING = "opening"  # its sandbox being made; not yet in the table
    READY = "ready"  # a confined worker serves it
    ASLEEP = "asleep"  # no process: the daemon holds its channels
    SWITCHING = "switching"  # its network being changed (in place, or its sandbox replaced)
    CLOSING = "closing"  # its processes being ended, its worktree checked
    CLOSED = "closed"  # nothing of it is left


class Event(enum.Enum):
    OPENED = "opened"  # its worker is ready: in the table
    OPEN_FAILED = "open_failed"  # a step of the open failed: its remains go
    SLEPT = "slept"  # its tool server handed its channels over and exited
    WOKEN = "woken"  # a new tool server, confined as the first, serves it
    SWITCH = "switch"  # a network switch begins
    SWITCHED = "switched"  # the switch is done, a worker serves it
    SWITCHED_ASLEEP = "switched_asleep"  # done in place while it slept: asleep still
    SWITCH_FAILED = "switch_failed"  # half switched: it ends rather than run unasked
    CLOSE = "close"  # its client closed it
    WORKER_DIED = "worker_died"  # its worker ended on its own (idle timeout, crash)
    SLEEP_FAILED = "sleep_failed"  # its tool server failed to hand over
    WAKE_FAILED = "wake_failed"  # it could not be woken: it never runs less confined
    OVER_MEMORY = "memory"  # the memory watchdog ended it
    ORPHANED = "orphaned"  # every connection that held it had gone for its grace
    IDLE = "idle"  # its idle timeout passed while it slept
    ENDED = "ended"  # another reason of the daemon's own (its network stack, the fork server died)
    DAEMON_STOP = "daemon_stop"  # the daemon stops
    DISCARDED = "discarded"  # its remains are gone


# The ways a session ends that a client or the daemon may ask for, ready or asleep.
_ENDS = (Event.CLOSE, Event.OVER_MEMORY, Event.ORPHANED, Event.IDLE, Event.ENDED, Event.DAEMON_STOP)
_LIVE = frozenset({State.READY, State.ASLEEP})

# The transition table: each event, the states it may happen in, and where it leads.
TRANSITIONS: Mapping[Event, tuple[frozenset[State], State]] = {
    Event.OPENED: (frozenset({State.OPENING}), State.READY),
    Event.OPEN_FAILED: (frozenset({State.OPENING}), State.CLOSED),
    Event.SLEPT: (frozenset({State.READY}), State.ASLEEP),
    Event.WOKEN: (frozenset({State.ASLEEP}), State.READY),
    Event.SWITCH: (_LIVE, State.SWITCHING),
    Event.SWITCHED: (frozenset({State.SWITCHING}), State.READY),
    Event.SWITCHED_ASLEEP: (frozenset({State.SWITCHING}), State.ASLEEP),
    Event.SWITCH_FAILED: (frozenset({State.SWITCHING}), State.CLOSING),
    Event.WORKER_DIED: (frozenset({State.READY}), State.CLOSING),
    Event.SLEEP_FAILED: (frozenset({State.READY}), State.CLOSING),
    # Asleep: the new tool server did not start. Ready: it started, and went
    # before it had the session's channels (or no thread could watch it).
    Event.WAKE_FAILED: (_LIVE, State.CLOSING),
    **{end: (_LIVE, State.CLOSING) for end in _ENDS},
    Event.DISCARDED: (frozenset({State.CLOSING}), State.CLOSED),
}


class IllegalTransition(Exception):
    """An event in a state it cannot happen in: a bug in the manager, never a
    client's doing (requests are decided by ``decide`` first)."""

    def __init__(self, state: State, event: Event) -> None:
        self.state, self.event = state, event
        self.to = TRANSITIONS[event][1]
        allowed = ", ".join(sorted(s.value for s in TRANSITIONS[event][0]))
        super().__init__(f"illegal session transition from {state.value} to {self.to.value} "
                         f"({event.value}): {event.value} happens only when {allowed}")


def move(state: State, event: Event) -> State:
    """The state ``event`` leads to from ``state``; raises ``IllegalTransition``."""
    froms, to = TRANSITIONS[event]
    if state not in froms:
        raise IllegalTransition(state, event)
    return to


def ending_event(word: str) -> Event:
    """The event of an end the daemon decides (``SessionManager.end``'s word)."""
    for event in (Event.OVER_MEMORY, Event.ORPHANED, Event.IDLE):
        if event.value == word:
            return event
    return Event.ENDED


class Op(enum.Enum):
    """A request on a session, from whoever asks: a client, a timer, a watch."""

    CLOSE = "close"  # close it, or end it for a reason of the daemon's
    SWITCH = "switch"  # change its network
    WAKE = "wake"  # a client wrote to a channel of it asleep
    SLEEP = "sleep"  # its tool server asks to sleep
    ATTACH = "attach"  # a new channel to it
    CHECKPOINT = "checkpoint"  # keep its worktree, or put it back (daemon/checkpoints/): held still meanwhile
    WORKER_GONE = "worker_gone"  # its watch saw its worker's control channel close


class Action(enum.Enum):
    GO = "go"  # do it now (under the session's lock)
    WAIT = "wait"  # another operation holds the session: take its lock, then ask again
    NOTHING = "nothing"  # nothing to do: done already, or by another operation
    REFUSE = "refuse"  # refused: ``Verdict.reason`` says why


@dataclass(frozen=True)
class Verdict:
    action: Action
    reason: str = ""  # for REFUSE: the end of "cannot <op>: <reason>"


_GO, _WAIT, _NOTHING = Verdict(Action.GO), Verdict(Action.WAIT), Verdict(Action.NOTHING)
_CLOSING = Verdict(Action.REFUSE, "it is closing")
_CLOSED = Verdict(Action.REFUSE, "it has ended")

# What each request may do in each state.
DECISIONS: Mapping[Op, Mapping[State, Verdict]] = {
    Op.CLOSE: {State.OPENING: _WAIT, State.READY: _GO, State.ASLEEP: _GO, State.SWITCHING: _WAIT,
               State.CLOSING: _NOTHING, State.CLOSED: _NOTHING},
    Op.SWITCH: {State.OPENING: _WAIT, State.READY: _GO, State.ASLEEP: _GO, State.SWITCHING: _WAIT,
                State.CLOSING: _CLOSING, State.CLOSED: _CLOSED},
    # Ready: woken already (by an earlier byte, another channel).
    Op.WAKE: {State.OPENING: Verdict(Action.REFUSE, "it is not asleep"), State.READY: _NOTHING,
              State.ASLEEP: _GO, State.SWITCHING: _WAIT, State.CLOSING: _CLOSING, State.CLOSED: _CLOSED},
    Op.SLEEP: {State.OPENING: Verdict(Action.REFUSE, "it is opening"), State.READY: _GO,
               State.ASLEEP: Verdict(Action.REFUSE, "it is asleep already"),
               State.SWITCHING: Verdict(Action.REFUSE, "its network is being switched"),
               State.CLOSING: _CLOSING, State.CLOSED: _CLOSED},
    Op.ATTACH: {State.OPENING: _WAIT, State.READY: _GO, State.ASLEEP: _GO, State.SWITCHING: _WAIT,
                State.CLOSING: _CLOSING, State.CLOSED: _CLOSED},
    # Asleep: kept or restored as it sleeps (no process of it runs, and none
    # starts while the session's lock is held).
    Op.CHECKPOINT: {State.OPENING: _WAIT, State.READY: _GO, State.ASLEEP: _GO, State.SWITCHING: _WAIT,
                    State.CLOSING: _CLOSING, State.CLOSED: _CLOSED},
    # Switching: the switch decides (a worker it replaced went on purpose;
    # one it kept that died is seen once the switch is done). Asleep: it
    # handed over and exited on purpose.
    Op.WORKER_GONE: {State.OPENING: _WAIT, State.READY: _GO, State.ASLEEP: _NOTHING,
                     State.SWITCHING: _WAIT, State.CLOSING: _NOTHING, State.CLOSED: _NOTHING},
}


def decide(state: State, op: Op) -> Verdict:
    """What ``op`` may do on a session in ``state``."""
    return DECISIONS[op][state]


def is_live(state: State) -> bool:
    """Listed, and reachable by its id: neither closing nor closed."""
    return state not in (State.CLOSING, State.CLOSED)
