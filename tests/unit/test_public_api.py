"""The public client API, pinned: adding or removing a name is a decision, made here.

Changing a list below is a change of the public API (and of the version).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import dispatch
import dispatch.tools
import dispatchd

# Pinned as text, in order, so that the list reads as the decision it is
# (and is not a copy of the module's own list to keep in step by hand).
DISPATCH_ALL = (
    "Client ConnectionLost DaemonUnavailable Definition DispatchError Registry RequestFailed"
    " RequestTimeout Result Session UntrustedSocket aio connect tools"
).split()
AIO_ALL = "AsyncClient AsyncDefinition AsyncRegistry AsyncSession connect run_tool_loop".split()
TOOLS_ALL = (
    "Definition DuplicateToolError Error ExecutionError Registry Result ToolNotFoundError ValidationError"
).split()


def test_dispatch_all_is_pinned():
    assert dispatch.__all__ == DISPATCH_ALL


def test_dispatch_tools_all_is_pinned():
    assert dispatch.tools.__all__ == TOOLS_ALL


def test_dispatch_aio_all_is_pinned():
    import dispatch.aio

    assert dispatch.aio.__all__ == AIO_ALL


def test_every_exported_name_exists():
    assert [name for name in dispatch.__all__ if not hasattr(dispatch, name)] == []
    assert [name for name in dispatch.tools.__all__ if not hasattr(dispatch.tools, name)] == []


def test_star_import_gives_exactly_all():
    namespace: dict[str, object] = {}
    exec("from dispatch import *", namespace)  # noqa: S102 - the test is what a star import yields
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(DISPATCH_ALL)


def test_entry_points():
    assert callable(dispatch.connect)
    assert isinstance(dispatch.Client, type)
    assert isinstance(dispatch.Session, type)
    assert isinstance(dispatch.tools.Registry, type)
    assert dispatch.tools is importlib.import_module("dispatch.tools")


def test_re_exports_are_the_same_objects():
    assert dispatch.Registry is dispatch.tools.Registry
    assert dispatch.Definition is dispatch.tools.Definition
    assert dispatch.Result is dispatch.tools.Result
    from dispatch import client, errors

    assert dispatch.Client is client.Client
    assert dispatch.Session is client.Session
    assert dispatch.connect is client.connect
    assert dispatch.DispatchError is errors.DispatchError


def test_errors_share_one_base():
    for name in ("ConnectionLost", "DaemonUnavailable", "RequestFailed", "RequestTimeout", "UntrustedSocket"):
        assert issubclass(getattr(dispatch, name), dispatch.DispatchError), name
    for name in ("DuplicateToolError", "ExecutionError", "ToolNotFoundError", "ValidationError"):
        assert issubclass(getattr(dispatch.tools, name), dispatch.tools.Error), name
    # One tree: the tool errors live in dispatch.errors, under DispatchError;
    # dispatch.tools.Error is kept as the very same class under its old name.
    from dispatch import errors

    assert dispatch.tools.Error is errors.ToolError
    assert issubclass(dispatch.tools.Error, dispatch.DispatchError)
    for name in ("DuplicateToolError", "ExecutionError", "ToolNotFoundError", "ValidationError"):
        assert getattr(dispatch.tools, name) is getattr(errors, name), name


def test_tools_keeps_every_name_of_the_one_file_module():
    """dispatch.tools is a face over private modules; what code imported from
    it before the split (public names and the few private ones the package
    used) is still there, as the same objects."""
    from dispatch import _asyncbridge, _compact, _definition, _providers, _registry, _result

    same = {
        "Result": _result.Result,
        "Definition": _definition.Definition,
        "ToolFunc": _definition.ToolFunc,
        "Registry": _registry.Registry,
        "Approval": _registry.Approval,
        "ToolCallOutcome": _registry.ToolCallOutcome,
        "OutputStore": _compact.OutputStore,
        "RETRIEVE_OUTPUT": _compact.RETRIEVE_OUTPUT,
        "compact": _compact.compact,
        "_CALLER_LOOP": _asyncbridge.CALLER_LOOP,
        "_await": _asyncbridge.await_from_sync,
        "_read_tool_call": _providers.read_tool_call,
    }
    assert {name: getattr(dispatch.tools, name, None) for name in same} == same


def test_py_typed_markers_exist():
    client_pkg = Path(dispatch.__file__).parent
    daemon_pkg = Path(dispatchd.__file__).parent
    assert (client_pkg / "py.typed").is_file()
    assert (daemon_pkg / "py.typed").is_file()
    repo = Path(__file__).resolve().parents[2]
    assert client_pkg.resolve() == repo / "client" / "dispatch"
    assert daemon_pkg.resolve() == repo / "dispatchd"
