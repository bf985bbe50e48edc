"""The session's state machine (daemon/lifecycle.py), without a daemon: every
legal edge, every illegal one refused with its states named, and what each
request may do when another one overlaps it."""

from __future__ import annotations

import itertools

import pytest

from dispatchd.daemon.lifecycle import (
    DECISIONS, TRANSITIONS, Action, Event, IllegalTransition, Op, State, decide, ending_event, is_live, move)

S, E = State, Event

# Every legal edge, written out once more by hand (from, event, to): the table must say exactly this.
EDGES = """
opening    opened           ready
opening    open_failed      closed
ready      slept            asleep
asleep     woken            ready
ready      switch           switching
asleep     switch           switching
switching  switched         ready
switching  switched_asleep  asleep
switching  switch_failed    closing
ready      worker_died      closing
ready      sleep_failed     closing
ready      wake_failed      closing
asleep     wake_failed      closing
closing    discarded        closed
"""
ENDS = ("close", "memory", "orphaned", "idle", "ended", "daemon_stop")  # asked of a session ready or asleep
LEGAL = {(State(a), Event(e)): State(b) for a, e, b in (line.split() for line in EDGES.strip().splitlines())}
LEGAL.update({(state, Event(e)): S.CLOSING for state in (S.READY, S.ASLEEP) for e in ENDS})


@pytest.mark.parametrize(("state", "event"), sorted(LEGAL, key=lambda k: (k[0].value, k[1].value)),
                         ids=lambda x: x.value)
def test_every_legal_edge(state: State, event: Event) -> None:
    assert move(state, event) is LEGAL[(state, event)]


ILLEGAL = sorted(set(itertools.product(State, Event)) - set(LEGAL), key=lambda k: (k[0].value, k[1].value))


@pytest.mark.parametrize(("state", "event"), ILLEGAL, ids=lambda x: x.value)
def test_every_illegal_edge_is_refused_naming_from_and_to(state: State, event: Event) -> None:
    to = TRANSITIONS[event][1]
    with pytest.raises(IllegalTransition, match=f"^illegal session transition from {state.value} to "
                                                f"{to.value} \\({event.value}\\)") as caught:
        move(state, event)
    assert (caught.value.state, caught.value.to, caught.value.event) == (state, to, event)


def test_the_table_has_no_edge_beyond_the_list() -> None:
    table = {(s, e): to for e, (froms, to) in TRANSITIONS.items() for s in froms}
    assert table == LEGAL


def test_closed_is_final_and_closing_leads_only_to_closed() -> None:
    assert [e for e in Event if (S.CLOSED, e) in LEGAL] == []
    assert {LEGAL[(S.CLOSING, e)] for e in Event if (S.CLOSING, e) in LEGAL} == {S.CLOSED}


def test_a_whole_life() -> None:
    state = S.OPENING
    for event in (E.OPENED, E.SLEPT, E.WOKEN, E.SWITCH, E.SWITCHED, E.SLEPT, E.SWITCH, E.SWITCHED_ASLEEP,
                  E.WOKEN, E.CLOSE, E.DISCARDED):
        state = move(state, event)
    assert state is S.CLOSED


def test_every_request_is_decided_in_every_state() -> None:
    for op in Op:
        assert set(DECISIONS[op]) == set(State), op
        for state in State:
            verdict = decide(state, op)
            assert (verdict.action is Action.REFUSE) == bool(verdict.reason), (op, state)


# --- requests that overlap --------------------------------------------------------


def test_a_second_close_is_nothing_to_do() -> None:
    state = move(S.READY, E.CLOSE)
    assert decide(state, Op.CLOSE).action is Action.NOTHING  # while the first one closes
    assert decide(move(state, E.DISCARDED), Op.CLOSE).action is Action.NOTHING  # after it


def test_a_close_while_switching_waits_for_the_switch() -> None:
    assert decide(S.SWITCHING, Op.CLOSE).action is Action.WAIT
    assert decide(move(S.SWITCHING, E.SWITCHED), Op.CLOSE).action is Action.GO
    # The switch failed meanwhile: the session ended with it, nothing left to close.
    assert decide(move(move(S.SWITCHING, E.SWITCH_FAILED), E.DISCARDED), Op.CLOSE).action is Action.NOTHING


def test_a_switch_while_closing_is_refused_precisely() -> None:
    closing = decide(S.CLOSING, Op.SWITCH)
    assert (closing.action, closing.reason) == (Action.REFUSE, "it is closing")
    closed = decide(S.CLOSED, Op.SWITCH)
    assert (closed.action, closed.reason) == (Action.REFUSE, "it has ended")
    # Its allowed twins: ready or asleep, a switch goes; a second switch waits for the first.
    assert decide(S.READY, Op.SWITCH).action is Action.GO
    assert decide(S.ASLEEP, Op.SWITCH).action is Action.GO
    assert decide(S.SWITCHING, Op.SWITCH).action is Action.WAIT


def test_a_wake_while_closing_is_refused() -> None:
    assert decide(S.CLOSING, Op.WAKE) == decide(S.CLOSING, Op.SWITCH)
    assert decide(S.CLOSED, Op.WAKE).action is Action.REFUSE
    assert decide(S.ASLEEP, Op.WAKE).action is Action.GO  # the allowed twin
    assert decide(S.READY, Op.WAKE).action is Action.NOTHING  # woken already, by another channel
    with pytest.raises(IllegalTransition, match="from closing to ready"):
        move(S.CLOSING, E.WOKEN)


def test_a_worker_gone_during_a_switch_is_left_to_the_switch() -> None:
    assert decide(S.SWITCHING, Op.WORKER_GONE).action is Action.WAIT
    # Replaced: the switch ends ready again, with another worker (the manager
    # compares the watch's worker); kept and died: ready, the watch ends it.
    assert decide(move(S.SWITCHING, E.SWITCHED), Op.WORKER_GONE).action is Action.GO
    assert move(S.READY, E.WORKER_DIED) is S.CLOSING
    for state in (S.ASLEEP, S.CLOSING, S.CLOSED):  # handed over, or ended on purpose
        assert decide(state, Op.WORKER_GONE).action is Action.NOTHING


def test_sleep_only_when_ready() -> None:
    assert [s for s in State if decide(s, Op.SLEEP).action is Action.GO] == [S.READY]
    assert decide(S.CLOSING, Op.SLEEP).reason == "it is closing"


def test_attach_while_closing_is_refused_and_while_asleep_goes() -> None:
    assert decide(S.CLOSING, Op.ATTACH).action is Action.REFUSE
    assert decide(S.ASLEEP, Op.ATTACH).action is Action.GO
    assert decide(S.READY, Op.ATTACH).action is Action.GO


def test_an_end_of_the_daemons_names_its_event() -> None:
    assert ending_event("memory") is E.OVER_MEMORY
    assert ending_event("orphaned") is E.ORPHANED
    assert ending_event("idle") is E.IDLE
    assert ending_event("network_stack_died") is E.ENDED
    assert ending_event("fork_server_died") is E.ENDED


def test_live_states() -> None:
    assert [s for s in State if not is_live(s)] == [S.CLOSING, S.CLOSED]
