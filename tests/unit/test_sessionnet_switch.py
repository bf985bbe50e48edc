"""What a network switch leaves when the fork server has no process to give
(daemon/sessionnet.py): the session as it was where nothing changed, off
where the stack has gone and only its rules could not be replaced, ended
where its way out is not known to be gone. The fork server and the stack
are fakes: this is the switch's decision alone; the escape suite
(test_shared_processes.py) runs it against the kernel."""

from __future__ import annotations

import errno
import types
from typing import Any

import msgspec
import pytest

from dispatchd.confine import netstack
from dispatchd.confine.netstack import NetworkPorts
from dispatchd.daemon import sessionnet
from dispatchd.daemon.spawn import NoProcess
from dispatchd.errors import ConfinementError


def _plan(mode: Any) -> netstack.NetworkPlan:
    return netstack.plan_network(mode, use_userns=True, stack_missing="", nft_missing="", landlock_abi=7,
                                 ports=NetworkPorts(connect=[443]), stack="slirp4netns")


class _ForkServer:
    def __init__(self, closed_ok: bool = True) -> None:
        self.closed_ok, self.rules = closed_ok, []  # type: ignore[var-annotated]

    def net_closed(self, userns: int, netns: int) -> None:
        if not self.closed_ok:
            raise NoProcess("cannot fork to look at the session's namespace: EAGAIN")

    def net_rules(self, rules: str, userns: int, netns: int) -> None:
        raise NoProcess("cannot fork to enter the session's namespaces: EAGAIN")


class _Stack:
    name, pid = "slirp4netns", 4321

    def __init__(self) -> None:
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


def _session(mode: Any) -> Any:
    return types.SimpleNamespace(id="s1", net=_plan(mode), stack=_Stack(), ns_fds=(5, 6), door=None, cgroup="")


def _networks(fork_server: _ForkServer) -> sessionnet.SessionNetworks:
    launch = types.SimpleNamespace(stack="slirp4netns")
    return sessionnet.SessionNetworks(fork_server, None, None, launch)  # type: ignore[arg-type]


def test_ports_to_off_without_a_process_for_the_rules_is_off_the_old_table_on_record() -> None:
    session = _session("ports")
    stack, old = session.stack, session.net
    assert "reject" in old.rules
    _networks(_ForkServer()).apply(session, _plan("off"))  # before: the session was ended
    assert stack.stopped and session.stack is None
    assert session.net.mode == "off" and not session.net.stack
    assert session.net.rules == old.rules  # what is in the namespace, for the next switch to replace


def test_ports_to_off_whose_way_out_is_not_known_gone_still_ends_the_session() -> None:
    # The twin: without the look that the stack's interface is gone, off is not reached.
    session = _session("ports")
    with pytest.raises(ConfinementError) as ended:
        _networks(_ForkServer(closed_ok=False)).apply(session, _plan("off"))
    assert ended.value.step == "network: stop slirp4netns"
    assert "its way out is not gone" in str(ended.value)


def test_ports_to_other_ports_without_a_process_is_refused_unchanged() -> None:
    session = _session("ports")
    old = session.net
    new = netstack.plan_network("ports", use_userns=True, stack_missing="", nft_missing="", landlock_abi=7,
                                ports=NetworkPorts(connect=[80]), stack="slirp4netns")
    with pytest.raises(sessionnet.NetworkUnchanged) as refused:
        _networks(_ForkServer()).apply(session, new)
    assert "the session's network is unchanged" in str(refused.value)
    assert session.net is old and not session.stack.stopped


class _RulesForkServer(_ForkServer):
    """One that has processes for nft: the rules go in, and back."""

    def net_rules(self, rules: str, userns: int, netns: int) -> None:
        self.rules.append(rules)


def _stack_refused(errno_: int, words: str) -> Any:
    def start_stack(*args: Any, **kwargs: Any) -> Any:
        raise ConfinementError("network: start slirp4netns", errno_, detail=words)
    return start_stack


