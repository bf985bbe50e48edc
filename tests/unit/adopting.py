"""A process that runs tools as the tool server does: it adopts orphans.

``python -m tests.unit.adopting ROOT SCRATCH`` makes itself a child
subreaper (``orphans.adopt_orphans``), as the tool server does first, then
reads one JSON request a line on stdin (``{"id", "tool", "params"}``), runs
each on a thread of its own (calls overlap, as a session's do) and writes
each Result as one JSON line (``{"id", "success", "output", "error",
"metadata"}``). A test runner's process cannot adopt orphans itself: every
child of its own would count as one a call left.

``Adopting`` is the test's side of it; ``sleeping`` finds the processes a
test left, by their marker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Any

__all__ = ["Adopting", "sleeping"]


def sleeping(marker: str) -> list[int]:
    """Live ``sleep MARKER`` processes of this test run (``tests.conftest.sleepers``:
    a run beside it as the same user, sleeping the same marker, is not counted)."""
    from tests.conftest import sleepers  # the test's side only: the runner never calls this

    return sleepers(marker)


class Adopting:
    """The runner, started; ``call`` sends a request and waits for its Result,
    ``send`` and ``result`` do it in two steps (calls that overlap)."""

    def __init__(self, root: str, scratch: str) -> None:
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.unit.adopting", root, scratch], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self._ids = 0
        self._results: dict[int, dict[str, Any]] = {}

    def send(self, tool: str, **params: Any) -> int:
        assert self.proc.stdin is not None
        self._ids += 1
        self.proc.stdin.write(json.dumps({"id": self._ids, "tool": tool, "params": params}) + "\n")
        return self._ids

    def result(self, rid: int) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while rid not in self._results:
            line = self.proc.stdout.readline()
            assert line, "the runner exited"
            got = json.loads(line)
            self._results[got["id"]] = got
        return self._results.pop(rid)

    def call(self, tool: str, **params: Any) -> dict[str, Any]:
        return self.result(self.send(tool, **params))

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(30)
        self.proc.stdout.close()


def _main(root: str, scratch: str) -> None:
    from dispatchd.policy import Limits
    from dispatchd.tools import orphans
    from dispatchd.tools.base import ToolContext, run_tool
    from dispatchd.tools.jobs import Jobs
    from dispatchd.tools.table import TOOLS

    orphans.adopt_orphans()
    jobs = Jobs(scratch)
    ctx = ToolContext(root=root, limits=Limits(), env={"PATH": "/usr/bin:/bin"}, jobs=jobs)
    out_lock = threading.Lock()

    def run(req: dict[str, Any]) -> None:
        r = run_tool(TOOLS[req["tool"]], ctx, req["params"])
        line = json.dumps({"id": req["id"], "success": r.success, "output": r.output, "error": r.error,
                           "metadata": r.metadata})
        with out_lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    threads = []
    for line in sys.stdin:
        thread = threading.Thread(target=run, args=(json.loads(line),))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    jobs.close()


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
