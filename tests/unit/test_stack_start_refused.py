"""A user-mode stack that exits before it is ready (confine/netstack.py
``start_stack``): one whose own fork or thread was refused (the sessions'
process bound, the user's limit) is told as EAGAIN, so that the switch is
undone (daemon/sessionnet.py); any other early exit is a plain failure. The
stack is a stand-in shell that says what slirp4netns says and exits."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Callable

import pytest

from dispatchd.confine import netstack
from dispatchd.errors import ConfinementError

pytestmark = pytest.mark.process


def _stack_saying(words: str, then: str = "exit 1") -> tuple[Callable[[list[int]], tuple[int, int]],
                                                              list[subprocess.Popen[bytes]]]:
    children: list[subprocess.Popen[bytes]] = []

    def launch(fds: list[int]) -> tuple[int, int]:
        # fds: the user and network namespaces, the readiness pipe, its stderr file.
        child = subprocess.Popen(["/bin/sh", "-c", f"echo '{words}' >&2; {then}"], stderr=fds[3],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 pass_fds=(fds[2],))  # held until it exits, as a stack holds it
        children.append(child)
        return child.pid, os.pidfd_open(child.pid)

    return launch, children


def _start(words: str, then: str = "exit 1") -> ConfinementError:
    launch, children = _stack_saying(words, then)
    r, w = os.pipe()
    try:
        with pytest.raises(ConfinementError) as failed:
            netstack.start_stack(r, w, launch=launch, name="slirp4netns")
    finally:
        os.close(r)
        os.close(w)
        for child in children:
            child.wait()
    return failed.value


def test_a_stack_whose_own_fork_was_refused_is_told_as_eagain() -> None:
    failed = _start("fork: Resource temporarily unavailable")
    assert failed.errno == errno.EAGAIN
    assert str(failed) == "cannot apply network: start slirp4netns: fork: Resource temporarily unavailable"


def test_a_stack_that_exits_for_another_reason_is_a_plain_failure() -> None:
    failed = _start("open(\"/dev/net/tun\"): No such file or directory")
    assert failed.errno == 0
    assert str(failed) == 'cannot apply network: start slirp4netns: open("/dev/net/tun"): No such file or directory'


def test_a_stack_that_did_not_report_in_time_is_a_plain_failure_whatever_it_said(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netstack, "READY_TIMEOUT_S", 0.3)
    failed = _start("fork: Resource temporarily unavailable", then="exec sleep 30")
    assert failed.errno == 0
