"""``confine/hygiene.py``'s session and group steps: a worker gets a process
group of its own in its forking process's session, which has no controlling
terminal; where that session has one, the worker gets a session of its own.
Each case runs in a fresh interpreter (it changes its session)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.process  # each case runs in a fresh interpreter

_COMMON = """
import os, pty, sys
from dispatchd.confine import hygiene

def in_child(body):
    sys.stdout.flush()  # not printed again by the child
    pid = os.fork()
    if pid == 0:
        try:
            body()
        finally:
            sys.stdout.flush()
            os._exit(0)
    os.waitpid(pid, 0)
"""


def run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", _COMMON + textwrap.dedent(code)], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_worker_leads_a_group_in_the_forking_session_which_has_no_terminal() -> None:
    out = run("""
        def forker():
            hygiene.lead_session()
            forker_pid = os.getpid()
            def worker():
                hygiene.new_group()
                print(os.getsid(0) == forker_pid, os.getpgid(0) == os.getpid(), hygiene.controlling_terminal())
            in_child(worker)
        in_child(forker)
    """)
    assert out.split() == ["True", "True", "0"]


def test_a_worker_forked_in_a_session_with_a_terminal_leads_a_session_of_its_own() -> None:
    """The twin: the same step where the forking session has a terminal (made
    here with a pseudo-terminal opened by the session's leader)."""
    out = run("""
        def forker():
            os.setsid()
            leader, follower = pty.openpty()  # opened with O_NOCTTY: not yet the session's
            os.open(os.ttyname(follower), os.O_RDWR)  # a terminal its leader opens becomes the session's
            tty = os.stat(os.ttyname(follower)).st_rdev
            print(hygiene.controlling_terminal() == tty != 0)
            forker_pid = os.getpid()
            def worker():
                hygiene.new_group()
                print(os.getsid(0) == os.getpid() != forker_pid, hygiene.controlling_terminal())
            in_child(worker)
        in_child(forker)
    """)
    assert out.split() == ["True", "True", "0"]