def test_a_switch_on_whose_stack_could_not_fork_is_refused_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    # One process left: the fork server starts slirp4netns, whose own fork is refused.
    monkeypatch.setattr(netstack, "start_stack", _stack_refused(errno.EAGAIN, "fork: Resource temporarily unavailable"))
    session = _session("off")
    session.stack = None
    old, fork_server = session.net, _RulesForkServer()
    with pytest.raises(sessionnet.NetworkUnchanged) as refused:
        _networks(fork_server).apply(session, _plan("ports"))  # before: the session was ended
    assert str(refused.value) == ("cannot apply network: start slirp4netns: fork: Resource temporarily "
                                  "unavailable; the session's network is unchanged")
    assert session.net is old and session.stack is None
    assert fork_server.rules[-1] == (old.rules or netstack.reset_rules())  # the ports table taken out again


def test_a_switch_on_whose_stack_failed_otherwise_still_ends_the_session(monkeypatch: pytest.MonkeyPatch) -> None:
    # The twin: a stack that exits for any other reason is no want of a process.
    monkeypatch.setattr(netstack, "start_stack", _stack_refused(0, "it exited"))
    session = _session("off")
    session.stack = None
    with pytest.raises(ConfinementError) as ended:
        _networks(_RulesForkServer()).apply(session, _plan("ports"))
    assert not isinstance(ended.value, sessionnet.NetworkUnchanged)
    assert str(ended.value) == "cannot apply network: start slirp4netns: it exited"


def test_a_switch_on_whose_stack_could_not_fork_ends_the_session_when_its_way_out_is_not_known_gone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The stack ran before its fork was refused: without the look that it left
    # nothing up, the session is not said to be as it was.
    monkeypatch.setattr(netstack, "start_stack", _stack_refused(errno.EAGAIN, "fork: Resource temporarily unavailable"))
    session = _session("off")
    session.stack = None
    fork_server = _RulesForkServer(closed_ok=False)
    with pytest.raises(ConfinementError) as ended:
        _networks(fork_server).apply(session, _plan("ports"))
    assert not isinstance(ended.value, sessionnet.NetworkUnchanged)
    assert str(ended.value) == "cannot apply network: start slirp4netns: fork: Resource temporarily unavailable"


# --- what is committed, and when ---------------------------------------------------

class _Started:
    """A stack that starts (``netstack.start_stack``'s stand-in)."""

    def __init__(self) -> None:
        self.started = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.started += 1
        stack = _Stack()
        stack.with_it = []  # type: ignore[attr-defined]
        return stack


@pytest.mark.parametrize("mode", ["on", "ports"])
def test_a_switch_to_off_commits_nothing_and_keeps_the_table_on_record(mode: str) -> None:
    """The stack gone, the namespace has its loopback alone, which the table
    lets in and out: removing it would only cost an RCU grace period."""
    session = _session(mode)
    old, fork_server = session.net, _RulesForkServer()
    _networks(fork_server).apply(session, _plan("off"))
    assert fork_server.rules == [] and session.stack is None
    assert session.net == msgspec.structs.replace(_plan("off"), rules=old.rules)


def test_back_to_the_mode_of_the_table_kept_commits_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    started = _Started()
    monkeypatch.setattr(netstack, "start_stack", started)
    session = _session("on")
    fork_server = _RulesForkServer()
    _networks(fork_server).apply(session, _plan("off"))
    _networks(fork_server).apply(session, _plan("on"))
    assert fork_server.rules == [] and started.started == 1
    assert session.net == _plan("on")
    # The twin: to another mode's rules, the table kept is replaced, in one transaction.
    _networks(fork_server).apply(session, _plan("off"))
    _networks(fork_server).apply(session, _plan("ports"))
    assert fork_server.rules == [_plan("ports").rules] and _plan("ports").rules.startswith(netstack.reset_rules())


def test_into_a_namespace_without_a_table_the_rules_are_committed_without_a_removal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netstack, "start_stack", _Started())
    session = _session("off")
    session.stack = None
    fork_server = _RulesForkServer()
    _networks(fork_server).apply(session, _plan("on"))
    assert fork_server.rules == [_plan("on").rules.removeprefix(netstack.reset_rules())]
    assert fork_server.rules[0].startswith("table inet dispatchd {\n")
    assert session.net == _plan("on")  # on record as planned: the next switch replaces it whole


def test_to_commit() -> None:
    on, reset = _plan("on").rules, netstack.reset_rules()
    assert netstack.to_commit(on, "") == on[len(reset):]
    assert netstack.to_commit(on, _plan("ports").rules) == on
    assert netstack.to_commit(reset, on) == reset
    assert netstack.to_commit(reset, "") == reset  # nothing but a removal: kept whole
