"""The tool interface: what a tool is, where tools are kept, what a call returns.

- ``Result`` is what every tool call returns: success with an ``output``, or
  failure with an ``error``, plus opaque ``metadata`` for the agent loop (never
  sent to a model). Immutable.
- ``Definition`` is one tool: a name, a description, a JSON Schema for its
  parameters and a function. ``Definition.call`` never raises.
- ``Registry`` holds definitions by name, hands out their schemas in the shape
  a model provider wants (``schemas``) and runs a tool call as the model
  returned it (``dispatch``), answering in that provider's shape. ``call`` and
  ``dispatch`` never raise. It may ask an approval callback before a write or
  execute tool runs, and show a model long results in part (head, tail, and
  an id for ``retrieve_output``), keeping the whole in an ``OutputStore``.

This module is the face only: every name is re-exported from a private module
with one job, and is the same object there.

    _result.py        Result
    _definition.py    Definition, ToolFunc (its fast argument check: _fastcheck.py)
    _compact.py       compact, OutputStore, RETRIEVE_OUTPUT and the retrieve_output tool
    _registry.py      Registry, Approval, ToolCallOutcome
    _providers.py     provider shapes: tool schemas, tool calls, replies, messages
                      (_schemas.py rewrites a schema for strict mode and Gemini)
    _asyncbridge.py   an async approval or tool awaited from synchronous code
    _plain.py         plain JSON copies, shared by the modules above
    errors.py         the errors below, in the client's one exception tree

Errors, for use outside the never-raising ``call``/``dispatch`` paths::

    Error                      base of every tool error (= dispatch.errors.ToolError,
    │                          itself a dispatch.DispatchError)
    ├── DuplicateToolError     register() was given a name already taken  (name)
    ├── ToolNotFoundError      get()/subset() was given an unknown name   (name; also a LookupError)
    ├── ValidationError        a bad definition or bad arguments          (tool, errors; also a ValueError)
    └── ExecutionError         a tool's function raised                   (tool; __cause__ is the exception)

``ValidationError`` and ``ExecutionError`` also give the failure messages that
``call`` returns, so the text a model reads is the text the exception carries.
``Error`` is kept as an alias of ``ToolError`` for compatibility: it was this
module's own base class before the client had one exception tree.
"""

from __future__ import annotations

# ``import X as X``: re-exported on purpose (mypy --strict reads only that,
# or __all__, as a re-export).
from dispatch._asyncbridge import CALLER_LOOP as _CALLER_LOOP
from dispatch._asyncbridge import await_from_sync as _await
from dispatch._compact import RETRIEVE_OUTPUT as RETRIEVE_OUTPUT
from dispatch._compact import OutputStore as OutputStore
from dispatch._compact import compact as compact
from dispatch._definition import Definition
from dispatch._definition import ToolFunc as ToolFunc
from dispatch._providers import read_tool_call as _read_tool_call
from dispatch._registry import Approval as Approval
from dispatch._registry import Registry
from dispatch._registry import ToolCallOutcome as ToolCallOutcome
from dispatch._result import Result
from dispatch.errors import DuplicateToolError, ExecutionError, ToolNotFoundError, ValidationError
from dispatch.errors import ToolError as Error

__all__ = [
    "Definition",
    "DuplicateToolError",
    "Error",
    "ExecutionError",
    "Registry",
    "Result",
    "ToolNotFoundError",
    "ValidationError",
]
# Also public, though not in __all__ yet (tests/unit/test_tools_registry.py pins
# it): Approval, OutputStore, ToolCallOutcome, RETRIEVE_OUTPUT, compact, ToolFunc.
# _CALLER_LOOP, _await and _read_tool_call stay importable from here for code
# written against the one-file module; the package imports them from their
# own modules.
