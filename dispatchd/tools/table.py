"""The worker's tools: each spec of ``spec.py`` bound to the function that runs it.

Guarantees:
- ``TOOLS`` holds one ``Tool`` for every spec in ``spec.SPECS``, in the same
  order; a spec without a function (or a function without a spec) fails the
  import, so the two lists cannot drift apart.
- Each function is called with the tool's own decoded parameter struct
  (``run_tool``): no keyword adapter stands between the schema and the code.

Worker side only: importing this imports every tool's implementation, which
the daemon never does (it reads ``spec.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dispatchd.tools import files, jobs, search, shell
from dispatchd.tools.base import Outcome, Tool, ToolContext
from dispatchd.catalogue import SPECS

__all__ = ["TOOLS"]

_FUNCS: dict[str, Callable[[ToolContext, Any], Outcome]] = {
    "read_file": files.read_file,
    "write_file": files.write_file,
    "edit_file": files.edit_file,
    "create_file": files.create_file,
    "list_files": files.list_files,
    "search_files": search.search_files,
    "shell_exec": shell.shell_exec,
    "job_output": jobs.job_output,
    "job_stop": jobs.job_stop,
    "job_list": jobs.job_list,
}
if set(_FUNCS) != set(SPECS):
    raise RuntimeError(f"tool specs and functions differ: {sorted(set(_FUNCS) ^ set(SPECS))}")

# Calls of these run on their channel's thread (they watch it: CallControl.channel_fd).
_WATCH_CHANNEL = {"shell_exec"}

TOOLS: dict[str, Tool] = {name: Tool(spec, _FUNCS[name], name in _WATCH_CHANNEL) for name, spec in SPECS.items()}
