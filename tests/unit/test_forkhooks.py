"""``worker/forkhooks.py``: threading's and logging's at-fork hooks are left
out of a single-threaded process's forks, put back in the child, and never
left out while a second thread runs. Each case runs in a fresh interpreter:
the hooks are the interpreter's own lists."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.process  # each case runs in a fresh interpreter

_COMMON = """
import gc, logging, os, threading
from dispatchd.worker import forkhooks

# The hooks by their names on this interpreter (logging's pair was renamed in 3.13).
PAIR = ("_acquireLock", "_releaseLock") if hasattr(logging, "_acquireLock") else ("_prepareFork", "_afterFork")

def registered():
    hooks = (threading._after_fork, logging._after_at_fork_child_reinit_locks, getattr(logging, PAIR[0]),
             getattr(logging, PAIR[1]))
    return [sum(r.count(h) for r in gc.get_referrers(h) if type(r) is list and r is not hooks) for h in hooks]
"""


def run(code: str) -> str:
    # A bound: a case that fails with its second thread still waiting would
    # otherwise never end.
    out = subprocess.run([sys.executable, "-c", _COMMON + textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_left_out_of_forks_and_put_back_in_the_child() -> None:
    out = run("""
        assert registered() == [1, 1, 1, 1]
        assert forkhooks.leave_out()
        assert registered() == [0, 0, 0, 0]
        assert not forkhooks.leave_out()  # once
        pid = os.fork()
        if pid == 0:
            forkhooks.put_back()
            ok = registered() == [1, 1, 1, 1]
            # The child starts threads and logs from them, as a worker does.
            t = threading.Thread(target=logging.getLogger("x").warning, args=("from a thread",))
            t.start()
            t.join()
            os._exit(0 if ok and threading.active_count() == 1 else 1)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), registered())
    """)
    assert out.strip() == "0 [0, 0, 0, 0]"


def test_nothing_is_left_out_while_another_thread_runs() -> None:
    out = run("""
        done = threading.Event()
        t = threading.Thread(target=done.wait)
        t.start()
        print(forkhooks.leave_out(), registered())
        done.set()
        t.join()
    """)
    assert out.strip() == "False [1, 1, 1, 1]"


def test_a_python_whose_hooks_are_named_otherwise_leaves_them_all_in() -> None:
    """A Python that names logging's pair otherwise (as 3.13 did to 3.12's):
    simulated here by taking the name this one uses off the module. The
    hook itself is still registered, and must stay: nothing is left out
    when not every hook is found where it is looked for."""
    out = run("""
        hook = getattr(logging, PAIR[0])
        delattr(logging, PAIR[0])
        print(forkhooks.leave_out(), sum(r.count(hook) for r in gc.get_referrers(hook) if type(r) is list))
    """)
    assert out.strip() == "False 1"
