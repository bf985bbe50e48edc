"""A command's resource limits (proctree.spawn) are in force from its first
instruction: set in its child before the exec, by the C helper and by the
``preexec_fn`` it falls back to, never by the tool server after the spawn.

Each case runs in a process of its own, which lowers its hard limits (for
good) as a confined tool server's are, then spawns a command that reads its
own limits and tries to raise them, and waits for it to exit *inside* the
spawn: nothing done after ``start`` returns can have reached the command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dispatchd.confine.limits import FD_PASSING_RESERVE
from dispatchd.tools.proctree import PROCESS_RESERVE

SERVER_NPROC = 5000
SERVER_NOFILE = 4096
BUDGET = 1000  # the session's max_processes: the reserve is min(PROCESS_RESERVE, BUDGET // 4)

COMMAND_NPROC = SERVER_NPROC - min(PROCESS_RESERVE, BUDGET // 4)
COMMAND_NOFILE = SERVER_NOFILE - FD_PASSING_RESERVE

# The command: its limits as the kernel has them at its start, then whether
# it may raise its soft process limit back to the server's hard one (refused)
# and to its own hard one (the allowed twin).
COMMAND = (f'cat /proc/self/limits; ulimit -Su {SERVER_NPROC} 2>&1; echo "raise to server: $?"; '
           f'ulimit -Su {COMMAND_NPROC}; echo "raise to own: $?"')

SPAWNING = r"""
import json, os, resource, sys
from dispatchd.tools import native, proctree

resource.setrlimit(resource.RLIMIT_NPROC, (%(nproc)d, %(nproc)d))
resource.setrlimit(resource.RLIMIT_NOFILE, (%(nofile)d, %(nofile)d))
if sys.argv[1] == "popen":
    native.lines = None  # the fallback start_command takes without the C helper
elif native.lines is None:
    sys.exit("the C helper is not built")
out_r, out_w = os.pipe2(os.O_CLOEXEC)
devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

def start(limits):
    child = proctree.start_command(["/bin/bash", "-c", sys.argv[2]], dict(os.environ), "/", devnull, out_w, out_w,
                                   limits)
    child.wait()  # inside the spawn: whatever spawn did after start() cannot have reached it
    return child

child = proctree.spawn(start, %(budget)d)
os.close(out_w)
out = b""
while chunk := os.read(out_r, 65536):
    out += chunk
print(json.dumps({"code": child.returncode, "out": out.decode(), "kind": type(child).__name__,
                  "ours": [resource.getrlimit(resource.RLIMIT_NPROC), resource.getrlimit(resource.RLIMIT_NOFILE)]}))
"""


def _spawned(how: str) -> dict[str, object]:
    code = SPAWNING % {"nproc": SERVER_NPROC, "nofile": SERVER_NOFILE, "budget": BUDGET}
    done = subprocess.run([sys.executable, "-c", code, how, COMMAND], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


def _limit(out: str, name: str) -> list[str]:
    line = next(x for x in out.splitlines() if x.startswith(name))
    return line[len(name):].split()[:2]


@pytest.mark.process
@pytest.mark.parametrize("how", ["c_helper", "popen"])
def test_a_command_starts_under_its_limits_soft_and_hard(how: str) -> None:
    result = _spawned(how)
    assert result["kind"] == ("Command" if how == "c_helper" else "Popen")
    out = str(result["out"])
    assert _limit(out, "Max processes") == [str(COMMAND_NPROC)] * 2, out
    assert _limit(out, "Max open files") == [str(COMMAND_NOFILE)] * 2, out
    # Denied: back up to the server's hard limit (bash: "cannot modify limit: Invalid argument").
    assert "cannot modify limit: Invalid argument" in out and "raise to server: 1" in out, out
    # Allowed twin: up to its own hard limit, which it has already.
    assert "raise to own: 0" in out, out
    assert result["code"] == 0
    # The server's own limits are untouched (the child's were set in the child).
    assert result["ours"] == [[SERVER_NPROC, SERVER_NPROC], [SERVER_NOFILE, SERVER_NOFILE]]
